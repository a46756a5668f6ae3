"""``maru.gil_calls``: the wall time of calls that keep the GIL, by thread (the thread census's).

Real threads and real sleeps inside the timed calls: every assertion compares an account with what
the calls did (how long they blocked, which thread made them)."""

from __future__ import annotations

import threading
import time

from maru import gil_calls


def test_a_threads_held_time_is_its_own() -> None:
    """``held_ns`` reads the calling thread's account: another thread's timed calls do not move it."""
    call = gil_calls.timed(lambda: time.sleep(0.003))
    mine = gil_calls.held_ns()
    other = threading.Thread(target=call)
    other.start()
    other.join()
    assert gil_calls.held_ns() == mine
    call()
    assert gil_calls.held_ns() - mine >= 3_000_000


def test_accounts_count_calls_and_long_ones_and_keep_the_name_of_an_ended_thread() -> None:
    """Three quick calls and one of 1 ms (over ``LONG_NS``) on a named thread that then ends: its
    account says 4 calls, one long, at least the 1 ms held, and it is still named."""
    quick = gil_calls.timed(lambda: None)
    slow = gil_calls.timed(lambda: time.sleep(gil_calls.LONG_NS / 1e9 * 2))
    tid: list[int] = []

    def work() -> None:
        tid.append(threading.get_native_id())
        for _ in range(3):
            quick()
        slow()

    t = threading.Thread(target=work, name="gil-calls-worker")
    t.start()
    t.join()
    calls, held, long = gil_calls.snapshot()[tid[0]]
    assert (calls, long) == (4, 1) and held >= 2 * gil_calls.LONG_NS
    assert gil_calls.thread_name(tid[0]) == "gil-calls-worker"


def test_an_exception_from_the_call_still_counts_and_passes_through() -> None:
    def failing() -> None:
        time.sleep(0.001)
        raise OSError("driver said no")

    call = gil_calls.timed(failing)
    before = gil_calls.snapshot().get(threading.get_native_id(), (0, 0, 0))
    try:
        call()
    except OSError as e:
        assert str(e) == "driver said no"
    else:
        raise AssertionError("the call's exception was swallowed")
    after = gil_calls.snapshot()[threading.get_native_id()]
    assert after[0] == before[0] + 1 and after[1] - before[1] >= 1_000_000
