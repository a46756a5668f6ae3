"""Where a write-behind store's issue spends vLLM's forward-thread time (GPU).

In real vLLM the storing instances spent 4.2 ms of host time in ``wait_for_save`` per store batch
of 14 chunks on average (H200, 2026-12-02): the issue of the paced store (``kv_ops.paced_store``)
on the forward thread. This builds an engine as the vLLM worker does (real server, CUDA caches of
Llama-3-8B's KV geometry, the warm-up), reserves ahead (as the worker does beside the forward),
then times ``issue_store`` for stores of 1, 8, 16 and 32 chunks: the whole issue, the part in
``DevicePipeline.store`` (the device pipeline's queueing), the rest (the engine's bookkeeping).
Then one cProfile run of 16-chunk issues, its top functions by own time.

Measured (H200, 2026-12-02, bench/RESULTS.md): the reserve round trip 0.31-1.27 ms (1-32 chunks),
now made beside the forward; the issue 0.66-0.85 ms for one chunk, 1.25-1.71 ms for 8, 2.0-3.1 ms
for 16, 3.7-4.2 ms for 32. A variant issuing only raw calls per chunk (the slot mapping by a raw
copy, graph launches on an explicit stream, the checksum kernel on the copy stream as the pacing
yield) measured the same within the spread (A/B on one machine) and was not kept.

Usage (GPU machine, repo root): python bench/store_issue.py [--reps 10]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_connector import BS, CHUNK, HS, NB, NH, make_caches, request, server_client  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402


def one(engine: KVTransferEngine, chunks: int, gen: torch.Generator, timed: dict) -> None:
    reqs = [request(chunks * CHUNK, f"si-{chunks}-{uuid.uuid4().hex[:8]}", gen)]
    t0 = time.perf_counter()
    res = engine.reserve_store(reqs)
    t1 = time.perf_counter()
    pending = engine.issue_store(reqs, res)
    t2 = time.perf_counter()
    rep = engine.complete_store(pending)
    assert rep.stored == chunks, rep
    timed.setdefault("reserve", []).append(t1 - t0)
    timed.setdefault("issue", []).append(t2 - t1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    a = ap.parse_args()
    with server_client(6 << 30) as client:
        src = make_caches(NB, 1)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        engine = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK)
        pipe = engine.path.pipeline
        in_pipe: list[float] = []
        real_store = pipe.store

        def timed_store(*args, **kw):  # type: ignore[no-untyped-def]
            t = time.perf_counter()
            try:
                return real_store(*args, **kw)
            finally:
                in_pipe.append(time.perf_counter() - t)

        pipe.store = timed_store
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):  # warm: graphs, kernels, pinned buffers
            one(engine, 8, gen, {})
        rows = []
        for chunks in (1, 8, 16, 32):
            timed: dict = {}
            in_pipe.clear()
            for _ in range(a.reps):
                one(engine, chunks, gen, timed)
            med = {k: statistics.median(v) for k, v in timed.items()}
            rows.append((chunks, med["reserve"], med["issue"], statistics.median(in_pipe)))
        prof = cProfile.Profile()
        for _ in range(a.reps):
            reqs = [request(16 * CHUNK, f"prof-{uuid.uuid4().hex[:8]}", gen)]
            res = engine.reserve_store(reqs)
            prof.enable()
            pending = engine.issue_store(reqs, res)
            prof.disable()
            engine.complete_store(pending)
        engine.close()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    print(s.getvalue())
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(30)
    print(s.getvalue())
    print(
        f"{torch.cuda.get_device_name()}; {CHUNK}-token chunks; paced={engine.paces_stores}; median of {a.reps}"
    )
    print("| chunks | reserve us | issue us | of which DevicePipeline.store | issue us per chunk |")
    print("|---:|---:|---:|---:|---:|")
    for chunks, r, i, p in rows:
        print(f"| {chunks} | {r * 1e6:.0f} | {i * 1e6:.0f} | {p * 1e6:.0f} | {i / chunks * 1e6:.0f} |")


if __name__ == "__main__":
    main()
