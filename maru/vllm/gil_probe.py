"""``maru_gil_probe_ms``: how long a thread of the engine process waits for the GIL, measured.

vLLM's engine loop, its input and output threads and Maru's threads (the write-behind drain, the
async loader) share one interpreter. A forward issued late because another thread held the GIL
shows in TTFT, not in any device time. The probe is a daemon thread that sleeps ``period`` and
times how late each wake-up is: a wake-up needs the GIL, so the lateness is the GIL wait (plus the
OS's timer slack, ~0.05-0.1 ms). It counts only wake-ups while the engine runs steps (``active``):
an idle engine's are on time and would dilute the figure.

Its cost: one GIL hand-off a period (at 2 ms, 500 a second). A diagnostic for the timing line
(``maru_log_timing``), off by default.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable

from maru.vllm.worker_stats import WorkerStats

# Upper bounds of the lateness histogram's buckets, ms (the last bucket is open).
BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0)


class GilProbe:
    """Times its own wake-ups into ``stats`` (``gil_probe_*``) while ``active()`` is true.

    Invariant: ``stats.gil_probe_hist[i]`` counts the wake-ups at most ``BUCKETS_MS[i]`` late (and
    later than the bucket before); the last entry those later than every bound; their sum is
    ``stats.gil_probe_wakeups``.
    """

    def __init__(
        self,
        period_s: float,
        stats: WorkerStats,
        active: Callable[[], bool],
        draining: Callable[[], bool] | None = None,
    ) -> None:
        """``draining()``: whether the write-behind drain thread is at work on a store now; its
        wake-ups are also counted apart (``gil_probe_drain_*``): the mean over all of them is
        diluted, the drain running in a few percent of the stepping time."""
        if period_s <= 0:
            raise ValueError("the probe's period must be positive")
        self.period_s = period_s
        self.stats = stats
        self._active = active
        self._draining = draining
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        stats.gil_probe_hist = [0] * (len(BUCKETS_MS) + 1)

    def start(self) -> None:
        """Start the thread (once; later calls do nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="maru-gil-probe", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.perf_counter()
            time.sleep(self.period_s)  # gives the GIL up; taking it back is what is timed
            late = time.perf_counter() - t0 - self.period_s
            if self._active():
                self.record(late, draining=self._draining is not None and self._draining())

    def record(self, late_s: float, draining: bool = False) -> None:
        """File one wake-up ``late_s`` seconds late (only the probe thread calls it); ``draining``:
        the drain thread was at work on a store when it woke."""
        s = self.stats
        late_s = max(0.0, late_s)
        if draining:
            s.gil_probe_drain_wakeups += 1
            s.gil_probe_drain_late_s += late_s
            s.gil_probe_drain_over_1ms += late_s > 1e-3
        s.gil_probe_wakeups += 1
        s.gil_probe_late_s += late_s
        s.gil_probe_max_late_s = max(s.gil_probe_max_late_s, late_s)
        s.gil_probe_hist[bisect.bisect_left(BUCKETS_MS, late_s * 1e3)] += 1


def quantile_ms(hist: list[int], q: float) -> float | None:
    """The bucket bound under which a share ``q`` of the wake-ups fall (None: no wake-ups; inf:
    past the last bound)."""
    total = sum(hist)
    if not total:
        return None
    need, seen = q * total, 0
    for bound, n in zip((*BUCKETS_MS, float("inf")), hist, strict=True):
        seen += n
        if seen >= need:
            return bound
    return float("inf")


def probe_note(stats: WorkerStats) -> str:
    """The timing line's part: "" when the probe counted nothing."""
    n = stats.gil_probe_wakeups
    if not n:
        return ""
    hist = stats.gil_probe_hist
    over_1ms = sum(c for b, c in zip((*BUCKETS_MS, float("inf")), hist, strict=True) if b > 1.0)

    def bound(q: float) -> str:
        v = quantile_ms(hist, q)
        return f"> {BUCKETS_MS[-1]:g}" if v == float("inf") else f"<= {v:g}"

    d = stats.gil_probe_drain_wakeups
    drain = (
        f" (while a store drained: {d}, {1e3 * stats.gil_probe_drain_late_s / d:.2f} ms late on average, "
        f"{stats.gil_probe_drain_over_1ms} over 1 ms)"
        if d
        else ""
    )
    return (
        f"; GIL probe: {n} wake-ups while stepping, {1e3 * stats.gil_probe_late_s / n:.2f} ms late on "
        f"average, p50 {bound(0.5)} ms, p99 {bound(0.99)} ms, max {1e3 * stats.gil_probe_max_late_s:.1f} ms, "
        f"{over_1ms} over 1 ms{drain}"
    )
