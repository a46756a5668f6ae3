"""The asynchronous load (``maru_async_load``): issued off the forward thread, reported once done.

The engine's ``start_load`` and the ``AsyncLoader``/``BackgroundRunner`` that run it, and the worker
that reports a request in ``finished_recving`` only once its transfer is ``done()``. On CUDA caches
the worker issues loads through ``kv_ops.device_pipeline.DevicePipeline`` and polls completion;
here the same worker code runs on CPU caches with a CPU ``TransferEngine`` injected as the engine's
pipeline, and transfers are wrapped in ``Gated`` handles whose completion the test controls (what a
slow GPU transfer looks like to the bookkeeping). Real server, real shared-memory pool; the
reference is the plain synchronous load on an identical cache, compared byte for byte.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.transfer.background import AsyncLoader, BackgroundRunner
from maru.transfer.records import RequestTransfer
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.helpers import (
    CHUNK,
    GEOM_CPU,
    CountingPins,
    Gated,
    MaruConnectorMetadata,
    case,
    check_connector_load,
    inject_pipeline,
    layer_equal,
    needs_vllm,
    plain_engine,
    request,
    same,
    slots_of,
    until,
    until_finished,
    worker,
)

server = module_server("async-load")
client = pool_client()


def loaded_reference(
    client: MaruHandler, req: RequestTransfer, blocks: tuple[int, ...], physical: str, seed: int
) -> tuple[RequestTransfer, Any, Any]:
    """``req`` (stored) aimed at ``blocks`` of a destination, the reference cache it loaded into
    synchronously, and an identical fresh destination: (request, reference, destination)."""
    dreq = RequestTransfer(req.req_id, blocks, req.chunks)
    ref = case("kv_first", physical, seed)
    assert plain_engine(ref, client).load([dreq]).loaded_req_ids == [req.req_id]
    return dreq, ref, case("kv_first", physical, seed)


@pytest.mark.parametrize("path", ["async", "layers"])
@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_connector_load_paths_round_trip_byte_exact_and_leave_skipped_slots_poisoned(
    path: str, physical: str, client: MaruHandler
) -> None:
    check_connector_load(path, physical, client, GEOM_CPU, CHUNK, inject=True)


def test_start_load_on_cpu_caches_is_complete_at_once_and_unpins_exactly_once(client: MaruHandler) -> None:
    src = case("cpu_attn", "NHD", 31)
    req = request("start-cpu", [5, 9, 1, 3], 2 * CHUNK)
    assert plain_engine(src, client).store([req]).stored == 2
    dreq = RequestTransfer(req.req_id, (0, 2, 4, 6), req.chunks)
    ref, dst = case("cpu_attn", "NHD", 32), case("cpu_attn", "NHD", 32)
    assert plain_engine(ref, client).load([dreq]).loaded_req_ids == [req.req_id]
    pins = CountingPins(client)
    load = plain_engine(dst, pins).start_load([dreq])
    assert load.done()  # placed synchronously on CPU: nothing left in flight
    assert same(dst, ref) and pins.released == 0
    rep = load.collect()
    assert rep.loaded_req_ids == [req.req_id] and (rep.chunks, rep.tokens) == (2, 2 * CHUNK)
    # Where the time went: each phase measured, none longer than the whole.
    assert {"lookup", "prepare", "issue", "wait"} <= set(rep.phases)
    assert all(0 <= v <= rep.seconds for v in rep.phases.values())
    load.release()
    load.release()
    assert pins.pinned == pins.released == 2


@needs_vllm
def test_async_load_reports_only_once_done_releases_pins_once_and_fails_a_transfer_failing_at_completion(
    server: ServerProcess, client: MaruHandler
) -> None:
    src = case("kv_first", "HND", 21)
    ok = request("gated-ok", [5, 9, 1, 3], 2 * CHUNK)
    bad = request("gated-bad", [6, 7, 8, 10], 2 * CHUNK)
    assert plain_engine(src, client).store([ok, bad]).stored == 4
    dok, ref, dst = loaded_reference(client, ok, (0, 2, 4, 6), "HND", 22)
    dbad = RequestTransfer(bad.req_id, (11, 12, 13, 14), bad.chunks)
    w = worker(server, dst, async_load=True)
    try:
        pins, settles = inject_pipeline(w)
        gate = threading.Event()
        issued: list[Gated] = []
        real = w.engine.path.pipeline.load

        issuers: set[int] = set()

        def load(objs: Any, slots: Any, **kw: Any) -> Gated:
            # One batch per step here, in step order: the second batch fails at completion.
            issuers.add(threading.get_ident())
            err = RuntimeError("injected device fault") if issued else None
            issued.append(Gated(real(objs, slots, **kw), gate, err))
            return issued[-1]

        def polled_until(cond: Any) -> None:  # vLLM calls get_finished every step
            until(lambda: w.get_finished(set()) == (None, None) and cond())

        w.engine.path.pipeline.load = load
        w.start_load_kv(MaruConnectorMetadata(async_loads=[dok]))
        polled_until(lambda: len(issued) == 1)
        w.start_load_kv(MaruConnectorMetadata(async_loads=[dbad]))  # the next step
        polled_until(lambda: len(issued) == 2)  # both in flight: nothing waited for the first
        # The loader thread only looked up; the copies were issued by the polling thread, which
        # holds the GIL already (on a GPU, a helper thread issuing them lost it on every CUDA call).
        assert issuers == {threading.get_ident()}
        for _ in range(3):  # vLLM polls every step; nothing is done yet
            assert w.get_finished(set()) == (None, None)
        assert w.get_block_ids_with_load_errors() == set()
        assert pins.pinned == 4 and pins.released == 0  # pins held while the transfers run
        assert all(g.waits == 0 for g in issued)

        gate.set()
        seen = until_finished(w, {ok.req_id, bad.req_id})
        assert sum(len(s) for s in seen) == 2  # each reported exactly once
        assert w.get_block_ids_with_load_errors() == set(dbad.block_ids)
        assert (w.stats.async_loads, w.stats.async_load_failures, w.stats.loads) == (2, 1, 1)
        assert settles  # the failed transfer's streams were drained before its pins went
        assert w.async_loads.loader.drain(10) == []  # the unpins run on the loader thread
        assert pins.pinned == pins.released == 4
        assert w.get_finished(set()) == (None, None)
        assert pins.released == 4  # never twice
        for layer in range(3):
            assert layer_equal(dst, ref, layer, slots_of(dok, 2 * CHUNK))
    finally:
        stop_worker(w)


@pytest.mark.parametrize("lookup_s", [0.0, 0.3])
def test_async_load_is_issued_before_the_forward_when_its_lookup_is_back_in_time(
    server: ServerProcess, client: MaruHandler, monkeypatch: pytest.MonkeyPatch, lookup_s: float
) -> None:
    """start_load_kv issues the batch itself (its copies run under the step's forward) unless the
    lookup takes longer than ``ASYNC_ISSUE_WAIT_S``; then the next get_finished issues it."""
    import time

    import maru.vllm.async_loads as async_loads_mod

    monkeypatch.setattr(async_loads_mod, "ASYNC_ISSUE_WAIT_S", 0.1)
    src = case("kv_first", "NHD", 24)
    req = request(f"early-{lookup_s}", [5, 9, 1, 3], 2 * CHUNK)
    assert plain_engine(src, client).store([req]).stored == 2
    dst_req, ref, dst = loaded_reference(client, req, (0, 2, 4, 6), "NHD", 25)
    w = worker(server, dst, async_load=True)
    try:
        inject_pipeline(w)
        real_look_up = w.engine.look_up

        def slow_look_up(requests: Any) -> Any:
            time.sleep(lookup_s)
            return real_look_up(requests)

        w.engine.look_up = slow_look_up  # type: ignore[method-assign]
        issued: list[int] = []
        real = w.engine.path.pipeline.load

        def load(objs: Any, slots: Any, **kw: Any) -> Any:
            issued.append(threading.get_ident())
            return real(objs, slots, **kw)

        w.engine.path.pipeline.load = load
        w.start_load_kv(MaruConnectorMetadata(async_loads=[dst_req]))
        early = lookup_s < 0.1
        assert len(issued) == (1 if early else 0), "issued before the forward only if the lookup was back"
        seen = until_finished(w, {req.req_id})
        assert sum(len(x) for x in seen) == 1 and issued == [threading.get_ident()]  # once, this thread
        assert w.get_block_ids_with_load_errors() == set()
        for layer in range(3):
            assert layer_equal(dst, ref, layer, slots_of(dst_req, 2 * CHUNK))
    finally:
        stop_worker(w)


@needs_vllm
def test_async_load_without_a_server_fails_the_request_without_a_lookup(
    server: ServerProcess, client: MaruHandler
) -> None:
    req = request("async-off", [0, 1, 2, 3], 2 * CHUNK)
    w = worker(server, case("kv_first", "NHD", 23), async_load=True, enable_load=False)
    try:
        w.start_load_kv(MaruConnectorMetadata(async_loads=[req]))
        assert w.get_finished(set()) == (None, {req.req_id})
        assert w.get_block_ids_with_load_errors() == set(req.block_ids)
    finally:
        stop_worker(w)


@pytest.mark.parametrize("fails_in", ["look_up", "issue_load"])
def test_async_loader_turns_an_exception_at_issue_into_a_failed_request_never_a_lost_one(
    fails_in: str,
) -> None:
    from maru.transfer.loads import LookedUp
    from maru.transfer.records import LoadReport

    class Broken:
        def look_up(self, requests: Any) -> LookedUp:
            if fails_in == "look_up":
                raise RuntimeError("injected bug at issue")
            return LookedUp(list(requests), LoadReport(), {}, [], 0.0)

        def issue_load(self, looked: LookedUp) -> Any:
            raise RuntimeError("injected bug at issue")

    req = request("loader-bug", [0, 1, 2, 3], 2 * CHUNK)
    loader = AsyncLoader("test-loader")
    loader.submit("tag", Broken(), [req])  # type: ignore[arg-type]
    out = loader.close(timeout=10)
    assert [t for t, _ in out] == [["tag"]] and len(loader) == 0
    rep = out[0][1]
    assert rep.loaded_req_ids == [] and "injected bug at issue" in rep.failed[req.req_id]


def test_background_runner_returns_results_and_exceptions_in_order() -> None:
    r = BackgroundRunner("test-runner")
    r.submit("a", lambda: 1)
    r.submit("b", lambda: 1 / 0)
    out = r.close(timeout=5)
    assert [t for t, _ in out] == ["a", "b"]
    assert out[0][1] == 1 and isinstance(out[1][1], ZeroDivisionError)


def test_worker_async_load_reports_finished_after_placing_and_fails_whole_on_a_missing_chunk(
    server: ServerProcess, client: MaruHandler
) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    src = case("blocks_first", "HND", 11)
    ok = request("async-ok", [5, 9, 1, 3], 2 * CHUNK)
    bad = request("async-bad", [6, 7, 8, 10], 2 * CHUNK)
    plain_engine(src, client).store([ok, bad])
    assert client.delete([bad.chunks[1].key]) == [True]
    ref = case("blocks_first", "HND", 12)
    dok = RequestTransfer(ok.req_id, (0, 2, 4, 6), ok.chunks)
    plain_engine(ref, client).load([dok])
    dst, before = case("blocks_first", "HND", 12), case("blocks_first", "HND", 12)
    dbad = RequestTransfer(bad.req_id, (11, 12, 13, 14), bad.chunks)
    w = worker(server, dst, async_load=True)
    try:
        w.start_load_kv(MaruConnectorMetadata(async_loads=[dok, dbad]))
        seen = until_finished(w, {ok.req_id, bad.req_id})
        assert sum(len(s) for s in seen) == 2  # each reported exactly once
        assert w.get_block_ids_with_load_errors() == {11, 12, 13, 14}
        assert same(dst, ref)  # ok placed exactly; nothing of bad placed (ref never had it)
        assert not same(dst, before)
        assert (w.stats.async_loads, w.stats.async_load_failures, w.stats.loads) == (2, 1, 1)
    finally:
        stop_worker(w)
