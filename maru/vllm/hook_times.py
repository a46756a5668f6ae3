"""Host time the connector spends inside each of vLLM's hooks: what Maru costs a step off the bus.

vLLM calls the scheduler-side hooks on its scheduling thread and the worker-side ones around the
forward; time spent there delays every request of the step, cold ones included. ``HookTimes``
sums the wall time, the calling thread's CPU time and the calls per hook; ``timed`` wraps a
connector method so it counts itself. Wall minus CPU is time the thread sat blocked inside the
hook: a server round trip, or waiting for the GIL while another thread of the process (vLLM's
input and output threads, Maru's write-behind drain) runs Python.
Parts of a hook (``timed_part``) are counted under ``hook/part`` as well, with ``maru_log_timing``
only (``HookTimes.parts``): where the hook's time goes (the scheduler's prompt keys, prefix probe
and offer pin inside ``get_num_new_matched_tokens``). Each timed call reads two clocks and files
the sums, ~5 us on the CI machine: a new request ran four parts inside its two hooks, ~25 of its
~255 us in process (``bench/scheduler_probe.py --warm``, forty-third session), so the detail is for
a diagnosis, not always.
``MARU_HOOK_PARTS`` overrides it either way (``MARU_HOOK_PARTS=0`` with ``maru_log_timing``: the
hook lines without their parts, so a bench's times are the default configuration's).
The hooks' CPU time is read with ``maru_log_timing`` only too (``HookTimes.cpu``): the thread's CPU
clock costs ~1 us a read on the CI machine, two of a hook's ~3.4 us of timing, and a new request
passes four or five scheduler hooks; without it a hook counts its wall time (``timed_wall_as``'s way).
The sums are in ``MaruKVConnector.maru_stats()["hook_ms"]`` and, with ``maru_log_timing``, in one
line per process at shutdown; the scheduler side also logs it every 10 s while vLLM calls it (an
API server's engine is often killed before its scheduler shuts down).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

from maru.env_flags import flag
from maru.vllm.interpreter_clock import CLOCK as GC_CLOCK
from maru.vllm.sampled_profile import profile_for

F = TypeVar("F", bound=Callable[..., Any])

ENV_PARTS = "MARU_HOOK_PARTS"


def parts_timed(log_timing: bool) -> bool:
    """Whether the parts of hooks are timed (``HookTimes.parts``): with ``maru_log_timing``, unless
    ``MARU_HOOK_PARTS`` says otherwise (``maru.env_flags``)."""
    return flag(ENV_PARTS, default=log_timing)


def hook_times_for(log_timing: bool) -> HookTimes:
    """A connector's ``HookTimes``: the parts (``parts_timed``) and the hooks' CPU time with
    ``maru_log_timing``; every hook's wall time and calls always (``maru_stats()["hook_ms"]``)."""
    return HookTimes(parts=parts_timed(log_timing), cpu=log_timing)


class HookTimes:
    """Seconds (wall and the thread's CPU) and calls per hook name. Invariant: only ever grows
    (a process-lifetime sum); a hook's CPU seconds never exceed its wall seconds by more than the
    clocks' resolution. ``parts``: whether the parts of hooks are timed too (``timed_part``); off,
    a part runs untimed, at the cost of one attribute read. ``cpu``: whether a hook reads the
    thread's CPU clock too; off, hooks are timed by wall only (no ``cpu_ms``)."""

    def __init__(self, parts: bool = True, cpu: bool = True) -> None:
        self.parts = parts
        self.cpu = cpu
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        # The longest call's wall seconds per hook: a mean that one call made (a first call's
        # imports, a one-off wait) is then told from one that every step pays.
        self.longest: dict[str, float] = {}
        # Seconds of the process's garbage collections that fell inside these hooks (parts are
        # inside hooks: not counted twice); 0 unless ``interpreter_clock.CLOCK`` is installed.
        self.gc_s = 0.0
        self._logged_at = time.monotonic()
        self._logged_calls = 0

    def due(self, interval_s: float) -> bool:
        """True at most once per ``interval_s``, and only when hooks were called since the last
        True: when a periodic log line would say something new."""
        now = time.monotonic()
        total = sum(self.calls.values())
        if now - self._logged_at < interval_s or total == self._logged_calls:
            return False
        self._logged_at, self._logged_calls = now, total
        return True

    def add(self, name: str, seconds: float, cpu_seconds: float | None = None) -> None:
        """Count one call; ``cpu_seconds`` None: a hook timed by wall only (``timed_wall_as``)."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        if seconds > self.longest.get(name, 0.0):
            self.longest[name] = seconds
        if cpu_seconds is not None:
            self.cpu_seconds[name] = self.cpu_seconds.get(name, 0.0) + cpu_seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{hook: {"calls": n, "ms": wall total, "cpu_ms": the thread's CPU total, "max_ms": the
        longest call}}``, the costliest first; no ``cpu_ms`` for a hook timed by wall only."""
        order = sorted(self.seconds, key=self.seconds.__getitem__, reverse=True)
        out: dict[str, dict[str, float]] = {}
        for k in order:
            out[k] = {
                "calls": self.calls[k],
                "ms": round(self.seconds[k] * 1e3, 3),
                "max_ms": round(self.longest.get(k, 0.0) * 1e3, 3),
            }
            if k in self.cpu_seconds:
                out[k]["cpu_ms"] = round(self.cpu_seconds[k] * 1e3, 3)
        return out

    def line(self) -> str:
        """One log line: ``hook N calls X ms (Y us each, Z on CPU, longest W ms), ...`` (no CPU part
        for a hook timed by wall only)."""
        return ", ".join(
            f"{k} {v['calls']:.0f} calls {v['ms']:.1f} ms ({v['ms'] * 1e3 / v['calls']:.0f} us each"
            + (f", {v['cpu_ms'] * 1e3 / v['calls']:.0f} on CPU" if "cpu_ms" in v else "")
            + f", longest {v['max_ms']:.2f} ms)"
            for k, v in self.as_dict().items()
        )


