"""StepClock: device time of the forwards by kind of step, read back without waiting.

CUDA events cannot run here: a fake device clock stands in (the CUDA path runs in the GPU passes,
``bench/gpu_vllm_pass.sh``, whose worker lines carry it)."""

from __future__ import annotations

import logging
import random
import statistics
from types import SimpleNamespace
from typing import Any

from maru.vllm.step_clock import BESIDE, LAYERED, LOADED, MAX_PENDING, PLAIN, STORED, StepClock, kind_of_step


class FakeDevice:
    """A device clock: each recorded event gets the current device time; ``now`` says how far
    the device has run (an event past it is not reached yet)."""

    def __init__(self) -> None:
        self.t = 0.0  # device time at which the next event is recorded, ms
        self.now = 0.0
        self.index = 3  # the caches' device (use_cuda's device_index; not the default 0)

    def torch(self) -> SimpleNamespace:
        dev = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                self.at: float | None = None

            def record(self, stream: Any = None) -> None:
                assert stream == ("stream of", dev.index)  # the caches' device's current stream
                self.at = dev.t

            def query(self) -> bool:
                assert self.at is not None
                return self.at <= dev.now

            def elapsed_time(self, other: Event) -> float:
                assert self.query() and other.query(), "elapsed_time on an event not reached"
                return other.at - self.at  # type: ignore[operator]

        return SimpleNamespace(cuda=SimpleNamespace(Event=Event, current_stream=lambda i: ("stream of", i)))


def test_forward_and_gap_per_kind_match_the_device_times() -> None:
    rng = random.Random(7)
    dev = FakeDevice()
    clock = StepClock(enabled=True)
    clock.use_cuda(dev.torch(), dev.index)
    fwds: dict[str, float] = {PLAIN: 0.0, LAYERED: 0.0}
    gaps: dict[str, list[float]] = {PLAIN: [], LAYERED: []}
    steps: dict[str, int] = {PLAIN: 0, LAYERED: 0}
    first = True
    for _ in range(40):
        kind = rng.choice([PLAIN, LAYERED])
        # Half the steps queued while the device still ran the previous one (no gap).
        gap, fwd = (rng.uniform(0.1, 30) if rng.random() < 0.5 else 0.0), rng.uniform(1, 9)
        dev.t += gap
        clock.started()
        dev.t += fwd
        clock.ended(kind)
        fwds[kind] += fwd
        if not first and gap > 0:
            gaps[kind].append(gap)
        steps[kind] += 1
        first = False
        if rng.random() < 0.3:
            dev.now = dev.t  # the device caught up: collect reads everything so far
            clock.collect()
    dev.now = dev.t
    clock.collect()
    for kind in (PLAIN, LAYERED):
        got = clock.kinds[kind]
        assert got.steps == steps[kind]
        assert abs(got.forward_ms - fwds[kind]) < 1e-9
        assert got.after_idle == len(gaps[kind])
        assert abs(statistics.median(got.gaps_ms) - statistics.median(gaps[kind])) < 1e-9
        assert (
            f"{kind}: {steps[kind]} steps, forward {fwds[kind] / steps[kind]:.2f} ms each, "
            f"{len(gaps[kind])} queued after the device drained "
            f"(idle before: median {statistics.median(gaps[kind]):.2f} ms)"
        ) in clock.line()


def test_collect_never_reads_an_event_the_device_has_not_reached() -> None:
    dev = FakeDevice()
    clock = StepClock(enabled=True)
    clock.use_cuda(dev.torch(), dev.index)
    for _ in range(3):
        clock.started()
        dev.t += 2.0
        clock.ended(PLAIN)
    dev.now = 4.0  # two steps done, the third still running
    clock.collect()  # the fake raises if an unreached event were timed
    assert clock.kinds[PLAIN].steps == 2
    dev.now = dev.t
    clock.collect()
    assert clock.kinds[PLAIN].steps == 3


