"""Throughput of ``maru.checksum`` on this CPU (one core), against zlib.crc32 as a yardstick.

    python bench/checksum.py [--mib 64]

Prints a table: object size, GB/s of maru.checksum, GB/s of crc32. The checksum is computed on
store and on every verified retrieve, so its GB/s bounds what a single-threaded client can
store or verify per second.
"""

from __future__ import annotations

import argparse
import time
import zlib

import numpy as np

from maru.checksum import checksum


def rate(fn, buf: bytes, total: int) -> float:
    reps = max(1, total // len(buf))
    fn(buf)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(reps):
            fn(buf)
        best = min(best, time.perf_counter() - t)
    return reps * len(buf) / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64, help="bytes hashed per row and repetition")
    args = ap.parse_args()
    total = args.mib << 20
    rng = np.random.default_rng(0)
    print("| object size | maru.checksum GB/s | zlib.crc32 GB/s |")
    print("| ---: | ---: | ---: |")
    for size in (4 << 10, 64 << 10, 256 << 10, 1 << 20, 16 << 20, 64 << 20):
        buf = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        print(f"| {size >> 10} KiB | {rate(checksum, buf, total):.2f} | {rate(zlib.crc32, buf, total):.2f} |")


if __name__ == "__main__":
    main()
