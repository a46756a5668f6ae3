"""``maru_store_yield_ms``: a write-behind store issued while vLLM computes prompts waits for a step
without them (or its deadline) before the drain thread reserves, gathers and publishes it.

Worker side against a real server and a real shared-memory pool, on synthetic caches built the way
vLLM builds them (block size 4 != 3 heads); the scheduler side's step flag from the objects vLLM
hands it. What must hold:

- while the latest step planned computes prompt tokens, a store stays unpublished, its drain not
  begun; a step without them releases it, and the bytes published are the cache's;
- with no such step, the store runs at its deadline (counted apart), never later than asked;
- a flush (shutdown, tests) ends the wait; ``maru_store_yield_ms: 0`` never waits;
- a preemption while a store waits gathers it on the forward thread before the blocks are reused
  (the wait does not hold the barrier), and it publishes the bytes read then;
- the scheduler side says whether a step computes prompts, speculative drafts not counted.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest

from maru.client import MaruHandler
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.helpers import CHUNK, case, request

pytest.importorskip("vllm")  # the metadata class derives from vLLM's

from maru.vllm.metadata import MaruConnectorMetadata as Meta  # noqa: E402
from maru.vllm.metadata import computes_prompt  # noqa: E402
from tests.vllm.test_write_behind import assert_stored, worker  # noqa: E402

server = module_server("store-yield")
client = pool_client()


def step(w: Any, *, prefill: bool, **meta: Any) -> None:
    """One engine step as vLLM drives the worker: the plan reaches ``start_load_kv``, then the
    forward runs and ``wait_for_save`` queues the step's stores."""
    m = Meta(prefill=prefill, **meta)
    w.start_load_kv(m)
    w.wait_for_save(m)


def yielding(w: Any, timeout: float = 20.0) -> bool:
    """Wait until the drain thread holds a store for the prompts."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if w.write_behind.yielding:
            return True
        time.sleep(0.005)
    return False


def drained(w: Any, timeout: float = 20.0) -> bool:
    """Poll the drain like vLLM's steps do (``collect`` without waiting: no flush) until no store
    batch is in flight."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w.write_behind.collect()
        if w.stats.stores_in_flight == 0:
            return True
        time.sleep(0.01)
    return False


def test_a_store_made_while_prompts_are_computed_waits_for_a_step_without_them(
    server: ServerProcess, client: MaruHandler
) -> None:
    src = case("kv_first", "NHD", 31)
    req = request("yield-decode", [5, 9, 1, 3], 2 * CHUNK)
    keys = [c.key for c in req.chunks]
    w = worker(server.url, src, store_yield_ms=5000)  # far past this test's checks
    try:
        step(w, prefill=True, stores=[req])
        step(w, prefill=True)  # more prompts: still waiting
        assert yielding(w)
        time.sleep(0.3)  # the drain thread had every chance to run (it must not)
        w.write_behind.collect()
        assert client.exists(keys) == [False, False]
        assert (w.stats.stores_in_flight, w.stats.drain_batches) == (1, 0)
        assert w.write_behind.on_device()  # its blocks not read yet: vLLM keeps them
        step(w, prefill=False)  # a decode step: the burst of prompts is over
        assert drained(w)
        assert client.exists(keys) == [True, True]
        s = w.stats
        assert (s.store_yields, s.store_yield_deadlines, s.drain_batches, s.chunks_stored) == (1, 0, 1, 2)
        assert s.store_yield_s >= 0.3
        assert "stores that waited for the prompts: 1" in s.timing_note()
    finally:
        stop_worker(w)
    assert_stored(client, req, src)


