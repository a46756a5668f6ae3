"""``maru.vllm.thread_census``: whose CPU a window of the engine process was, from /proc (Linux).

Real threads burn real CPU here; every assertion compares the census with the thread's own
``time.thread_time`` (generous bounds: it is CPU accounting, not a clock race), or with names."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from maru.vllm import thread_census
from maru.vllm.step_clock import STORED, StepClock, cpu_stamp

pytestmark = pytest.mark.skipif(
    not thread_census.os.path.isdir("/proc/self/task"), reason="needs Linux /proc"
)


class _Burner:
    """A thread named ``name`` that runs ``ms`` of CPU, records its own thread CPU time (s) in
    ``took``, then lives on until ``stop()`` (a thread that ended is gone from /proc)."""

    def __init__(self, name: str, ms: float, took: list[float]) -> None:
        self.done, self.release = threading.Event(), threading.Event()

        def run() -> None:
            c0 = time.thread_time()
            x = 0
            while time.thread_time() - c0 < ms / 1e3:
                x += 1
            took.append(time.thread_time() - c0)
            self.done.set()
            self.release.wait(10)

        self.thread = threading.Thread(target=run, name=name)
        self.thread.start()
        assert self.done.wait(10)

    def stop(self) -> None:
        self.release.set()
        self.thread.join()

    def gone(self) -> None:
        """Wait until the kernel thread left /proc (``join`` returns when Python is done with the
        thread, which the kernel may still list for a moment: then its CPU is listed, not gone)."""
        task = f"/proc/self/task/{self.thread.native_id}"
        deadline = time.monotonic() + 10
        while thread_census.os.path.exists(task):
            assert time.monotonic() < deadline, f"{task} still listed 10 s after the thread ended"
            time.sleep(0.001)


def test_a_busy_thread_is_named_with_its_cpu_and_the_skipped_thread_is_left_out() -> None:
    me = threading.get_native_id()
    before = thread_census.snapshot()
    assert me in before and before[me][0] > 0
    took: list[float] = []
    t = _Burner("census-busy", 60, took)
    x = 0
    for i in range(200_000):  # this thread works too: it is skipped
        x += i
    shares = thread_census.shares(before, thread_census.snapshot(), skip=me)
    t.stop()
    assert "census-busy" in shares
    own_ms = took[0] * 1e3
    assert 0.5 * own_ms <= shares["census-busy"] <= 1.5 * own_ms + 5
    assert threading.current_thread().name not in shares
    assert shares[thread_census.RUN_QUEUE] >= 0  # this thread's wait for a CPU, apart
    # Without the skip this thread's work shows under its own name.
    assert threading.current_thread().name in thread_census.shares(before, thread_census.snapshot())


def test_a_thread_that_ended_in_the_window_counts_as_gone() -> None:
    """A thread started and ended between the snapshots is gone from /proc: its CPU shows in the
    process's total, as ``GONE``, not under a name."""
    before = thread_census.snapshot()
    took: list[float] = []
    t = _Burner("census-brief", 60, took)
    t.stop()
    t.gone()
    shares = thread_census.shares(before, thread_census.snapshot(), skip=threading.get_native_id())
    assert "census-brief" not in shares
    own_ms = took[0] * 1e3
    assert 0.5 * own_ms <= shares[thread_census.GONE] <= 1.5 * own_ms + 10


def test_a_threads_gil_holding_cuda_calls_show_as_wall_time_beside_its_cpu() -> None:
    """A thread blocked 30 ms inside a (stand-in) CUDA call that keeps the GIL: ~no CPU, but
    30 ms under ``<name> (GIL held in CUDA calls)``, and one long call; the line lists it apart."""
    from maru import gil_calls

    blocking = gil_calls.timed(lambda: time.sleep(0.03))  # a call that blocks without CPU
    before = thread_census.snapshot()
    t = threading.Thread(target=blocking, name="census-held")
    t.start()
    t.join()
    shares = thread_census.shares(before, thread_census.snapshot(), skip=threading.get_native_id())
    held = shares["census-held" + thread_census.HELD]
    assert 30 <= held < 30 + 200
    assert shares.get("census-held", 0.0) < 10  # asleep: its CPU is not what it held
    assert shares[thread_census.LONG] == 1
    s = thread_census.ThreadShares()
    s.add(shares)
    line = s.line()
    assert "GIL held in CUDA calls: census-held " in line and "1.0 calls a step of 0.5 ms or more" in line
    assert line.index("GIL held") > line.index(thread_census.GONE)  # after the CPU entries


def test_shares_add_up_per_window_and_the_line_shows_the_largest_first() -> None:
    s = thread_census.ThreadShares()
    assert s.line() == ""
    s.add({"a": 1.0, "b": 4.0})
    s.add({"a": 3.0, "c": 0.5})
    assert s.windows == 2
    assert s.line() == "a 2.00, b 2.00, c 0.25"
    assert s.line(top=1) == "a 2.00"
    s.add({thread_census.GONE: 6.0, thread_census.RUN_QUEUE: 0.3, "c": 1.0})
    s.add({thread_census.GONE: -0.6, thread_census.RUN_QUEUE: 0.0})  # the counts' noise: below 0
    assert s.line(top=2) == (f"a 1.00, b 1.00; {thread_census.GONE} 1.35; {thread_census.RUN_QUEUE} 0.07")


def test_the_census_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(thread_census.ENV, raising=False)
    assert not thread_census.enabled()
    monkeypatch.setenv(thread_census.ENV, "0")
    assert not thread_census.enabled()
    assert thread_census.slow_note() is None
    monkeypatch.setenv(thread_census.ENV, "1")
    assert thread_census.enabled()
    note = thread_census.slow_note()
    assert note is not None and "Fix: unset MARU_THREAD_CENSUS" in note  # what maru doctor shows


class _Events:
    """CUDA events that are always reached, on a device clock that advances 2 ms a record."""

    def __init__(self) -> None:
        self.t = 0.0

    def torch(self) -> Any:
        clock = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at = 0.0

            def record(self, stream: Any = None) -> None:
                clock.t += 2.0
                self.at = clock.t

            def query(self) -> bool:
                return True

            def elapsed_time(self, other: Any) -> float:
                return other.at - self.at

        return SimpleNamespace(cuda=SimpleNamespace(Event=Event, current_stream=lambda i: None))


def test_the_step_clock_files_the_other_threads_cpu_from_the_plan_by_name() -> None:
    """A prefill step planned with a census snapshot: the thread that ran between the plan and the
    start is named in the line, with its CPU a step; a step planned without one files nothing."""
    clock = StepClock(enabled=True)
    clock.use_cuda(_Events().torch(), 0)
    took: list[float] = []
    for _ in range(2):
        stamp, threads = cpu_stamp(), thread_census.snapshot()
        t = _Burner("census-drain", 30, took)
        clock.started(time.monotonic(), stamp, threads)
        t.stop()
        clock.ended(STORED, 2000, True)
    clock.started(time.monotonic(), cpu_stamp(), {})  # no census: not a window
    clock.ended(STORED, 2000, True)
    clock.collect()
    census = clock.kinds[f"{STORED} (prefill)"].census
    assert census.windows == 2
    own_ms = sum(took) * 1e3 / 2
    assert 0.5 * own_ms <= census.ms["census-drain"] / 2 <= 1.5 * own_ms + 5
    assert "other threads' CPU from the plan, ms a step: census-drain" in clock.line()
