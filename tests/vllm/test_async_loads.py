"""``AsyncLoads`` (``maru_async_load`` on one worker): a batch whose lookup is not back within the wait
before the forward is issued after it (vLLM schedules the request a step later) and counted in
``async_issued_late``, once; a batch whose lookup is back in time is not.

Real server, real shared-memory pool, CPU caches (there the issue is the copy itself); the test
holds the worker engine's lookup back (a slow server round trip). The reference is the plain
synchronous load of the same requests into an identical cache, compared byte for byte.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.transfer.records import RequestTransfer
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.helpers import (
    CHUNK,
    MaruConnectorMetadata,
    case,
    plain_engine,
    request,
    same,
    until_finished,
    worker,
)

server = module_server("async-loads")
client = pool_client()


def test_a_batch_whose_lookup_misses_the_wait_is_counted_late_once_and_a_quick_one_is_not(
    server: ServerProcess, client: MaruHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    import maru.vllm.async_loads as async_loads_mod

    # Far above a lookup's round trip (~0.3 ms): a quick lookup is in time even on a loaded host.
    monkeypatch.setattr(async_loads_mod, "ASYNC_ISSUE_WAIT_S", 0.5)
    src = case("kv_first", "NHD", 71)
    stored = request("late", [5, 9, 1, 3], 2 * CHUNK)
    assert plain_engine(src, client).store([stored]).stored == 2
    blocks = [(0, 2, 4, 6), (7, 8, 10, 11), (12, 13, 14, 15), (1, 3, 5, 9)]
    quick, slow1, slow2, quick2 = (
        RequestTransfer(f"late-{i}", b, stored.chunks) for i, b in enumerate(blocks)
    )
    ref, dst = case("kv_first", "NHD", 72), case("kv_first", "NHD", 72)
    assert len(plain_engine(ref, client).load([quick, slow1, slow2, quick2]).loaded_req_ids) == 4
    w = worker(server, dst, async_load=True)
    try:
        answer = threading.Event()
        answer.set()
        real_look_up = w.engine.look_up

        def look_up(requests: Any) -> Any:  # the loader thread's round trip
            assert answer.wait(30)
            return real_look_up(requests)

        w.engine.look_up = look_up  # type: ignore[method-assign]

        w.start_load_kv(MaruConnectorMetadata(async_loads=[quick]))
        assert w.stats.async_issued_late == 0  # back in time: issued before the forward
        assert sum(len(x) for x in until_finished(w, {quick.req_id})) == 1

        answer.clear()  # the server is slow to answer from now on
        w.start_load_kv(MaruConnectorMetadata(async_loads=[slow1]))
        assert w.stats.async_issued_late == 1  # left for the get_finished after the forward
        w.start_load_kv(MaruConnectorMetadata(async_loads=[slow2]))  # the next step
        # Its own turn waits behind slow1's: late too; slow1's is not counted a second time.
        assert w.stats.async_issued_late == 2
        assert w.get_finished(set()) == (None, None)  # nothing looked up yet
        answer.set()
        seen = until_finished(w, {slow1.req_id, slow2.req_id})
        assert sum(len(x) for x in seen) == 2  # each reported exactly once
        assert w.stats.async_issued_late == 2

        w.start_load_kv(MaruConnectorMetadata(async_loads=[quick2]))
        assert w.stats.async_issued_late == 2  # back in time again
        assert sum(len(x) for x in until_finished(w, {quick2.req_id})) == 1

        loader = w.async_loads.loader
        assert loader is not None and loader.batches == 4
        assert (w.stats.async_loads, w.stats.async_load_failures, w.stats.loads) == (4, 0, 4)
        assert w.get_block_ids_with_load_errors() == set()
        assert same(dst, ref)  # every request placed exactly, nothing else touched
    finally:
        stop_worker(w)