def test_a_stalled_device_drops_the_oldest_steps_and_says_so() -> None:
    dev = FakeDevice()
    clock = StepClock(enabled=True)
    clock.use_cuda(dev.torch(), dev.index)
    for _ in range(MAX_PENDING + 5):
        clock.started()
        dev.t += 1.0
        clock.ended(PLAIN)
    dev.now = dev.t
    clock.collect()
    assert clock.kinds[PLAIN].steps == MAX_PENDING
    assert clock.dropped == 5
    assert "5 steps not read back" in clock.line()


def test_off_or_without_cuda_it_records_nothing() -> None:
    dev = FakeDevice()
    off = StepClock(enabled=False)
    off.use_cuda(dev.torch(), dev.index)
    no_cuda = StepClock(enabled=True)
    for clock in (off, no_cuda):
        clock.started()
        clock.ended(PLAIN)
        clock.collect()
        assert clock.kinds == {} and clock.line() == ""


def test_a_failing_event_stops_the_timing_and_never_raises(caplog: Any) -> None:
    class Broken:
        class cuda:  # noqa: N801 - stands in for torch.cuda
            class Event:
                def __init__(self, enable_timing: bool = False) -> None:
                    raise RuntimeError("no device")

    clock = StepClock(enabled=True)
    clock.use_cuda(Broken)
    with caplog.at_level(logging.WARNING, logger="maru.vllm"):
        clock.started()
        clock.ended(PLAIN)
        clock.started()
        clock.collect()
    assert clock.kinds == {}
    said = [
        r.getMessage()
        for r in caplog.records
        if "timing the forwards on the device stopped" in r.getMessage()
    ]
    assert len(said) == 1 and "(RuntimeError: no device)" in said[0] and "Fix:" in said[0]


def test_prefill_steps_are_counted_apart_with_their_tokens() -> None:
    dev = FakeDevice()
    clock = StepClock(enabled=True)
    clock.use_cuda(dev.torch(), dev.index)
    for fwd, tokens, prefill in ((20.0, 8192, True), (3.0, 16, False), (10.0, 4000, True), (3.5, 16, False)):
        clock.started()
        dev.t += fwd
        clock.ended(PLAIN, tokens, prefill)
    clock.started()
    dev.t += 1.0
    clock.ended(PLAIN)  # no count from the scheduler side: a plain step without tokens
    dev.now = dev.t
    clock.collect()
    pre, plain = clock.kinds[f"{PLAIN} (prefill)"], clock.kinds[PLAIN]
    assert (pre.steps, pre.forward_ms, pre.tokens) == (2, 30.0, 12192)
    assert (plain.steps, plain.forward_ms, plain.tokens) == (3, 7.5, 32)
    line = clock.line()
    assert "plain (prefill): 2 steps, forward 15.00 ms each, 6096 tokens each" in line
    assert "plain: 3 steps, forward 2.50 ms each, 11 tokens each" in line


def test_a_plain_step_is_told_apart_by_its_own_store_and_by_an_earlier_store_on_the_device() -> None:
    assert kind_of_step(PLAIN, stores_now=False, store_on_device=False) == PLAIN
    assert kind_of_step(PLAIN, stores_now=False, store_on_device=True) == BESIDE
    assert kind_of_step(PLAIN, stores_now=True, store_on_device=True) == STORED  # its own store first
    for loaded in (LAYERED, LOADED):  # what its start saw (a load) comes first
        assert kind_of_step(loaded, stores_now=True, store_on_device=True) == loaded


