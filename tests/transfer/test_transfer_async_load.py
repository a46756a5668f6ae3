"""Non-blocking asynchronous load and the pipelined layer-overlap load, without a GPU.

On CUDA caches the worker issues loads through ``kv_ops.device_pipeline.DevicePipeline`` and polls their
completion instead of waiting: the asynchronous load (``maru_async_load``) reports a request in
``finished_recving`` only once its transfer is ``done()``, and the layer-overlap load
(``maru_overlap_load_with_compute``) issues one ``load_layers`` per step and unpins once it is
``done()``. Here the same worker code runs on CPU caches with a CPU ``TransferEngine`` injected as
the engine's pipeline (it places at issue, like the CUDA engine's bytes once complete), and the
transfers are wrapped in ``Gated`` handles whose completion the test controls: that is what a slow
GPU transfer looks like to the bookkeeping. Real server, real shared-memory pool; the reference
is the plain synchronous load on an identical cache, compared byte for byte.
"""

from __future__ import annotations

import importlib.util
import threading
import time
from typing import Any

import pytest
import torch

from maru import kv_ops
from maru.client import MaruHandler
from maru.kv_ops.device_pipeline import DevicePipeline
from maru.kv_ops.testing import CacheCase, bits
from maru.transfer.background import AsyncLoader
from maru.transfer.paths import PipelinedPath
from maru.transfer.records import RequestTransfer
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.test_transfer import BS, CHUNK, _request
from tests.transfer.test_transfer_datapath import (
    NAMES,
    CountingPins,
    _case,
    _engine,
    _layer_equal,
    _same,
    _slots,
    _until_finished,
    _worker,
)
from tests.transfer.test_transfer_wiring import (
    GEOM_CPU,
    engine,
    make_case,
    placed_pairs,
    requests,
    same,
    spy,
)

POISON = 0x5A  # every byte of a fresh destination cache: an unwritten slot keeps it


def poison(case: CacheCase) -> None:
    for st in case.storages():
        bits(st).view(torch.uint8).fill_(POISON)


def _gather(case: CacheCase, slots: list[int]) -> torch.Tensor:
    """The KV of ``slots``, every layer, through kv_ops's reference kernels (an independent reader)."""
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    s = torch.tensor(slots, dtype=torch.int64, device=case.layer_tensors()[0].device)
    return bits(kv_ops.gather(case.caches, layout, s, backend="reference"))


