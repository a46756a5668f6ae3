"""How long a small copy of the inference engine waits behind Maru's chunk copies on a GPU.

vLLM copies a few bytes between host and GPU every step (sampled token ids to the host, inputs to
the GPU). Maru's stores and loads move whole chunks (33.5 MB at 256 tokens of a Llama-3-8B-shaped
cache) on the copy engines. Copies of one direction run in order on an engine, so a step's small
copy issued right after Maru queued N chunk copies may wait for all N to finish.

Measured here, without vLLM: the latency of a 4 KiB pinned copy on its own stream (the engine's),
issued right after Maru's ``DevicePipeline`` was given 16 chunks (4096 tokens, 0.5 GB):

* idle: nothing else queued;
* store through the ring (the default): ``DevicePipeline.store`` of all 16 chunks (what a
  write-behind store issues at the end of a forward) through GPU staging and the copy engine, in
  one call, then paced from a helper thread (``window`` chunks at a time, the next
  window queued before or only after the one before it completed);
* store in place (``store_path="direct"``, ``kv_ops.store_paths``): the kernel writes the objects;
* paced store (``store(..., paced=True)``, ``kv_ops.paced_store``, the write-behind default): one
  call, on a stream of its own, each chunk's gather between two chunk copies (through the
  fifty-ninth pass: a 5 us kernel between copies, on two streams of its own);
* raw copies of staged chunks, back to back or with a spin kernel between (what the paced store
  was chosen from);
* the paced store again, small copies issued at random moments all through it (as vLLM's come),
  its chunk copies whole and in pieces (``paced_store.PIECE_BYTES``, the default since the
  sixty-first pass);
* load, one call: ``DevicePipeline.load`` of 16 chunks, then a small host-to-device copy.

Usage (GPU machine, repo root): python bench/copy_interference.py
"""

from __future__ import annotations

import os
import random
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maru import kv_ops  # noqa: E402
from maru.kv_ops import paced_store  # noqa: E402
from maru.kv_ops.device_pipeline import DevicePipeline  # noqa: E402

L, NH, HS, BS, NB, CHUNK, CHUNKS = 32, 8, 128, 16, 4096, 256, 16