def test_with_no_step_after_the_prompts_the_store_runs_at_its_deadline(
    server: ServerProcess, client: MaruHandler
) -> None:
    src = case("kv_first", "HND", 32)
    req = request("yield-deadline", [2, 7, 11, 4], 2 * CHUNK)
    w = worker(server.url, src, store_yield_ms=150)
    try:
        step(w, prefill=True, stores=[req])  # and then the engine goes idle: no step plans anything
        assert drained(w)
        assert client.exists([c.key for c in req.chunks]) == [True, True]
        s = w.stats
        assert (s.store_yields, s.store_yield_deadlines) == (1, 1)
        assert 0.1 <= s.store_yield_s  # Event.wait gave up at the deadline, not before
    finally:
        stop_worker(w)
    assert_stored(client, req, src)


@pytest.mark.parametrize("yield_ms", [0, 5000])
def test_a_flush_ends_the_wait_and_zero_never_waits(
    yield_ms: int, server: ServerProcess, client: MaruHandler
) -> None:
    src = case("kv_first", "NHD", 33)
    req = request(f"yield-flush-{yield_ms}", [3, 1, 8, 6], 2 * CHUNK)
    w = worker(server.url, src, store_yield_ms=yield_ms)
    try:
        step(w, prefill=True, stores=[req])
        if yield_ms == 0:
            assert drained(w)  # no flush needed
        else:
            assert yielding(w)
        w.flush_stores(timeout_s=20.0)
        assert w.stats.stores_in_flight == 0
        assert client.exists([c.key for c in req.chunks]) == [True, True]
        s = w.stats
        assert s.store_yield_deadlines == 0  # the flush, not the 5 s deadline, ended it
        assert s.store_yields == (0 if yield_ms == 0 else 1)
        step(w, prefill=True, stores=[request(f"yield-after-{yield_ms}", [0, 2, 4, 5], CHUNK)])
        assert yield_ms == 0 or yielding(w)
        w.flush_stores(timeout_s=20.0)
        assert w.stats.store_yields == (0 if yield_ms == 0 else 2)  # the next prompt waited again
    finally:
        stop_worker(w)
    assert_stored(client, req, src)


def test_a_preempted_request_s_waiting_store_is_gathered_before_its_blocks_are_reused(
    server: ServerProcess, client: MaruHandler
) -> None:
    src, original = case("kv_first", "NHD", 34), case("kv_first", "NHD", 34)
    req = request("yield-preempt", [6, 2, 9, 1], 2 * CHUNK)
    w = worker(server.url, src, store_yield_ms=5000)
    try:
        step(w, prefill=True, stores=[req])
        assert yielding(w)
        m = Meta(prefill=True, preempted_req_ids={req.req_id})
        w.handle_preemptions(m)  # returns once no store reads the blocks: not after the 5 s
        assert not w.write_behind.on_device()
        assert w.stats.preemption_waits == 1 and w.stats.stores_cancelled == 0
        for t in src.caches:  # vLLM hands the freed blocks to another request
            t.fill_(-7.0)
        w.start_load_kv(m)
        w.wait_for_save(m)
        step(w, prefill=False)
        assert drained(w)
        assert w.stats.store_yield_deadlines == 0
    finally:
        stop_worker(w)
    assert_stored(client, req, original)  # what the blocks held before the preemption


def test_the_scheduler_side_says_whether_a_step_computes_prompts() -> None:
    out = SimpleNamespace
    assert not computes_prompt(out(num_scheduled_tokens={}))
    assert not computes_prompt(out(num_scheduled_tokens={"a": 1, "b": 1}))  # decode steps
    assert computes_prompt(out(num_scheduled_tokens={"a": 1, "b": 37}))  # a prefill chunk beside them
    # Speculative decoding: a decode step schedules the token and its drafts.
    spec = {"a": [11, 12, 13], "b": [14]}
    assert not computes_prompt(out(num_scheduled_tokens={"a": 4, "b": 2}, scheduled_spec_decode_tokens=spec))
    assert computes_prompt(out(num_scheduled_tokens={"a": 4, "b": 9}, scheduled_spec_decode_tokens=spec))
    assert computes_prompt(out(num_scheduled_tokens={"a": 4, "c": 2}, scheduled_spec_decode_tokens=spec))
    assert not computes_prompt(out())  # an object without the field: nothing known, nothing held
