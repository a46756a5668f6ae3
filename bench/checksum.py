"""Throughput of ``maru.checksum`` on this CPU: the compiled loop and the numpy one, alone and beside a
busy Python thread, with zlib.crc32 as a yardstick.

    python bench/checksum.py [--mib 64]

Prints a table: object size, then GB/s of maru.checksum compiled (``maru.native``) and numpy, each
alone and beside a thread that spins in Python (what vLLM's engine loop does while requests wait
for loads), then crc32 alone. The checksum is computed on store and on every verified retrieve, so
its GB/s bounds what one client thread can store or verify per second. Objects from 16 MiB are
split over up to 8 threads (``maru.checksum.PARALLEL_BYTES``), so those rows use every core.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import maru.checksum as ck  # noqa: E402


def rate(fn: Callable[[bytes], int], buf: bytes, total: int) -> float:
    reps = max(1, total // len(buf))
    fn(buf)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn(buf)
        best = min(best, time.perf_counter() - t)
    return reps * len(buf) / best / 1e9


@contextmanager
def spinning() -> Iterator[None]:
    """A thread that runs Python bytecode without pause while the body runs."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    t = threading.Thread(target=spin, daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join()


@contextmanager
def numpy_only() -> Iterator[None]:
    saved = ck._native
    ck._native = lambda: None  # type: ignore[assignment]
    try:
        yield
    finally:
        ck._native = saved  # type: ignore[assignment]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64, help="bytes hashed per row and repetition")
    args = ap.parse_args()
    total = args.mib << 20
    rng = np.random.default_rng(0)
    if ck.implementation() != "native":
        print(f"(no compiled loop here: {ck.native.load().reason}; its columns repeat numpy)")
    print(
        "| object size | compiled GB/s | compiled, beside a busy thread | numpy GB/s "
        "| numpy, beside a busy thread | zlib.crc32 GB/s |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: |")
    for size in (4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20):
        buf = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        row = [rate(ck.checksum, buf, total)]
        with spinning():
            row.append(rate(ck.checksum, buf, total))
        with numpy_only():
            row.append(rate(ck.checksum, buf, total))
            with spinning():
                row.append(rate(ck.checksum, buf, total))
        row.append(rate(zlib.crc32, buf, total))
        print(f"| {size >> 10} KiB | " + " | ".join(f"{r:.2f}" for r in row) + " |")


if __name__ == "__main__":
    main()