def small_copy_ms(direction: str, stream: torch.cuda.Stream, host: torch.Tensor, dev: torch.Tensor) -> float:
    """Wall time from issuing a 4 KiB copy on ``stream`` to its completion."""
    ev = torch.cuda.Event()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        if direction == "d2h":
            host.copy_(dev, non_blocking=True)
        else:
            dev.copy_(host, non_blocking=True)
        ev.record(stream)
    ev.synchronize()
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    caches = [
        t for t in torch.zeros((L, NB, 2, BS, NH, HS), dtype=torch.bfloat16, device="cuda")
    ]  # fmt: skip
    layout = kv_ops.detect_layouts(caches, block_size=BS, num_kv_heads=NH, head_size=HS)
    pipe = DevicePipeline(caches, layout, store_path="direct")
    pipe.warm(CHUNK)
    ring = DevicePipeline(caches, layout)
    ring.warm(CHUNK)
    objs = [
        torch.empty(pipe.object_shape(CHUNK), dtype=torch.bfloat16, pin_memory=True) for _ in range(CHUNKS)
    ]
    slots = torch.arange(CHUNKS * CHUNK, dtype=torch.int64)
    eng = torch.cuda.Stream()
    host = torch.empty(1024, dtype=torch.int32, pin_memory=True)
    dev = torch.zeros(1024, dtype=torch.int32, device="cuda")
    nbytes = sum(o.numel() for o in objs) * 2

    def paced(window: int, overlap: bool) -> threading.Thread:
        def run() -> None:
            prev = None
            for i in range(0, CHUNKS, window):
                if prev is not None and not overlap:
                    prev.wait()  # the copy stream runs dry before the next window: others get the engine
                h = ring.store(objs[i : i + window], slots[i * CHUNK : (i + window) * CHUNK])
                if prev is not None and overlap:
                    prev.wait()
                prev = h
            if prev is not None:
                prev.wait()

        t = threading.Thread(target=run)
        t.start()
        return t

    rows = []
    names = (
        "idle d2h", "store in place (direct)", "store, ring, one call", "store, ring, paced 1 overlapped",
        "store, ring, paced 1 with gaps", "store, ring, paced 2 with gaps", "store, paced (kv_ops.paced_store)",
        "raw copies, back to back", "raw copies, 5 us kernel between", "raw copies, 50 us kernel between",
        "idle h2d", "load, one call",
    )  # fmt: skip
    # Pacing on the device alone (no host wake-up between chunks): the copies of staged chunks on one
    # stream with a short spin kernel queued between each two. Does the copy engine serve another
    # stream's copy while the stream's head is a kernel?
    stages = [torch.empty(o.shape, dtype=o.dtype, device="cuda") for o in objs]
    raw_stream = torch.cuda.Stream()
    cycles_per_us = torch.cuda.get_device_properties(0).clock_rate / 1e3 if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1980.0  # fmt: skip

    def raw_copies(spin_us: float) -> None:
        with torch.cuda.stream(raw_stream):
            for k, (o, st) in enumerate(zip(objs, stages, strict=True)):
                if k and spin_us:
                    torch.cuda._sleep(int(spin_us * cycles_per_us))
                o.copy_(st, non_blocking=True)

    for name in names:
        lat, total = [], []
        for _ in range(8):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            thread = handle = None
            if name == "store in place (direct)":
                handle = pipe.store(objs, slots)
            elif name == "store, ring, one call":
                handle = ring.store(objs, slots)
            elif name == "store, paced (kv_ops.paced_store)":
                handle = ring.store(objs, slots, paced=True)  # the write-behind default
            elif name.startswith("store, ring, paced"):
                thread = paced(int(name.split()[3]), "overlapped" in name)
                time.sleep(0.0005)  # the first window is queued
            elif name.startswith("raw copies"):
                spin = 0.0 if "back to back" in name else float(name.split(", ")[1].split()[0])
                raw_copies(spin)
                done_ev = torch.cuda.Event()
                done_ev.record(raw_stream)
                handle = done_ev  # waited below like a handle
            elif name == "load, one call":
                handle = pipe.load(objs, slots)
            lat.append(small_copy_ms("h2d" if "h2d" in name or "load" in name else "d2h", eng, host, dev))
            if handle is not None:
                handle.synchronize() if isinstance(handle, torch.cuda.Event) else handle.wait()
            if thread is not None:
                thread.join()
            torch.cuda.synchronize()
            total.append((time.perf_counter() - t0) * 1e3)
        rows.append((name, statistics.median(lat[2:]), max(lat[2:]), statistics.median(total[2:])))
    # vLLM's small copies come at any phase of a store, not right after it was queued: sample them
    # through the whole paced store, its copies whole and in pieces (``paced_store.PIECE_BYTES``).
    sampled_rows = []
    for label, piece in (("whole copies", 1 << 40), (f"pieces of {paced_store.PIECE_BYTES >> 20} MiB", 0)):
        saved = paced_store.PIECE_BYTES
        paced_store.PIECE_BYTES = piece or saved
        waits, total = [], []
        try:
            for _ in range(10):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                handle = ring.store(objs, slots, paced=True)
                while not handle.done():
                    waits.append(small_copy_ms("d2h", eng, host, dev))
                    time.sleep(random.uniform(0, 2e-4))
                handle.wait()
                total.append((time.perf_counter() - t0) * 1e3)
        finally:
            paced_store.PIECE_BYTES = saved
        waits.sort()
        sampled_rows.append((label, waits, statistics.median(total[2:])))
    print(f"{torch.cuda.get_device_name()}: {CHUNKS} chunks of {CHUNK} tokens, {nbytes / 1e9:.2f} GB")
    print(
        f"store paths: direct {pipe.store(objs[:1], slots[:CHUNK]).path}, ring (default) {ring.store(objs[:1], slots[:CHUNK]).path}"
    )
    print(
        "| background | small copy waits ms (p50 / max) | background done ms | GB/s |\n|---|---:|---:|---:|"
    )
    for name, p50, mx, tot in rows:
        gbps = nbytes / (tot / 1e3) / 1e9 if "idle" not in name else float("nan")
        print(f"| {name} | {p50:.2f} / {mx:.2f} | {tot:.1f} | {gbps:.1f} |")
    print(
        "\n| paced store, small copies sampled through it | copies | waits ms (p50 / p90 / max) | "
        "store done ms | GB/s |\n|---|---:|---:|---:|---:|"
    )
    for label, waits, tot in sampled_rows:
        q = [waits[min(len(waits) - 1, int(f * len(waits)))] for f in (0.5, 0.9)] if waits else [0.0, 0.0]
        top = waits[-1] if waits else 0.0
        print(
            f"| {label} | {len(waits)} | {q[0]:.3f} / {q[1]:.3f} / {top:.3f} | {tot:.1f} | {nbytes / (tot / 1e3) / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
