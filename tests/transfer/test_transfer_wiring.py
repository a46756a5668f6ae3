"""``KVTransferEngine``'s wiring to ``kv_ops.device_pipeline.DevicePipeline`` (the GPU data path).

On CUDA caches the engine stores and loads through a ``TransferEngine``; on CPU caches it never
builds one. Without a GPU here, the wiring itself (one pipelined call per request, wait before
commit / before unpin, ``place_begin``/``place_end`` as -1 slots, aborts and failures) is driven
on CPU by handing the engine a CPU ``TransferEngine``: same code path, CPU placements. The same
scenario runs on CUDA in ``tests/gpu/test_transfer_engine_wiring_gpu.py``.

Reference: the plain engine (CPU: direct kv_ops; CUDA: the staged path) on an identical poisoned
cache, compared byte for byte over the whole storage, plus every placed token against the source.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from maru import kv_ops
from maru.client import MaruHandler
from maru.kv_ops.device_pipeline import DevicePipeline
from maru.kv_ops.testing import CacheCase, bits, make_cache, naive_token
from maru.transfer.engine import KVTransferEngine
from maru.transfer.paths import PipelinedPath
from maru.transfer.records import ChunkRef, RequestTransfer
from tests.pool_fixtures import module_client

client = module_client("wiring")


def make_case(physical: str, seed: int, geom: dict[str, Any]) -> CacheCase:
    g = torch.Generator().manual_seed(seed)
    return make_cache("kv_first", physical, generator=g, **geom)


def engine(case: CacheCase, client: Any, *, inject: bool = False, pipelined: bool = True) -> KVTransferEngine:
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    eng = KVTransferEngine(list(case.caches), layout, client, pipelined=pipelined)
    if inject:  # CPU only: drive the pipelined wiring with a CPU TransferEngine
        eng.path = PipelinedPath(DevicePipeline(list(case.caches), layout))
    return eng


def requests(tag: str, bs: int, chunk: int, num_blocks: int) -> tuple[RequestTransfer, RequestTransfer]:
    """Three full chunks and a partial tail (not block aligned); the load skips the first block
    (``place_begin``) and stops one token short of the tail's end (``place_end``)."""
    tail = bs // 2 + 1
    n = 3 * chunk + tail
    keys = [f"wiring/{tag}/c{i}" for i in range(4)]
    store = tuple(ChunkRef(keys[i], i * chunk, chunk) for i in range(3)) + (
        ChunkRef(keys[3], 3 * chunk, tail),
    )
    load = (
        (ChunkRef(keys[0], 0, chunk, place_begin=bs),)
        + store[1:3]
        + (ChunkRef(keys[3], 3 * chunk, tail, place_end=tail - 1),)
    )
    need = (n + bs - 1) // bs
    g = torch.Generator().manual_seed(len(tag) * 7919 + sum(map(ord, tag)))
    src = tuple(int(b) for b in torch.randperm(num_blocks, generator=g)[:need])
    dst = tuple(int(b) for b in torch.randperm(num_blocks, generator=g)[:need])
    return RequestTransfer("r-" + tag, src, store), RequestTransfer("r-" + tag, dst, load)


def placed_pairs(src: RequestTransfer, dst: RequestTransfer, bs: int) -> list[tuple[int, int]]:
    """(source slot, destination slot) of every token the load places."""
    out = []
    for c in dst.chunks:
        pb, pe = c.placed()
        for t in range(c.start + pb, c.start + pe):
            out.append((src.block_ids[t // bs] * bs + t % bs, dst.block_ids[t // bs] * bs + t % bs))
    return out


def spy(pipeline: Any, name: str) -> list[int]:
    """Record the number of chunk objects of every ``pipeline.<name>`` call."""
    calls: list[int] = []
    real = getattr(pipeline, name)

    def wrapped(objs: Any, slots: Any, **kw: Any) -> Any:
        calls.append(len(objs))
        return real(objs, slots, **kw)

    setattr(pipeline, name, wrapped)
    return calls


def same(a: CacheCase, b: CacheCase) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a.snapshot(), b.snapshot(), strict=True))


def check_round_trip(
    physical: str, client: MaruHandler, geom: dict[str, Any], chunk: int, *, inject: bool
) -> KVTransferEngine:
    """Store from one cache, load into a poisoned one; byte-exact against the reference engine."""
    bs = geom["block_size"]
    tag = f"{physical}-{geom['device']}-{'inj' if inject else 'own'}"
    src_req, dst_req = requests(tag, bs, chunk, geom["num_blocks"])
    src = make_case(physical, 1, geom)
    st = engine(src, client, inject=inject)
    stores = spy(st.path.pipeline, "store")
    rep = st.store([src_req])
    assert (rep.stored, rep.failed, rep.error) == (4, 0, None)
    assert stores == [4]  # one pipelined call for the step's four chunks

    from tests.transfer.test_transfer_datapath import CountingPins  # that module imports this one

    dst, ref = make_case(physical, 2, geom), make_case(physical, 2, geom)
    pins = CountingPins(client)
    eng = engine(dst, pins, inject=inject)
    loads = spy(eng.path.pipeline, "load")
    lrep = eng.load([dst_req])
    assert loads == [4]  # one pipelined call for the request
    assert lrep.loaded_req_ids == [dst_req.req_id] and not lrep.failed
    assert lrep.tokens == dst_req.num_placed_tokens() and lrep.chunks == 4
    assert pins.pinned == pins.released == 4

    # Reference: the engine's other path (CPU: kv_ops direct; CUDA: the staged copies).
    assert engine(ref, client, pipelined=False).load([dst_req]).loaded_req_ids == [dst_req.req_id]
    if geom["device"] == "cuda":
        torch.cuda.synchronize()
    assert same(dst, ref)  # placed tokens and every untouched byte
    n_kv = 2
    for s_src, s_dst in placed_pairs(src_req, dst_req, bs):
        for layer in range(geom["num_layers"]):
            for kv in range(n_kv):
                assert torch.equal(
                    bits(naive_token(dst, layer, kv, s_dst)), bits(naive_token(src, layer, kv, s_src))
                ), (s_src, s_dst, layer, kv)
    return eng


GEOM_CPU = dict(
    device="cpu", num_blocks=16, block_size=4, num_kv_heads=3, head_size=8, num_layers=3, dtype=torch.float32
)


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
    from tests.transfer.test_transfer_datapath import CountingPins

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
