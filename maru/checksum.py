"""The object checksum: 64 bits over an object's bytes, the same on the CPU and on a GPU.

A writer computes it when it stores an object (``MaruHandler.batch_store`` sends it in COMMIT);
the server keeps it with the key and returns it in LOOKUP; a reader recomputes it over the
bytes it is about to trust and treats a difference as a miss. It detects a stale or buggy
writer (a process that kept writing after its reservation was taken away); it is not a MAC: a
process that can write the pool file can also forge a matching checksum (the pool file's
permissions are the defence there; docs/reliability.md).

Definition (``ALGORITHM``), over the object's ``n`` bytes zero-padded to a multiple of 8 and
read as little-endian uint64 words ``w_0 .. w_{m-1}``, all arithmetic mod 2**64::

    x_i = w_i + i * K1
    x_i = x_i * K2;  x_i ^= x_i >> 32
    x_i = x_i * K3;  x_i ^= x_i >> 29
    h   = sum_i x_i
    checksum = h ^ n

Each word is mixed with its own index, so moved, swapped or zeroed words change the result;
the sum makes it order-independent, so any number of threads (or a GPU grid: one program per
block of words, ``tl.sum`` of uint64 per block, an atomic or a second-pass add) computes
exactly the same value. On the CPU the sum runs in compiled C (``maru.native``: one call that
does not stop at every numpy operation to take the GIL back, 2-4x numpy's speed); where it cannot be built the numpy
version here walks the words in cache-sized blocks, announced once as a slower path. A Triton
kernel must use the same constants, the same shifts, uint64 wrapping multiplies and the same
zero padding. 64-bit words rather than 32-bit ones: half the words for the same bytes, which
makes the numpy version about 1.7x faster (bench/checksum.py).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from maru import native
from maru.announce import announce_once

log = logging.getLogger("maru.checksum")

ALGORITHM = "maru-mix64-sum-v1"
K1 = 0x9E3779B97F4A7C15
K2 = 0xBF58476D1CE4E5B9
K3 = 0x94D049BB133111EB
MASK64 = (1 << 64) - 1

# Words per block: two uint64 temporaries of this many words stay in a core's L2.
_BLOCK_WORDS = 1 << 15
_K1 = np.uint64(K1)
_K2 = np.uint64(K2)
_K3 = np.uint64(K3)
_S32 = np.uint64(32)
_S29 = np.uint64(29)
_BASE = np.arange(_BLOCK_WORDS, dtype=np.uint64) * _K1  # i * K1 for i in one block (wraps)


def _as_bytes(buffer: Any) -> np.ndarray:
    """``buffer`` as a flat uint8 array without copying (it must be C-contiguous)."""
    if isinstance(buffer, np.ndarray):
        if not buffer.flags.c_contiguous:
            raise ValueError("checksum needs a C-contiguous buffer; pass np.ascontiguousarray(x)")
        return buffer.reshape(-1).view(np.uint8)
    mv = memoryview(buffer)
    if not mv.c_contiguous:
        raise ValueError("checksum needs a C-contiguous buffer")
    return np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)


def checksum(buffer: Any) -> int:
    """The checksum (see the module docstring) of ``buffer``'s bytes, an int in ``[0, 2**64)``.

    ``buffer`` is anything with the buffer protocol (bytes, memoryview of the pool, a numpy
    array), C-contiguous. Reads it once; never writes it. From ``PARALLEL_BYTES`` up, the words
    are split over ``_threads()`` threads (the sum does not depend on the split). Compiled (see
    ``implementation()``): 7.5-9 GB/s a core on this project's CI machine from 256 KiB; numpy: 2-4.6 GB/s.
    """
    data = _as_bytes(buffer)
    n = data.size
    full = n // 8
    words = data[: full * 8].view("<u8")
    threads = _threads() if n >= PARALLEL_BYTES else 1
    nat = _native()
    if nat is not None:
        # Small objects keep the GIL for the call; large ones give it up once and split in C
        # (taking the GIL back beside a busy thread costs up to 5 ms: maru.native).
        if threads > 1:
            total = int(nat.words_sum_parallel(data.ctypes.data, 0, full, threads))  # type: ignore[misc]
        else:
            total = int(nat.words_sum(data.ctypes.data, 0, full))  # type: ignore[misc]
    elif threads > 1:
        step = -(-full // threads // _BLOCK_WORDS) * _BLOCK_WORDS  # whole blocks per thread
        parts = [(a, min(a + step, full)) for a in range(0, full, step)]
        total = sum(_pool().map(lambda ab: numpy_words_sum(words, *ab), parts))
    else:
        total = numpy_words_sum(words, 0, full)
    if n % 8:
        tail = bytes(data[full * 8 :]) + bytes(8 - n % 8)
        total += _mix(int.from_bytes(tail, "little"), full)
    return (total & MASK64) ^ n


PARALLEL_BYTES = 16 << 20  # below this a thread hand-off costs more than it saves
_POOL: ThreadPoolExecutor | None = None
_POOL_PID = 0  # the process that made _POOL: a forked child must not use its parent's (dead) threads
_POOL_LOCK = threading.Lock()


def _threads() -> int:
    return max(
        1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    )


def _pool() -> ThreadPoolExecutor:
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or _POOL_PID != os.getpid():
            _POOL = ThreadPoolExecutor(max_workers=_threads(), thread_name_prefix="maru-checksum")
            _POOL_PID = os.getpid()
        return _POOL


def implementation() -> str:
    """``"native"`` (compiled C, see ``maru.native``) or ``"numpy"`` (slower) in this process."""
    return "native" if _native() is not None else "numpy"


def slow_reasons() -> list[str]:
    """The numpy path's sentence (reason and fix) for a client's ``slow`` list; [] when compiled."""
    nat = native.load()
    if nat.words_sum is not None:
        return []
    return [
        f"checksums run in numpy, 2-4x slower and stalled by busy Python threads ({nat.reason}). Fix: {nat.fix}"
    ]


def _native() -> native.Native | None:
    """The compiled loops (both entry points present), or None (the numpy path, announced once)."""
    nat = native.load()
    if nat.words_sum is None or nat.words_sum_parallel is None:
        announce_once(
            log,
            "maru.checksum.numpy",
            logging.WARNING,
            "Maru: checksums run in numpy, not compiled C: 2-4x slower, and much slower beside a busy "
            "Python thread. Reason: %s. Fix: %s",
            nat.reason,
            nat.fix,
        )
        return None
    return nat


def numpy_words_sum(words: np.ndarray, begin: int, end: int) -> int:
    """Sum of the mixed terms of ``words[begin:end]`` (word indices are absolute), mod 2**64."""
    total = 0
    x = np.empty(min(_BLOCK_WORDS, max(end - begin, 1)), dtype=np.uint64)
    t = np.empty_like(x)
    with np.errstate(over="ignore"):
        for start in range(begin, end, _BLOCK_WORDS):
            m = min(_BLOCK_WORDS, end - start)
            xx, tt = x[:m], t[:m]
            np.add(words[start : start + m], _BASE[:m], out=xx)
            if start:
                # (start + i) * K1 == i * K1 + start * K1 (mod 2**64): one scalar add per block.
                np.add(xx, np.uint64((start * K1) & MASK64), out=xx)
            np.multiply(xx, _K2, out=xx)
            np.right_shift(xx, _S32, out=tt)
            np.bitwise_xor(xx, tt, out=xx)
            np.multiply(xx, _K3, out=xx)
            np.right_shift(xx, _S29, out=tt)
            np.bitwise_xor(xx, tt, out=xx)
            total += int(xx.sum(dtype=np.uint64))
    return total & MASK64


def _mix(word: int, index: int) -> int:
    """One word's term, in plain ints (the tail word; also the readable reference)."""
    x = (word + index * K1) & MASK64
    x = (x * K2) & MASK64
    x ^= x >> 32
    x = (x * K3) & MASK64
    x ^= x >> 29
    return x


def reference_checksum(data: bytes) -> int:
    """The definition word by word in plain Python (slow; the oracle of the tests)."""
    n = len(data)
    padded = data + bytes(-n % 8)
    total = 0
    for i in range(len(padded) // 8):
        total += _mix(int.from_bytes(padded[8 * i : 8 * i + 8], "little"), i)
    return (total & MASK64) ^ n
