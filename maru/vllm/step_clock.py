"""GPU time of each forward, by what Maru did in its step (``maru_log_timing`` only): what a load or
a store costs the device, not just the host.

The host-side hook times (``HookTimes``) say what Maru costs vLLM's threads; they cannot say how
much longer a forward runs on the device while a layer load places its layers under it, or while a
write-behind store's gathers and copies share the GPU, nor how long the device sits idle after a
step whose host hook blocked (a load that waits for its checksums). ``StepClock`` records a CUDA
event on the forward's stream when the step starts (``start_load_kv``) and when its forward has
been issued (``wait_for_save``), and reads them back later without blocking (``collect``, from
``get_finished``): per kind of step, the forwards' device time, and how many steps were queued
after the device had drained (the previous forward's end event reached before this one's start
was queued: the host was behind, or the engine had nothing to run), with the median idle gap.
Where the scheduler side says what vLLM scheduled (``maru_log_timing``), a step in which some
request got more than one token is counted apart, as "<kind> (prefill)", with its tokens: a
storing instance's prefill steps are then compared with another instance's plain prefill steps of
the same workload, not with a mean over decode steps too. Where the plan also says when it was made
(``scheduled_at``), each kind also gets the host time from the scheduler's plan to the step's start
here: a device idle before a step splits into the time before vLLM scheduled it and the host's work
after.

Invariants: never raises into vLLM (an error stops the timing, logged once); never synchronises
(an event not yet reached is read at a later collect; at most ``MAX_PENDING`` steps wait, older
ones are dropped and counted); a step is counted once; off the GPU (no CUDA caches) or with
``maru_log_timing`` off, it records nothing and costs nothing.
"""

from __future__ import annotations

import collections
import logging
import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from maru.vllm import thread_census

logger = logging.getLogger("maru.vllm")

MAX_PENDING = 64  # steps whose events are not read yet (a stalled device: the oldest are dropped)

# Kinds of step, by what Maru did in it (the first that applies).
LAYERED = "layer load"  # a load placed layer by layer under this forward
LOADED = "load before"  # a load completed before this forward (the host waited for it)
STORED = "store"  # this step's blocks stored (write-behind: gathered and copied behind it)
PLAIN = "plain"  # nothing of Maru's
# Nothing of Maru's in this step, while an earlier step's write-behind store still works on the
# device (its gathers and copies not all done): the steps a store's device work can slow down.
BESIDE = "plain, beside a store"


def kind_of_step(kind: str, stores_now: bool, store_on_device: bool) -> str:
    """The kind a step is counted under: ``kind`` (what its start saw: a load) unless plain; a plain
    step that stores its blocks is ``STORED``, one run while an earlier store's device work may
    still run is ``BESIDE``."""
    if kind != PLAIN:
        return kind
    if stores_now:
        return STORED
    return BESIDE if store_on_device else PLAIN


GAPS_KEPT = 4096  # idle gaps kept per kind for the median (the most recent)
IDLE_MS = 0.05  # a gap longer than this: the device had drained before the step was queued


@dataclass
class _KindTimes:
    steps: int = 0
    forward_ms: float = 0.0  # device time from the step's start event to its end event
    # Device idle time before each step queued after the device had drained (previous end event
    # to this start): the host was behind, or the engine had nothing to run (between requests:
    # hence the median, not the mean, says which).
    gaps_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=GAPS_KEPT))
    after_idle: int = 0  # steps queued after the device had drained
    tokens: int = 0  # tokens vLLM scheduled in these steps (0 where the scheduler did not say)
    # Host time from the scheduler side's plan of the step (``build_connector_meta``) to its start
    # here (``start_load_kv``: the forward about to be queued), where the plan said when.
    planned_ms: collections.deque[float] = field(default_factory=lambda: collections.deque(maxlen=GAPS_KEPT))
    # CPU time in that window (where the plan was made on this thread): this thread's, the other
    # threads' of the process (whether another thread's work ran beside vLLM's host work).
    planned_cpu_ms: collections.deque[tuple[float, float]] = field(
        default_factory=lambda: collections.deque(maxlen=GAPS_KEPT)
    )
    # The forward's issue on the host (``start_load_kv`` to ``wait_for_save``): wall time, this
    # thread's CPU, the other threads' CPU.
    issue_ms: collections.deque[tuple[float, float, float]] = field(
        default_factory=lambda: collections.deque(maxlen=GAPS_KEPT)
    )
    # ``MARU_THREAD_CENSUS``: whose that other threads' CPU from the plan was, by thread name.
    census: thread_census.ThreadShares = field(default_factory=thread_census.ThreadShares)


