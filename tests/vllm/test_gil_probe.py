"""``maru.vllm.gil_probe``: the probe thread's wake-up lateness, its histogram and its line.

The thread test holds the GIL in a pure-Python loop under a long switch interval: the probe's
wake-ups must then wait for the interpreter's forced switch, which is what the probe exists to see.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from maru.vllm.config import MaruConnectorConfig
from maru.vllm.gil_probe import BUCKETS_MS, GilProbe, probe_note, quantile_ms
from maru.vllm.worker_stats import WorkerStats


def test_wake_ups_are_filed_in_their_bucket_and_the_note_reads_them() -> None:
    s = WorkerStats()
    probe = GilProbe(0.002, s, lambda: True)
    for late_ms in (0.05, 0.07, 0.3, 0.3, 3.0, 80.0):
        probe.record(late_ms / 1e3)
    probe.record(-0.00001)  # the OS woke it a hair early: filed as on time
    assert s.gil_probe_wakeups == 7 == sum(s.gil_probe_hist)
    assert s.gil_probe_drain_wakeups == 0 and "while a store drained" not in probe_note(s)
    assert s.gil_probe_hist[0] == 3  # <= 0.1 ms
    assert s.gil_probe_hist[BUCKETS_MS.index(0.5)] == 2
    assert s.gil_probe_hist[BUCKETS_MS.index(5.0)] == 1
    assert s.gil_probe_hist[-1] == 1  # past the last bound
    assert s.gil_probe_max_late_s == pytest.approx(0.08)
    assert quantile_ms(s.gil_probe_hist, 0.5) == 0.5
    assert quantile_ms(s.gil_probe_hist, 0.99) == float("inf")
    note = probe_note(s)
    assert note.startswith("; GIL probe: 7 wake-ups while stepping, 11.96 ms late on average")
    assert "p50 <= 0.5 ms, p99 > 50 ms, max 80.0 ms, 2 over 1 ms" in note
    assert s.timing_note().endswith(note)


def test_nothing_is_said_before_a_wake_up_is_counted() -> None:
    s = WorkerStats()
    GilProbe(0.002, s, lambda: True)
    assert probe_note(s) == "" and s.timing_note() == ""
    assert quantile_ms(s.gil_probe_hist, 0.5) is None
    with pytest.raises(ValueError):
        GilProbe(0.0, s, lambda: True)


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass  # pure Python: the GIL is given up only at the interpreter's forced switches


def test_a_thread_holding_the_gil_makes_the_probe_wake_late() -> None:
    s = WorkerStats()
    probe = GilProbe(0.001, s, lambda: True)
    old = sys.getswitchinterval()
    sys.setswitchinterval(0.02)  # the holder keeps the GIL 20 ms at a time
    try:
        probe.start()
        time.sleep(0.02)  # the probe thread is sleeping in its loop
        _busy(0.3)
    finally:
        sys.setswitchinterval(old)
        probe.stop()
    assert s.gil_probe_wakeups > 0
    # Each wake-up during the loop waited for a forced switch: up to 20 ms, never all of them ~0.
    assert s.gil_probe_max_late_s > 0.002


def test_wake_ups_while_the_engine_is_idle_are_not_counted() -> None:
    s = WorkerStats()
    active = threading.Event()
    probe = GilProbe(0.001, s, active.is_set)
    probe.start()
    time.sleep(0.05)
    assert s.gil_probe_wakeups == 0
    active.set()
    deadline = time.monotonic() + 5
    while s.gil_probe_wakeups == 0 and time.monotonic() < deadline:
        time.sleep(0.005)
    probe.stop()
    assert s.gil_probe_wakeups > 0


def test_the_config_key_reads_milliseconds_and_zero_is_off() -> None:
    assert MaruConnectorConfig().gil_probe_ms == 0.0
    assert MaruConnectorConfig.from_extra_config({"maru_gil_probe_ms": "2"}).gil_probe_ms == 2.0
    assert MaruConnectorConfig.from_extra_config({"maru_gil_probe_ms": 0}).gil_probe_ms == 0.0


def test_wake_ups_while_a_store_drains_are_also_counted_apart() -> None:
    s = WorkerStats()
    probe = GilProbe(0.002, s, lambda: True, draining=lambda: True)
    probe.record(0.0005, draining=True)
    probe.record(0.004, draining=True)
    probe.record(0.0001)
    assert (s.gil_probe_wakeups, s.gil_probe_drain_wakeups, s.gil_probe_drain_over_1ms) == (3, 2, 1)
    assert probe_note(s).endswith(
        "1 over 1 ms (while a store drained: 2, 2.25 ms late on average, 1 over 1 ms)"
    )


def test_the_write_behind_says_when_its_drain_thread_is_at_work() -> None:
    from maru.transfer.records import StoreReport
    from maru.transfer.stores import PendingStore, PreparedStore
    from maru.vllm.write_behind import WriteBehind

    release, entered = threading.Event(), threading.Event()

    class Engine:  # the two calls WriteBehind makes of a transfer engine
        def issue_store(self, stores: list) -> PendingStore:
            return PendingStore(requests=list(stores), prep=PreparedStore(report=StoreReport()))

        def complete_store(self, pending: PendingStore) -> StoreReport:
            entered.set()
            assert release.wait(10)
            pending.finish_reading()
            return StoreReport()

    wb = WriteBehind(WorkerStats(), lambda rep: None, timeout_s=5.0)
    assert not wb.draining
    wb.issue(Engine(), [])  # type: ignore[arg-type]
    assert entered.wait(10)
    assert wb.draining  # read by the probe from its own thread
    release.set()
    wb.collect(None)
    assert not wb.draining and wb.stats.drain_batches == 1
    wb.close()
