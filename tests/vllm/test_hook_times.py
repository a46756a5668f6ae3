"""``maru.vllm.hook_times``: the host time of each connector hook is summed, per name, and shown."""

from __future__ import annotations

import time

import pytest

from maru.vllm.hook_times import HookTimes, timed


class _Hooks:
    def __init__(self) -> None:
        self.hook_times = HookTimes()

    @timed
    def fast(self, x: int) -> int:
        return x + 1

    @timed
    def slow(self) -> None:
        time.sleep(0.01)

    @timed
    def broken(self) -> None:
        raise ValueError("boom")


def test_each_hook_counts_its_calls_and_time_even_when_it_raises() -> None:
    h = _Hooks()
    assert [h.fast(i) for i in range(3)] == [1, 2, 3]
    h.slow()
    with pytest.raises(ValueError, match="boom"):
        h.broken()
    d = h.hook_times.as_dict()
    assert {k: v["calls"] for k, v in d.items()} == {"fast": 3, "slow": 1, "broken": 1}
    assert list(d)[0] == "slow" and d["slow"]["ms"] >= 10.0  # the costliest first; sleep is a floor
    assert h.fast.__name__ == "fast"
    line = h.hook_times.line()
    assert line.startswith("slow 1 calls") and "fast 3 calls" in line and "broken 1 calls" in line


def test_periodic_line_is_due_once_per_interval_and_only_after_new_calls(monkeypatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    h = _Hooks()
    assert not h.hook_times.due(30.0)  # nothing called yet
    h.fast(1)
    assert not h.hook_times.due(30.0)  # called, but the interval has not passed
    now[0] += 31
    assert h.hook_times.due(30.0)
    assert not h.hook_times.due(30.0)  # once per interval
    now[0] += 31
    assert not h.hook_times.due(30.0)  # the interval passed, but no new calls
    h.fast(2)
    assert h.hook_times.due(30.0)
