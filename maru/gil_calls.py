"""Wall time of the CUDA runtime calls Maru makes while holding the GIL: a diagnosis (``MARU_THREAD_CENSUS=1``).

``kv_ops.cuda_sync.RawSync`` makes its quick calls (async copies and memsets, event records and
waits, graph launches) through a ``PyDLL``, which keeps the GIL: ~1 us a call, and no thread
switch between two of them. If one of those calls blocks in the driver instead (a full launch
queue, the context's lock held by another thread's long call), every other Python thread waits
for the GIL meanwhile, and neither thread's CPU shows it: the thread census counts CPU, not this.
With the census on, every such call's wall time is added to the calling thread's account, and the
census reports each thread's held time in its window beside its CPU (``thread_census.shares``).

Accounts are per kernel thread id, written only by their own thread (no lock: a reader on another
thread may see a count one call behind). Off by default: the wrapper costs ~1 us a call on the CI
machine (a ctypes call of its own costs ~0.6 there). ``ENV`` is the census's switch too
(``maru.vllm.thread_census`` takes it from here); this module sits outside ``maru.vllm`` and
``maru.kv_ops`` so that both sides import it without torch or vLLM.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from maru.env_flags import flag

ENV = "MARU_THREAD_CENSUS"  # the thread census's switch, and this timing's
LONG_NS = 500_000  # a call held the GIL this long or more: counted apart (0.5 ms: ~500 quick calls)

# Kernel thread id -> [calls, nanoseconds held, calls of LONG_NS or more]; and the thread's name
# (kept: a thread that ended is still named where its account is read).
_ACCOUNTS: dict[int, list[int]] = {}
_NAMES: dict[int, str] = {}


def enabled() -> bool:
    """Whether the census (and so this timing) is asked for."""
    return flag(ENV)


def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (a call that keeps the GIL) with its wall time added to the calling thread's account."""

    def call(*args: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return fn(*args)
        finally:
            held = time.perf_counter_ns() - t0
            tid = threading.get_native_id()
            acc = _ACCOUNTS.get(tid)
            if acc is None:
                _NAMES[tid] = threading.current_thread().name
                acc = _ACCOUNTS.setdefault(tid, [0, 0, 0])
            acc[0] += 1
            acc[1] += held
            if held >= LONG_NS:
                acc[2] += 1

    call.__name__ = getattr(fn, "__name__", "call")
    call.__wrapped__ = fn  # type: ignore[attr-defined]
    return call


def snapshot() -> dict[int, tuple[int, int, int]]:
    """Every thread's account so far: kernel thread id -> (calls, nanoseconds held, long calls)."""
    return {tid: (a[0], a[1], a[2]) for tid, a in list(_ACCOUNTS.items())}


def thread_name(tid: int) -> str | None:
    """The Python name of the thread whose account is ``tid`` (None: no account)."""
    return _NAMES.get(tid)


def held_ns() -> int:
    """The calling thread's nanoseconds held in timed calls so far (0 when none was timed)."""
    acc = _ACCOUNTS.get(threading.get_native_id())
    return acc[1] if acc is not None else 0
