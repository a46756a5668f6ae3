"""Which threads of the engine process ran between two moments: a diagnosis, ``MARU_THREAD_CENSUS=1``.

The step clock says how much CPU the process's other threads took between the scheduler's plan of
a prefill step and its start (``StepClock``, ``maru_log_timing``); this says whose it was. A
snapshot reads each thread's time on a CPU from ``/proc/self/task/<tid>/schedstat`` (nanoseconds,
Linux); two snapshots give each thread's share of the window, named by its Python thread name
(``threading.Thread.native_id``) or, for threads Python did not start (libzmq's, CUDA's, torch's
pools), by the kernel's name for it (``comm``). The process's own total (``process_time``) gives
the CPU of threads that ended in the window, and the schedstat's second field how long the
scheduling thread itself waited for a CPU while runnable: its time off its CPU that is neither is
asleep (the GIL, the device, a socket). A thread holding the GIL inside a CUDA call that blocks
shows no CPU for it: with the census on, Maru's own GIL-holding CUDA calls are timed too
(``maru.gil_calls``), so their wall time shows, by thread, beside the CPU.

Off by default: a snapshot reads one small file per thread (about a millisecond for a hundred
threads), on vLLM's scheduling thread. Only prefill steps are censused. A thread that ended
within the window is not named (it is gone from ``/proc``); its CPU shows as ``GONE``. Never
raises: a thread that ends between the listing and the read is skipped; without ``/proc`` the
census is off.
"""

from __future__ import annotations

import collections
import os
import threading
import time

from maru import gil_calls
from maru.env_flags import flag

ENV = gil_calls.ENV  # "MARU_THREAD_CENSUS": one switch for the census and the GIL-held timing
_TASKS = "/proc/self/task"


def enabled() -> bool:
    """Whether ``MARU_THREAD_CENSUS`` asks for the census (and ``/proc`` can answer it)."""
    return flag(ENV) and os.path.isdir(_TASKS)


def slow_note() -> str | None:
    """The slow path a scheduler side that censuses reports (``maru doctor``); None when off."""
    if not enabled():
        return None
    return (
        f"{ENV} reads every thread's CPU time at each prefill step's plan and start (about a millisecond "
        f"a step on vLLM's scheduling thread) and times Maru's GIL-holding CUDA calls (~1 us a call): a "
        f"diagnosis. Fix: unset {ENV} when the diagnosis is done"
    )


PROCESS = 0  # a snapshot's entry for the whole process (no thread has id 0)
GONE = "threads that ended before the start"  # a window's CPU of threads gone from /proc
RUN_QUEUE = "this thread waiting for a CPU"  # the skipped thread's time runnable but not running
HELD = " (GIL held in CUDA calls)"  # suffix of a thread's entry: its quick CUDA calls' wall time
LONG = "CUDA calls that held the GIL 0.5 ms or more"  # a window's count of them, all threads


def snapshot() -> dict[int, tuple[int, int]]:
    """Each thread of this process (kernel thread id) -> (nanoseconds it ran on a CPU, nanoseconds it
    waited for one while runnable), and ``PROCESS`` -> (the process's CPU nanoseconds, 0): the
    process's total also counts threads that end before the next snapshot."""
    out: dict[int, tuple[int, int]] = {PROCESS: (time.process_time_ns(), 0)}
    # Each thread's quick CUDA calls' wall time (``maru.gil_calls``), under its negated id.
    out.update({-tid: (held, long) for tid, (_, held, long) in gil_calls.snapshot().items()})
    try:
        tids = os.listdir(_TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/schedstat", "rb") as f:
                fields = f.read().split()
            out[int(tid)] = (int(fields[0]), int(fields[1]))
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile, or an unexpected format
    return out


def _name(tid: int, python: dict[int, str]) -> str:
    if tid in python:
        return python[tid]
    try:
        with open(f"{_TASKS}/{tid}/comm") as f:
            return f"{f.read().strip()} (not Python's)"
    except OSError:
        return f"thread {tid}"


def shares(
    before: dict[int, tuple[int, int]], after: dict[int, tuple[int, int]], skip: int | None = None
) -> dict[str, float]:
    """Milliseconds each thread ran between two snapshots, by name (threads of one name summed;
    ``skip``: a thread id left out, e.g. the caller's own); threads that did not run are left out.
    Two more entries: ``GONE``, the CPU of threads that ended in between (the process's total less
    every listed thread's; a few ms of noise either way: the kernel updates a running thread's
    count at its ticks), and ``RUN_QUEUE``, how long ``skip`` waited for a CPU while runnable; and
    per thread that made quick CUDA calls (``maru.gil_calls``), ``<name> (GIL held in CUDA calls)``:
    their wall time, the GIL held throughout, with ``LONG`` the count of calls of 0.5 ms or more. A
    thread Python is done with that the kernel still lists (a moment after ``join``) counts under
    the kernel's name for it, not as ended."""
    python = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[str, float] = collections.defaultdict(float)
    listed = 0
    for tid, (ns, waited) in after.items():
        if tid == PROCESS:
            continue
        if tid < 0:  # a thread's GIL-holding CUDA calls (``maru.gil_calls``): wall time, not CPU
            held, long = ns - before.get(tid, (0, 0))[0], waited - before.get(tid, (0, 0))[1]
            if held > 0:
                out[(gil_calls.thread_name(-tid) or _name(-tid, python)) + HELD] += held / 1e6
            if long > 0:
                out[LONG] += long
            continue
        ran = ns - before.get(tid, (0, 0))[0]  # a thread started in the window: all of it
        listed += ran
        if tid == skip:
            out[RUN_QUEUE] = (waited - before.get(tid, (0, 0))[1]) / 1e6
        elif ran > 0:
            out[_name(tid, python)] += ran / 1e6
    if PROCESS in before and PROCESS in after:
        out[GONE] = (after[PROCESS][0] - before[PROCESS][0] - listed) / 1e6
    return dict(out)


class ThreadShares:
    """The other threads' CPU in a window, summed over windows, by thread name (one kind of step)."""

    def __init__(self) -> None:
        self.windows = 0
        self.ms: dict[str, float] = collections.defaultdict(float)

    def add(self, shares_ms: dict[str, float]) -> None:
        self.windows += 1
        for name, ms in shares_ms.items():
            self.ms[name] += ms

    def line(self, top: int = 4) -> str:
        """``name a, name b, ...; GONE c; RUN_QUEUE d`` in ms a window (the ``top`` largest named
        threads), "" before any window."""
        if not self.windows:
            return ""
        named = [
            (k, v) for k, v in self.ms.items() if k not in (GONE, RUN_QUEUE, LONG) and not k.endswith(HELD)
        ]
        best = sorted(named, key=lambda kv: -kv[1])[:top]
        out = ", ".join(f"{name} {ms / self.windows:.2f}" for name, ms in best)
        for key in (GONE, RUN_QUEUE):
            if key in self.ms:
                out += f"; {key} {max(0.0, self.ms[key] / self.windows):.2f}"
        held = sorted(((k, v) for k, v in self.ms.items() if k.endswith(HELD)), key=lambda kv: -kv[1])
        if held:
            out += "; GIL held in CUDA calls: " + ", ".join(
                f"{k.removesuffix(HELD)} {v / self.windows:.2f}" for k, v in held[:top]
            )
            if LONG in self.ms:
                out += f" ({self.ms[LONG] / self.windows:.1f} calls a step of 0.5 ms or more)"
        return out
