"""Where the host time of one public ``maru.kv_ops.scatter`` call goes, step by step, on CUDA caches.

Each step of the call (validation, backend choice, the layer table, the tile sizes, the launcher's
key, the device and stream queries, the launch itself) is timed alone in a loop, with the GPU
running behind; the sum is compared with the whole call. Geometry: 32 layers, 8 KV heads x 128,
bf16, block 16, 16 tokens (the GPU time is negligible: the host is what is timed).

Usage (GPU machine, repo root): python bench/kv_ops_breakdown.py
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.kv_ops_host import cuda_case  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.kv_ops import launch, ops, triton_kernels  # noqa: E402
from maru.kv_ops.selection import resolve  # noqa: E402


def us(f: Any, n: int = 3000) -> float:
    for _ in range(200):
        f()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
    return best * 1e6


def main() -> None:
    case, layout = cuda_case()
    slots = torch.randperm(4096 * 16, device="cuda")[:16].to(torch.int64)
    obj = kv_ops.gather(case.caches, layout, slots)
    caches = case.caches
    refs = ops.layer_refs(caches, layout)
    first = ops._first_tensor(caches)
    bits = ops.as_bits(obj)
    cache0, tab, align = triton_kernels.prepared(refs)
    lau = triton_kernels._PLACE
    block_t, block_r, warps = triton_kernels.tiles(layout, 16)
    args = (
        bits, cache0, tab, slots, 16, 0, *bits.stride()[:3], layout.block_stride, layout.head_stride,
        layout.kv_stride, layout.k_token_stride, layout.v_token_stride, layout.k_dim_stride,
        layout.v_dim_stride, layout.block_size, layout.head_size, layout.row_size, layout.num_kv,
        block_t, block_r, False, False, True, align, triton_kernels.row_is_contiguous(layout),
    )  # fmt: skip
    grid = (triton.cdiv(16, block_t), 32 * layout.num_kv)
    lau.launch(grid, warps, *args)
    get_device, get_stream = lau._device_hooks()
    dev = get_device()
    key = lau.key(dev, warps, args)
    kernel = lau._kernels[key]
    hooks = launch._launch_hooks()
    run_args = lau.prep(dev, warps, args)[1]
    print("launch hooks passed:", hooks)
    stream = get_stream(dev)
    steps = [
        ("ops.layer_refs (cache hit)", lambda: ops.layer_refs(caches, layout)),
        ("ops._first_tensor", lambda: ops._first_tensor(caches)),
        ("ops._check_index", lambda: ops._check_index(slots, first.device, layout.num_slots, "s")),
        ("ops._check_obj", lambda: ops._check_obj(obj, tuple(obj.shape), first, "o")),
        ("selection.resolve", lambda: resolve(None, "cuda")),
        ("ops.as_bits", lambda: ops.as_bits(obj)),
        ("triton_kernels.prepared", lambda: triton_kernels.prepared(refs)),
        ("triton_kernels.tiles", lambda: triton_kernels.tiles(layout, 16)),
        ("row_is_contiguous", lambda: triton_kernels.row_is_contiguous(layout)),
        ("obj.stride() x3", lambda: (obj.stride(0), obj.stride(1), obj.stride(2))),
        ("launcher: current device", get_device),
        ("launcher: current stream", lambda: get_stream(dev)),
        ("launcher: key", lambda: lau.key(dev, warps, args)),
        ("launcher: prep (key and launch arguments)", lambda: lau.prep(dev, warps, args)),
        ("launcher: hooks", launch._launch_hooks),
        (
            "kernel.run (Triton's C launcher)",
            lambda: kernel.run(
                grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata, None, *hooks, *args
            ),
        ),  # fmt: skip
        (
            "kernel.run, CUDA tensors as addresses",
            lambda: kernel.run(
                grid[0], grid[1], 1, stream, kernel.function, kernel.packed_metadata, None, *hooks, *run_args
            ),
        ),  # fmt: skip
        ("Launcher.launch (whole)", lambda: lau.launch(grid, warps, *args)),
        (
            "triton_kernels.place (whole)",
            lambda: triton_kernels.place(refs, layout, slots, bits, gather=False),
        ),
        ("kv_ops.scatter (the public call)", lambda: kv_ops.scatter(obj, caches, layout, slots)),
        ("torch: empty_like(slots) (a trivial torch op)", lambda: torch.empty_like(slots)),
    ]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    print("| step | host us |\n|---|---:|")
    for name, f in steps:
        print(f"| {name} | {us(f):.2f} |")
    print("launcher:", lau.stats())


if __name__ == "__main__":
    main()
