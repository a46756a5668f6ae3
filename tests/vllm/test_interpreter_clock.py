"""The garbage collector's clock and the forward thread's Python pace (``maru.vllm.interpreter_clock``),
and the collections the hook timers attribute to Maru's hooks (``maru.vllm.hook_times``).

Collections are made explicitly with the automatic collector off, so every count is exact."""

from __future__ import annotations

import gc
import re
from collections.abc import Iterator
from typing import Any

import pytest

from maru.vllm import hook_times as ht
from maru.vllm import interpreter_clock as ic


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Iterator[ic.GcClock]:
    """A fresh clock installed as the process's (the hook timers read it), the collector manual."""
    c = ic.GcClock()
    c.armed = True  # as after vLLM froze its heap
    monkeypatch.setattr(ht, "GC_CLOCK", c)
    was = gc.isenabled()
    gc.disable()
    c.install()
    try:
        yield c
    finally:
        c.uninstall()
        if was:
            gc.enable()


def test_collections_are_counted_by_generation_with_their_time(clock: ic.GcClock) -> None:
    gc.collect(0)
    gc.collect(0)
    gc.collect(2)
    assert clock.collections == [2, 0, 1]
    assert clock.total_s == pytest.approx(sum(clock.seconds)) and clock.total_s > 0
    # The longest is at least the one gen-2 collection and the mean of the two gen-0 ones.
    assert clock.longest_s >= max(clock.seconds[2], clock.seconds[0] / 2)
    assert clock.longest_s <= clock.total_s and clock.longest_gen in (0, 2)
    note = clock.note(0.0)
    assert re.fullmatch(
        r"; garbage collector: 3 collections \(gen 0 / 1 / 2: 2 / 0 / 1\), \d+\.\d ms, longest "
        r"\d+\.\d\d ms \(gen [02]\), 0\.0 ms of it inside Maru's hooks",
        note,
    ), note


def test_install_is_once_and_uninstall_stops_the_count(clock: ic.GcClock) -> None:
    clock.install()  # again: still one callback
    assert gc.callbacks.count(clock._callback) == 1
    clock.uninstall()
    gc.collect(0)
    assert clock.collections == [0, 0, 0] and clock.note(0.0) == ""


def test_collections_count_once_armed_after_the_heap_is_frozen(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not counted until armed (a serving step's hook), and arming waits for vLLM's ``gc.freeze``;
    an unfreeze later (a shutdown) does not stop the count."""
    c = ic.GcClock()
    frozen = [0]
    monkeypatch.setattr(ic.gc, "get_freeze_count", lambda: frozen[0])

    def collect(gen: int) -> None:
        c._callback("start", {"generation": gen})
        c._callback("stop", {"generation": gen})

    collect(2)  # start-up
    c.arm()  # a step before any freeze (a warm-up run): not yet
    collect(2)
    assert c.collections == [0, 0, 0] and not c.armed
    frozen[0] = 5000
    collect(2)  # frozen, but no serving step yet (vLLM's explicit collections of its start-up)
    assert c.collections == [0, 0, 0]
    c.arm()
    collect(0)
    frozen[0] = 0
    collect(1)
    assert c.collections == [1, 1, 0] and c.armed


def test_the_callback_never_raises_and_ignores_a_stop_without_start() -> None:
    c = ic.GcClock()
    c.armed = True
    c._callback("stop", {"generation": 1})  # no start seen: nothing counted
    c._callback("start", {})
    c._callback("stop", {"generation": "not a number"})  # swallowed
    assert c.collections == [0, 0, 0]
    c._callback("start", {})
    c._callback("stop", {"generation": 7})  # clamped to the oldest
    assert c.collections == [0, 0, 1]


class _Hooks:
    def __init__(self) -> None:
        self.hook_times = ht.HookTimes()

    @ht.timed
    def collecting_hook(self) -> None:
        gc.collect(0)
        self.collecting_part()

    @ht.timed_part("collecting_hook/part")
    def collecting_part(self) -> None:
        gc.collect(1)

    @ht.timed
    def quiet_hook(self) -> None:
        return None

    @ht.timed_wall_as("per_layer")
    def per_layer(self) -> None:
        gc.collect(0)


def test_a_hook_counts_the_collections_inside_it_once(clock: ic.GcClock) -> None:
    h = _Hooks()
    gc.collect(2)  # outside any hook: not Maru's
    outside = clock.total_s
    h.quiet_hook()
    assert h.hook_times.gc_s == 0.0
    h.collecting_hook()  # one collection in the hook, one in its part: counted once each
    assert clock.collections == [1, 1, 1]
    assert h.hook_times.gc_s == pytest.approx(clock.total_s - outside)
    before = h.hook_times.gc_s
    h.per_layer()  # a hook timed by wall counts them too
    assert clock.collections == [2, 1, 1]
    assert h.hook_times.gc_s > before
    assert h.hook_times.gc_s == pytest.approx(clock.total_s - outside)
    assert "of it inside Maru's hooks" in clock.note(h.hook_times.gc_s)


def test_python_pace_samples_at_most_every_interval() -> None:
    pace = ic.PythonPace(every_s=3600.0)
    assert pace.note() == ""
    pace.maybe_sample()
    pace.maybe_sample()  # within the interval: no second sample
    assert len(pace.samples) == 1 and pace.samples[0] > 0
    fast = ic.PythonPace(every_s=0.0)
    for _ in range(3):
        fast.maybe_sample()
    assert len(fast.samples) == 3
    m = re.fullmatch(
        r"; Python: 20,000 adds in (\d+\.\d\d) ms \(median of 3 samples on the forward thread, min (\d+\.\d\d)\)",
        fast.note(),
    )
    assert m is not None and float(m.group(2)) <= float(m.group(1))


def test_the_pace_loop_is_the_harness_loop_scaled(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sample runs exactly PACE_LOOP adds (a hundredth of the harness's 2,000,000)."""
    calls: list[Any] = []
    real_range = range

    def counting_range(n: int) -> Any:
        calls.append(n)
        return real_range(n)

    monkeypatch.setattr(ic, "range", counting_range, raising=False)
    ic._loop_seconds()
    assert calls == [ic.PACE_LOOP] and ic.PACE_LOOP * 100 == 2_000_000