def timed(method: F) -> F:
    """Count the wrapped method's wall and thread CPU time into ``self.hook_times`` under its name;
    with ``MARU_PROFILE`` a sample of its calls is profiled too (``maru.vllm.sampled_profile``)."""
    name = method.__name__
    return _timed_as(lambda _self: name, profiled_as=name)(method)


def timed_wall_as(name: str) -> Callable[[F], F]:
    """``timed`` by wall time only, counted under ``name``: for a hook vLLM calls once per layer
    (``wait_for_layer_load``: 32 calls a step; reading the thread's CPU clock costs ~0.45 us a read,
    a perf counter ~0.04), put on the helper that runs only when the hook has work, so the hook's
    calls with nothing to do are neither timed nor counted."""

    def deco(method: F) -> F:
        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            t0, g0 = time.perf_counter(), GC_CLOCK.total_s
            try:
                return method(self, *args, **kwargs)
            finally:
                self.hook_times.add(name, time.perf_counter() - t0)
                self.hook_times.gc_s += GC_CLOCK.total_s - g0

        return wrapper  # type: ignore[return-value]

    return deco


def timed_part(name: str) -> Callable[[F], F]:
    """``timed``, under ``name`` (``"hook/part"``), for a method that runs inside a hook: its time
    is also in the hook's. A part of the hook's time, not an addition to it; timed only where
    ``self.hook_times.parts`` is on."""
    return _timed_as(lambda _self: name)


def timed_step(part: str, hook: str) -> Callable[[F], F]:
    """``timed_part`` for a helper more than one hook runs: counted as ``"<hook>/<part>"`` under the
    hook its caller names in ``self.running_hook`` (``hook`` when it names none), so a part is
    always inside the hook whose time holds it."""
    return _timed_as(lambda self: f"{getattr(self, 'running_hook', None) or hook}/{part}")


def _timed_as(name_of: Callable[[Any], str], profiled_as: str | None = None) -> Callable[[F], F]:
    """Wall and thread CPU time of the wrapped method into ``self.hook_times`` under ``name_of(self)``;
    ``profiled_as``: the ``MARU_PROFILE`` site whose sample of calls is profiled (hooks, not parts);
    a hook (not a part) also counts the garbage collections inside it (``HookTimes.gc_s``)."""
    hook = profiled_as is not None

    def wrap(method: F) -> F:
        if not hook:  # a part: timed only with the detail on (``HookTimes.parts``)

            @functools.wraps(method)
            def part(self: Any, *args: Any, **kwargs: Any) -> Any:
                times = self.hook_times
                if not times.parts:
                    return method(self, *args, **kwargs)
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    return method(self, *args, **kwargs)
                finally:
                    times.add(name_of(self), time.perf_counter() - t0, time.thread_time() - c0)

            return part  # type: ignore[return-value]

        @functools.wraps(method)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            times = self.hook_times
            cpu = times.cpu
            t0, g0 = time.perf_counter(), GC_CLOCK.total_s
            c0 = time.thread_time() if cpu else 0.0
            try:
                prof = profile_for(profiled_as)
                if prof is not None:
                    return prof.run(method, self, *args, **kwargs)
                return method(self, *args, **kwargs)
            finally:
                wall = time.perf_counter() - t0
                times.add(name_of(self), wall, time.thread_time() - c0 if cpu else None)
                times.gc_s += GC_CLOCK.total_s - g0

        return wrapper  # type: ignore[return-value]

    return wrap
