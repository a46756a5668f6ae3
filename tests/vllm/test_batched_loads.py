"""A step's loads are one batch: one lookup-and-pin round trip for every request, one placement issue,
all or nothing per request; the asynchronous loader batches concurrent requests the same way.

Real server, real shared-memory pool, CPU caches; the worker's client is wrapped to count its
LOOKUP round trips (``CountingPins``). Each loaded token is compared with its source token.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.kv_ops.testing import CacheCase, naive_token
from maru.transfer.records import RequestTransfer
from tests.pool_fixtures import module_server, stop_worker
from tests.transfer.helpers import BS, CHUNK, CountingPins, bits_equal, case, counting_worker, request

pytest.importorskip("vllm")

from maru.vllm.metadata import MaruConnectorMetadata  # noqa: E402
from maru.vllm.worker import MaruWorkerConnector  # noqa: E402

server = module_server("batched-loads")


def _worker(srv: Any, case: CacheCase, **cfg: Any) -> tuple[MaruWorkerConnector, list[CountingPins]]:
    return counting_worker(srv, case, **cfg)


def _stored_requests(srv: Any, tag: str, n: int) -> tuple[CacheCase, list[RequestTransfer]]:
    """``n`` requests of two chunks each, stored from a source cache (disjoint blocks)."""
    src = case("blocks_first", "HND", 31)
    reqs = [request(f"{tag}-{i}", [2 * i, 2 * i + 1, 2 * i + 8, 2 * i + 9], 2 * CHUNK) for i in range(n)]
    w, _ = _worker(srv, src)
    try:
        w.wait_for_save(MaruConnectorMetadata(stores=reqs))
        w.flush_stores()  # write-behind (the default): published once drained
        assert w.stats.chunks_stored == 2 * n
    finally:
        stop_worker(w)
    return src, reqs


def _moved(req: RequestTransfer) -> RequestTransfer:
    """The same chunks under another block table (blocks 0..15 reversed)."""
    return RequestTransfer(req.req_id, tuple(15 - b for b in req.block_ids), req.chunks)


def _placed_like_source(src: CacheCase, dst: CacheCase, a: RequestTransfer, b: RequestTransfer) -> bool:
    for t in range(2 * CHUNK):
        s1, s2 = a.block_ids[t // BS] * BS + t % BS, b.block_ids[t // BS] * BS + t % BS
        for layer in range(3):
            for kv in (0, 1):
                if not bits_equal(naive_token(dst, layer, kv, s2), naive_token(src, layer, kv, s1)):
                    return False
    return True


def test_a_step_of_concurrent_loads_is_one_lookup_and_a_missing_chunk_fails_only_its_request(
    server: Any,
) -> None:
    src, reqs = _stored_requests(server, "sync", 4)
    h = MaruHandler(server.url, timeout_s=5)
    try:  # evicted between the scheduler's probe and the worker's lookup
        assert h.delete([reqs[2].chunks[1].key]) == [True]
    finally:
        h.close()
    dst = case("blocks_first", "HND", 32)
    w, clients = _worker(server, dst)
    try:
        loads = [_moved(r) for r in reqs]
        w.start_load_kv(MaruConnectorMetadata(loads=loads))
        assert clients[0].lookups == 1  # one LOOKUP round trip for the four requests
        assert w.get_block_ids_with_load_errors() == set(loads[2].block_ids)
        assert clients[0].pinned == clients[0].released == 7
        for i in (0, 1, 3):
            assert _placed_like_source(src, dst, reqs[i], loads[i])
        assert w.stats.loads == 3 and w.stats.chunks_loaded == 6
    finally:
        stop_worker(w)


def test_the_async_loader_loads_the_requests_of_a_step_as_one_batch(server: Any) -> None:
    src, reqs = _stored_requests(server, "async", 4)
    h = MaruHandler(server.url, timeout_s=5)
    try:
        assert h.delete([reqs[1].chunks[0].key]) == [True]
    finally:
        h.close()
    dst = case("blocks_first", "HND", 33)
    w, clients = _worker(server, dst, async_load=True)
    try:
        loads = [_moved(r) for r in reqs]
        w.start_load_kv(MaruConnectorMetadata(async_loads=loads))
        finished: set[str] = set()
        deadline = time.monotonic() + 30
        while len(finished) < 4 and time.monotonic() < deadline:
            finished |= w.get_finished()[1] or set()
            time.sleep(0.005)
        assert finished == {r.req_id for r in reqs}
        loader = w.async_loads.loader
        assert loader is not None and loader.batches == 1 and clients[0].lookups == 1
        assert w.get_block_ids_with_load_errors() == set(loads[1].block_ids)
        for i in (0, 2, 3):
            assert _placed_like_source(src, dst, reqs[i], loads[i])
        assert loader.drain(10) == []  # unpins run on the loader thread
        assert clients[0].pinned == clients[0].released == 7
    finally:
        stop_worker(w)


def test_a_chunk_that_fails_to_place_fails_only_its_request_in_the_batch(server: Any) -> None:
    src, reqs = _stored_requests(server, "place", 2)
    dst = case("blocks_first", "HND", 34)
    w, clients = _worker(server, dst)
    try:
        bad = RequestTransfer(reqs[1].req_id, (10, 11, 12, 99), reqs[1].chunks)  # no block 99
        loads = [_moved(reqs[0]), bad]
        w.start_load_kv(MaruConnectorMetadata(loads=loads))
        assert w.get_block_ids_with_load_errors() == set(bad.block_ids)
        assert _placed_like_source(src, dst, reqs[0], loads[0])
        assert clients[0].lookups == 1 and clients[0].pinned == clients[0].released == 4
    finally:
        stop_worker(w)
