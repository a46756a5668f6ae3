"""The write-behind store on the pipelined (CUDA) path: reserved and gathered by the drain thread.

``issue_store`` (vLLM's forward thread) only takes the path's ``mark()``; ``complete_store`` (the
drain thread) reserves the objects (one RESERVE round trip), issues the gather ordered
after the mark, waits for it and publishes. The preemption barrier (``wait_store_read``) gathers
a store the drain has not started itself. Real server and shared-memory pool; the pipelined path
runs on CPU caches here (``DevicePipeline`` without a GPU; the event ordering is tested on the
H200 in ``tests/vllm/test_write_behind_gpu.py``). What must hold: no round trip on the issuing
thread, the bytes published are the cache's when the drain reads them, each reserved object is
published or aborted (the server holds no reservation afterwards), a failed reservation fails
the store with its reason and publishes nothing, and a store is gathered exactly once.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from maru import kv_ops
from maru.client import MaruHandler
from maru.errors import PoolFullError
from maru.kv_ops.device_pipeline import DevicePipeline
from maru.kv_ops.testing import CacheCase
from maru.transfer.device_path import PipelinedPath
from maru.transfer.engine import KVTransferEngine
from maru.transfer.records import RequestTransfer
from tests.pool_fixtures import module_server, pool_client
from tests.transfer.helpers import CHUNK, assert_loads_back, case, request

server = module_server("deferred-gather")
client = pool_client()


def pipelined(src: CacheCase, client: Any) -> KVTransferEngine:
    layout = kv_ops.detect_layouts(src.caches, **src.detect_kwargs())
    eng = KVTransferEngine(list(src.caches), layout, client)
    eng.path = PipelinedPath(DevicePipeline(list(src.caches), layout))
    return eng


class CountingAllocs:
    """The client, recording the thread of each RESERVE round trip (and failing them on demand)."""

    def __init__(self, real: MaruHandler, fail: bool = False) -> None:
        self.real, self.fail = real, fail
        self.calls: list[tuple[str, int]] = []

    def batch_alloc(self, sizes: list[int]) -> Any:
        self.calls.append((threading.current_thread().name, len(sizes)))
        if self.fail:
            raise PoolFullError("pool full (test)")
        return self.real.batch_alloc(sizes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def assert_published(client: MaruHandler, req: RequestTransfer, original: CacheCase) -> None:
    assert_loads_back(client, req, original, (11, 13, 8, 2, 10, 0)[: len(req.block_ids)])


def on_thread(fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` on a thread named like the worker's drain thread; its result."""
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), name="maru-store-drain-test")
    t.start()
    t.join(30)
    assert out, "the drain-side call did not return"
    return out[0]


def test_the_issue_makes_no_round_trip_and_the_drain_reserves_gathers_and_publishes(
    client: MaruHandler,
) -> None:
    src, original = case("kv_first", "HND", 41), case("kv_first", "HND", 41)
    a = request("deferred-a", [3, 14, 6, 1], 2 * CHUNK)
    b = request("deferred-b", [7, 9, 4, 12], 2 * CHUNK - 3)
    counting = CountingAllocs(client)
    eng = pipelined(src, counting)
    assert eng.path.defers_store_gather
    pending = eng.issue_store([a, b])
    assert counting.calls == [] and pending.issued is None and not pending.read_done.is_set()
    assert client.usage()["reservations"] == 0  # nothing reserved on the forward thread
    for t in list(src.caches) + list(original.caches):  # written after the issue: the drain reads this
        t.mul_(-1.0)
    rep = on_thread(eng.complete_store, pending)
    assert counting.calls == [("maru-store-drain-test", 4)]  # one RESERVE, on the drain thread
    assert (rep.stored, rep.failed, rep.tokens) == (4, 0, 4 * CHUNK - 3) and pending.read_done.is_set()
    assert client.usage()["reservations"] == 0
    assert_published(client, a, original)
    assert_published(client, b, original)


def test_a_failed_reservation_fails_the_store_with_its_reason_and_publishes_nothing(
    client: MaruHandler,
) -> None:
    src = case("kv_first", "NHD", 42)
    req = request("deferred-failed", [2, 8, 5, 11], 2 * CHUNK)
    eng = pipelined(src, CountingAllocs(client, fail=True))
    pending = eng.issue_store([req])
    rep = on_thread(eng.complete_store, pending)
    assert (rep.stored, rep.failed) == (0, 2) and "pool full (test)" in (rep.error or "")
    assert pending.read_done.is_set()  # the blocks are free: nothing reads them any more
    assert client.exists([k.key for k in req.chunks]) == [False, False]
    assert client.usage()["reservations"] == 0


@pytest.mark.parametrize("barrier_first", [True, False])
def test_a_store_is_gathered_once_by_the_barrier_or_the_drain_whichever_comes_first(
    client: MaruHandler, barrier_first: bool
) -> None:
    src, original = case("kv_first", "NHD", 43), case("kv_first", "NHD", 43)
    req = request(f"deferred-once-{barrier_first}", [4, 6, 0, 9], 2 * CHUNK)
    counting = CountingAllocs(client)
    eng = pipelined(src, counting)
    pending = eng.issue_store([req])
    if barrier_first:
        assert eng.wait_store_read(pending, 5)  # a preemption: gathered here, on the forward thread
        assert pending.read_done.is_set() and len(counting.calls) == 1
        for t in src.caches:  # the blocks are reused at once: the published bytes must not change
            t.zero_()
        rep = on_thread(eng.complete_store, pending)
    else:
        rep = on_thread(eng.complete_store, pending)
        assert eng.wait_store_read(pending, 5)  # read already done: returns at once
    assert [n for _, n in counting.calls] == [2]  # one RESERVE, one gather, whoever ran it
    assert (rep.stored, rep.failed) == (2, 0)
    assert client.usage()["reservations"] == 0
    assert_published(client, req, original)
