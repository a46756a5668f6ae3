"""End-to-end TTFT on vLLM's CPU build: cold vs warm from Maru (a second process) vs vLLM's own prefix cache.

    .venv/bin/python bench/e2e_cpu.py [--lengths 1024 4096 8192] [--reps 2] [--model-dir DIR]

Generates (or reuses) the bench model (8 layers, hidden 1024, 16 heads, 8 KV heads of 64,
float32; random weights), starts a ``maru server`` on a free port, then three vLLM engines one
after the other, each in its own process (in-process engine mode inside), all with the same
settings (block size 32, enforce_eager, chunked prefill off up to the longest prompt):

- ``none``: no connector. Per prompt: cold TTFT, then the same prompt again (vLLM's own
  prefix-cache hit in the same process).
- ``store``: Maru connector, cold TTFT while storing every chunk (instance A).
- ``load``: Maru connector, a fresh process: TTFT of the same prompts loaded from Maru (B);
  before each sample vLLM's own prefix cache is reset, so every sample loads from Maru.
- ``load-async`` (with ``--async-load``): the same with ``maru_async_load: true`` (the request
  waits in ``WAITING_FOR_REMOTE_KVS`` while the worker loads it, vLLM's engine loop spinning).

TTFT is the wall time of ``generate(max_tokens=1)`` for one prompt. Each engine first serves a
warm-up prompt. Every prompt is fresh random token ids, so no run sees another's cache except
where intended. Prints a table (rich) and, with ``--markdown``, the RESULTS.md rows.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from maru.demo.runner import EngineProcess  # noqa: E402
from maru.demo.tiny_model import BENCH_SPEC, build_tiny_model  # noqa: E402


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, BENCH_SPEC.vocab) for _ in range(n)]


def _start_server(tmp: Path, pool: str) -> tuple[object, str]:
    from maru.demo.server import ServerProcess

    srv = ServerProcess(tmp, pool_size=pool)
    srv.start()
    return srv, srv.url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--reps", type=int, default=2, help="distinct prompts per length (each computed cold)")
    ap.add_argument("--samples", type=int, default=3, help="timed hits/loads per prompt")
    ap.add_argument("--model-dir", default=os.path.expanduser("~/.cache/maru/bench-model"))
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--async-load", action="store_true", help="also load with maru_async_load: true")
    a = ap.parse_args(argv)

    model = str(build_tiny_model(a.model_dir, BENCH_SPEC))
    tmp = Path(a.log_dir or tempfile.mkdtemp(prefix="maru-bench-e2e-"))
    tmp.mkdir(parents=True, exist_ok=True)
    max_len = max(a.lengths)
    kv_bytes_per_token = BENCH_SPEC.num_layers * 2 * BENCH_SPEC.kv_heads * BENCH_SPEC.head_dim * 4
    pool = f"{(sum(a.lengths) * a.reps * kv_bytes_per_token * 12 // 10) // 2**20 + 256}M"
    srv, url = _start_server(tmp, pool)
    base = dict(
        model=model,
        block_size=32,
        max_model_len=max_len + 128,
        max_num_batched_tokens=max_len + 128,
        kv_cache_memory_bytes=max(1 << 30, 3 * (max_len + 128) * kv_bytes_per_token),
    )
    maru = {
        "extra": {"maru_server_url": url, "maru_kv_chunk_tokens": a.chunk_tokens, "maru_log_timing": True}
    }
    prompts = {(n, r): _prompt(n, 1000 * r + n) for n in a.lengths for r in range(a.reps)}
    warm = _prompt(512, 7)
    res: dict[str, dict[int, list[float]]] = {
        k: {n: [] for n in a.lengths} for k in ("cold", "hit", "store", "load", "load_async")
    }
    cached: dict[int, list[int]] = {n: [] for n in a.lengths}
    same: list[bool] = []
    first_tok: dict[tuple[int, int], int] = {}
    try:
        with EngineProcess(base, log_path=tmp / "none.log") as e:
            e.call({"op": "ttft", "prompt": warm})
            for (n, r), p in prompts.items():
                c = e.call({"op": "ttft", "prompt": p})
                res["cold"][n].append(c["seconds"])
                first_tok[(n, r)] = c["token"]
                for _ in range(a.samples):  # the prefix stays in vLLM's cache: every call is a hit
                    h = e.call({"op": "ttft", "prompt": p})
                    res["hit"][n].append(h["seconds"])
                    print(
                        f"none   n={n} r={r}: cold {c['seconds']:.3f}s  prefix-hit {h['seconds']:.3f}s ({h['cached']} cached)"
                    )
        with EngineProcess({**base, "connector": maru}, log_path=tmp / "store.log") as e:
            e.call({"op": "ttft", "prompt": warm})
            for (n, r), p in prompts.items():
                c = e.call({"op": "ttft", "prompt": p})
                res["store"][n].append(c["seconds"])
                print(f"store  n={n} r={r}: cold+store {c['seconds']:.3f}s")
        modes = [("load", maru, "load")]
        if a.async_load:
            extra = {**maru["extra"], "maru_async_load": True}
            modes.append(("load-async", {**maru, "extra": extra}, "load_async"))
        for label, conn, key in modes:
            with EngineProcess({**base, "connector": conn}, log_path=tmp / f"{label}.log") as e:
                e.call({"op": "ttft", "prompt": warm})
                for (n, r), p in prompts.items():
                    for _ in range(a.samples):
                        # Forget the local copy, so every sample loads from Maru again.
                        e.call({"op": "reset_prefix_cache"})
                        w = e.call({"op": "ttft", "prompt": p})
                        res[key][n].append(w["seconds"])
                        if key == "load":
                            cached[n].append(w["cached"])
                        elif w["cached"] != cached[n][-1]:
                            print(f"  ({label}: {w['cached']} tokens from Maru, sync loaded {cached[n][-1]})")
                        same.append(w["token"] == first_tok[(n, r)])
                        print(
                            f"{label:10} n={n} r={r}: warm {w['seconds']:.3f}s ({w['cached']} tokens from Maru)"
                        )
                stats = e.call({"op": "stats"})
    finally:
        srv.cleanup()  # type: ignore[attr-defined]

    med = {k: {n: statistics.median(v) for n, v in d.items() if v} for k, d in res.items()}
    best = {k: {n: min(v) for n, v in d.items() if v} for k, d in res.items()}
    try:
        from rich.console import Console
        from rich.table import Table

        t = Table(title=f"TTFT, vLLM CPU (bench model, float32, block 32), median of {a.reps}")
        for col in (
            "prompt",
            "cold (no connector)",
            "cold + Maru store",
            "store overhead",
            "vLLM prefix hit",
            "warm from Maru",
            "Maru / prefix hit",
            "tokens from Maru",
        ):
            t.add_column(col, justify="right")
        for n in a.lengths:
            t.add_row(
                str(n),
                f"{med['cold'][n]:.3f} s",
                f"{med['store'][n]:.3f} s",
                f"{(med['store'][n] / med['cold'][n] - 1) * 100:+.1f}%",
                f"{med['hit'][n]:.3f} s",
                f"{med['load'][n]:.3f} s",
                f"{med['load'][n] / med['hit'][n]:.2f}x",
                str(min(cached[n])),
            )
        Console().print(t)
    except ImportError:  # pragma: no cover
        print(med)
    if a.async_load:
        for n in a.lengths:
            print(
                f"async load n={n}: median {statistics.median(res['load_async'][n]):.3f} s, "
                f"min {min(res['load_async'][n]):.3f} s (sync {med['load'][n]:.3f} s)"
            )
    print("first tokens identical (warm vs cold):", all(same))
    print("loader stats:", stats.get("worker"))
    if a.markdown:
        print(
            "| prompt tokens | stat | cold, no connector | cold, Maru storing | store overhead | vLLM prefix hit "
            "| warm from Maru | Maru / prefix hit | tokens loaded |"
        )
        print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
        for n in a.lengths:
            for name, m in (("median", med), ("min", best)):
                print(
                    f"| {n} | {name} | {m['cold'][n]:.3f} s | {m['store'][n]:.3f} s "
                    f"| {(m['store'][n] / m['cold'][n] - 1) * 100:+.1f}% | {m['hit'][n]:.3f} s "
                    f"| {m['load'][n]:.3f} s | {m['load'][n] / m['hit'][n]:.2f}x "
                    f"| {min(cached[n])} |"
                )
    return 0 if all(same) else 1


if __name__ == "__main__":
    raise SystemExit(main())
