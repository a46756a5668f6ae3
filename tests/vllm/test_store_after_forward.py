"""``maru_store_after_next_forward`` (``write_behind.ForwardGate``): a write-behind store issued by
the drain thread only once the next step's forward started.

Real server and shared-memory pool, the worker over CPU caches built the way vLLM builds them
(block size 4 != 3 heads). Nothing depends on timing: the tests wait until the drain thread is
blocked in the gate (``ForwardGate.waiting``) before asserting that nothing was published yet.
What must hold: the store waits for the next ``start_load_kv``; a flush or a preemption of its
request does not wait for a forward that cannot come, an idle engine's store goes at the timeout,
and the bytes published are the blocks' as they were when the store was queued.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from maru.client import MaruHandler
from maru.vllm.config import MaruConnectorConfig
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.helpers import CHUNK, case, request
from tests.vllm.test_write_behind import Meta, assert_stored, worker

server = module_server("store-after-forward")
client = pool_client()


def until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return False


def gated_worker(url: str, src: object, timeout_s: float = 30.0) -> object:
    w = worker(url, src, store_after_next_forward=True)
    assert w.write_behind.gate is not None
    w.write_behind.gate.timeout_s = timeout_s
    return w


def held_at_gate(w: object, req: object) -> None:
    """Queue ``req``'s store as a step's end does, and wait until the drain thread holds it at the gate."""
    w.wait_for_save(Meta(stores=[req]))
    assert until(lambda: w.write_behind.gate.waiting == 1)


def test_a_store_waits_for_the_next_forward_then_publishes_the_blocks_it_was_queued_with(
    server: ServerProcess, client: MaruHandler
) -> None:
    src, original = case("kv_first", "NHD", 31), case("kv_first", "NHD", 31)
    req = request("gate-next", [5, 9, 1, 3], 2 * CHUNK)
    keys = [c.key for c in req.chunks]
    w = gated_worker(server.url, src)
    try:
        w.start_load_kv(Meta())  # this step's forward
        held_at_gate(w, req)  # queued at the step's end, held by the drain thread
        assert client.exists(keys) == [False, False] and w.stats.stores_in_flight == 1
        w.start_load_kv(Meta())  # the next step's forward starts: the drain issues the store
        assert until(lambda: client.exists(keys) == [True, True])
        # Published; its report reaches the stats when the drain thread returns it (polled each step).
        assert until(lambda: w.get_finished(set()) is not None and w.stats.chunks_stored == 2)
        s = w.stats
        assert (s.drain_gate_waits, s.drain_gate_timeouts, s.chunks_stored) == (1, 0, 2)
        assert 0 < s.drain_gate_wait_s < 30
        assert w.data_paths()["paths"]["store"].endswith(", issued after the next forward")  # maru stats
    finally:
        stop_worker(w)
    assert_stored(client, req, original)


def test_a_store_queued_after_the_forward_started_still_waits_for_the_next_one(
    server: ServerProcess, client: MaruHandler
) -> None:
    """The ticket is taken when the store is queued: the forward that already ran does not count."""
    src = case("blocks_first", "HND", 32)
    req = request("gate-ticket", [7, 2, 10, 4], 2 * CHUNK)
    w = gated_worker(server.url, src)
    try:
        for _ in range(3):
            w.start_load_kv(Meta())
        held_at_gate(w, req)
        assert client.exists([c.key for c in req.chunks]) == [False, False]
    finally:
        stop_worker(w)  # shutdown opens the gate and publishes it
    assert client.exists([c.key for c in req.chunks]) == [True, True]


def test_an_idle_engines_store_goes_at_the_timeout(server: ServerProcess, client: MaruHandler) -> None:
    src, original = case("kv_first", "HND", 33), case("kv_first", "HND", 33)
    req = request("gate-idle", [3, 8, 6, 1], 2 * CHUNK)
    w = gated_worker(server.url, src, timeout_s=0.2)
    try:
        w.wait_for_save(Meta(stores=[req]))  # no forward follows
        assert until(lambda: client.exists([c.key for c in req.chunks]) == [True, True])
        w.get_finished(set())
        assert (w.stats.drain_gate_waits, w.stats.drain_gate_timeouts) == (1, 1)
    finally:
        stop_worker(w)
    assert_stored(client, req, original)


def test_a_flush_does_not_wait_for_a_forward_that_cannot_come(
    server: ServerProcess, client: MaruHandler
) -> None:
    src, original = case("blocks_first", "NHD", 34), case("blocks_first", "NHD", 34)
    req = request("gate-flush", [9, 4, 11, 2], 2 * CHUNK)
    w = gated_worker(server.url, src)
    try:
        held_at_gate(w, req)
        w.flush_stores()  # opens the gate: the store is published now, not after 30 s
        assert client.exists([c.key for c in req.chunks]) == [True, True]
        assert (w.stats.drain_gate_waits, w.stats.drain_gate_timeouts) == (1, 0)
        # Open until the next forward: then a store waits again.
        w.start_load_kv(Meta())
        again = request("gate-flush-2", [1, 5, 12, 7], 2 * CHUNK)
        held_at_gate(w, again)
    finally:
        stop_worker(w)
    assert_stored(client, req, original)


def test_a_preempted_requests_held_store_is_read_before_the_forward_and_keeps_the_old_bytes(
    server: ServerProcess, client: MaruHandler
) -> None:
    """The preemption barrier runs before the forward that would release the store: it gathers the
    held store itself instead of waiting for that forward (it would wait out the gate's timeout), and
    the blocks it returns are reusable at once."""
    src, original = case("kv_first", "NHD", 35), case("kv_first", "NHD", 35)
    req = request("gate-preempt", [8, 3, 12, 5], 2 * CHUNK)
    w = gated_worker(server.url, src)
    try:
        held_at_gate(w, req)
        w.handle_preemptions(Meta(preempted_req_ids={req.req_id}))
        # Read, while the drain thread is still held: the barrier gathered it on this thread.
        assert w.write_behind.gate.waiting == 1 and not w.write_behind.on_device()
        assert w.stats.preemption_waits == 1
        for t in src.caches:  # the next forward reuses the preempted request's blocks
            t.fill_(-3.0)
        w.start_load_kv(Meta())
        w.flush_stores()
        assert w.stats.drain_gate_timeouts == 0 and w.stats.stores_cancelled == 0
        assert w.stats.chunks_stored == 2
    finally:
        stop_worker(w)
    assert_stored(client, req, original)  # what the blocks held before the reuse


@pytest.mark.parametrize("async_store", [True, False])
def test_the_gate_exists_only_where_asked_for_with_write_behind(async_store: bool) -> None:
    cfg = MaruConnectorConfig.from_extra_config(
        {"maru_store_after_next_forward": "true", "maru_async_store": str(async_store).lower()}
    )
    assert cfg.store_after_next_forward and cfg.data_path()["store_after_next_forward"] is True
    said = [line for line in cfg.data_path_lines() if "maru_store_after_next_forward" in line]
    assert len(said) == (1 if async_store else 0)
    assert not MaruConnectorConfig.from_extra_config({}).store_after_next_forward
