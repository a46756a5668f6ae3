"""``maru_store_yield_to_prefill_ms`` (``maru.vllm.prefill_gate``): a write-behind store batch is
drained only once the step that started last schedules no prefill (or at the hold's limit).

Real server and shared-memory pool, the worker over CPU caches built the way vLLM builds them
(block size 4 != 3 heads), and the scheduler side planning from vLLM-shaped scheduler outputs.
Nothing depends on timing but the hold's limit itself: the tests wait until the drain thread is
blocked in the gate (``PrefillGate.waiting``) before asserting that nothing was published yet.
What must hold: a store queued after a prefill step waits for a step without one and then
publishes the bytes its blocks held when it was queued; a quiet engine's store goes at once; an
idle engine's at the limit; a flush or a preemption never waits for a step that cannot come.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from maru.client import MaruHandler
from maru.errors import ConfigError
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import ChunkKeyer, KeySpace
from maru.vllm.prefill_gate import PrefillGate, prefill_step
from maru.vllm.worker_stats import WorkerStats
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.helpers import BS, CHUNK, case, request

pytest.importorskip("vllm")  # the metadata class derives from vLLM's

from maru.vllm.metadata import MaruConnectorMetadata as Meta  # noqa: E402
from maru.vllm.scheduler import MaruSchedulerConnector  # noqa: E402
from maru.vllm.worker import MaruWorkerConnector  # noqa: E402
from tests.vllm.test_write_behind import Engine, assert_stored, so_of, vreq, worker  # noqa: E402

server = module_server("prefill-gate")
client = pool_client()

PREFILL, DECODE = Meta(prefill=True), Meta(prefill=False)


def until(cond: Callable[[], bool], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.005)
    return False


def gated_worker(url: str, src: Any, hold_ms: float = 30_000) -> Any:
    w = worker(url, src, store_yield_to_prefill_ms=hold_ms)
    assert isinstance(w.write_behind.gate, PrefillGate)
    return w


def held_at_gate(w: Any, req: Any) -> None:
    """Queue ``req``'s store at a prefill step's end, and wait until the drain thread holds it."""
    w.start_load_kv(PREFILL)
    w.wait_for_save(Meta(stores=[req]))
    assert until(lambda: w.write_behind.gate.waiting == 1)


# ---------------------------------------------------------------------- which steps are prefill


def so(
    counts: dict[str, int], spec: dict[str, list[int]] | None = None, total: bool = True
) -> SimpleNamespace:
    out = SimpleNamespace(num_scheduled_tokens=counts, scheduled_spec_decode_tokens=spec or {})
    if total:
        out.total_num_scheduled_tokens = sum(counts.values())
    return out


@pytest.mark.parametrize(
    ("step", "prefill"),
    [
        (so({"a": 1, "b": 1, "c": 1}), False),  # every request decodes one token
        (so({"a": 1, "b": 7, "c": 1}), True),  # b is in its prompt
        (so({"a": 3, "b": 1}, {"a": [11, 12]}), False),  # a decodes with two draft tokens
        (so({"a": 3, "b": 2}, {"a": [11, 12]}), True),  # b: two tokens, no draft
        (so({"a": 1, "b": 9}, total=False), True),  # no total in the output: counted
        (so({}), False),  # nothing scheduled
    ],
)
def test_a_prefill_step_is_one_where_a_request_got_more_than_a_decode_token(step: Any, prefill: bool) -> None:
    assert prefill_step(step) is prefill


# ---------------------------------------------------------------------- the gate alone


def test_the_gate_holds_a_batch_through_prefill_steps_and_releases_it_at_the_first_step_without() -> None:
    stats = WorkerStats()
    gate = PrefillGate(stats, hold_s=30)
    gate.wait(time.monotonic())  # no step yet: nothing to yield to
    assert stats.store_holds == 0
    gate.step_started(prefill=True)
    done = threading.Event()
    t = threading.Thread(target=lambda: (gate.wait(time.monotonic()), done.set()))
    t.start()
    assert until(lambda: gate.waiting == 1)
    gate.step_started(prefill=True)  # another prefill step: still held
    assert not done.wait(0.05)
    gate.step_started(prefill=False)
    assert done.wait(10)
    t.join()
    assert (stats.store_holds, stats.store_hold_timeouts) == (1, 0) and 0 < stats.store_hold_s < 30
    gate.wait(time.monotonic())  # the last step had no prefill: at once
    assert stats.store_holds == 1


def test_a_held_batch_goes_at_the_limit_counted_from_when_it_was_queued() -> None:
    stats = WorkerStats()
    gate = PrefillGate(stats, hold_s=0.2)
    gate.step_started(prefill=True)
    t0 = time.monotonic()
    gate.wait(t0 - 0.15)  # queued 150 ms ago: 50 ms left of its hold
    waited = time.monotonic() - t0
    assert (stats.store_holds, stats.store_hold_timeouts) == (1, 1)
    assert waited < 0.2  # not a whole hold from when the drain reached it
    gate.wait(t0 - 1.0)  # past its limit already: no wait at all, still counted as held
    assert (stats.store_holds, stats.store_hold_timeouts) == (2, 2)


def test_open_releases_every_waiter_and_stays_open_until_the_next_step() -> None:
    stats = WorkerStats()
    gate = PrefillGate(stats, hold_s=30)
    gate.step_started(prefill=True)
    threads = [threading.Thread(target=gate.wait, args=(time.monotonic(),)) for _ in range(2)]
    for t in threads:
        t.start()
    assert until(lambda: gate.waiting == 2)
    gate.open()
    for t in threads:
        t.join(10)
        assert not t.is_alive()
    gate.wait(time.monotonic())  # open: at once
    assert (stats.store_holds, stats.store_hold_timeouts) == (2, 0)
    gate.step_started(prefill=True)  # closed again
    late = threading.Thread(target=gate.wait, args=(time.monotonic(),))
    late.start()
    assert until(lambda: gate.waiting == 1)
    gate.open()
    late.join(10)


@pytest.mark.parametrize("hold_s", [0.0, -1.0])
def test_a_gate_without_a_positive_hold_is_refused(hold_s: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        PrefillGate(WorkerStats(), hold_s)


# ---------------------------------------------------------------------- in the worker, real pool


def test_a_store_after_a_prefill_step_waits_for_a_step_without_one_then_publishes_its_blocks(
    server: ServerProcess, client: MaruHandler
) -> None:
    src, original = case("kv_first", "NHD", 41), case("kv_first", "NHD", 41)
    req = request("pg-burst", [5, 9, 1, 3], 2 * CHUNK)
    keys = [c.key for c in req.chunks]
    w = gated_worker(server.url, src)
    try:
        held_at_gate(w, req)
        assert client.exists(keys) == [False, False] and w.stats.stores_in_flight == 1
        w.start_load_kv(PREFILL)  # the burst's next prefill step: still held
        w.wait_for_save(Meta())
        time.sleep(0.05)
        assert client.exists(keys) == [False, False] and w.write_behind.gate.waiting == 1
        w.start_load_kv(DECODE)  # the burst's decode: the drain reserves, gathers, publishes
        assert until(lambda: client.exists(keys) == [True, True])
        assert until(lambda: w.get_finished(set()) is not None and w.stats.chunks_stored == 2)
        s = w.stats
        assert (s.store_holds, s.store_hold_timeouts) == (1, 0) and 0 < s.store_hold_s < 30
        assert "store batches held for a step without prefill: 1" in s.timing_note()
        assert w.data_paths()["paths"]["store"].endswith(", yields to prefill")  # maru stats
    finally:
        stop_worker(w)
    assert_stored(client, req, original)


@pytest.mark.parametrize(
    ("last_step", "hold_ms", "holds"),
    [
        (DECODE, 30_000, (0, 0)),  # the last step had no prefill: drained at once
        (PREFILL, 200, (1, 1)),  # an idle engine after a prefill step: no step comes, the limit does
    ],
    ids=["after-decode", "idle-engine"],
)
def test_a_store_goes_at_once_after_a_quiet_step_and_at_the_limit_on_an_idle_engine(
    server: ServerProcess, client: MaruHandler, last_step: Meta, hold_ms: float, holds: tuple[int, int]
) -> None:
    seed = 42 if last_step is DECODE else 43
    src, original = case("blocks_first", "HND", seed), case("blocks_first", "HND", seed)
    req = request(f"pg-go-{seed}", [7, 2, 10, 4], 2 * CHUNK)
    w = gated_worker(server.url, src, hold_ms=hold_ms)
    try:
        w.start_load_kv(last_step)
        w.wait_for_save(Meta(stores=[req]))  # no step follows
        assert until(lambda: client.exists([c.key for c in req.chunks]) == [True, True])
        w.get_finished(set())
        assert (w.stats.store_holds, w.stats.store_hold_timeouts) == holds
    finally:
        stop_worker(w)
    assert_stored(client, req, original)


def test_a_flush_does_not_wait_for_a_step_that_cannot_come(
    server: ServerProcess, client: MaruHandler
) -> None:
    src, original = case("blocks_first", "NHD", 44), case("blocks_first", "NHD", 44)
    req = request("pg-flush", [9, 4, 11, 2], 2 * CHUNK)
    w = gated_worker(server.url, src)
    try:
        held_at_gate(w, req)
        w.flush_stores()  # opens the gate: published now, not after 30 s
        assert client.exists([c.key for c in req.chunks]) == [True, True]
        assert (w.stats.store_holds, w.stats.store_hold_timeouts) == (1, 0)
        again = request("pg-flush-2", [1, 5, 12, 7], 2 * CHUNK)
        held_at_gate(w, again)  # the next prefill step closed it again
    finally:
        stop_worker(w)  # shutdown opens it and publishes the second store
    assert_stored(client, req, original)
    assert client.exists([c.key for c in again.chunks]) == [True, True]


def test_a_preempted_requests_held_store_is_read_before_the_forward_and_keeps_the_old_bytes(
    server: ServerProcess, client: MaruHandler
) -> None:
    """The preemption barrier runs before a step that may reuse the blocks, and that step may be
    another prefill one: the barrier gathers the held store itself instead of waiting for the gate."""
    src, original = case("kv_first", "NHD", 45), case("kv_first", "NHD", 45)
    req = request("pg-preempt", [8, 3, 12, 5], 2 * CHUNK)
    w = gated_worker(server.url, src)
    try:
        held_at_gate(w, req)
        w.handle_preemptions(Meta(preempted_req_ids={req.req_id}))
        assert w.write_behind.gate.waiting == 1 and not w.write_behind.on_device()
        assert w.stats.preemption_waits == 1
        for t in src.caches:  # the next forward reuses the preempted request's blocks
            t.fill_(-3.0)
        w.start_load_kv(DECODE)
        w.flush_stores()
        assert w.stats.store_hold_timeouts == 0 and w.stats.stores_cancelled == 0
        assert w.stats.chunks_stored == 2
    finally:
        stop_worker(w)
    assert_stored(client, req, original)  # what the blocks held before the reuse


def test_the_scheduler_marks_prefill_steps_and_the_worker_holds_the_burst_stores_until_decode(
    server: ServerProcess, client: MaruHandler
) -> None:
    """Both sides as vLLM drives them: a prompt's chunks planned in its prefill step are held while
    another request's prefill follows, and stored in the first decode step."""
    space = KeySpace(f"pg-model-{time.time_ns()}", "", "float32", 3, 3, 8, CHUNK)
    cfg = MaruConnectorConfig(
        server_url=server.url, kv_chunk_tokens=CHUNK, async_store=True, store_yield_to_prefill_ms=30_000
    )
    sched = MaruSchedulerConnector(
        cfg, ChunkKeyer(space), BS, client_factory=lambda: MaruHandler(server.url, timeout_s=2)
    )
    w = gated_worker(server.url, case("kv_first", "NHD", 46))
    eng = Engine(sched, w)
    g = torch.Generator().manual_seed(9)
    prompts = {r: [int(x) for x in torch.randint(3, 2000, (22,), generator=g)] for r in "ab"}
    try:
        for r in "ab":
            assert sched.get_num_new_matched_tokens(vreq(r, prompts[r]), 0) == (0, False)
            sched.update_state_after_alloc(vreq(r, prompts[r]), None, 0)
        eng.step(so_of((("a", [0, 1, 2, 3, 4, 5], 0, 22),)))  # a's prefill: its chunks planned
        assert until(lambda: w.write_behind.gate.waiting == 1)
        eng.step(so_of((("b", [6, 7, 8, 9, 10, 11], 0, 22),)))  # b's prefill
        assert w.stats.chunks_stored == 0 and w.write_behind.gate.waiting == 1
        decode = so_of()
        decode.num_scheduled_tokens = {"a": 1, "b": 1}
        eng.step(decode)  # every request decodes: both batches go
        assert until(lambda: (w.write_behind.collect(), w.stats.chunks_stored)[1] == 6), w.stats.chunks_stored
        # The first batch waited at the gate; the second, queued behind it, found the gate open.
        assert (w.stats.store_holds, w.stats.store_hold_timeouts) == (1, 0)
        # A warm request finds what the held stores published.
        assert sched.get_num_new_matched_tokens(vreq("c", prompts["a"]), 0) == (20, False)
    finally:
        stop_worker(w)
        sched.shutdown()


