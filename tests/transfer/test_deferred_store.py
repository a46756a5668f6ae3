"""The write-behind store (``maru_async_store``) at the engine and worker level.

``prepare_store`` gathers on the forward thread and publishes nothing until ``commit_store``; the
worker commits on its drain thread. Real server, real shared-memory pool; the connector-level
behaviour (finished reporting, preemption, shutdown) is in ``tests/vllm/test_write_behind.py``.
"""

from __future__ import annotations

import pytest

from maru.client import MaruHandler
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.helpers import (
    CHUNK,
    assert_loads_back,
    case,
    plain_engine,
    request,
    worker,
)

server = module_server("deferred-store")
client = pool_client()


def test_prepared_store_is_invisible_until_committed_and_independent_of_later_cache_writes(
    client: MaruHandler,
) -> None:
    src = case("cpu_attn", "NHD", 9)
    original = case("cpu_attn", "NHD", 9)
    req = request("write-behind", [5, 9, 1, 3], 2 * CHUNK)
    eng = plain_engine(src, client)
    prep = eng.prepare_store([req])
    assert len(prep.keys) == 2 and prep.report.failed == 0
    assert client.exists([c.key for c in req.chunks]) == [False, False]
    for t in src.caches:  # vLLM reuses the blocks right after the gather
        t.fill_(-7.0)
    rep = eng.commit_store(prep)
    assert (rep.stored, rep.failed, rep.tokens) == (2, 0, 2 * CHUNK)
    assert client.exists([c.key for c in req.chunks]) == [True, True]
    assert_loads_back(client, req, original, (0, 2, 4, 6), seed=10)


def test_worker_write_behind_store_commits_on_the_drain_thread(
    server: ServerProcess, client: MaruHandler
) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    src = case("kv_first", "NHD", 15)
    req = request("drain", [5, 9, 1, 3], 2 * CHUNK)
    w = worker(server, src, async_store=True)
    try:
        w.wait_for_save(MaruConnectorMetadata(stores=[req]))
        w.flush_stores()
        # The store drained: the finished request's blocks may go (tests/test_write_behind.py has more).
        assert w.get_finished({req.req_id}) == ({req.req_id}, None)
        assert client.exists([c.key for c in req.chunks]) == [True, True]
        assert (w.stats.deferred_commits, w.stats.chunks_stored, w.stats.store_failures) == (1, 2, 0)
        w.wait_for_save(MaruConnectorMetadata(stores=[req]))  # the same chunks again: present
    finally:
        stop_worker(w)  # drains the second commit
    assert w.stats.chunks_present == 2
