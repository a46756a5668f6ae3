"""Sampled profiles of the connector's own code inside a real engine (``MARU_PROFILE``): a diagnosis.

Why: the hook timings say how long a hook took (``maru.vllm.hook_times``), not which functions
took it. On an H200 host, reading the replies of pins posted at arrival cost an offer 145 us
(144 on CPU) in vLLM against ~40-60 us in process on the CI machine, and the write-behind drain
thread spent 5.6-7.7 ms of Python CPU a store batch against ~0.3-0.7 ms for the same issue at the
connector level (bench/RESULTS.md, fortieth pass). What takes it is only visible in the engine.

``MARU_PROFILE=N`` profiles one call in ``N`` of every site: each scheduler and worker hook that
``hook_times.timed`` counts, and each store batch of the drain thread (``drain``).
``MARU_PROFILE=N:site,site`` limits it to those sites (hook names, or ``drain``). A profiled call
runs slower, so only a sample is. After a site's first profiled call and every ``DUMP_EVERY``-th,
its table (the top functions by own time, per profiled call) is logged (the engine's log: a
killed engine keeps its last tables). Off unless set; a bad value is said once and ignored.

The profiler is this module's own (``_ThreadProfiler``: ``sys.setprofile``, the calling thread
only), neither ``cProfile`` nor ``profile``: from Python 3.12 ``cProfile`` hooks
``sys.monitoring``, one tool for the whole interpreter, so a second thread's profiler fails to
start, and ``profile`` asserts on its own frame bookkeeping under 3.12 (an ``AssertionError``
raised inside the profiled call); each stopped an engine on the H200. This one never raises: a
call or return it cannot pair is left out of the table, never thrown into the profiled code.
Times are wall time on the calling thread (``time.perf_counter``: reading the thread's CPU clock
costs a system call, several times the profiled code's own calls): a function that blocks (a
reply, an event, the GIL taken by another thread) shows that time as its own. They are
inflated by the profiler's per-call overhead (about a microsecond): compare functions, not
absolute times.

Invariant: a thread runs one profiler at a time: a profiled call inside another (a hook inside a
profiled hook) is run plainly, so the outer table stays whole.
"""

from __future__ import annotations

import logging
import os
import sys
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


class _ThreadProfiler:
    """Own and cumulative wall time and calls per function, for calls made on one thread while
    ``sys.setprofile(self.event)`` is set there. ``event`` never raises."""

    def __init__(self) -> None:
        # function -> [own s, cumulative s, calls]; a recursive call's cumulative time counts at
        # each level of a recursion
        self.totals: dict[str, list[float]] = {}
        self._stack: list[list[Any]] = []  # [function, start, time in callees]
        self._clock = time.perf_counter

    def event(self, frame: Any, event: str, arg: Any) -> None:
        try:
            now = self._clock()
            if event == "call" or event == "c_call":
                self._stack.append([_name(frame, event, arg), now, 0.0])
            elif self._stack:  # return, c_return, c_exception: pairs with the last call
                fn, t0, inner = self._stack.pop()
                spent = now - t0
                row = self.totals.get(fn)
                if row is None:
                    row = self.totals[fn] = [0.0, 0.0, 0]
                row[0] += spent - inner
                row[1] += spent
                row[2] += 1
                if self._stack:
                    self._stack[-1][2] += spent
        except Exception:  # a diagnosis never throws into the code it watches
            return

    def merge_into(self, totals: dict[str, list[float]]) -> None:
        for fn, (own, cum, calls) in self.totals.items():
            row = totals.setdefault(fn, [0.0, 0.0, 0])
            row[0] += own
            row[1] += cum
            row[2] += calls


def _name(frame: Any, event: str, arg: Any) -> str:
    if event == "c_call":
        mod = getattr(arg, "__module__", None) or getattr(
            type(getattr(arg, "__self__", None)), "__name__", ""
        )
        return f"{{{mod}.{getattr(arg, '__qualname__', None) or getattr(arg, '__name__', '?')}}}"
    code = frame.f_code
    return f"{_short(code.co_filename)}:{code.co_firstlineno}({code.co_name})"


class SampledProfile:
    """Profiles one call in ``every`` of one site (``run``); ``table`` sums the profiled calls."""

    def __init__(self, site: str, every: int) -> None:
        if every < 1:
            raise ValueError(f"profiling one call in N needs N >= 1, not {every}")
        self.site = site
        self.every = every
        self.calls = 0
        self.profiled = 0
        self._totals: dict[str, list[float]] = {}

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``fn(*args, **kwargs)``, profiled when it is the ``every``-th call since the last one
        profiled (and no profiled call runs on this thread already, nor another profile function)."""
        self.calls += 1
        if self.calls % self.every or getattr(_active, "on", False) or sys.getprofile() is not None:
            return fn(*args, **kwargs)
        prof = _ThreadProfiler()
        _active.on = True
        sys.setprofile(prof.event)
        try:
            return fn(*args, **kwargs)
        finally:
            sys.setprofile(None)
            _active.on = False
            prof.merge_into(self._totals)
            self.profiled += 1
            if self.profiled == 1 or self.profiled % DUMP_EVERY == 0:  # the first: short runs too
                logger.info("Maru: %s", self.table())

    def table(self) -> str:
        """The profiled calls' top functions by own time, in microseconds per profiled call."""
        head = (
            f"profile of {self.site}: {self.profiled} of {self.calls} calls, us of wall time on this thread"
        )
        rows = [(fn, r) for fn, r in self._totals.items() if fn != "{sys.setprofile}"]
        if not rows:
            return f"{head}:\n(nothing profiled yet)\n"
        rows.sort(key=lambda kv: kv[1][0], reverse=True)
        n = max(1, self.profiled)
        lines = [f"{head} (per profiled call: own, with callees; calls):"]
        for fn, (own, cum, calls) in rows[:TOP]:
            lines.append(f"{own * 1e6 / n:9.1f} {cum * 1e6 / n:9.1f} {calls / n:7.1f}  {fn}")
        return "\n".join(lines) + "\n"


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

    def described(self) -> str:
        return ", ".join(sorted(self.sites)) if self.sites else "every hook and the drain thread"

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
    profiles = _current()
    return None if profiles is None else profiles.for_site(site)


def slow_note() -> str | None:
    """The slow path this process reports while ``MARU_PROFILE`` is set (``maru doctor``): what it
    costs and the fix. None when nothing is profiled."""
    profiles = _current()
    if profiles is None:
        return None
    return (
        f"{ENV} profiles one call in {profiles.every} of {profiles.described()} in this engine: a profiled call runs "
        f"several times slower (a diagnosis). Fix: unset {ENV} when the diagnosis is done"
    )


def _current() -> Profiles | None:
    """``MARU_PROFILE`` as read at the first call (said once: what is profiled, or a bad value)."""
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
                _profiles.described(),
            )
    return _profiles


def reset() -> None:
    """Read ``MARU_PROFILE`` again at the next ``profile_for`` (tests)."""
    global _profiles, _read
    _profiles, _read = None, False
