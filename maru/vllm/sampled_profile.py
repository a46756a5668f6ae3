"""Sampled cProfiles of the connector's own code inside a real engine (``MARU_PROFILE``): a diagnosis.

Why: the hook timings say how long a hook took (``maru.vllm.hook_times``), not which functions
took it. On an H200 host, reading the replies of pins posted at arrival cost an offer 145 us
(144 on CPU) in vLLM against ~40-60 us in process on the CI machine, and the write-behind drain
thread spent 5.6-7.7 ms of Python CPU a store batch against ~0.3-0.7 ms for the same issue at the
connector level (bench/RESULTS.md, fortieth pass). What takes it is only visible in the engine.

``MARU_PROFILE=N`` profiles one call in ``N`` of every site: each scheduler and worker hook that
``hook_times.timed`` counts, and each store batch of the drain thread (``drain``).
``MARU_PROFILE=N:site,site`` limits it to those sites (hook names, or ``drain``). A profiled call
runs slower, so only a sample is; every ``DUMP_EVERY`` profiled calls of a site its table (the
top functions by own time, summed over its profiled calls) is logged, and after the first (the engine's log: a killed
engine keeps its last tables). Off unless set; a bad value is said once and ignored.

The profiler is the standard library's pure-Python ``profile`` (``sys.setprofile``: the calling
thread only), not ``cProfile``: from Python 3.12 ``cProfile`` hooks ``sys.monitoring``, one tool
for the whole interpreter, so a second thread's profiler fails to start (it stopped an engine
on the H200 this way) and one thread's table would hold every thread's calls. Own times are
the calling thread's CPU time (``time.thread_time``), inflated by the profiler's own per-call
overhead (a few microseconds): compare functions, not absolute times.

Invariant: a thread runs one profiler at a time: a profiled call inside another (a hook inside a
profiled hook) is run plainly, so the outer table stays whole.
"""

from __future__ import annotations

import logging
import os
import profile
import pstats
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

logger = logging.getLogger("maru.vllm")

ENV = "MARU_PROFILE"
DUMP_EVERY = 3  # profiled calls of a site between two logged tables
TOP = 30  # functions a table lists

T = TypeVar("T")
_active = threading.local()  # .on: this thread runs a profiled call now


class SampledProfile:
    """Profiles one call in ``every`` of one site (``run``); ``table`` sums the profiled calls."""

    def __init__(self, site: str, every: int) -> None:
        if every < 1:
            raise ValueError(f"profiling one call in N needs N >= 1, not {every}")
        self.site = site
        self.every = every
        self.calls = 0
        self.profiled = 0
        self._stats: pstats.Stats | None = None
        self._failed = False

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, profiled when it is the ``every``-th call since the last one
        profiled (and no profiled call runs on this thread already). Never raises for the
        profiler's sake: a profile that cannot be summed is said once and left out."""
        self.calls += 1
        if self.calls % self.every or getattr(_active, "on", False):
            return fn(*args, **kwargs)
        prof = profile.Profile(time.thread_time)  # this thread's CPU: other threads' time stays out
        _active.on = True
        try:
            return prof.runcall(fn, *args, **kwargs)
        finally:
            _active.on = False
            self._account(prof)

    def _account(self, prof: profile.Profile) -> None:
        try:
            if self._stats is None:
                self._stats = pstats.Stats(prof)
            else:
                self._stats.add(prof)
        except Exception as e:  # a diagnosis must never fail the engine
            if not self._failed:
                self._failed = True
                logger.warning("Maru: profiling %s failed (%s); its calls run unprofiled", self.site, e)
            return
        self.profiled += 1
        if self.profiled == 1 or self.profiled % DUMP_EVERY == 0:  # the first: short runs too
            logger.info("Maru: %s", self.table())

    def table(self) -> str:
        """The profiled calls' top functions by own time, in microseconds (pstats' seconds print
        three decimals: a hook's whole call is below that), headed by the site."""
        head = f"profile of {self.site}: {self.profiled} of {self.calls} calls, us of this thread's CPU"
        if self._stats is None:
            return f"{head}:\n(nothing profiled yet)\n"
        rows = sorted(
            ((k, v) for k, v in self._stats.stats.items() if not _profiler_own(k)),  # type: ignore[attr-defined]
            key=lambda kv: kv[1][2],
            reverse=True,
        )
        n = max(1, self.profiled)
        lines = [f"{head} (per profiled call: own, with callees; calls):"]
        for (path, line, func), (_cc, nc, tt, ct, _callers) in rows[:TOP]:
            where = f"{_short(path)}:{line}({func})" if line else func
            lines.append(f"{tt * 1e6 / n:9.1f} {ct * 1e6 / n:9.1f} {nc / n:7.1f}  {where}")
        return "\n".join(lines) + "\n"


def _profiler_own(key: tuple[str, int, str]) -> bool:
    """The profiler's own entries: its pseudo-frames (the call it ran, "profiler") and the
    ``sys.setprofile`` that ends it."""
    path, line, func = key
    return path == "profile" or (line == 0 and func == "setprofile")


def _short(path: str) -> str:
    """A path from its package on (``maru/...``, ``vllm/...``), or its file name."""
    for mark in ("/maru/", "/vllm/", "/torch/", "/zmq/"):
        i = path.rfind(mark)
        if i >= 0:
            return path[i + 1 :]
    return os.path.basename(path)


class Profiles:
    """The sites ``MARU_PROFILE`` asks for, each with its ``SampledProfile`` (made on first use)."""

    def __init__(self, every: int, sites: frozenset[str] | None) -> None:
        self.every = every
        self.sites = sites  # None: every site
        self._made: dict[str, SampledProfile] = {}
        self._lock = threading.Lock()

    @classmethod
    def parse(cls, raw: str) -> Profiles | None:
        """``"N"`` or ``"N:site,site"``; None for an empty value. Raises ValueError otherwise."""
        raw = raw.strip()
        if not raw:
            return None
        n, _, names = raw.partition(":")
        every = int(n)
        if every < 1:
            raise ValueError(f"N must be >= 1, not {every}")
        sites = frozenset(s.strip() for s in names.split(",") if s.strip()) or None
        return cls(every, sites)

    def for_site(self, site: str) -> SampledProfile | None:
        if self.sites is not None and site not in self.sites:
            return None
        p = self._made.get(site)
        if p is None:
            with self._lock:
                p = self._made.setdefault(site, SampledProfile(site, self.every))
        return p


_profiles: Profiles | None = None
_read = False


def profile_for(site: str) -> SampledProfile | None:
    """The sampled profile of ``site`` when ``MARU_PROFILE`` asks for it, else None (the common
    case: one dict lookup after the first call)."""
    global _profiles, _read
    if not _read:
        _read = True
        raw = os.environ.get(ENV, "")
        try:
            _profiles = Profiles.parse(raw)
        except ValueError as e:
            logger.warning("Maru: %s=%r is not N or N:site,site (%s); nothing is profiled", ENV, raw, e)
            _profiles = None
        if _profiles is not None:
            logger.info(
                "Maru: %s: one call in %d of %s is profiled (a diagnosis: profiled calls run slower)",
                ENV,
                _profiles.every,
                ", ".join(sorted(_profiles.sites)) if _profiles.sites else "every hook and the drain thread",
            )
    return None if _profiles is None else _profiles.for_site(site)


def reset() -> None:
    """Read ``MARU_PROFILE`` again at the next ``profile_for`` (tests)."""
    global _profiles, _read
    _profiles, _read = None, False