def cpu_stamp() -> tuple[int, int, float, float]:
    """(process id, thread id, this thread's CPU s, the process's CPU s): where and when a plan was
    made, for ``StepClock.started`` to split the host time after it by thread."""
    return os.getpid(), threading.get_ident(), time.thread_time(), time.process_time()


class StepClock:
    """Per-kind device time of the forwards (see the module docstring)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._torch: Any = None
        self._device: int | None = None
        self._pending: collections.deque[tuple[str, int, Any, Any]] = collections.deque()
        self._start: Any = None
        self._planned_ms: float | None = None  # this step's plan-to-start host time, if known
        self._planned_cpu: tuple[float, float] | None = None  # its CPU: this thread's, the others'
        self._issue0: tuple[float, float, float] | None = None  # wall, thread CPU, process CPU at start
        self._census: dict[str, float] | None = None  # the other threads' ms since the plan, by name
        self._last_end: Any = None
        self.kinds: dict[str, _KindTimes] = {}
        self.dropped = 0

    def use_cuda(self, torch_mod: Any, device_index: int | None = None) -> None:
        """Record on CUDA (the caches are on CUDA device ``device_index``, the forward's); without
        it, nothing is recorded."""
        if self.enabled:
            self._torch = torch_mod
            self._device = device_index

    def _event(self) -> Any:
        ev = self._torch.cuda.Event(enable_timing=True)
        # The current stream of the caches' device, named: ``record()`` alone looks the current
        # device up through torch's Python (availability checks, an environment read): most of
        # the step clock's time on the forward thread in the forty-first pass's profile (126 of
        # 154 us a profiled event, bench/RESULTS.md), paid by every instance timed that way.
        ev.record(self._torch.cuda.current_stream(self._device))
        return ev

    def _off(self, e: Exception) -> None:
        """A diagnostic must never fail a step: stop timing, say why once."""
        self._torch, self._start = None, None
        self._pending.clear()
        logger.warning(
            "Maru: timing the forwards on the device stopped (%s: %s); loads and stores are unaffected, "
            "only maru_log_timing's device times end here. Fix: report it with the vLLM and torch versions",
            type(e).__name__,
            e,
        )

    def started(
        self, scheduled_at: float = 0.0, scheduled_cpu: tuple = (), scheduled_threads: dict | None = None
    ) -> None:
        """The step's forward is about to be queued on the current stream; ``scheduled_at``: when
        the scheduler side planned it (``time.monotonic()``; 0: unknown); ``scheduled_cpu``: its
        ``cpu_stamp()`` (empty: unknown); ``scheduled_threads``: its ``thread_census.snapshot()``
        (``MARU_THREAD_CENSUS``; the other threads' CPU since then is filed by thread name)."""
        if self._torch is not None:
            now = time.monotonic()
            self._planned_ms = (now - scheduled_at) * 1e3 if scheduled_at else None
            thread_s, process_s = time.thread_time(), time.process_time()
            self._issue0 = (now, thread_s, process_s)
            self._planned_cpu = None
            self._census = None
            # A tuple, or a list once it crossed a serializer: the plan's process and thread.
            if len(scheduled_cpu) == 4 and tuple(scheduled_cpu[:2]) == (os.getpid(), threading.get_ident()):
                mine = thread_s - scheduled_cpu[2]
                self._planned_cpu = (mine * 1e3, (process_s - scheduled_cpu[3] - mine) * 1e3)
                if scheduled_threads:
                    after = thread_census.snapshot()
                    self._census = thread_census.shares(scheduled_threads, after, threading.get_native_id())
            try:
                self._start = self._event()
            except Exception as e:
                self._off(e)

    def ended(self, kind: str, tokens: int = 0, prefill: bool = False) -> None:
        """The step's forward is queued; ``kind`` says what Maru did in the step; ``tokens``: what vLLM
        scheduled in it; ``prefill``: some request got more than one token (counted apart)."""
        if self._torch is None or self._start is None:
            return
        start, self._start = self._start, None
        if prefill:
            kind = f"{kind} (prefill)"
        planned, self._planned_ms = self._planned_ms, None
        times = self.kinds.setdefault(kind, _KindTimes())
        if planned is not None and planned >= 0:  # another host's clock could be behind: dropped
            times.planned_ms.append(planned)
            if self._planned_cpu is not None:
                times.planned_cpu_ms.append(self._planned_cpu)
            if self._census is not None:
                times.census.add(self._census)
                self._census = None
        if self._issue0 is not None:
            wall0, thread0, process0 = self._issue0
            mine = time.thread_time() - thread0
            others = time.process_time() - process0 - mine
            times.issue_ms.append(((time.monotonic() - wall0) * 1e3, mine * 1e3, others * 1e3))
            self._issue0 = None
        try:
            self._pending.append((kind, tokens, start, self._event()))
        except Exception as e:
            self._off(e)
        while len(self._pending) > MAX_PENDING:
            self._pending.popleft()
            self.dropped += 1
            self._last_end = None  # the gap before the next one is unknown

    def collect(self) -> None:
        """Read back the steps the device has finished, in order, without waiting."""
        try:
            self._collect()
        except Exception as e:
            self._off(e)

    def _collect(self) -> None:
        while self._pending:
            kind, tokens, start, end = self._pending[0]
            if not end.query():
                return
            self._pending.popleft()
            t = self.kinds.setdefault(kind, _KindTimes())
            t.steps += 1
            t.tokens += tokens
            t.forward_ms += start.elapsed_time(end)
            if self._last_end is not None:
                gap = self._last_end.elapsed_time(start)
                if gap > IDLE_MS:
                    t.after_idle += 1
                    t.gaps_ms.append(gap)
            self._last_end = end

    def line(self) -> str:
        """``kind: N steps, forward X ms each[, T tokens each], M queued after the device drained (idle
        before: median Y ms)[, started a median Z ms after the scheduler planned it]; ...`` ("" before
        any step was read back)."""
        parts = [
            f"{k}: {t.steps} steps, forward {t.forward_ms / t.steps:.2f} ms each"
            + (f", {t.tokens / t.steps:.0f} tokens each" if t.tokens else "")
            + f", {t.after_idle} queued after the device drained"
            + (f" (idle before: median {statistics.median(t.gaps_ms):.2f} ms)" if t.gaps_ms else "")
            + (
                f", started a median {statistics.median(t.planned_ms):.2f} ms after the scheduler planned it"
                if t.planned_ms
                else ""
            )
            + (
                " (CPU meanwhile: {:.2f} ms on its thread, {:.2f} on the others)".format(
                    *_medians(t.planned_cpu_ms)
                )
                if t.planned_cpu_ms
                else ""
            )
            + (
                ", issued in {:.2f} ms (CPU: {:.2f} ms on its thread, {:.2f} on the others)".format(
                    *_medians(t.issue_ms)
                )
                if t.issue_ms
                else ""
            )
            + (
                f", other threads' CPU from the plan, ms a step: {t.census.line()}"
                if t.census.windows
                else ""
            )
            for k, t in sorted(self.kinds.items(), key=lambda kv: -kv[1].steps)
            if t.steps
        ]
        if self.dropped:
            parts.append(f"{self.dropped} steps not read back")
        return "; ".join(parts)


def _medians(rows: collections.deque[tuple[float, ...]]) -> list[float]:
    """The median of each column of ``rows`` (not empty)."""
    return [statistics.median(col) for col in zip(*rows, strict=True)]
