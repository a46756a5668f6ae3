"""``maru demo``: two vLLM instances share a prompt's KV cache through Maru.

Starts a ``maru server`` (emulated pool in /dev/shm, free port), generates a small Llama model
with random weights and a locally trained tokenizer (cached under ~/.cache/maru/demo-model; no
downloads), then two vLLM instances as separate processes, one after the other. Instance A
serves a long prompt cold and stores its KV in Maru; instance B, a fresh process with an empty
cache, serves the same prompt and loads the prefix from Maru. Prints prompt tokens, tokens
loaded, time to first token cold (A) vs warm (B) and whether the outputs are identical.
Exits non-zero if B loaded nothing or the outputs differ.

Works on a CPU-only machine (vLLM's CPU build, float32); with an NVIDIA GPU and the GPU build of
vLLM the same code runs on the GPU (bfloat16).

    python -m maru.demo.two_instances [--prompt-tokens 1536] [--model-dir DIR] [--keep-logs]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

from maru.demo.runner import EngineProcess
from maru.demo.server import EmbeddedServer
from maru.demo.tiny_model import TinyModelSpec, build_tiny_model

DEMO_SPEC = TinyModelSpec(
    num_layers=4, hidden=768, intermediate=2048, heads=12, kv_heads=4, max_positions=4096, weight_std=0.08
)


def _prompt_tokens(model_dir: Path, n: int) -> list[int]:
    """``n`` tokens of real text (CPython's license, repeated if short) in the model's tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = ""
    for p in (stdlib / "LICENSE.txt", Path(sys.base_prefix) / "LICENSE.txt", stdlib / "this.py"):
        if p.is_file():
            text = p.read_text(errors="replace")
            break
    ids = tok.encode(text).ids
    while len(ids) < n:
        ids += tok.encode(text).ids
    return ids[:n]


def _on_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="maru demo", description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-tokens", type=int, default=1536, help="prompt length (default 1536)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens to generate (default 16)")
    ap.add_argument("--chunk-tokens", type=int, default=256, help="maru_kv_chunk_tokens (default 256)")
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/maru/demo-model"))
    ap.add_argument("--keep-logs", action="store_true", help="keep the engines' logs and print where")
    ap.add_argument("--port", type=int, help="server port (default 5555, or a free one if that is busy)")
    a = ap.parse_args(argv)
    if a.prompt_tokens < 2 * a.chunk_tokens:
        print(f"maru demo: --prompt-tokens must be at least {2 * a.chunk_tokens}", file=sys.stderr)
        return 2

    from rich.console import Console
    from rich.table import Table

    con = Console()
    logs = Path(tempfile.mkdtemp(prefix="maru-demo-logs-"))
    gpu = _on_gpu()
    t0 = time.perf_counter()
    con.print(f"[bold]maru demo[/]: two vLLM instances share a {a.prompt_tokens}-token prompt through Maru")
    with con.status(
        "generating the demo model (random weights, local tokenizer; cached after the first run)"
    ):
        model_dir = build_tiny_model(a.model_dir, DEMO_SPEC)
    prompt = _prompt_tokens(model_dir, a.prompt_tokens)
    kv_bytes = DEMO_SPEC.num_layers * 2 * DEMO_SPEC.kv_heads * DEMO_SPEC.head_dim * 4 * (a.prompt_tokens + 64)
    server = EmbeddedServer(port=a.port, pool_size=f"{max(256, 3 * kv_bytes // 2**20)}M")
    with con.status("starting maru server"):
        server.start(timeout=60)
    con.print(f"maru server on {server.url} (pool {server.pool_path})")
    spec: dict[str, Any] = dict(
        model=str(model_dir),
        dtype="bfloat16" if gpu else "float32",
        block_size=32,
        max_model_len=a.prompt_tokens + a.max_tokens + 64,
        max_num_batched_tokens=a.prompt_tokens + a.max_tokens + 64,
        kv_cache_memory_bytes=max(256 << 20, 2 * kv_bytes),
        connector={"extra": {"maru_server_url": server.url, "maru_kv_chunk_tokens": a.chunk_tokens}},
    )
    res: dict[str, dict[str, Any]] = {}
    try:
        for name in ("A", "B"):
            with con.status(f"instance {name}: starting vLLM ({'GPU' if gpu else 'CPU'}) in its own process"):
                eng = EngineProcess(spec, log_path=logs / f"vllm-{name}.log").start()
            try:
                with con.status(f"instance {name}: serving the prompt"):
                    # Warm-up on unrelated tokens (the engine's first step is slower).
                    eng.call({"op": "generate", "prompts": [prompt[::-1][:64]], "max_tokens": 1})
                    eng.call({"op": "flush_stores"})  # the warm-up's own stores are not the prompt's
                    before = eng.call({"op": "stats"}).get("worker", {})
                    first = eng.call({"op": "ttft", "prompt": prompt})
                    # Write-behind (the default) publishes after the request: count what it stored.
                    eng.call({"op": "flush_stores"})
                    during = eng.call({"op": "stats"}).get("worker", {})
                    full = eng.call({"op": "generate", "prompts": [prompt], "max_tokens": a.max_tokens})
                    stats = eng.call({"op": "stats"})
            finally:
                eng.close()
            for r in (first, full):
                if "error" in r:
                    raise RuntimeError(f"instance {name}: {r['error']} (log: {logs / f'vllm-{name}.log'})")
            w = stats.get("worker", {})
            loaded = int(during.get("tokens_loaded", 0)) - int(before.get("tokens_loaded", 0))
            stored = int(during.get("chunks_stored", 0)) - int(before.get("chunks_stored", 0))
            chunks = int(during.get("chunks_loaded", 0)) - int(before.get("chunks_loaded", 0))
            res[name] = {"ttft": first["seconds"], "loaded": loaded, "stored": stored, "chunks": chunks,
                         "token": first["token"], "out": full["outputs"][0], "stats": w}  # fmt: skip
            con.print(
                f"instance {name}: time to first token {first['seconds']:.3f} s, "
                f"{res[name]['loaded']} prompt tokens loaded from Maru"
            )
    except Exception as e:
        con.print(f"[red]demo failed:[/] {e}")
        con.print(f"engine logs: {logs}")
        return 1
    finally:
        server.cleanup()

    a_, b_ = res["A"], res["B"]
    same = a_["token"] == b_["token"] and a_["out"] == b_["out"]
    loaded = b_["loaded"]
    t = Table(title="Maru: prefix sharing between two vLLM instances")
    t.add_column("")
    t.add_column("instance A (cold)", justify="right")
    t.add_column("instance B (warm, from Maru)", justify="right")
    t.add_row("prompt tokens", str(len(prompt)), str(len(prompt)))
    t.add_row("tokens loaded from Maru", str(a_["loaded"]), str(loaded))
    t.add_row("chunks stored / loaded", f"{a_['stored']} stored", f"{b_['chunks']} loaded")
    t.add_row(
        "time to first token",
        f"{a_['ttft']:.3f} s",
        f"{b_['ttft']:.3f} s ({a_['ttft'] / max(b_['ttft'], 1e-9):.1f}x faster)",
    )
    t.add_row("outputs identical (greedy)", "", "[green]yes[/]" if same else "[red]NO[/]")
    con.print(t)
    con.print(
        f"total {time.perf_counter() - t0:.0f} s; vLLM {'GPU' if gpu else 'CPU'} build, model {model_dir}"
    )
    if a.keep_logs:
        con.print(f"engine logs: {logs}")
    else:
        shutil.rmtree(logs, ignore_errors=True)
    if loaded <= 0:
        con.print("[red]instance B loaded nothing from Maru[/]")
        return 1
    if not same:
        con.print("[red]instance B's output differs from instance A's[/]")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