# ---------------------------------------------------------------------- configuration


def test_the_key_is_read_bounded_and_said_only_with_write_behind() -> None:
    cfg = MaruConnectorConfig.from_extra_config({"maru_store_yield_to_prefill_ms": "150"})
    assert cfg.store_yield_to_prefill_ms == 150.0 and cfg.data_path()["store_yield_to_prefill_ms"] == 150.0
    said = [line for line in cfg.data_path_lines() if "maru_store_yield_to_prefill_ms" in line]
    assert len(said) == 1 and "at most 150 ms" in said[0]
    sync = MaruConnectorConfig.from_extra_config(
        {"maru_store_yield_to_prefill_ms": 150, "maru_async_store": False}
    )
    assert not [line for line in sync.data_path_lines() if "maru_store_yield_to_prefill_ms" in line]
    d = MaruConnectorConfig.from_extra_config({})
    assert d.store_yield_to_prefill_ms == 250.0  # the default (bench/RESULTS.md, sixty-second pass)
    assert [
        line
        for line in d.data_path_lines()
        if "at most 250 ms (maru_store_yield_to_prefill_ms, the default)" in line
    ]
    off = MaruConnectorConfig.from_extra_config({"maru_store_yield_to_prefill_ms": 0})
    assert off.store_yield_to_prefill_ms == 0.0
    assert not [line for line in off.data_path_lines() if "maru_store_yield_to_prefill_ms" in line]
    for bad in (-5, "2500", "soon"):
        with pytest.raises(ConfigError, match="maru_store_yield_to_prefill_ms"):
            MaruConnectorConfig.from_extra_config({"maru_store_yield_to_prefill_ms": bad})


def test_a_sync_store_worker_has_no_gate(server: ServerProcess) -> None:
    c = MaruConnectorConfig(
        server_url=server.url, kv_chunk_tokens=CHUNK, async_store=False, store_yield_to_prefill_ms=100
    )
    w = MaruWorkerConnector(c, block_size=BS, num_kv_heads=3, head_size=8)
    assert w.write_behind.gate is None
    assert w.data_paths()["paths"]["store"] == "sync"