def test_the_host_time_from_the_schedulers_plan_to_the_start_is_filed_per_kind(monkeypatch: Any) -> None:
    """A step planned at ``scheduled_at`` (``time.monotonic``) and started later is filed with
    the host time between them under its kind (prefill apart); a step whose plan did not say
    when, or whose plan time lies ahead of this clock, files nothing."""
    import maru.vllm.step_clock as sc

    now = [1000.0]
    monkeypatch.setattr(sc.time, "monotonic", lambda: now[0])
    dev = FakeDevice()
    clock = StepClock(enabled=True)
    clock.use_cuda(dev.torch(), dev.index)
    rng = random.Random(11)
    want: dict[str, list[float]] = {PLAIN: [], f"{STORED} (prefill)": []}
    for i in range(30):
        prefill = i % 3 == 0
        kind = STORED if prefill else PLAIN
        delay_ms = rng.uniform(0.05, 9.0)
        planned = now[0]
        now[0] += delay_ms / 1e3
        said = i % 5 != 4  # every fifth plan said nothing
        clock.started(planned if said else 0.0)
        dev.t += 3.0
        clock.ended(kind, 100, prefill)
        if said:
            want[f"{kind} (prefill)" if prefill else kind].append(delay_ms)
        now[0] += 0.01
    clock.started(now[0] + 5.0)  # a plan "in the future" (another host's clock): dropped
    clock.ended(PLAIN)
    dev.now = dev.t
    clock.collect()
    for kind, delays in want.items():
        got = list(clock.kinds[kind].planned_ms)
        assert len(got) == len(delays)
        assert all(abs(a - b) < 1e-6 for a, b in zip(got, delays, strict=True))
        assert (
            f"started a median {statistics.median(delays):.2f} ms after the scheduler planned it"
            in clock.line()
        )


def test_the_cpu_from_the_plan_and_of_the_issue_is_split_between_this_thread_and_the_others(
    monkeypatch: Any,
) -> None:
    """From a plan made on this thread (its ``cpu_stamp``) to the start, and from the start to the
    end of the forward's issue, the CPU each thread of the process took is filed (this thread's,
    the others'); a plan stamped on another thread or process files no CPU for its window, and
    its issue is still split."""
    import os
    import threading

    import maru.vllm.step_clock as sc

    now, mine, total = [50.0], [3.0], [7.0]  # wall, this thread's CPU, the process's CPU (s)
    monkeypatch.setattr(sc.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(sc.time, "thread_time", lambda: mine[0])
    monkeypatch.setattr(sc.time, "process_time", lambda: total[0])
    dev = FakeDevice()
    clock = StepClock(enabled=True)
    clock.use_cuda(dev.torch(), dev.index)
    rng = random.Random(5)

    def spend(wall_ms: float, own_ms: float, others_ms: float) -> None:
        now[0] += wall_ms / 1e3
        mine[0] += own_ms / 1e3
        total[0] += (own_ms + others_ms) / 1e3

    want_plan: list[tuple[float, float]] = []
    want_issue: list[tuple[float, float, float]] = []
    for i in range(24):
        here = i % 4 != 3  # every fourth plan was made elsewhere (another thread, then a process)
        stamp = sc.cpu_stamp()
        if not here:
            stamp = (stamp[0], stamp[1] + 1, *stamp[2:]) if i % 8 == 3 else (os.getpid() + 1, *stamp[1:])
        elif i % 4 == 1:
            stamp = list(stamp)  # as after a serializer that makes tuples lists: still this thread's
        planned = now[0]
        plan = (rng.uniform(1, 9), rng.uniform(0.1, 5), rng.uniform(0, 4))
        spend(*plan)
        clock.started(planned, stamp)
        issue = (rng.uniform(5, 30), rng.uniform(0.5, 20), rng.uniform(0, 6))
        spend(*issue)
        dev.t += 3.0
        clock.ended(STORED, 2000, True)
        if here:
            want_plan.append(plan[1:])
        want_issue.append(issue)
    assert threading.get_ident() == sc.cpu_stamp()[1]
    dev.now = dev.t
    clock.collect()
    got = clock.kinds[f"{STORED} (prefill)"]
    close = lambda a, b: all(abs(x - y) < 1e-6 for x, y in zip(a, b, strict=True))  # noqa: E731
    assert len(got.planned_cpu_ms) == len(want_plan)
    assert all(close(a, b) for a, b in zip(got.planned_cpu_ms, want_plan, strict=True))
    assert all(close(a, b) for a, b in zip(got.issue_ms, want_issue, strict=True))
    med = [statistics.median(c) for c in zip(*want_plan, strict=True)]
    assert f"(CPU meanwhile: {med[0]:.2f} ms on its thread, {med[1]:.2f} on the others)" in clock.line()
    med = [statistics.median(c) for c in zip(*want_issue, strict=True)]
    assert (
        f"issued in {med[0]:.2f} ms (CPU: {med[1]:.2f} ms on its thread, {med[2]:.2f} on the others)"
        in clock.line()
    )
