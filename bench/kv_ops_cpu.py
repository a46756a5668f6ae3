"""Benchmark: the PyTorch reference placement on the CPU (the vLLM CPU connector's load and store path).

Geometry of the e2e bench model (``maru.demo.tiny_model.BENCH_SPEC``): 8 layers, 8 KV heads of 64,
float32, block size 32, vLLM's CPU-backend cache ``[NB, NH, BS, 2*HS]`` (K transposed in each
(block, head) slab). Moves 1k / 4k / 8k tokens the way the connector does: one ``scatter`` (load) or
``gather`` (store) call per 256-token chunk, tokens in whole blocks. Two block patterns: consecutive
block ids (what a fresh vLLM instance hands one request) and random block ids (a long-running one).

``--baseline REV`` also times ``maru/kv_ops/reference.py`` as of git revision REV, alternating with the
current code rep by rep so load drift on a shared machine hits both alike. Medians of ``--reps``.

    python bench/kv_ops_cpu.py [--threads 1 2] [--baseline HEAD~1] [--layouts cpu_attn kv_first/NHD]
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from maru import kv_ops  # noqa: E402
from maru.kv_ops import reference  # noqa: E402
from maru.kv_ops.ops import as_bits, layer_refs  # noqa: E402
from maru.kv_ops.testing import make_cache  # noqa: E402

L, NH, HS, BS = 8, 8, 64, 32
CHUNK = 256


def load_baseline(rev: str) -> ModuleType:
    """``maru/kv_ops/reference.py`` at git revision ``rev``, imported as a separate module."""
    text = subprocess.run(
        ["git", "show", f"{rev}:maru/kv_ops/reference.py"],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "reference_baseline.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("reference_baseline", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def wall(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def timed(fn: Callable[[], None]) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one ``fn()``; on a shared machine the CPU time is the
    steadier of the two (it leaves out the time other jobs held the cores)."""
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def move(
    op: Callable, refs: list, layout: object, slots: torch.Tensor, bits: torch.Tensor, chunks: list
) -> None:
    """One load or store the connector's way: one ``op`` call per chunk of tokens."""
    for a, b in chunks:
        op(refs, layout, slots[a:b], bits[:, :, a:b])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--baseline", default=None, help="git revision of reference.py to compare against")
    ap.add_argument(
        "--layouts", nargs="+", default=["cpu_attn"], help="cpu_attn, kv_first/NHD, kv_first/HND, packed/HND"
    )
    ap.add_argument("--patterns", nargs="+", default=["consecutive", "random"])
    args = ap.parse_args()

    impls: dict[str, ModuleType] = {"new": reference}
    if args.baseline:
        impls = {"before": load_baseline(args.baseline), "new": reference}
    max_tokens = max(args.tokens)
    nb = 3 * max_tokens // BS + 1
    gen = torch.Generator().manual_seed(0)
    print(
        f"# kv_ops reference on the CPU, torch {torch.__version__}; {L} layers, {NH} KV heads of {HS}, fp32, BS {BS}"
    )
    payload = torch.randn(L * 2 * max_tokens * NH * HS)
    copy_dst = torch.empty_like(payload)
    copy_s = statistics.median(wall(lambda: copy_dst.copy_(payload)) for _ in range(5))
    print(
        f"plain copy of {payload.numel() * 4 / 2**20:.0f} MiB: {copy_s * 1e3:.1f} ms ({payload.numel() * 4 / copy_s / 1e9:.1f} GB/s)"
    )
    rows = []
    for spec in args.layouts:
        fmt, _, physical = spec.partition("/")
        case = make_cache(
            fmt, physical or "HND", num_blocks=nb, block_size=BS, num_kv_heads=NH, head_size=HS,
            num_layers=L, dtype=torch.float32, generator=gen,
        )  # fmt: skip
        layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
        refs = layer_refs(case.caches, layout)
        for pattern in args.patterns:
            for tokens in args.tokens:
                nblk = tokens // BS
                if pattern == "consecutive":
                    ids = torch.arange(nblk) + 1  # vLLM's block 0 is the null block
                else:
                    ids = torch.randperm(nb, generator=gen)[:nblk]
                slots = (ids[:, None] * BS + torch.arange(BS)).reshape(-1)
                obj = torch.randn(L, 2, tokens, NH * HS, generator=gen)
                bits = as_bits(obj)
                nbytes = obj.numel() * 4
                chunks = [(c, min(c + CHUNK, tokens)) for c in range(0, tokens, CHUNK)]
                for threads in args.threads:
                    torch.set_num_threads(threads)
                    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
                    for _ in range(args.reps + 1):  # the first round warms up and is dropped
                        for name, mod in impls.items():
                            load = partial(move, mod.scatter, refs, layout, slots, bits, chunks)
                            store = partial(move, mod.gather, refs, layout, slots, bits, chunks)
                            times.setdefault((name, "load"), []).append(timed(load))
                            times.setdefault((name, "store"), []).append(timed(store))
                    for (name, op), ts in times.items():
                        med = statistics.median(w for w, _ in ts[1:])
                        cpu = statistics.median(c for _, c in ts[1:])
                        rows.append((spec, pattern, tokens, threads, op, name, med, nbytes / med / 1e9, cpu))
                        print(
                            f"{spec:14s} {pattern:11s} {tokens:5d} tok {threads} thr {op:5s} {name:6s} "
                            f"{med * 1e3:7.1f} ms {nbytes / med / 1e9:5.2f} GB/s (CPU {cpu * 1e3:.1f} ms)",
                            flush=True,
                        )
    torch.set_num_threads(max(args.threads))
    print()
    names = list(impls)
    head = " | ".join(f"{op} {n} ms (GB/s) [CPU ms]" for op in ("load", "store") for n in names)
    print(f"| layout | blocks | tokens | threads | {head} |")
    print("| --- | --- | ---: | ---: |" + " ---: |" * (2 * len(names)))
    index = {(r[0], r[1], r[2], r[3], r[4], r[5]): r for r in rows}
    keys = sorted({(r[0], r[1], r[2], r[3]) for r in rows}, key=lambda k: (k[0], k[1], k[2], k[3]))
    for spec, pattern, tokens, threads in keys:
        cells = []
        for op in ("load", "store"):
            for n in names:
                r = index[(spec, pattern, tokens, threads, op, n)]
                cells.append(f"{r[6] * 1e3:.1f} ({r[7]:.1f}) [{r[8] * 1e3:.0f}]")
        print(f"| {spec} | {pattern} | {tokens} | {threads} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
