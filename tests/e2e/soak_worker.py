"""One client of the integrity soak (``python -m tests.e2e.soak_worker URL INDEX WORKERS SECONDS``).

Stores objects whose bytes derive from their key (``content``), reads random keys of every
worker and compares every byte of each hit with ``content(key)``, until SECONDS pass. Prints
one JSON line of counts; ``wrong`` counts hits whose bytes differ (the promise: always 0).
"""

from __future__ import annotations

import hashlib
import json
import random
import sys
import time

import numpy as np

from maru.client import MaruHandler
from maru.errors import MaruError, PoolFullError, StaleAllocationError


def content(key: str) -> bytes:
    """The bytes stored under ``key``: 1 B .. 192 KiB, derived from the key alone."""
    seed = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 192 << 10))
    return rng.integers(0, 256, size, dtype=np.uint8).tobytes()


def main(url: str, index: int, workers: int, seconds: float) -> None:
    rng = random.Random(index)
    counts = dict(stores=0, stale=0, full=0, errors=0, hits=0, misses=0, wrong=0, bytes_verified=0)
    deadline = time.monotonic() + seconds
    h = MaruHandler(url, heartbeat_interval_s=0.5)
    written = 0
    while time.monotonic() < deadline:
        try:
            if rng.random() < 0.5:
                key = f"w{index}-{written}"
                data = content(key)
                obj = h.alloc(len(data))
                obj.buf[:] = data
                h.store(key, obj)
                written += 1
                counts["stores"] += 1
            else:
                keys = [f"w{rng.randrange(workers)}-{rng.randrange(max(written, 1) + 5)}" for _ in range(4)]
                for key, r in zip(keys, h.batch_retrieve(keys), strict=True):
                    if r is None:
                        counts["misses"] += 1
                        continue
                    got = r.tobytes()
                    trusted = r.valid
                    r.release()
                    counts["hits"] += 1
                    if got != content(key):
                        counts["wrong" if trusted else "errors"] += 1
                    else:
                        counts["bytes_verified"] += len(got)
        except StaleAllocationError:
            counts["stale"] += 1  # stalled past the lease: the reservation is gone, alloc again
        except PoolFullError:
            counts["full"] += 1
        except MaruError:
            counts["errors"] += 1
    counts["integrity"] = h.integrity()
    h.close()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
