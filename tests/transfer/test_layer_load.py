"""The layer-by-layer load (``maru_overlap_load_with_compute``): layer ``i`` placed before attention ``i``.

The engine's ``start_layer_load`` against the synchronous load, and the worker that waits per
layer, fails a request missing a chunk before the forward, and on CUDA caches issues one
``load_layers`` per step and unpins once it is ``done()`` (driven here on CPU caches with a CPU
``TransferEngine`` injected and ``Gated`` handles). Real server, real shared-memory pool; caches
built the way vLLM builds them (block size 4 != 3 heads, HND caches included).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from maru.client import MaruHandler
from maru.kv_ops.pool_objects import PoolObjects
from maru.transfer.records import RequestTransfer
from tests.helpers import ServerProcess, reported_slow
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.helpers import (
    BS,
    CHUNK,
    NAMES,
    CountingPins,
    Gated,
    MaruConnectorMetadata,
    case,
    inject_pipeline,
    layer_equal,
    needs_vllm,
    overlap_setup,
    plain_engine,
    request,
    same,
    slots_of,
    worker,
)

server = module_server("layer-load")
client = pool_client()


@pytest.mark.parametrize(
    "fmt,physical",
    [
        ("kv_first", "HND"),
        ("blocks_first", "HND"),
        ("cpu_attn", "NHD"),
        ("mla", "NHD"),
        ("cross_layer", "HND"),
    ],
)
def test_layer_by_layer_load_places_the_same_bytes_as_the_synchronous_load(
    fmt: str, physical: str, client: MaruHandler
) -> None:
    tag = f"layers-{fmt}-{physical}"
    src = case(fmt, physical, 1)
    n_tokens = 2 * CHUNK + BS  # two chunks and a one-block tail
    req = request(tag, [9, 3, 14, 0, 7], n_tokens)
    assert plain_engine(src, client).store([req]).stored == 3
    dreq = RequestTransfer(req.req_id, (2, 15, 6, 10, 1), req.chunks)
    ref, dst = case(fmt, physical, 2), case(fmt, physical, 2)
    assert plain_engine(ref, client).load([dreq]).loaded_req_ids == [req.req_id]

    pins = CountingPins(client)
    eng = plain_engine(dst, pins)
    before = case(fmt, physical, 2)
    ll = eng.start_layer_load(eng.pin([dreq]))
    # Where the issue's host time went: the pin, the lists, the path's issue; they add up to it.
    assert list(ll.report.phases) == ["pin", "prepare", "issue"]
    assert min(ll.report.phases.values()) >= 0
    assert abs(sum(ll.report.phases.values()) - ll.report.seconds) < 1e-9
    assert ll.report.phases_line().startswith("pin ") and ll.report.phases_line().endswith(" ms")
    rep = ll.wait()
    assert rep.loaded_req_ids == [req.req_id] and not rep.failed
    assert rep.tokens == n_tokens and rep.chunks == 3
    assert same(dst, ref) and not same(dst, before)
    assert pins.pinned == pins.released == 3


class _TorchPlacement:
    """A host placement that writes the cache with torch's in-place indexing, as the staged GPU path
    does (the CPU path writes through numpy, which torch's inference-tensor check does not see)."""

    def __init__(self, caches: list[torch.Tensor]) -> None:
        self.caches = caches

    def place_layer(self, obj: torch.Tensor, slots: torch.Tensor, layer: int) -> None:
        self.caches[layer][slots] = obj[layer]

    def sync(self) -> None:
        pass


@pytest.mark.parametrize("inference", [True, False], ids=["inference-mode", "grad-mode"])
def test_the_layer_thread_writes_caches_in_its_callers_autograd_mode(inference: bool) -> None:
    """vLLM makes its caches and runs its hooks under inference mode: the layer thread writes those
    inference tensors in place, which torch allows only inside inference mode (on every thread)."""
    from maru.transfer.handles import ThreadedLayerHandle

    layers, tokens, row = 3, 5, 8
    with torch.inference_mode(inference):
        caches = [torch.zeros(16, row) for _ in range(layers)]
        assert all(t.is_inference() == inference for t in caches)
        obj = torch.randn(layers, tokens, row)
        slots = torch.tensor([3, 9, 0, 14, 6])
        h = ThreadedLayerHandle(_TorchPlacement(caches), [[(obj, slots)]], layers)  # type: ignore[arg-type]
        h.wait()
    assert h.failed_items() == {}
    for i in range(layers):
        assert torch.equal(caches[i][slots], obj[i])


def test_wait_for_layer_returns_with_that_layer_placed_for_every_chunk(client: MaruHandler) -> None:
    src = case("kv_first", "HND", 3)
    req = request("layer-wait", [4, 1, 12, 7, 0, 9], 3 * CHUNK)
    plain_engine(src, client).store([req])
    dreq = RequestTransfer(req.req_id, (8, 2, 11, 5, 13, 3), req.chunks)
    ref = case("kv_first", "HND", 4)
    plain_engine(ref, client).load([dreq])
    dst = case("kv_first", "HND", 4)
    eng = plain_engine(dst, client)
    ll = eng.start_layer_load(eng.pin([dreq]))
    slots = slots_of(dreq, 3 * CHUNK)
    for layer in (2, 0, 1):  # any order: each wait covers its own layer only
        ll.wait_for_layer(layer)
        assert ll.layer_done(layer)
        assert layer_equal(dst, ref, layer, slots)
    ll.wait()
    assert same(dst, ref)


def test_requests_sharing_chunks_in_one_layer_step_place_what_the_chunk_load_places(
    client: MaruHandler,
) -> None:
    """A step's objects are made together (``KVTransferEngine._views_of``, one per pinned page): three
    requests share prefix chunks, each with its own blocks and placed range, beside one missing a
    chunk (failed alone). The layer-by-layer load leaves the caches byte for byte as the chunk load
    (its own objects and deferred slots) does, and every pin is released."""
    from maru.transfer.records import ChunkRef

    src = case("blocks_first", "HND", 41)
    a = request("layer-share-a", [0, 1, 2, 3, 4, 5], 3 * CHUNK)
    gone = request("layer-share-gone", [6, 7, 8, 9], 2 * CHUNK)
    assert plain_engine(src, client).store([a, gone]).stored == 5
    assert client.delete([gone.chunks[1].key]) == [True]
    k = a.chunks
    step = [
        RequestTransfer("sa", (9, 2, 7, 4, 11, 0), k),
        RequestTransfer(
            "sb", (5, 13, 1, 8), (ChunkRef(k[0].key, 0, CHUNK, BS), ChunkRef(k[1].key, CHUNK, CHUNK, 0, 3))
        ),
        RequestTransfer("sc", (12, 3, 10, 6), (k[0], ChunkRef(k[2].key, CHUNK, CHUNK, 1, CHUNK))),
        RequestTransfer("sgone", (14, 15, 16, 17), gone.chunks),
    ]
    ref, dst = case("blocks_first", "HND", 42), case("blocks_first", "HND", 42)
    rep_ref = plain_engine(ref, client).load(step)
    pins = CountingPins(client)
    eng = plain_engine(dst, pins)
    pinned = eng.pin(step)
    assert set(pinned.failed) == {"sgone"} and "gone" in pinned.failed["sgone"]
    rep = eng.start_layer_load(pinned).wait()
    assert sorted(rep.loaded_req_ids) == sorted(rep_ref.loaded_req_ids) == ["sa", "sb", "sc"]
    assert same(dst, ref) and not same(dst, case("blocks_first", "HND", 42))
    assert pins.pinned == pins.released and client.usage()["pinned"] == 0


def test_a_chunk_placing_nothing_between_placed_ones_is_left_out_of_the_layer_load(
    client: MaruHandler,
) -> None:
    """A request's mapping goes to the layer load whole (``ReadyRequest.placed``), except where a
    chunk places nothing: that chunk's object and slots are left out and the others keep theirs.
    A middle chunk placing nothing (its blocks never written), beside a request placing all: the
    caches equal the chunk load's, and the unplaced chunk's blocks keep their old bytes."""
    from maru.transfer.records import ChunkRef

    src = case("kv_first", "HND", 61)
    a = request("layer-hole-a", [0, 1, 2, 3, 4, 5], 3 * CHUNK)
    assert plain_engine(src, client).store([a]).stored == 3
    k = a.chunks
    hole = RequestTransfer(
        "hole",
        (9, 2, 7, 4, 11, 0),
        (
            ChunkRef(k[0].key, 0, CHUNK, 1),
            ChunkRef(k[1].key, CHUNK, CHUNK, 3, 3),
            ChunkRef(k[2].key, 2 * CHUNK, CHUNK),
        ),
    )
    step = [hole, RequestTransfer("whole", (5, 13, 1, 8, 12, 3), k)]
    ref, dst, old = (case("kv_first", "HND", 62) for _ in range(3))
    assert sorted(plain_engine(ref, client).load(step).loaded_req_ids) == ["hole", "whole"]
    eng = plain_engine(dst, client)
    pinned = eng.pin(step)
    group, hs = next(r for r in pinned.ready if r.req.req_id == "hole").placed()
    assert [h.key for h in hs] == [k[0].key, k[2].key] and group.tokens == [CHUNK, CHUNK]
    ids = hole.block_ids  # per token: its block's slot, -1 where not placed (chunk 0's first token)
    want = [-1] + [ids[t // BS] * BS + t % BS for t in range(1, CHUNK)]
    want += [ids[t // BS] * BS + t % BS for t in range(2 * CHUNK, 3 * CHUNK)]
    assert group.slots.tolist() == want
    rep = eng.start_layer_load(pinned).wait()
    assert sorted(rep.loaded_req_ids) == ["hole", "whole"]
    assert same(dst, ref) and not same(dst, old)
    assert client.usage()["pinned"] == 0


def test_step_objects_that_cannot_be_made_together_are_made_per_request_and_said_once(
    client: MaruHandler, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """If a step's objects cannot be made together (``_views_of``: not expected, the pages were
    bounds-checked), each request makes its own: the layer load places the same bytes, and the
    slower prep is announced once, with the reason."""
    from maru import announce
    from maru.transfer import engine as engine_module

    src = case("kv_first", "NHD", 71)
    a = request("step-objs-a", [0, 1, 2, 3], 2 * CHUNK)
    assert plain_engine(src, client).store([a]).stored == 2
    step = [RequestTransfer("so", (9, 2, 7, 4), a.chunks)]
    ref, dst = case("kv_first", "NHD", 72), case("kv_first", "NHD", 72)
    assert plain_engine(ref, client).load(step).loaded_req_ids == ["so"]

    def broken(*_: Any, **__: Any) -> Any:
        raise ValueError("made to fail")

    monkeypatch.setattr(engine_module.PoolObjects, "make", broken)
    announce.forget("transfer.step-objects")
    eng = plain_engine(dst, client)
    with caplog.at_level("WARNING", logger="maru.transfer"):
        for _ in range(2):
            rep = eng.start_layer_load(eng.pin(step)).wait()
            assert rep.loaded_req_ids == ["so"], rep.failed
    said = [r.getMessage() for r in caplog.records if "chunk objects together failed" in r.getMessage()]
    assert len(said) == 1 and "made to fail" in said[0]
    assert same(dst, ref) and client.usage()["pinned"] == 0
    announce.forget("transfer.step-objects")


def test_a_steps_objects_are_the_pinned_pages_themselves(client: MaruHandler) -> None:
    """``pin`` makes a step's objects by offset over one tensor of the pool (``read_tensor``): each
    is the very page its lookup pinned (its address and its bytes), shaped ``[L, KV, T, ROW]``
    contiguous; a key two requests share is one object."""
    src = case("kv_first", "NHD", 51)
    a = request("pages-a", [0, 1, 2, 3, 4, 5], 3 * CHUNK)
    assert plain_engine(src, client).store([a]).stored == 3
    b = RequestTransfer("pages-b", (9, 8, 7, 6), a.chunks[:2])
    eng = plain_engine(case("kv_first", "NHD", 52), client)
    pinned = eng.pin([a, b])
    try:
        assert not pinned.failed
        objs = {}
        for r in pinned.ready:
            assert len(r.objs) == len(r.handles) == len(r.req.chunks)
            assert r.nbytes == sum(len(h.view) for h in r.handles)
            for obj, h in zip(r.objs, r.handles, strict=True):
                page = torch.frombuffer(h.view, dtype=torch.uint8)
                assert obj.data_ptr() == page.data_ptr() and obj.is_contiguous()
                # A view of the one pool tensor (not a tensor of its own over the page's view).
                assert obj.untyped_storage().data_ptr() == client.pool_mapping.address
                assert obj.numel() * obj.element_size() == len(h.view)
                assert torch.equal(obj.reshape(-1).view(torch.uint8), page)
                objs.setdefault(h.key, []).append(obj)
        shared = objs[a.chunks[0].key]
        assert len(shared) == 2 and shared[0] is shared[1]
    finally:
        eng.release(pinned)
    assert client.usage()["pinned"] == 0


def test_layer_load_places_nothing_of_a_request_missing_a_chunk_and_unpins_everything(
    client: MaruHandler,
) -> None:
    src = case("blocks_first", "HND", 5)
    a = request("layer-miss-a", [0, 1, 2, 3, 4, 5], 3 * CHUNK)
    b = request("layer-miss-b", [6, 7, 8, 9], 2 * CHUNK)
    plain_engine(src, client).store([a, b])
    assert client.delete([a.chunks[2].key]) == [True]
    dst = case("blocks_first", "HND", 6)
    before = case("blocks_first", "HND", 6)
    pins = CountingPins(client)
    eng = plain_engine(dst, pins)
    pinned = eng.pin([a, b])
    assert set(pinned.failed) == {a.req_id} and "gone" in pinned.failed[a.req_id]
    rep = eng.start_layer_load(pinned).wait()
    assert rep.loaded_req_ids == [b.req_id] and a.req_id in rep.failed
    for layer in range(3):
        assert layer_equal(dst, before, layer, slots_of(a, 3 * CHUNK))  # nothing of a placed
        assert not layer_equal(dst, before, layer, slots_of(b, 2 * CHUNK))
    assert pins.pinned == pins.released == 4  # a's two present chunks were pinned and released too


def test_a_layer_that_fails_to_place_releases_every_waiter_and_reports_the_request(
    client: MaruHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = case("kv_first", "NHD", 7)
    req = request("layer-boom", [0, 1, 2, 3], 2 * CHUNK)
    plain_engine(src, client).store([req])
    pins = CountingPins(client)
    eng = plain_engine(case("kv_first", "NHD", 8), pins)
    real = eng.path.place_layer

    def place(obj: torch.Tensor, slots: torch.Tensor, layer: int) -> None:
        if layer == 1:
            raise RuntimeError("kernel fault")
        real(obj, slots, layer)

    monkeypatch.setattr(eng.path, "place_layer", place)
    ll = eng.start_layer_load(eng.pin([req]))
    ll.wait_for_layer(2)  # must not hang
    rep = ll.wait()
    assert rep.loaded_req_ids == [] and "kernel fault" in rep.failed[req.req_id]
    assert pins.pinned == pins.released == 2


def test_worker_overlap_load_waits_per_layer_and_reports_a_missing_chunk_after_the_forward(
    server: ServerProcess, client: MaruHandler
) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    src = case("kv_first", "HND", 13)
    ok = request("overlap-ok", [5, 9, 1, 3], 2 * CHUNK)
    bad = request("overlap-bad", [6, 7, 8, 10], 2 * CHUNK)
    plain_engine(src, client).store([ok, bad])
    assert client.delete([bad.chunks[0].key]) == [True]
    dok = RequestTransfer(ok.req_id, (0, 2, 4, 6), ok.chunks)
    dbad = RequestTransfer(bad.req_id, (11, 12, 13, 14), bad.chunks)
    ref = case("kv_first", "HND", 14)
    plain_engine(ref, client).load([dok])
    dst = case("kv_first", "HND", 14)
    w = worker(server, dst, overlap_load_with_compute=True)
    try:
        meta = MaruConnectorMetadata(loads=[dok, dbad])
        w.start_load_kv(meta)
        for i in range(3):  # what vLLM does before each attention layer
            w.wait_for_layer_load(NAMES[i])
            assert layer_equal(dst, ref, i, slots_of(dok, 2 * CHUNK))
        w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == {11, 12, 13, 14}
        assert same(dst, ref)
        assert (w.stats.overlap_loads, w.stats.loads, w.stats.load_errors) == (1, 1, 1)
        assert w.stats.layer_waits == 3
    finally:
        stop_worker(w)


def test_a_layer_loads_failures_are_in_the_errors_vllm_reads_before_wait_for_save(
    server: ServerProcess, client: MaruHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With a speculative decoder vLLM reads a step's load errors right after the forward and calls
    ``wait_for_save`` only after the drafter (0.32's V1 runner, 0.34's V2 runner): a layer that
    failed under the forward must be in that read, once."""
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    src = case("kv_first", "HND", 15)
    ok = request("finish-late", [5, 9, 1, 3], 2 * CHUNK)
    plain_engine(src, client).store([ok])
    dok = RequestTransfer(ok.req_id, (0, 2, 4, 6), ok.chunks)
    w = worker(server, case("kv_first", "HND", 16), overlap_load_with_compute=True)
    try:
        real = w.engine.path.place_layer

        def place(obj: torch.Tensor, slots: torch.Tensor, layer: int) -> None:
            if layer == 1:
                raise RuntimeError("kernel fault")
            real(obj, slots, layer)

        monkeypatch.setattr(w.engine.path, "place_layer", place)
        meta = MaruConnectorMetadata(loads=[dok])
        w.start_load_kv(meta)
        for i in range(3):
            w.wait_for_layer_load(NAMES[i])
        assert w.stats.load_errors == 0  # failed under the forward: not known before its end
        assert w.get_block_ids_with_load_errors() == set(dok.block_ids)  # read before wait_for_save
        w.wait_for_save(meta)  # after the drafter: nothing more to report
        assert w.get_block_ids_with_load_errors() == set() and w.stats.load_errors == 1
    finally:
        stop_worker(w)


@needs_vllm
def test_overlap_load_issues_one_load_layers_per_step_and_unpins_once_it_is_done(
    server: ServerProcess, client: MaruHandler
) -> None:
    w, ref, dst, before, dst_a, dbad = overlap_setup(server, client, "ovl-gated", 41)
    try:
        pins, _ = inject_pipeline(w)
        gate = threading.Event()
        calls: list[tuple[int, int]] = []
        made: list[int] = []
        real = w.engine.path.pipeline.load_layers

        def load_layers(objs: Any, slots: Any, **kw: Any) -> Gated:
            calls.append((len(objs), int((slots >= 0).sum())))
            # The objects over the pool tensor, none made yet (the direct issue reads addresses).
            made.append(sum(o is not None for o in objs._cache) if isinstance(objs, PoolObjects) else -1)
            return Gated(real(objs, slots, **kw), gate)

        w.engine.path.pipeline.load_layers = load_layers
        meta = MaruConnectorMetadata(loads=[dst_a, dbad])
        w.start_load_kv(meta)
        # One call for the step: the four chunks of the ready request, only its placed tokens as
        # slots; the request missing a chunk is failed before the forward and never issued.
        assert calls == [(4, dst_a.num_placed_tokens())] and made == [0]
        assert w.stats.load_errors == 1
        for name in NAMES:  # what vLLM does before each attention layer
            w.wait_for_layer_load(name)
        w.wait_for_save(meta)  # after the forward: no host wait for the load
        assert pins.pinned == 5 and pins.released == 0  # the transfer is not done: pins held
        assert w.get_finished(set()) == (None, None) and pins.released == 0
        gate.set()
        w.get_finished(set())
        assert pins.released == 5
        w.get_finished(set())
        assert pins.released == 5  # exactly once

        assert w.get_block_ids_with_load_errors() == set(dbad.block_ids)
        assert (w.stats.overlap_loads, w.stats.loads, w.stats.layer_waits) == (1, 1, 3)
        # Placed under the forward: its bytes count, but not toward the load rate (no load_seconds).
        assert w.stats.bytes_loaded == w.stats.bytes_loaded_under_forward > 0
        assert w.stats.load_seconds == 0.0
        assert same(dst, ref)  # a placed exactly, nothing of the failed request, every other byte kept
        skipped = [dst_a.block_ids[t // BS] * BS + t % BS for t in range(BS)]  # place_begin = BS
        tail = dst_a.chunks[-1]
        last = tail.start + tail.num_tokens - 1  # place_end stops one token short
        skipped.append(dst_a.block_ids[last // BS] * BS + last % BS)
        for layer in range(3):
            assert layer_equal(dst, before, layer, skipped)
            assert not layer_equal(dst, before, layer, slots_of(dst_a, 2 * CHUNK)[BS:])
    finally:
        stop_worker(w)


@needs_vllm
def test_overlap_load_failing_at_issue_fails_the_step_before_the_forward_and_releases_every_pin(
    server: ServerProcess, client: MaruHandler
) -> None:
    w, _, dst, before, dst_a, dbad = overlap_setup(server, client, "ovl-issue", 51)
    try:
        pins, settles = inject_pipeline(w)

        def broken(*a: Any, **kw: Any) -> Any:
            raise RuntimeError("injected issue failure")

        w.engine.path.pipeline.load_layers = broken
        meta = MaruConnectorMetadata(loads=[dst_a, dbad])
        w.start_load_kv(meta)
        assert w.stats.load_errors == 2 and settles  # both known before the forward runs
        for name in NAMES:
            w.wait_for_layer_load(name)  # nothing to wait for; must not raise
        w.wait_for_save(meta)
        w.get_finished(set())
        assert pins.pinned == pins.released == 5
        assert w.get_block_ids_with_load_errors() == dst_a.placed_block_ids(BS) | set(dbad.block_ids)
        assert w.stats.loads == 0
        assert same(dst, before)
    finally:
        stop_worker(w)


@needs_vllm
def test_overlap_load_on_cpu_caches_keeps_the_layerwise_thread(server: ServerProcess) -> None:
    from maru.transfer.handles import ThreadedLayerHandle
    from maru.transfer.loads import PinnedLoad

    w = worker(server, case("kv_first", "NHD", 61), overlap_load_with_compute=True)
    try:
        assert w.engine.path.pipeline is None
        ll = w.engine.start_layer_load(PinnedLoad())
        assert ll.handle is None and ll.wait().loaded_req_ids == []  # nothing to place: no thread
        assert isinstance(w.engine.path.scatter_layers([]), ThreadedLayerHandle)
    finally:
        stop_worker(w)


@needs_vllm
def test_overlap_worker_loads_a_full_graph_step_before_its_forward(
    server: ServerProcess, client: MaruHandler
) -> None:
    """vLLM replays a decode-shaped batch as one full CUDA graph, which skips the per-layer hook:
    the worker then loads the step synchronously in start_load_kv, every layer placed before it
    returns; the request missing a chunk is failed then too."""
    w, ref, dst, before, dst_a, dbad = overlap_setup(server, client, "ovl-full", 71)
    try:
        meta = MaruConnectorMetadata(loads=[dst_a, dbad])
        w.start_load_kv(meta, layer_hooks=False)
        assert same(dst, ref)  # placed before any forward could read it (no per-layer wait comes)
        assert w.get_block_ids_with_load_errors() == set(dbad.block_ids)
        assert (w.stats.overlap_full_graph_loads, w.stats.overlap_loads, w.stats.loads) == (1, 0, 1)
        w.wait_for_save(meta)
        w.get_finished(set())
        assert w.stats.layer_loads_unwaited == 0 and w.stats.load_errors == 1
        assert w.stats.bytes_loaded_under_forward == 0 < w.stats.bytes_loaded  # a load the step waited for
    finally:
        stop_worker(w)


@needs_vllm
@pytest.mark.parametrize("placed_by_then", [True, False], ids=["done", "still-running"])
def test_a_forward_that_never_waited_for_the_layer_load_fails_every_request_it_placed(
    server: ServerProcess, client: MaruHandler, caplog: pytest.LogCaptureFixture, placed_by_then: bool
) -> None:
    """The safety net under the forward-mode check: a layer load issued for a forward that then
    ran without calling wait_for_layer_load (a mode the check did not know) may have been read
    half placed. After the forward every request it placed is reported failed (vLLM discards that
    step's output of them), once loudly, and its pins still go exactly once."""
    w, _, _, _, dst_a, dbad = overlap_setup(server, client, f"ovl-unwaited-{placed_by_then}", 81)
    try:
        pins, _ = inject_pipeline(w)
        gate = threading.Event()
        if placed_by_then:
            gate.set()
        real = w.engine.path.pipeline.load_layers
        w.engine.path.pipeline.load_layers = lambda objs, slots, **kw: Gated(real(objs, slots, **kw), gate)
        meta = MaruConnectorMetadata(loads=[dst_a, dbad])
        w.start_load_kv(meta, layer_hooks=True)
        assert w.stats.load_errors == 1  # the missing chunk, known at issue
        with caplog.at_level("ERROR", logger="maru.vllm"):
            w.wait_for_save(meta)  # the forward ran and called no wait_for_layer_load
        assert w.get_block_ids_with_load_errors() == dst_a.placed_block_ids(BS) | set(dbad.block_ids)
        assert w.stats.layer_loads_unwaited == 1 and w.stats.load_errors == 2
        assert w.stats.tokens_loaded == 0 and w.stats.loads == 0  # nothing counted as loaded
        assert any("never called wait_for_layer_load" in r.getMessage() for r in caplog.records)
        # Reported to the server with its fix: maru stats and maru doctor show it.
        assert any(
            s.startswith("1 layer-by-layer loads") and "maru_overlap_load_with_compute=false" in s
            for slow in reported_slow(server).values()
            for s in slow
        )
        gate.set()
        w.get_finished(set())
        w.get_finished(set())
        assert pins.pinned == pins.released == 5
    finally:
        stop_worker(w)


@needs_vllm
@pytest.mark.parametrize("setting,layered", [(None, False), (True, True), (False, False)])
def test_the_default_loads_cpu_caches_before_the_forward_and_a_setting_is_kept(
    server: ServerProcess, client: MaruHandler, setting: bool | None, layered: bool
) -> None:
    """Unset, maru_overlap_load_with_compute is decided by the worker's data path: layer by layer
    where the device places the layers (the pipelined GPU path, tests/e2e/test_gpu_vllm_graphs_e2e.py),
    before the forward on CPU caches and the staged GPU path (a placing thread would compete with
    the forward); set, it is kept on either."""
    from maru.transfer.device_path import PipelinedPath
    from maru.transfer.paths import CpuPath, StagedPath

    assert PipelinedPath.places_layers_on_device and not StagedPath.places_layers_on_device
    assert not CpuPath.places_layers_on_device
    src = case("kv_first", "NHD", 91)
    req = request(f"auto-{setting}", [0, 1, 2, 3], 2 * CHUNK)
    plain_engine(src, client).store([req])
    ref = case("kv_first", "NHD", 92)
    plain_engine(ref, client).load([req])
    dst = case("kv_first", "NHD", 92)
    w = worker(server, dst, overlap_load_with_compute=setting)
    try:
        assert w.layer_overlap is layered and w.data_paths()["paths"]["layer_overlap"] == (
            "on" if layered else "off"
        )
        meta = MaruConnectorMetadata(loads=[req])
        w.start_load_kv(meta)
        for name in w.layer_names:
            w.wait_for_layer_load(name)
        w.wait_for_save(meta)
        assert same(dst, ref) and w.stats.loads == 1 and w.stats.overlap_loads == int(layered)
    finally:
        stop_worker(w)
