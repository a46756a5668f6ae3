"""The step clock's events on a real device (skipped where none is visible, as in CI)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

from maru.vllm.step_clock import StepClock  # noqa: E402

SLEEP_CYCLES = 50_000_000  # ~25 ms on an H200's clocks: far above any event's own cost


@pytest.fixture(autouse=True)
def _needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_events_are_recorded_on_the_forwards_stream_so_they_bracket_its_work() -> None:
    """The forward runs on a side stream (as a stream context sets it): events on any other stream
    would not bracket the work and the forward's device time would read near zero."""
    clock = StepClock(enabled=True)
    clock.use_cuda(torch, torch.cuda.current_device())
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        clock.started()
        torch.cuda._sleep(SLEEP_CYCLES)
        clock.ended("plain", tokens=7)
    side.synchronize()
    clock.collect()
    times = clock.kinds["plain"]
    assert times.steps == 1 and times.tokens == 7
    # the sleep alone, timed by torch's events on the same stream, is the reference
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        a.record()
        torch.cuda._sleep(SLEEP_CYCLES)
        b.record()
    side.synchronize()
    assert times.forward_ms >= 0.5 * a.elapsed_time(b)
