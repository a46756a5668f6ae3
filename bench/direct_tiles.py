"""The direct layer load's tiles against the bus: a burst step's load, timed on the device.

A warm API burst loads ~15 requests at once, each the last 128 tokens of one chunk and a full
chunk after it (bench/RESULTS.md, pass 35). This replays that shape (32 layers, 8 KV heads x 128,
bf16, block 16; 30 chunk objects of 256 tokens in pinned host memory) through
``DevicePipeline.load_layers`` on the direct path, eager launches (no graphs, so each tile setting
is compiled and launched as set), and reports the device time of the whole load (CUDA events
around it) and the bytes it read a second, as a share of a plain pinned host-to-device copy.

Rows: every (tokens a program, warps) of ``TuneParams`` in the sweep, with checksums and segment
sums (what the connector runs), plus the production setting without segment sums and without
checksums. Usage (GPU): ``python bench/direct_tiles.py [--reps 10]``.
"""

from __future__ import annotations

import argparse
import itertools

import torch

from maru import kv_ops
from maru.kv_ops import device_pipeline as pl
from maru.kv_ops import triton_kernels as tk

L, NH, HS, BS, CHUNK, NCHUNK = 32, 8, 128, 16, 256, 30


def _time(fn, reps: int) -> float:  # noqa: ANN001
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--production", action="store_true", help="only the production tiles")
    args = ap.parse_args()
    nb = NCHUNK * CHUNK // BS * 2
    caches = [torch.randn(2, nb, BS, NH, HS, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    layout = kv_ops.detect_layouts(caches, block_size=BS, num_kv_heads=NH, head_size=HS)
    eng = pl.DevicePipeline(caches, layout, use_graphs=False)
    objs = [torch.empty(L, 2, CHUNK, NH * HS, dtype=torch.bfloat16).pin_memory() for _ in range(NCHUNK)]
    slots = torch.randperm(nb * BS)[: NCHUNK * CHUNK]
    store = eng.store(objs, slots, checksums=True, segment_tokens=BS)
    store.wait()
    segs = store.segment_sums()
    load = slots.clone()
    for r in range(NCHUNK // 2):  # each request: the last 128 tokens of its first chunk, a whole second
        load[2 * r * CHUNK : 2 * r * CHUNK + CHUNK // 2] = -1
    total = sum(o.numel() * 2 for o in objs)
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    pinned_ms = _time(lambda: dev.copy_(host, non_blocking=True), args.reps)
    pinned = total / pinned_ms / 1e6
    print(f"pinned H2D: {pinned:.1f} GB/s ({total / 2**20:.0f} MiB in {pinned_ms:.2f} ms)", flush=True)
    want = store.checksums()

    def run(checksums: bool, with_segs: bool) -> tuple[float, int]:
        kw = {"segments": segs} if with_segs else {}
        h = eng.load_layers(objs, load, checksums=checksums, **kw)
        h.wait()
        if checksums:
            assert h.checksums() == want, "checksums differ"
        ms = _time(lambda: eng.load_layers(objs, load, checksums=checksums, **kw).wait_on(), args.reps)
        if not checksums:  # the kernel reads only the rows it places
            return ms, int((load >= 0).sum()) * L * 2 * NH * HS * 2
        return ms, total - h.unread_bytes

    saved = (tk.TuneParams.block_t, tk.TuneParams.num_warps)
    print(
        "| tokens a program | warps | checksums | segment sums | load ms | MiB read | GB/s read | % of pinned |"
    )
    print("|---:|---:|---|---|---:|---:|---:|---:|")
    rows = [(bt, w, True, True) for bt, w in itertools.product((1, 2, 4, 8, 16), (2, 4, 8))]
    if args.production:
        rows = [(saved[0], saved[1], True, True)]
    rows += [(saved[0], saved[1], True, False), (saved[0], saved[1], False, False)]
    for bt, w, cs, sg in rows:
        tk.TuneParams.block_t, tk.TuneParams.num_warps = bt, w
        try:
            ms, read = run(cs, sg)
        except Exception as e:  # a setting the compiler refuses: say so, keep going
            print(
                f"| {bt} | {w} | {cs} | {sg} | error: {type(e).__name__}: {str(e)[:80]} | | | |", flush=True
            )
            continue
        gbs = read / ms / 1e6
        print(
            f"| {bt} | {w} | {cs} | {sg} | {ms:.2f} | {read / 2**20:.0f} | {gbs:.1f} | {100 * gbs / pinned:.1f}% |",
            flush=True,
        )
    tk.TuneParams.block_t, tk.TuneParams.num_warps = saved


if __name__ == "__main__":
    main()