def check_connector_load(
    path: str, physical: str, client: MaruHandler, geom: dict[str, Any], chunk: int, *, inject: bool
) -> None:
    """Store three chunks and a partial tail, load them into a fresh poisoned cache through the
    connector's CUDA load path ``path`` and check the bytes.

    ``"async"``: ``AsyncLoader`` (issue on its thread, completion polled, unpin on its thread);
    ``"layers"``: one ``load_layers`` through ``PipelinedLayerLoad``, every layer waited for. The
    load skips the first block (``place_begin``) and stops one token short of the tail
    (``place_end``). Checks: one pipelined call for the four chunks; every pin released once; the
    whole storage equals the plain engine's load (CPU: direct kv_ops; CUDA: staged) into an
    identical poisoned cache; every placed token equals its source token; the skipped slots are
    still poison. ``inject``: CPU caches, a CPU ``TransferEngine`` as the pipeline.
    """
    bs, cuda = geom["block_size"], geom["device"] == "cuda"
    tag = f"conn-{path}-{physical}-{geom['device']}"
    src_req, dst_req = requests(tag, bs, chunk, geom["num_blocks"])
    src = make_case(physical, 1, geom)
    assert engine(src, client, inject=inject).store([src_req]).stored == 4
    dst, ref = make_case(physical, 2, geom), make_case(physical, 2, geom)
    poison(dst)
    poison(ref)
    pins = CountingPins(client)
    eng = engine(dst, pins, inject=inject)
    assert eng.path.pipeline is not None
    if path == "async":
        calls = spy(eng.path.pipeline, "load")
        loader = AsyncLoader("test-loader")
        loader.submit("t", eng, [dst_req])
        got: list[tuple[Any, Any]] = []
        deadline = time.monotonic() + 60
        while not got and time.monotonic() < deadline:
            got = loader.poll()  # never blocks: reports the load once its transfer is done()
            time.sleep(0.001)
        got += loader.close(timeout=60)
        assert [t for t, _ in got] == [["t"]]
        rep = got[0][1]
    else:
        calls = spy(eng.path.pipeline, "load_layers")
        pinned = eng.pin([dst_req])
        assert not pinned.failed
        ll = eng.start_layer_load(pinned)
        assert not ll.report.failed  # issued on the pipelined path without error
        for layer in range(geom["num_layers"]):
            ll.wait_for_layer(layer)  # on CUDA: the current stream waits; the host does not
        ll.wait_all()
        rep = ll.wait()
        assert ll.done()
    assert calls == [4]  # one call for the request's four chunks
    assert rep.loaded_req_ids == [dst_req.req_id] and not rep.failed
    assert rep.tokens == dst_req.num_placed_tokens() and rep.chunks == 4
    assert pins.pinned == pins.released == 4
    assert engine(ref, client, pipelined=False).load([dst_req]).loaded_req_ids == [dst_req.req_id]
    if cuda:
        torch.cuda.synchronize()
    assert same(dst, ref)
    pairs = placed_pairs(src_req, dst_req, bs)
    assert torch.equal(_gather(dst, [d for _, d in pairs]), _gather(src, [s for s, _ in pairs]))
    tail = dst_req.chunks[-1]
    last = tail.start + tail.num_tokens - 1
    skipped = [dst_req.block_ids[t // bs] * bs + t % bs for t in [*range(bs), last]]
    assert bool((_gather(dst, skipped).view(torch.uint8) == POISON).all())


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="the worker connector needs vLLM"
)


def MaruConnectorMetadata(**kw: Any) -> Any:  # noqa: N802 (stands for the class)
    """The worker's step metadata (vLLM's connector metadata: skips where vLLM is not installed,
    so that ``check_connector_load`` stays importable from the GPU suite)."""
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata as Meta

    return Meta(**kw)


@pytest.mark.parametrize("path", ["async", "layers"])
@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_connector_load_paths_round_trip_byte_exact_and_leave_skipped_slots_poisoned(
    path: str, physical: str, client: MaruHandler
) -> None:
    check_connector_load(path, physical, client, GEOM_CPU, CHUNK, inject=True)


server = module_server("async-load")
client = pool_client()


class Gated:
    """A transfer handle whose completion the test controls: ``done()`` is False until ``gate`` is
    set; then it completes, or raises ``error`` (a transfer failing on the device). ``wait()``
    before the gate opens is a test failure (the worker must never block on a running transfer)."""

    def __init__(self, inner: Any, gate: threading.Event, error: Exception | None = None) -> None:
        self.inner = inner
        self.gate = gate
        self.error = error
        self.waits = 0

    def done(self) -> bool:
        if not self.gate.is_set():
            return False
        if self.error is not None:
            raise self.error
        return bool(self.inner.done())

    def wait(self) -> None:
        self.waits += 1
        if not self.gate.wait(timeout=10):
            raise AssertionError("wait() on a transfer that is not done: the caller blocked on it")
        if self.error is not None:
            raise self.error
        self.inner.wait()

    def wait_on(self, stream: Any = None) -> None:
        self.inner.wait_on(stream)

    def checksums(self) -> Any:
        return self.inner.checksums()

    def wait_for_layer(self, layer: int, stream: Any = None) -> None:
        self.inner.wait_for_layer(layer, stream)

    def layer_done(self, layer: int) -> bool:
        return self.gate.is_set() and bool(self.inner.layer_done(layer))


def _inject(w: Any) -> tuple[CountingPins, list[int]]:
    """Give the worker's engine a CPU ``TransferEngine`` (the CUDA code path) and count its pins
    and settles (``_settle``: drain the engine's streams after a failed transfer)."""
    eng = w.engine
    eng.path = PipelinedPath(DevicePipeline(eng.caches, eng.layout))
    pins = CountingPins(eng.client)
    eng.client = pins
    settles: list[int] = []
    real = eng.path.settle

    def settle() -> None:
        settles.append(1)
        real()

    eng.path.settle = settle
    return pins, settles


def _until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def _blocks_outside(used: tuple[int, ...], n: int, num_blocks: int = 16) -> tuple[int, ...]:
    return tuple(b for b in range(num_blocks) if b not in used)[:n]


def test_start_load_on_cpu_caches_is_complete_at_once_and_unpins_exactly_once(client: MaruHandler) -> None:
    src = _case("cpu_attn", "NHD", 31)
    req = _request("start-cpu", [5, 9, 1, 3], 2 * CHUNK)
    assert _engine(src, client).store([req]).stored == 2
    dreq = RequestTransfer(req.req_id, (0, 2, 4, 6), req.chunks)
    ref, dst = _case("cpu_attn", "NHD", 32), _case("cpu_attn", "NHD", 32)
    assert _engine(ref, client).load([dreq]).loaded_req_ids == [req.req_id]
    pins = CountingPins(client)
    load = _engine(dst, pins).start_load([dreq])
    assert load.done()  # placed synchronously on CPU: nothing left in flight
    assert _same(dst, ref) and pins.released == 0
    rep = load.collect()
    assert rep.loaded_req_ids == [req.req_id] and (rep.chunks, rep.tokens) == (2, 2 * CHUNK)
    load.release()
    load.release()
    assert pins.pinned == pins.released == 2


@needs_vllm
def test_async_load_reports_only_once_done_releases_pins_once_and_fails_a_transfer_failing_at_completion(
    server: ServerProcess, client: MaruHandler
) -> None:
    src = _case("kv_first", "HND", 21)
    ok = _request("gated-ok", [5, 9, 1, 3], 2 * CHUNK)
    bad = _request("gated-bad", [6, 7, 8, 10], 2 * CHUNK)
    assert _engine(src, client).store([ok, bad]).stored == 4
    dok = RequestTransfer(ok.req_id, (0, 2, 4, 6), ok.chunks)
    dbad = RequestTransfer(bad.req_id, (11, 12, 13, 14), bad.chunks)
    ref = _case("kv_first", "HND", 22)
    assert _engine(ref, client).load([dok]).loaded_req_ids == [ok.req_id]
    dst = _case("kv_first", "HND", 22)
    w = _worker(server, dst, async_load=True)
    try:
        pins, settles = _inject(w)
        gate = threading.Event()
        issued: list[Gated] = []
        real = w.engine.path.pipeline.load

        def load(objs: Any, slots: Any, **kw: Any) -> Gated:
            # One batch per step here, in step order: the second batch fails at completion.
            err = RuntimeError("injected device fault") if issued else None
            issued.append(Gated(real(objs, slots, **kw), gate, err))
            return issued[-1]

        w.engine.path.pipeline.load = load
        w.start_load_kv(MaruConnectorMetadata(async_loads=[dok]))
        _until(lambda: len(issued) == 1)
        w.start_load_kv(MaruConnectorMetadata(async_loads=[dbad]))  # the next step
        _until(lambda: len(issued) == 2)  # both in flight: the loader thread did not wait for the first
        for _ in range(3):  # vLLM polls every step; nothing is done yet
            assert w.get_finished(set()) == (None, None)
        assert w.get_block_ids_with_load_errors() == set()
        assert pins.pinned == 4 and pins.released == 0  # pins held while the transfers run
        assert all(g.waits == 0 for g in issued)

        gate.set()
        seen = _until_finished(w, {ok.req_id, bad.req_id})
        assert sum(len(s) for s in seen) == 2  # each reported exactly once
        assert w.get_block_ids_with_load_errors() == set(dbad.block_ids)
        assert (w.stats.async_loads, w.stats.async_load_failures, w.stats.loads) == (2, 1, 1)
        assert settles  # the failed transfer's streams were drained before its pins went
        assert w._loader.drain(10) == []  # the unpins run on the loader thread
        assert pins.pinned == pins.released == 4
        assert w.get_finished(set()) == (None, None)
        assert pins.released == 4  # never twice
        for layer in range(3):
            assert _layer_equal(dst, ref, layer, _slots(dok, 2 * CHUNK))
    finally:
        stop_worker(w)


@needs_vllm
def test_async_load_without_a_server_fails_the_request_without_a_lookup(
    server: ServerProcess, client: MaruHandler
) -> None:
    req = _request("async-off", [0, 1, 2, 3], 2 * CHUNK)
    w = _worker(server, _case("kv_first", "NHD", 23), async_load=True, enable_load=False)
    try:
        w.start_load_kv(MaruConnectorMetadata(async_loads=[req]))
        assert w.get_finished(set()) == (None, {req.req_id})
        assert w.get_block_ids_with_load_errors() == set(req.block_ids)
    finally:
        stop_worker(w)


def _overlap_setup(
    server: ServerProcess, client: MaruHandler, tag: str, seed: int
) -> tuple[Any, CacheCase, CacheCase, CacheCase, RequestTransfer, RequestTransfer]:
    """A request with skipped head and cut tail (``place_begin``/``place_end``) and one missing a
    chunk, stored; the worker (overlap on, CUDA code path injected) over a fresh cache."""
    src_a, dst_a = requests(tag, BS, CHUNK, 16)
    bad = _request(f"{tag}-bad", list(_blocks_outside(src_a.block_ids, 4)), 2 * CHUNK)
    src = _case("kv_first", "NHD", seed)
    assert _engine(src, client).store([src_a, bad]).stored == 6
    assert client.delete([bad.chunks[1].key]) == [True]
    dbad = RequestTransfer(bad.req_id, _blocks_outside(dst_a.block_ids, 4), bad.chunks)
    ref, dst, before = (_case("kv_first", "NHD", seed + 1) for _ in range(3))
    assert _engine(ref, client).load([dst_a]).loaded_req_ids == [dst_a.req_id]
    w = _worker(server, dst, overlap_load_with_compute=True)
    return w, ref, dst, before, dst_a, dbad


@needs_vllm
def test_overlap_load_issues_one_load_layers_per_step_and_unpins_once_it_is_done(
    server: ServerProcess, client: MaruHandler
) -> None:
    w, ref, dst, before, dst_a, dbad = _overlap_setup(server, client, "ovl-gated", 41)
    try:
        pins, _ = _inject(w)
        gate = threading.Event()
        calls: list[tuple[int, int]] = []
        real = w.engine.path.pipeline.load_layers

        def load_layers(objs: Any, slots: Any, **kw: Any) -> Gated:
            calls.append((len(objs), int((slots >= 0).sum())))
            return Gated(real(objs, slots, **kw), gate)

        w.engine.path.pipeline.load_layers = load_layers
        meta = MaruConnectorMetadata(loads=[dst_a, dbad])
        w.start_load_kv(meta)
        # One call for the step: the four chunks of the ready request, only its placed tokens as
        # slots; the request missing a chunk is failed before the forward and never issued.
        assert calls == [(4, dst_a.num_placed_tokens())]
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
        assert _same(dst, ref)  # a placed exactly, nothing of the failed request, every other byte kept
        skipped = [dst_a.block_ids[t // BS] * BS + t % BS for t in range(BS)]  # place_begin = BS
        tail = dst_a.chunks[-1]
        last = tail.start + tail.num_tokens - 1  # place_end stops one token short
        skipped.append(dst_a.block_ids[last // BS] * BS + last % BS)
        for layer in range(3):
            assert _layer_equal(dst, before, layer, skipped)
            assert not _layer_equal(dst, before, layer, _slots(dst_a, 2 * CHUNK)[BS:])
    finally:
        stop_worker(w)


@needs_vllm
def test_overlap_load_failing_at_issue_fails_the_step_before_the_forward_and_releases_every_pin(
    server: ServerProcess, client: MaruHandler
) -> None:
    w, _, dst, before, dst_a, dbad = _overlap_setup(server, client, "ovl-issue", 51)
    try:
        pins, settles = _inject(w)

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
        assert _same(dst, before)
    finally:
        stop_worker(w)


@needs_vllm
def test_overlap_load_on_cpu_caches_keeps_the_layerwise_thread(server: ServerProcess) -> None:
    from maru.transfer.handles import ThreadedLayerHandle
    from maru.transfer.loads import PinnedLoad

    w = _worker(server, _case("kv_first", "NHD", 61), overlap_load_with_compute=True)
    try:
        assert w.engine.path.pipeline is None
        ll = w.engine.start_layer_load(PinnedLoad())
        assert ll.handle is None and ll.wait().loaded_req_ids == []  # nothing to place: no thread
        assert isinstance(w.engine.path.scatter_layers([]), ThreadedLayerHandle)
    finally:
        stop_worker(w)


def test_async_loader_turns_an_exception_at_issue_into_a_failed_request_never_a_lost_one() -> None:
    class Broken:
        def start_load(self, requests: Any) -> Any:
            raise RuntimeError("injected bug at issue")

    req = _request("loader-bug", [0, 1, 2, 3], 2 * CHUNK)
    loader = AsyncLoader("test-loader")
    loader.submit("tag", Broken(), [req])  # type: ignore[arg-type]
    out = loader.close(timeout=10)
    assert [t for t, _ in out] == [["tag"]] and len(loader) == 0
    rep = out[0][1]
    assert rep.loaded_req_ids == [] and "injected bug at issue" in rep.failed[req.req_id]
