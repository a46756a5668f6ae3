"""The interpreter's share of the connector's host time inside an engine (``maru_log_timing`` only).

Why: the same calls cost several times more inside a vLLM engine than in a benchmark process on the
same host (the layer load's pin of 15 held turns: 0.4 ms in process on an H200 host, 0.8-1.2 ms in
the engine; bench/RESULTS.md, forty-third pass). Two things the hook times cannot tell apart say
where: the garbage collector (vLLM freezes its start-up heap, but a collection still walks every
young object of the process, and the hooks allocate) and the interpreter's own pace on that thread
(another busy thread or process on the core, the clock speed).

``GcClock`` times every collection of the process (``gc.callbacks``) from the first serving step
after vLLM froze its start-up heap (``gc.freeze``): by generation, the longest, and the part that fell
inside Maru's hooks (``hook_times`` reads ``total_s`` around each hook).
``PythonPace`` times a fixed loop on the engine's thread now and then (at most every
``PACE_EVERY_S``), to compare with the benchmark harness's "Python loop of 2,000,000 adds" (this
loop is a hundredth of it: 20,000 adds).

Invariants: the collector callback never raises and does no allocation beyond a float; installed
once a process (``install`` is idempotent); off (and free) unless installed.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections import deque
from typing import Any

PACE_LOOP = 20_000  # adds a sample: 1/100 of the harness's loop, ~0.6 ms on an H200 host
PACE_EVERY_S = 5.0  # at most one sample in this many seconds of serving


class GcClock:
    """Collections of the whole process, timed: ``collections`` and ``seconds`` by generation,
    ``total_s`` their sum (read around a hook: the part inside it), the longest pause."""

    def __init__(self) -> None:
        self.collections = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.total_s = 0.0
        self.longest_s = 0.0
        self.longest_gen = -1
        self.installed = False
        self.armed = False  # collections are counted once armed (``arm``: serving)
        self._t0 = 0.0

    def install(self) -> None:
        """Start timing collections (once a process)."""
        if not self.installed:
            gc.callbacks.append(self._callback)
            self.installed = True

    def arm(self) -> None:
        """Count from now on, once vLLM has frozen its start-up heap (``gc.freeze``): called from a
        hook that runs each serving step (the worker's ``get_finished``, the scheduler's
        ``update_connector_output``). The explicit full collections of vLLM's start-up (0.3-0.6 s
        each, some after the worker's first freeze and before the engine core's) are not counted."""
        if not self.armed and gc.get_freeze_count() > 0:
            self.armed = True

    def uninstall(self) -> None:
        if self.installed:
            try:
                gc.callbacks.remove(self._callback)
            except ValueError:
                pass
            self.installed = False

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        try:
            if phase == "start":
                if self.armed:
                    self._t0 = time.perf_counter()
                return
            if not self._t0:
                return
            d = time.perf_counter() - self._t0
            self._t0 = 0.0
            g = min(max(int(info.get("generation", 2)), 0), 2)
            self.collections[g] += 1
            self.seconds[g] += d
            self.total_s += d
            if d > self.longest_s:
                self.longest_s, self.longest_gen = d, g
        except Exception:  # a diagnostic inside the collector must never raise
            pass

    def note(self, inside_hooks_s: float) -> str:
        """``; garbage collector: N collections (gen 0 / 1 / 2: a / b / c), X ms, longest Y ms (gen g),
        Z ms of it inside Maru's hooks`` ("" when none was timed)."""
        n = sum(self.collections)
        if not n:
            return ""
        c = self.collections
        return (
            f"; garbage collector: {n} collections (gen 0 / 1 / 2: {c[0]} / {c[1]} / {c[2]}), "
            f"{self.total_s * 1e3:.1f} ms, longest {self.longest_s * 1e3:.2f} ms (gen {self.longest_gen}), "
            f"{inside_hooks_s * 1e3:.1f} ms of it inside Maru's hooks"
        )


class PythonPace:
    """The interpreter's pace on one thread: a fixed loop of ``PACE_LOOP`` adds, timed at most every
    ``PACE_EVERY_S`` (``maybe_sample``, called from a hook), the most recent samples kept."""

    def __init__(self, every_s: float = PACE_EVERY_S) -> None:
        self.every_s = every_s
        self.samples: deque[float] = deque(maxlen=256)
        self._last: float | None = None  # the first call samples

    def maybe_sample(self) -> None:
        now = time.monotonic()
        if self._last is not None and now - self._last < self.every_s:
            return
        self._last = now
        self.samples.append(_loop_seconds())

    def note(self) -> str:
        """``; Python: 20,000 adds in X ms (median of N samples on this thread while serving; the
        harness's 2,000,000: 100x)`` ("" before a sample)."""
        if not self.samples:
            return ""
        return (
            f"; Python: {PACE_LOOP:,} adds in {statistics.median(self.samples) * 1e3:.2f} ms (median of "
            f"{len(self.samples)} samples on the forward thread, min {min(self.samples) * 1e3:.2f})"
        )


def _loop_seconds() -> float:
    """The harness's loop (bench/gpu_vllm_e2e.py's host line), a hundredth of it, in a function."""
    t0 = time.perf_counter()
    s = 0
    for i in range(PACE_LOOP):
        s += i
    return time.perf_counter() - t0


CLOCK = GcClock()  # one per process: collections are the process's
