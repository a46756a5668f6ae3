"""Host time of one public ``maru.kv_ops.gather``/``scatter`` call, on CPU.

Two figures per op: the whole call at 16 tokens on the reference (CPU) backend, and the call with
the backend's data movement stubbed out (validation, cache lookup, dispatch: what the call costs
the host before any byte moves, on every backend), plus the Triton path's host-side preparation
(layer table and base pointer, ``triton_kernels.prepared``) where it can be measured without a GPU.
Geometry: 32 layers, 8 KV heads x 128, bf16, block 16 (Llama-3-8B's KV), FlashInfer-order NHD.

Usage: python bench/kv_ops_host.py [--cuda]

``--cuda`` (a GPU machine) instead times the real calls on CUDA caches at 256 tokens (Triton backend):
host time per call is the loop's wall time with the launches queued (the GPU runs behind), and the
GPU's own time per call from events, so a call is host-bound when the first exceeds the second.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maru import kv_ops  # noqa: E402
from maru.kv_ops import ops  # noqa: E402
from maru.kv_ops.testing import make_cache  # noqa: E402


def per_call_us(f: Any, n: int = 2000) -> float:
    for _ in range(50):
        f()
    best = float("inf")
    for _ in range(3):  # best of three: the machine may be shared
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def cuda_case() -> tuple[Any, Any]:
    """Llama-3-8B's KV geometry on the GPU (32 layers, 8 KV heads x 128, bf16, block 16): (case, layout)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    case = make_cache(
        "blocks_first", "NHD", device="cuda", num_blocks=4096, block_size=16, num_kv_heads=8,
        head_size=128, num_layers=32, dtype=torch.bfloat16, generator=g,
    )  # fmt: skip
    return case, kv_ops.detect_layouts(case.caches, **case.detect_kwargs())


def cuda_main() -> None:
    case, layout = cuda_case()
    print(f"{torch.cuda.get_device_name()}, kv_ops backend {kv_ops.backend('cuda')}, 32 layers")
    print(f"{'call':45s} {'host us/call':>12s} {'GPU us/call':>12s}")
    calls = []
    for tokens in (16, 256):  # at 16 tokens the GPU is faster than any launch: the host is timed
        slots = torch.randperm(4096 * 16, device="cuda")[:tokens].to(torch.int64)
        obj = kv_ops.gather(case.caches, layout, slots)
        calls.append(
            (f"scatter, {tokens} tokens", lambda o=obj, s=slots: kv_ops.scatter(o, case.caches, layout, s))
        )
        calls.append(
            (f"gather, {tokens} tokens", lambda o=obj, s=slots: kv_ops.gather(case.caches, layout, s, out=o))
        )
    from maru.kv_ops import triton_kernels

    def timed(name: str, f: Any) -> None:
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        n = 200
        host = per_call_us(f, n)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            f()
        b.record()
        b.synchronize()
        print(f"{name:45s} {host:12.1f} {a.elapsed_time(b) * 1e3 / n:12.1f}")

    for name, f in calls:
        timed(name, f)
    print("launcher:", triton_kernels._PLACE.stats())
    # The same calls through Triton's own per-call binding (what the launcher saves).
    triton_kernels._PLACE.unavailable = "forced by bench/kv_ops_host.py"
    for name, f in calls:
        timed(f"{name}, Triton's binding", f)


def main() -> None:
    if "--cuda" in sys.argv[1:]:
        return cuda_main()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    case = make_cache(
        "blocks_first", "NHD", device="cpu", num_blocks=64, block_size=16, num_kv_heads=8,
        head_size=128, num_layers=32, dtype=torch.bfloat16, generator=g,
    )  # fmt: skip
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    slots = torch.arange(16, dtype=torch.int64)
    obj = kv_ops.gather(case.caches, layout, slots)
    rows = [
        ("scatter, reference backend, 16 tokens", lambda: kv_ops.scatter(obj, case.caches, layout, slots)),
        ("gather, reference backend, 16 tokens", lambda: kv_ops.gather(case.caches, layout, slots, out=obj)),
    ]
    out = [(name, per_call_us(f, 300)) for name, f in rows]
    real_run = ops._run
    ops._run = lambda *a, **k: None  # type: ignore[assignment]
    try:
        out.append(
            (
                "scatter, data movement stubbed",
                per_call_us(lambda: kv_ops.scatter(obj, case.caches, layout, slots)),
            )
        )
        out.append(
            (
                "gather, data movement stubbed",
                per_call_us(lambda: kv_ops.gather(case.caches, layout, slots, out=obj)),
            )
        )
    finally:
        ops._run = real_run  # type: ignore[assignment]
    try:
        from maru.kv_ops import triton_kernels as tk

        refs = ops.layer_refs(case.caches, layout)
        prep = getattr(tk, "prepared", None)
        if prep is not None:
            out.append(("triton host prep (table, base pointer)", per_call_us(lambda: prep(refs))))
        else:
            out.append(
                (
                    "triton host prep (table, base pointer)",
                    per_call_us(lambda: (tk.layer_table(refs), tk.base_view(refs[0]))),
                )
            )
    except Exception as e:  # no triton here: say so rather than print a number
        print(f"(triton host prep not measured: {type(e).__name__}: {e})")
    print(f"{'call':45s} {'host us/call':>12s}")
    for name, us in out:
        print(f"{name:45s} {us:12.1f}")


if __name__ == "__main__":
    main()
