"""Reserving a store's objects ahead of its gather (``maru.transfer.reservations``).

The write-behind store's GPU path issues its gather on vLLM's forward thread and needs its pool
objects first; ``reserve_store`` makes them earlier (the worker, beside the forward) and
``issue_store(reservation=...)`` uses them. Real server and shared-memory pool; the pipelined
path runs on CPU caches (``DevicePipeline`` without a GPU). What must hold: the bytes published
are the cache's, each reserved object is used once or aborted (the server holds no reservation
afterwards), a chunk the reservation lacks is reserved then, a failed reservation fails the
store with its reason and publishes nothing.
"""

from __future__ import annotations

from typing import Any

from maru import kv_ops
from maru.client import MaruHandler
from maru.kv_ops.device_pipeline import DevicePipeline
from maru.kv_ops.testing import CacheCase
from maru.transfer.engine import KVTransferEngine
from maru.transfer.paths import PipelinedPath
from maru.transfer.records import RequestTransfer
from maru.transfer.stores import StoreReservation
from tests.pool_fixtures import module_server, pool_client
from tests.transfer.helpers import CHUNK, assert_loads_back, case, request

server = module_server("reservations")
client = pool_client()


def pipelined(src: CacheCase, client: MaruHandler) -> KVTransferEngine:
    layout = kv_ops.detect_layouts(src.caches, **src.detect_kwargs())
    eng = KVTransferEngine(list(src.caches), layout, client)
    eng.path = PipelinedPath(DevicePipeline(list(src.caches), layout))
    return eng


class CountingAllocs:
    """The client, counting its RESERVE round trips (objects per call)."""

    def __init__(self, real: MaruHandler) -> None:
        self.real, self.calls = real, []  # type: ignore[var-annotated]

    def batch_alloc(self, sizes: list[int]) -> Any:
        self.calls.append(len(sizes))
        return self.real.batch_alloc(sizes)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


def assert_published(client: MaruHandler, req: RequestTransfer, original: CacheCase) -> None:
    assert_loads_back(client, req, original, (11, 13, 8, 2, 10, 0)[: len(req.block_ids)])


def test_a_reservation_serves_the_store_without_a_round_trip_and_its_leftovers_are_aborted(
    client: MaruHandler,
) -> None:
    src, original = case("kv_first", "HND", 41), case("kv_first", "HND", 41)
    a = request("ahead-a", [3, 14, 6, 1], 2 * CHUNK)
    dropped = request("ahead-dropped", [7, 9, 4, 12], 2 * CHUNK - 3)  # reserved, then not stored
    c = request("ahead-c", [0, 5, 10], CHUNK + 2)  # stored, never reserved ahead
    eng = pipelined(src, client)
    res = eng.reserve_store([a, dropped])
    assert res.error is None and len(res.objects) == 4
    assert client.usage()["reservations"] == 4
    counting = CountingAllocs(client)
    eng.client = counting
    pending = eng.issue_store([a, c], res)
    assert counting.calls == [2]  # only c's two chunks needed a round trip on this thread
    assert res.objects == {} and len(pending.unused) == 2  # dropped's: for the drain to abort
    assert eng.wait_store_read(pending, 5)
    rep = eng.complete_store(pending)
    assert (rep.stored, rep.failed, rep.tokens) == (4, 0, 3 * CHUNK + 2)
    assert client.exists([k.key for k in a.chunks + c.chunks + dropped.chunks]) == [True] * 4 + [False] * 2
    assert client.usage()["reservations"] == 0  # every reserved object used or aborted
    assert_published(client, a, original)
    assert_published(client, c, original)


def test_a_reservation_that_failed_fails_the_store_with_its_reason_and_publishes_nothing(
    client: MaruHandler,
) -> None:
    src = case("kv_first", "NHD", 42)
    req = request("ahead-failed", [2, 8, 5, 11], 2 * CHUNK)
    eng = pipelined(src, client)
    spare = eng.reserve_store([request("ahead-spare", [1], CHUNK)])  # a leftover to abort too
    res = StoreReservation(objects=spare.objects, error="pool full (test)", server_lost=False)
    pending = eng.issue_store([req], res)
    assert pending.issued is None and pending.read_done.is_set()  # the blocks are free at once
    rep = eng.complete_store(pending)
    assert (rep.stored, rep.failed) == (0, 2) and "pool full (test)" in (rep.error or "")
    assert client.exists([k.key for k in req.chunks]) == [False, False]
    assert client.usage()["reservations"] == 0


def test_released_reservation_holds_nothing_and_a_store_without_one_reserves_itself(
    client: MaruHandler,
) -> None:
    src, original = case("kv_first", "NHD", 43), case("kv_first", "NHD", 43)
    req = request("ahead-released", [4, 6, 0, 9], 2 * CHUNK)
    eng = pipelined(src, client)
    res = eng.reserve_store([req])
    eng.release_reservation(res)
    assert res.objects == {} and client.usage()["reservations"] == 0
    pending = eng.issue_store([req])  # no reservation: one round trip here, as before
    assert eng.wait_store_read(pending, 5)
    assert eng.complete_store(pending).stored == 2
    assert_published(client, req, original)
