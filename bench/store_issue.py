"""What a write-behind store costs vLLM's forward thread (GPU): queued at once, gathered on the drain.

The worker's ``wait_for_save`` runs on vLLM's forward thread. Until 2026-12-02 it issued the
store's gather there (2.0-3.6 ms for 16 chunks on the H200 host, bench/RESULTS.md); now it records
a CUDA event on the forward's stream, and the drain thread reserves, issues the gather after that
event, waits for it and publishes. The drain thread still needs the GIL for its Python, so what
the forward thread pays is not zero: this measures it.

An engine is built as the vLLM worker builds it (real server, CUDA caches of Llama-3-8B's KV
geometry, the warm-up). A stand-in forward (``--ops`` small kernel launches from Python: host-bound,
the worst case for sharing the GIL; optionally behind ``--gpu-ms`` of device work it then waits
for, as a GPU-bound step does) is timed, per store size (1, 8, 16, 32 chunks of 256 tokens):

* alone;
* then issuing the store's gather itself on the forward thread, objects reserved beforehand (the
  old way, what ``wait_for_save`` cost before);
* beside a drain thread that reserves, gathers and publishes the same store (the new way: the
  forward thread only records the event, ``issue_store``).

"paid" is the forward's median time minus its time alone. Also: the drain's own times (reserve,
issue, wait for the copies, publish).

Measured (H200, 2026-12-02, bench/RESULTS.md, twentieth pass), paid for 1 / 8 / 16 / 32 chunks:
GPU-bound (``--gpu-ms 40``) old 1.43 / 2.61 / 3.86 / 6.48 ms, new 0.11 / 0.16 / 0.15 / 0.07 ms;
host-bound old 1.00 / 1.86 / 3.02 / 4.85 ms, new 1.65 / 3.21 / 4.48 / 7.49 ms (the GIL).

Usage (GPU machine, repo root): python bench/store_issue.py [--reps 10] [--ops 3000] [--gpu-ms 0]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_connector import BS, CHUNK, HS, NB, NH, make_caches, request, server_client  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402
from maru.transfer.records import StoreReport  # noqa: E402
from maru.transfer.stores import PreparedStore  # noqa: E402


class Forward:
    """A stand-in for vLLM's forward: ``ops`` small launches from Python, then (``gpu_ms`` > 0)
    a wait for device work queued before them."""

    def __init__(self, ops: int, gpu_ms: float) -> None:
        self.ops, self.gpu_ms = ops, gpu_ms
        self.x = torch.zeros(1024, device="cuda")
        self.cycles = 0
        if gpu_ms > 0:  # calibrate torch.cuda._sleep: cycles per ms
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch.cuda._sleep(50_000_000)
            torch.cuda.synchronize()
            self.cycles = int(50_000_000 * gpu_ms / ((time.perf_counter() - t) * 1e3))

    def run(self, between: Any = None) -> float:
        """Seconds of the forward; ``between()`` runs on this thread after the launches (the old
        ``wait_for_save``)."""
        t = time.perf_counter()
        if self.cycles:
            torch.cuda._sleep(self.cycles)
        for _ in range(self.ops):
            self.x.add_(1.0)
        if between is not None:
            between()
        if self.cycles:
            torch.cuda.current_stream().synchronize()
        return time.perf_counter() - t


def fresh(chunks: int, gen: torch.Generator) -> list[Any]:
    return [request(chunks * CHUNK, f"si-{chunks}-{uuid.uuid4().hex[:8]}", gen)]


def old_way(engine: KVTransferEngine, fwd: Forward, chunks: int, gen: torch.Generator) -> float:
    """The gather issued on the forward thread into objects reserved beforehand."""
    reqs = fresh(chunks, gen)
    prep = PreparedStore(report=StoreReport())
    reserved = engine._reserve(reqs, prep)
    assert reserved is not None
    issued: list[Any] = []
    dt = fwd.run(lambda: issued.append(engine.issue_gather(*reserved, prep, paced=engine.paced_store)))
    engine.finish_gather(issued[0], prep)
    assert engine.commit_store(prep).stored == chunks
    return dt


def new_way(engine: KVTransferEngine, fwd: Forward, chunks: int, gen: torch.Generator, drain: dict) -> float:
    """The forward thread records the event; a drain thread does the rest beside the next forward."""
    reqs = fresh(chunks, gen)
    pending = engine.issue_store(reqs)
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(engine.complete_store(pending)), name="maru-store-drain")
    th.start()
    dt = fwd.run()
    th.join()
    assert out and out[0].stored == chunks, out
    drain.setdefault("complete", []).append(out[0].seconds)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ops", type=int, default=3000, help="small launches of the stand-in forward")
    ap.add_argument("--gpu-ms", type=float, default=0.0, help="device work the forward waits for")
    a = ap.parse_args()
    with server_client(6 << 30) as client:
        src = make_caches(NB, 1)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        engine = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK)
        fwd = Forward(a.ops, a.gpu_ms)
        gen = torch.Generator().manual_seed(0)
        drain: dict = {}
        for _ in range(3):  # warm: graphs, kernels, pinned buffers, the follower stream
            old_way(engine, fwd, 8, gen)
            new_way(engine, fwd, 8, gen, drain)
            fwd.run()
        rows = []
        for chunks in (1, 8, 16, 32):
            alone, old, new = [], [], []
            drain = {}
            for _ in range(a.reps):  # interleaved, so drift hits all three alike
                alone.append(fwd.run())
                old.append(old_way(engine, fwd, chunks, gen))
                new.append(new_way(engine, fwd, chunks, gen, drain))
            base = statistics.median(alone)
            rows.append(
                (
                    chunks,
                    base,
                    statistics.median(old) - base,
                    statistics.median(new) - base,
                    statistics.median(drain["complete"]),
                )
            )
        engine.close()
    print(
        f"{torch.cuda.get_device_name()}; {CHUNK}-token chunks; paced={engine.paces_stores}; stand-in forward "
        f"{a.ops} launches{f' behind {a.gpu_ms:.0f} ms of device work' if a.gpu_ms else ''}; median of {a.reps}"
    )
    print(
        "| chunks | forward alone ms | paid, issue on the forward thread (old) ms | paid, drain thread (new) ms | drain's store ms |"
    )
    print("|---:|---:|---:|---:|---:|")
    for chunks, base, old, new, comp in rows:
        print(f"| {chunks} | {base * 1e3:.2f} | {old * 1e3:.2f} | {new * 1e3:.2f} | {comp * 1e3:.2f} |")


if __name__ == "__main__":
    main()
