"""Host time of the worker's load prep for a burst of held turns, in process (CPU caches).

    .venv/bin/python bench/load_prep_cpu.py [--users 15] [--reps 40] [--profile]

A real ``maru server``, a ``KVTransferEngine`` over CPU caches of 32 layers (2 KV heads of 64,
fp16, block 16, 256-token chunks: the layer and chunk counts of the H200 runs, fewer bytes). Each
user stored two chunks; a load step then places, for every user, the last 128 tokens of the first
chunk and 112 of the second (a multi-round turn's hit ends inside a chunk), the chunks held pinned
by a second client (the scheduler's offer pins: ``RequestTransfer.held``, no lookup round trip).
Timed: ``engine.pin`` of the step (what ``start_load_kv`` pays before the layer load's issue:
the held views, each request's checks, objects and slot mappings), then its release. Reported:
min / median microseconds a step; ``--profile``: the top functions of the timed calls; ``--cold MB``:
caches turned over before each call (MB MiB touched, other Python run), as between two load steps
in an engine.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.load_rpc_cpu import BS  # noqa: E402
from bench.load_rpc_cpu import engine as rpc_engine  # noqa: E402
from maru.client import MaruHandler  # noqa: E402
from maru.demo.server import ServerProcess  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402
from maru.transfer.records import ChunkRef, HeldChunk, RequestTransfer  # noqa: E402

NH, HS, LAYERS, CHUNK = 2, 64, 32, 256  # BS: load_rpc_cpu's 16


def engine(seed: int, client: MaruHandler, num_blocks: int) -> KVTransferEngine:
    return rpc_engine(
        seed, client, num_blocks, heads=NH, head_size=HS, layers=LAYERS, chunk=CHUNK, dtype=torch.float16
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--users", type=int, default=15)
    ap.add_argument("--reps", type=int, default=40)
    ap.add_argument(
        "--chunks", type=int, default=2, help="chunks a user stored and loads (the last one placed in part)"
    )
    ap.add_argument("--profile", action="store_true")
    ap.add_argument(
        "--cold",
        type=int,
        default=0,
        metavar="MB",
        help="before each timed call, touch MB MiB of memory and run other Python (an engine's step "
        "runs between two load steps): the prep with cold caches, as in the engine",
    )
    a = ap.parse_args()
    evict = _evictor(a.cold) if a.cold else (lambda: None)
    k = a.chunks
    per_user = k * CHUNK // BS
    stored = [
        RequestTransfer(
            f"u{u}",
            tuple(range(u * per_user, (u + 1) * per_user)),
            tuple(ChunkRef(f"prep/u{u}/c{i}", i * CHUNK, CHUNK) for i in range(k)),
        )
        for u in range(a.users)
    ]
    blocks = a.users * per_user + 1
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(tmp, pool_size=(a.users * k + 4) * (8 << 20), log_level="WARNING")
        srv.start()
        client, holder = MaruHandler(srv.url, timeout_s=30), MaruHandler(srv.url, timeout_s=30)
        try:
            assert engine(1, client, blocks).store(stored).stored == k * a.users
            keys = [c.key for q in stored for c in q.chunks]
            handles = holder.batch_retrieve(keys, pin=True, verify=False, segments=True)
            held = {h.key: HeldChunk(h.key, h.offset, h.size, h.checksum, h.segments) for h in handles}
            step = [
                RequestTransfer(
                    q.req_id,
                    tuple(reversed(q.block_ids)),  # other blocks than the stored ones
                    (
                        ChunkRef(q.chunks[0].key, 0, CHUNK, place_begin=128),
                        *(ChunkRef(c.key, c.start, CHUNK) for c in q.chunks[1:-1]),
                        ChunkRef(q.chunks[-1].key, (k - 1) * CHUNK, CHUNK, 0, 112),
                    ),
                    held=tuple(held[c.key] for c in q.chunks),
                )
                for q in stored
            ]
            eng = engine(2, client, blocks)
            prof = cProfile.Profile() if a.profile else None
            times = []
            for i in range(a.reps + 5):
                evict()
                if prof is not None and i >= 5:
                    prof.enable()
                t0 = time.perf_counter()
                pinned = eng.pin(step)
                dt = time.perf_counter() - t0
                if prof is not None:
                    prof.disable()
                assert not pinned.failed and len(pinned.ready) == a.users, pinned.failed
                eng.release(pinned)
                if i >= 5:  # warm-up
                    times.append(dt)
            holder.batch_release(handles)
        finally:
            client.close()
            holder.close()
            srv.cleanup()
    print(
        f"engine.pin of {a.users} held turns ({k} chunks each, placed in part{', cold caches' if a.cold else ''}): "
        f"min {min(times) * 1e6:.0f} us, median {statistics.median(times) * 1e6:.0f} us"
    )
    if prof is not None:
        pstats.Stats(prof).sort_stats(os.environ.get("SORT", "tottime")).print_stats(25)


def _evictor(mb: int) -> Callable[[], None]:
    """What runs between two load steps in an engine, roughly: memory touched (every cache line of
    ``mb`` MiB: the data caches emptied of the prep's objects) and other Python run (dicts, lists,
    strings: the interpreter's own caches turned over)."""
    big = np.ones(mb << 18, dtype=np.float32)  # mb MiB

    def evict() -> None:
        float(big.sum())
        junk = [{"id": i, "tokens": list(range(i % 7, i % 7 + 8)), "name": str(i)} for i in range(4000)]
        sorted(junk, key=lambda d: d["name"])
        json.dumps(junk[:500])

    return evict


if __name__ == "__main__":
    main()
