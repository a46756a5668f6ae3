"""A load issued beside a busy Python thread: what the GIL costs, and what keeping it saves.

vLLM's engine loop spins in Python while asynchronous loads are pending (an empty step polls the
connector). A load issued from another thread makes a few hundred CUDA calls; through a plain
``ctypes.CDLL`` each gives the GIL up and must win it back from the spinning thread. This bench
issues one ``DevicePipeline.load`` of N 256-token chunks (pool pages registered with CUDA, Llama-3-8B
KV geometry) and times issue-to-done, median of 5, in four cases:

* ``alone``: issued and waited on the main thread, nothing else running;
* ``busy, releasing``: issued on a helper thread while the main thread spins, CUDA calls through
  ``CDLL`` and graphs replayed through torch (both give the GIL up): the old loader;
* ``busy, keeping``: the same with the calls that return at once kept under the GIL (``PyDLL``,
  ``cudaGraphLaunch``): the current ``RawSync``;
* ``busy, caller issues``: the spinning thread itself issues, then polls ``done()`` between spins:
  the current ``AsyncLoader`` (the loader thread only looks up).

Usage (GPU): python bench/gil_contention.py [--chunks 64] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_datapath import BS, CHUNK, HS, NB, NH, Pool, make_caches, request_slots  # noqa: E402

from maru import kv_ops  # noqa: E402
from maru.client import cuda_host  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402
from maru.kv_ops.cuda_sync import RawSync  # noqa: E402


def spin(stop: threading.Event, poll: Any = None) -> None:
    """What vLLM's engine loop looks like to the GIL: pure Python, never blocking."""
    x = 0
    while not stop.is_set():
        for i in range(200):
            x += i
        if poll is not None:
            poll()


def releasing(engine: pl.DevicePipeline) -> None:
    """The engine as before: every CUDA call and graph replay gives the GIL up."""
    engine._sync = RawSync.load(keep_gil=False)
    for slot in engine._ring:
        if slot.placer is not None:
            slot.placer._launcher = None


def keeping(engine: pl.DevicePipeline) -> None:
    engine._sync = RawSync.load(keep_gil=True)
    for slot in engine._ring:
        if slot.placer is not None:
            slot.placer._launcher = engine._sync
            slot.placer._execs.clear()


def timed(
    case: str, engine: pl.DevicePipeline, objs: list[torch.Tensor], slots: torch.Tensor
) -> dict[str, float]:
    if case == "alone":
        t0 = time.perf_counter()
        h = engine.load(objs, slots, checksums=True)
        issue = time.perf_counter() - t0
        h.wait()
        return {"issue_s": issue, "total_s": time.perf_counter() - t0}
    stop = threading.Event()
    out: dict[str, float] = {}
    if case == "busy, caller issues":
        state: dict[str, Any] = {}

        def poll() -> None:  # the caller's thread: issue once, then poll without blocking
            if "h" not in state:
                t0 = time.perf_counter()
                state["h"] = engine.load(objs, slots, checksums=True)
                out["issue_s"] = time.perf_counter() - t0
            elif state["h"].done():
                out["total_s"] = time.perf_counter() - state["t0"]
                stop.set()

        state["t0"] = time.perf_counter()
        spin(stop, poll)
        return out
    spinner = threading.Thread(target=spin, args=(stop,))
    spinner.start()
    time.sleep(0.01)
    try:

        def issue() -> None:
            t0 = time.perf_counter()
            h = engine.load(objs, slots, checksums=True)
            out["issue_s"] = time.perf_counter() - t0
            while not h.done():  # the old loader polled; never a blocking wait here
                time.sleep(0)
            out["total_s"] = time.perf_counter() - t0

        t = threading.Thread(target=issue)
        t.start()
        t.join()
    finally:
        stop.set()
        spinner.join()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, nargs="*", default=[8, 64])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    caches = make_caches(NB)
    layout = kv_ops.detect_layouts(caches, block_size=BS, num_kv_heads=NH, head_size=HS)
    engine = pl.DevicePipeline(caches, layout)
    nbytes = engine.object_bytes(CHUNK)
    pool = Pool(max(a.chunks) * nbytes)
    reg = cuda_host.register_host_mapping(pool.mm)
    gen = torch.Generator().manual_seed(3)
    rows = []
    print(f"switch interval {sys.getswitchinterval() * 1e3:.1f} ms, {torch.cuda.get_device_name()}")
    for n in a.chunks:
        objs = [engine.host_object(pool.mm, CHUNK, k * nbytes) for k in range(n)]
        slots = request_slots(n * CHUNK, NB, gen)
        for case in ("alone", "busy, releasing", "busy, keeping", "busy, caller issues"):
            (releasing if case == "busy, releasing" else keeping)(engine)
            timed(case, engine, objs, slots)  # warm
            runs = [timed(case, engine, objs, slots) for _ in range(a.reps)]
            total = statistics.median(r["total_s"] for r in runs)
            issue = statistics.median(r["issue_s"] for r in runs)
            gbps = n * nbytes / total / 1e9
            rows.append(
                {"chunks": n, "case": case, "issue_ms": issue * 1e3, "total_ms": total * 1e3, "gbps": gbps}
            )
            print(
                f"{n:3d} chunks  {case:22s} issue {issue * 1e3:7.2f} ms  issue-to-done {total * 1e3:7.2f} ms  {gbps:5.1f} GB/s",
                flush=True,
            )
    del objs
    print(f"pool registered: {reg}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("| chunks | case | issue ms | issue-to-done ms | GB/s |\n|---:|---|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['chunks']} | {r['case']} | {r['issue_ms']:.2f} | {r['total_ms']:.2f} | {r['gbps']:.1f} |"
        )


if __name__ == "__main__":
    main()
