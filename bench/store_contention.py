"""What a write-behind store's device work costs a forward running beside it.

The storing instance's requests pay +2.3-2.7 ms of prefill (scheduled to first token) against an
instance without a connector (bench/RESULTS.md, sixtieth and sixty-first passes). A store's device
work besides its copies is, per chunk, one graph: the gather from the paged cache into the staging
slot and the sum of the staged bytes. Those kernels share the SMs and device memory with vLLM's
forward. Measured here, no vLLM, the API workload's store batch (16 requests x (one 256-token chunk
+ a 144-token tail): 32 chunks, 8B-shaped cache: 32 layers, 8 KV heads x 128, bf16, block 16):

* the device time of one paced chunk graph (gather + sum), and of the gather and the checksum
  graphs alone, each launched back to back on an idle device (CUDA events);
* a stand-in forward (GEMMs, ``--forward-ms`` of device time) alone, and with a paced store batch
  (``DevicePipeline.store(..., paced=True)``, the write-behind lane) issued right after the
  GEMMs were queued, from another stream: how much longer the forward takes, ms a batch. (The
  first version issued the store first and counted its ~1.5 ms of host issue as slowdown.)

Sixty-first pass, H100: the batch's chunk graphs take 1.22 ms alone (a 256-token chunk 47 us: the
gather 26, the sum 12), and the 26 ms forward ran +0.45 / +0.51 ms longer beside the store.
Capping the kernels' grid (32-64 programs looping over the tiles) made the graphs 3.8-7x slower
and the forward no faster (+0.68 / +1.37 ms): tried, not kept.

Usage (GPU machine, repo root): python bench/store_contention.py [--reps 12] [--forward-ms 25]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maru import kv_ops  # noqa: E402
from maru.kv_ops.device_pipeline import DevicePipeline  # noqa: E402

L, NH, HS, BS, NB, CHUNK = 32, 8, 128, 16, 4096, 256
BATCH = [CHUNK, 144] * 16  # the API workload's store batch


def graph_us(placer: object, key: tuple, stream: torch.cuda.Stream, n: int, sync: object) -> float:
    """Device time of one launch of ``key``'s graph, over ``n`` launches back to back."""
    exe = placer.raw_exec(key, capture=True)  # type: ignore[attr-defined]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record(stream)
    for _ in range(n):
        sync.launch_graph(exe, stream.cuda_stream)  # type: ignore[attr-defined]
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / n


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument("--forward-ms", type=float, default=25.0)
    ap.add_argument(
        "--segments", type=int, default=0, help="segment sums of this many tokens (the connector's)"
    )
    ap.add_argument("--no-checksums", action="store_true")
    args = ap.parse_args()
    caches = [torch.randn((NB, 2, BS, NH, HS), device="cuda").to(torch.bfloat16) for _ in range(L)]
    layout = kv_ops.detect_layouts(caches, block_size=BS, num_kv_heads=NH, head_size=HS)
    pipe = DevicePipeline(caches, layout)
    pipe.warm(CHUNK)
    sync = pipe._sync
    lane = pipe._paced()
    side = torch.cuda.Stream()
    n_tok = sum(BATCH)
    slots = torch.randperm(NB * BS, device="cuda")[:n_tok].to(torch.int64).contiguous()
    objs = [torch.empty(pipe.object_shape(t), dtype=torch.bfloat16, pin_memory=True) for t in BATCH]

    # One paced chunk graph (gather + sum) and the ring's gather and checksum graphs, alone.
    rows = []
    big = torch.arange(1 << 20, device="cuda", dtype=torch.int64) % (NB * BS)
    with torch.cuda.stream(lane.gather):
        for t in (CHUNK, 144):
            lane.batch.start(sync, big, 1, lane.gather.cuda_stream)
            paced = graph_us(lane.slots[0].placer, ("paced-chunk", t, None), lane.gather, 64, sync)
            ring = pipe._ring[0].placer
            ring.set_slots(slots[:t])  # real slots: a gather of -1 slots reads nothing
            gather = graph_us(ring, ("gather", t, None), lane.gather, 64, sync)
            summed = graph_us(ring, ("checksum", t, None), lane.gather, 64, sync)
            rows.append((t, paced, gather, summed))
    torch.cuda.synchronize()

    # The stand-in forward: GEMMs sized to ``--forward-ms`` of device time.
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        for _ in range(3):  # cuBLAS's first call sets itself up
            torch.mm(a, b)
        start.record(side)
        for _ in range(4):
            torch.mm(a, b)
        end.record(side)
    end.synchronize()
    per_mm = start.elapsed_time(end) / 4
    n_mm = max(1, round(args.forward_ms / per_mm))

    store_ms: list[float] = []
    lane_caller = torch.cuda.Stream()  # the store's caller: not the forward's stream (write-behind)

    def forward_ms(with_store: bool) -> float:
        # The GEMMs are queued first, the store after them from the same thread: the store's host
        # issue (~1.5-2 ms, drain_cpu.py) must not delay the forward's queueing (the first version
        # of this bench issued the store first and counted that host time as device slowdown).
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            start.record(side)
            for _ in range(n_mm):
                torch.mm(a, b)
            end.record(side)
        handle = None
        if with_store:
            with torch.cuda.stream(lane_caller):
                handle = pipe.store(
                    objs,
                    slots,
                    paced=True,
                    checksums=not args.no_checksums,
                    segment_tokens=args.segments or None,
                )
        end.synchronize()
        if handle is not None:
            handle.wait()
            store_ms.append((time.perf_counter() - t0) * 1e3)
        return start.elapsed_time(end)

    alone, beside = [], []
    for _ in range(args.reps):  # alternated: the device's pace drifts
        alone.append(forward_ms(False))
        beside.append(forward_ms(True))
    torch.cuda.synchronize()
    print(
        f"{torch.cuda.get_device_name()}; batch {len(BATCH)} chunks, {n_tok} tokens; ways {sorted(pipe.store_ways)}; "
        f"checksums {not args.no_checksums}, segment sums of {args.segments or '-'} tokens"
    )
    print(
        "| chunk tokens | paced chunk graph (gather + sum), us | gather graph alone | checksum graph alone |"
    )
    print("|---:|---:|---:|---:|")
    for t, p, g, s in rows:
        print(f"| {t} | {p:.1f} | {g:.1f} | {s:.1f} |")
    batch_us = sum(rows[0][1] if t == CHUNK else rows[1][1] for t in BATCH)
    print(f"\nthe batch's chunk graphs, alone: {batch_us / 1e3:.2f} ms of device time")
    d = [x - y for x, y in zip(beside, alone, strict=True)]
    print(
        f"stand-in forward ({n_mm} GEMMs 8192^3): alone {statistics.median(alone):.2f} ms, beside a paced store batch "
        f"{statistics.median(beside):.2f} ms: +{statistics.median(d):.2f} ms (median of {args.reps} pairs; "
        f"quartiles {statistics.quantiles(d, n=4)[0]:+.2f} / {statistics.quantiles(d, n=4)[2]:+.2f}); "
        f"the store done {statistics.median(store_ms):.1f} ms after its issue ({sum(o.numel() * 2 for o in objs) / statistics.median(store_ms) / 1e6:.1f} GB/s)"
    )


if __name__ == "__main__":
    main()
