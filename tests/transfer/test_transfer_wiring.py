"""``KVTransferEngine``'s wiring to ``kv_ops.device_pipeline.DevicePipeline`` (the GPU data path).

On CUDA caches the engine stores and loads through a ``TransferEngine``; on CPU caches it never
builds one. Without a GPU here, the wiring itself (one pipelined call per request, wait before
commit / before unpin, ``place_begin``/``place_end`` as -1 slots, aborts and failures) is driven
on CPU by handing the engine a CPU ``TransferEngine``: same code path, CPU placements. The same
scenario (``tests/transfer/helpers.py::check_round_trip``) runs on CUDA in
``tests/transfer/test_transfer_engine_wiring_gpu.py``.

Reference: the plain engine (CPU: direct kv_ops; CUDA: the staged path) on an identical poisoned
cache, compared byte for byte over the whole storage, plus every placed token against the source.
"""

from __future__ import annotations

from typing import Any

import pytest

from maru.client import MaruHandler
from maru.transfer.records import RequestTransfer
from tests.pool_fixtures import module_client
from tests.transfer.helpers import GEOM_CPU, CountingPins, check_round_trip, engine, make_case, requests, same

client = module_client("wiring")


def test_cpu_caches_never_build_a_transfer_engine(client: MaruHandler) -> None:
    eng = engine(make_case("NHD", 1, GEOM_CPU), client)
    assert eng.data_path == "cpu" and eng.path.pipeline is None and eng.host_registration is None


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_pipelined_wiring_round_trips_skip_and_partial_tail_byte_exact(
    physical: str, client: MaruHandler
) -> None:
    check_round_trip(physical, client, GEOM_CPU, 8, inject=True)


def test_pipelined_load_issues_one_call_for_every_request_and_an_issue_failure_fails_them_all(
    client: MaruHandler,
) -> None:
    src_a, dst_a = requests("issue-a", 4, 8, 16)
    src_b, dst_b = requests("issue-b", 4, 8, 16)
    assert engine(make_case("NHD", 1, GEOM_CPU), client, inject=True).store([src_a, src_b]).stored == 8
    n = len(dst_a.block_ids)  # disjoint blocks, so both requests' tokens can be checked
    dst_a = RequestTransfer(dst_a.req_id, tuple(range(n)), dst_a.chunks)
    dst_b = RequestTransfer(dst_b.req_id, tuple(range(8, 8 + n)), dst_b.chunks)
    dst = make_case("NHD", 2, GEOM_CPU)
    pins = CountingPins(client)
    eng = engine(dst, pins, inject=True)
    real_load = eng.path.pipeline.load
    calls = []

    def flaky(objs: Any, slots: Any, **kw: Any) -> Any:
        calls.append(len(objs))
        if len(calls) == 2:
            raise RuntimeError("injected issue failure")
        return real_load(objs, slots, **kw)

    eng.path.pipeline.load = flaky
    rep = eng.load([dst_a, dst_b])
    assert calls == [8] and pins.lookups == 1  # one lookup, one placement call for the step
    assert sorted(rep.loaded_req_ids) == sorted([dst_a.req_id, dst_b.req_id]) and not rep.failed
    ref = make_case("NHD", 2, GEOM_CPU)
    engine(ref, client).load([dst_a, dst_b])
    assert same(dst, ref)
    rep = eng.load([dst_a, dst_b])  # the second call fails at issue: both requests fail
    assert not rep.loaded_req_ids
    assert all("injected issue failure" in rep.failed[r.req_id] for r in (dst_a, dst_b))
    assert pins.pinned == pins.released == 16


def test_pipelined_store_failure_publishes_nothing_and_does_not_raise(client: MaruHandler) -> None:
    src_req, _ = requests("store-fail", 4, 8, 16)
    eng = engine(make_case("HND", 1, GEOM_CPU), client, inject=True)

    def broken(*a: Any, **kw: Any) -> Any:
        raise RuntimeError("injected copy failure")

    eng.path.pipeline.store = broken
    rep = eng.store([src_req])
    assert (rep.stored, rep.failed) == (0, 4) and "injected copy failure" in (rep.error or "")
    handles = client.batch_retrieve([c.key for c in src_req.chunks], pin=True)
    try:
        assert all(h is None for h in handles)
    finally:
        client.batch_release(handles)
