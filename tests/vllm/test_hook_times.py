"""``maru.vllm.hook_times``: the host time of each connector hook is summed, per name, and shown."""

from __future__ import annotations

import time

import pytest

from maru.vllm.hook_times import HookTimes, timed, timed_part, timed_step, timed_wall_as


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


def test_the_longest_call_is_kept_apart_from_the_mean() -> None:
    """One slow call among fast ones: the mean says little, the longest says it was one call."""
    t = HookTimes()
    for s in (0.0001, 0.0002, 0.050, 0.0001):
        t.add("get_finished", s, s / 2)
    t.add("wait_for_layer_load", 0.00001)  # timed by wall only
    d = t.as_dict()
    assert d["get_finished"]["max_ms"] == 50.0 and d["get_finished"]["ms"] == 50.4
    assert d["wait_for_layer_load"]["max_ms"] == 0.01
    line = t.line()
    assert "get_finished 4 calls 50.4 ms (12600 us each, 6300 on CPU, longest 50.00 ms)" in line
    assert "wait_for_layer_load 1 calls 0.0 ms (10 us each, longest 0.01 ms)" in line


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


class _Blocking:
    def __init__(self) -> None:
        self.hook_times = HookTimes()

    @timed
    def blocked(self) -> None:
        time.sleep(0.05)  # off the CPU, as in a server round trip or a wait for the GIL

    @timed
    def busy(self) -> None:
        c0 = time.thread_time()
        while time.thread_time() - c0 < 0.02:  # on the CPU for 20 ms of this thread's time
            pass


def test_cpu_time_tells_a_blocked_hook_from_a_busy_one() -> None:
    h = _Blocking()
    h.blocked()
    h.busy()
    d = h.hook_times.as_dict()
    assert d["blocked"]["ms"] >= 50.0 and d["blocked"]["cpu_ms"] < 25.0  # mostly blocked
    assert d["busy"]["cpu_ms"] >= 20.0  # the spin is the thread's own CPU time
    assert d["busy"]["cpu_ms"] <= d["busy"]["ms"] + 1.0  # CPU never exceeds wall (clock resolution)
    assert "us each" in h.hook_times.line() and "on CPU" in h.hook_times.line()


class _PerLayer(_Blocking):
    @timed_wall_as("per_layer")
    def per_layer(self) -> None:
        time.sleep(0.002)

    @timed
    def per_step(self) -> None:
        pass


def test_a_per_layer_hook_counts_wall_time_only_and_says_so() -> None:
    h = _PerLayer()
    h.per_layer()
    h.per_step()
    d = h.hook_times.as_dict()
    assert d["per_layer"]["ms"] >= 2.0 and "cpu_ms" not in d["per_layer"]
    assert "cpu_ms" in d["per_step"]
    line = h.hook_times.line()
    assert "per_layer 1 calls" in line and "us each, longest" in line and line.count("on CPU") == 1


class _WithParts:
    def __init__(self, parts: bool) -> None:
        self.hook_times = HookTimes(parts=parts)
        self.running_hook: str | None = None

    @timed
    def hook(self, x: int) -> int:
        self.running_hook = "hook"
        try:
            return self.part(x) + self.step(x)
        finally:
            self.running_hook = None

    @timed_part("hook/part")
    def part(self, x: int) -> int:
        time.sleep(0.002)
        return 2 * x

    @timed_step("step", "other")
    def step(self, x: int) -> int:
        if x < 0:
            raise ValueError("negative")
        return x


@pytest.mark.parametrize("parts", [True, False])
def test_parts_are_timed_only_with_the_detail_on_and_run_the_same_either_way(parts: bool) -> None:
    """``maru_log_timing``'s detail: the parts of hooks timed (under ``hook/part``, and a step under
    the hook that runs it); off, they run untimed (their clocks cost ~5 us a call), the hooks still
    timed."""
    h = _WithParts(parts)
    assert h.hook(3) == 9
    with pytest.raises(ValueError, match="negative"):
        h.hook(-1)
    assert h.step(4) == 4  # outside any hook: counted under the hook it names
    d = h.hook_times.as_dict()
    assert d["hook"]["calls"] == 2 and d["hook"]["ms"] >= 4.0
    if parts:
        assert {k: v["calls"] for k, v in d.items()} == {
            "hook": 2,
            "hook/part": 2,
            "hook/step": 2,
            "other/step": 1,
        }
        assert d["hook/part"]["ms"] >= 4.0 and d["hook/part"]["ms"] <= d["hook"]["ms"]
    else:
        assert set(d) == {"hook"}
    assert h.part.__name__ == "part" and h.step.__name__ == "step"


def test_maru_hook_parts_overrides_the_log_timing_default_and_a_bad_value_is_said(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from maru import env_flags
    from maru.vllm.hook_times import parts_timed

    monkeypatch.delenv("MARU_HOOK_PARTS", raising=False)
    assert parts_timed(True) and not parts_timed(False)  # with maru_log_timing, by default
    monkeypatch.setenv("MARU_HOOK_PARTS", "0")  # a bench's hook lines at the default's cost
    assert not parts_timed(True)
    monkeypatch.setenv("MARU_HOOK_PARTS", "on")
    assert parts_timed(False)
    monkeypatch.setenv("MARU_HOOK_PARTS", "partly")  # not a switch value: the default, said
    assert parts_timed(True) and not parts_timed(False)
    assert any("MARU_HOOK_PARTS='partly'" in n for n in env_flags.misread())
    monkeypatch.delenv("MARU_HOOK_PARTS")
    parts_timed(False)  # read again with a good value: no longer misread
    assert not any("MARU_HOOK_PARTS" in n for n in env_flags.misread())


def test_without_log_timing_hooks_count_wall_time_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from maru.vllm.hook_times import ENV_PARTS, hook_times_for

    monkeypatch.delenv(ENV_PARTS, raising=False)
    quiet, told = hook_times_for(False), hook_times_for(True)
    assert (quiet.parts, quiet.cpu) == (False, False) and (told.parts, told.cpu) == (True, True)
    h = _Blocking()
    h.hook_times = quiet
    h.busy()
    h.blocked()
    d = quiet.as_dict()
    assert d["busy"]["ms"] >= 20.0 and d["blocked"]["ms"] >= 50.0  # the wall time, always
    assert "cpu_ms" not in d["busy"] and "cpu_ms" not in d["blocked"]
    assert "on CPU" not in quiet.line()


def test_a_layer_wait_with_no_layer_load_in_flight_returns_untimed_and_one_in_flight_waits_timed() -> None:
    """``MaruKVConnector.wait_for_layer_load`` runs before every attention layer of every step: a
    step without a layer load returns before any timing; a step with one waits, counted."""
    pytest.importorskip("vllm")
    from types import SimpleNamespace

    from maru.vllm.connector import MaruKVConnector

    waited: list[str] = []
    loads = SimpleNamespace(in_flight=False)
    worker = SimpleNamespace(layer_loads=loads, wait_for_layer_load=waited.append)
    conn = object.__new__(MaruKVConnector)  # only what the hook reads
    conn._worker = worker
    conn.hook_times = HookTimes()
    for i in range(4):
        conn.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
    assert waited == [] and conn.hook_times.calls == {}
    loads.in_flight = True
    for i in range(4):
        conn.wait_for_layer_load(f"model.layers.{i}.self_attn.attn")
    assert waited == [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    assert conn.hook_times.calls == {"wait_for_layer_load": 4}
    conn._worker = None  # the scheduler side: nothing
    conn.wait_for_layer_load("model.layers.0.self_attn.attn")
    assert conn.hook_times.calls == {"wait_for_layer_load": 4}
