"""The round trip the vLLM scheduler makes for its offer pins, as the benches time it
(``bench/rpc_gil.py``, ``bench/server_spin.py``): a lookup-and-pin of 2 stored keys, its UNPIN
posted without waiting."""

from __future__ import annotations

import time
from typing import Any


def store_keys(h: Any, n: int = 64) -> list[str]:
    """Store ``n`` small objects through handler ``h``; their keys."""
    keys = [f"kv1/bench/{i:032x}" for i in range(n)]
    objs = h.batch_alloc([4096] * n)
    for o in objs:
        o.buf[:] = b"\1" * 4096
    h.batch_store(keys, objs)
    return keys


def pin_trip_us(h: Any, keys: list[str], i: int) -> float:
    """Microseconds of trip ``i``: a lookup-and-pin of 2 of ``keys``, then its UNPIN posted."""
    t0 = time.perf_counter()
    got = h.batch_retrieve(keys[i % 30 : i % 30 + 2], pin=True, verify=False)
    h.batch_release(got, wait=False)
    return (time.perf_counter() - t0) * 1e6
