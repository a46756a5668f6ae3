"""The optional data paths of the transfer engine and the worker, without vLLM.

Layer-by-layer load (``maru_overlap_load_with_compute``), asynchronous load (``maru_async_load``)
and write-behind store (``maru_async_store``) against a real server and a real shared-memory
pool, on synthetic caches built the way vLLM builds them (block size 4 != 3 heads, so a swapped
axis cannot hide; HND caches included). The reference is the synchronous load, which
``tests/test_transfer.py`` checks token by token against the per-format oracle.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from maru import kv_ops
from maru.client import MaruHandler
from maru.kv_ops.testing import CacheCase, bits, make_cache, naive_token
from maru.transfer.background import BackgroundRunner
from maru.transfer.engine import KVTransferEngine
from maru.transfer.records import RequestTransfer
from maru.vllm.config import MaruConnectorConfig
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.test_transfer import BS, CHUNK, _request

NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


server = module_server("datapath")
client = pool_client()


class CountingPins:
    """A client proxy counting pinned and released handles (every pin must be released)."""

    def __init__(self, inner: MaruHandler) -> None:
        self.inner = inner
        self.lookups = 0  # batch_retrieve calls
        self.pinned = 0
        self.released = 0

    def batch_retrieve(self, keys: list[str], pin: bool = True, **kw: Any) -> list[Any]:
        out = self.inner.batch_retrieve(keys, pin=pin, **kw)
        self.lookups += 1
        self.pinned += sum(h is not None for h in out)
        return out

    def batch_release(self, handles: list[Any]) -> Any:
        self.released += sum(h is not None for h in handles)
        return self.inner.batch_release(handles)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _case(fmt: str, physical: str, seed: int) -> CacheCase:
    g = torch.Generator().manual_seed(seed)
    return make_cache(
        fmt,
        physical,
        num_blocks=16,
        block_size=BS,
        num_kv_heads=3,
        head_size=8,
        num_layers=3,
        dtype=torch.float32,
        generator=g,
    )


def _engine(case: CacheCase, client: Any) -> KVTransferEngine:
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    caches = [case.caches] if isinstance(case.caches, torch.Tensor) else case.caches
    return KVTransferEngine(caches, layout, client)


def _same(a: CacheCase, b: CacheCase) -> bool:
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a.snapshot(), b.snapshot(), strict=True))


def _layer_equal(a: CacheCase, b: CacheCase, layer: int, slots: list[int]) -> bool:
    n_kv = 1 if a.fmt == "mla" else 2
    return all(
        torch.equal(bits(naive_token(a, layer, kv, s)), bits(naive_token(b, layer, kv, s)))
        for s in slots
        for kv in range(n_kv)
    )


def _slots(rt: RequestTransfer, n_tokens: int) -> list[int]:
    return [rt.block_ids[t // BS] * BS + t % BS for t in range(n_tokens)]


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
    src = _case(fmt, physical, 1)
    n_tokens = 2 * CHUNK + BS  # two chunks and a one-block tail
    req = _request(tag, [9, 3, 14, 0, 7], n_tokens)
    assert _engine(src, client).store([req]).stored == 3
    dreq = RequestTransfer(req.req_id, (2, 15, 6, 10, 1), req.chunks)
    ref, dst = _case(fmt, physical, 2), _case(fmt, physical, 2)
    assert _engine(ref, client).load([dreq]).loaded_req_ids == [req.req_id]

    pins = CountingPins(client)
    eng = _engine(dst, pins)
    before = _case(fmt, physical, 2)
    ll = eng.start_layer_load(eng.pin([dreq]))
    rep = ll.wait()
    assert rep.loaded_req_ids == [req.req_id] and not rep.failed
    assert rep.tokens == n_tokens and rep.chunks == 3
    assert _same(dst, ref) and not _same(dst, before)
    assert pins.pinned == pins.released == 3


def test_wait_for_layer_returns_with_that_layer_placed_for_every_chunk(client: MaruHandler) -> None:
    src = _case("kv_first", "HND", 3)
    req = _request("layer-wait", [4, 1, 12, 7, 0, 9], 3 * CHUNK)
    _engine(src, client).store([req])
    dreq = RequestTransfer(req.req_id, (8, 2, 11, 5, 13, 3), req.chunks)
    ref = _case("kv_first", "HND", 4)
    _engine(ref, client).load([dreq])
    dst = _case("kv_first", "HND", 4)
    eng = _engine(dst, client)
    ll = eng.start_layer_load(eng.pin([dreq]))
    slots = _slots(dreq, 3 * CHUNK)
    for layer in (2, 0, 1):  # any order: each wait covers its own layer only
        ll.wait_for_layer(layer)
        assert ll.layer_done(layer)
        assert _layer_equal(dst, ref, layer, slots)
    ll.wait()
    assert _same(dst, ref)


def test_layer_load_places_nothing_of_a_request_missing_a_chunk_and_unpins_everything(
    client: MaruHandler,
) -> None:
    src = _case("blocks_first", "HND", 5)
    a = _request("layer-miss-a", [0, 1, 2, 3, 4, 5], 3 * CHUNK)
    b = _request("layer-miss-b", [6, 7, 8, 9], 2 * CHUNK)
    _engine(src, client).store([a, b])
    assert client.delete([a.chunks[2].key]) == [True]
    dst = _case("blocks_first", "HND", 6)
    before = _case("blocks_first", "HND", 6)
    pins = CountingPins(client)
    eng = _engine(dst, pins)
    pinned = eng.pin([a, b])
    assert set(pinned.failed) == {a.req_id} and "gone" in pinned.failed[a.req_id]
    rep = eng.start_layer_load(pinned).wait()
    assert rep.loaded_req_ids == [b.req_id] and a.req_id in rep.failed
    for layer in range(3):
        assert _layer_equal(dst, before, layer, _slots(a, 3 * CHUNK))  # nothing of a placed
        assert not _layer_equal(dst, before, layer, _slots(b, 2 * CHUNK))
    assert pins.pinned == pins.released == 4  # a's two present chunks were pinned and released too


def test_a_layer_that_fails_to_place_releases_every_waiter_and_reports_the_request(
    client: MaruHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _case("kv_first", "NHD", 7)
    req = _request("layer-boom", [0, 1, 2, 3], 2 * CHUNK)
    _engine(src, client).store([req])
    pins = CountingPins(client)
    eng = _engine(_case("kv_first", "NHD", 8), pins)
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


def test_prepared_store_is_invisible_until_committed_and_independent_of_later_cache_writes(
    client: MaruHandler,
) -> None:
    src = _case("cpu_attn", "NHD", 9)
    original = _case("cpu_attn", "NHD", 9)
    req = _request("write-behind", [5, 9, 1, 3], 2 * CHUNK)
    eng = _engine(src, client)
    prep = eng.prepare_store([req])
    assert len(prep.keys) == 2 and prep.report.failed == 0
    assert client.exists([c.key for c in req.chunks]) == [False, False]
    for t in src.caches:  # vLLM reuses the blocks right after the gather
        t.fill_(-7.0)
    rep = eng.commit_store(prep)
    assert (rep.stored, rep.failed, rep.tokens) == (2, 0, 2 * CHUNK)
    assert client.exists([c.key for c in req.chunks]) == [True, True]
    dst = _case("cpu_attn", "NHD", 10)
    dreq = RequestTransfer(req.req_id, (0, 2, 4, 6), req.chunks)
    assert _engine(dst, client).load([dreq]).loaded_req_ids == [req.req_id]
    for t, (s1, s2) in enumerate(zip(_slots(req, 2 * CHUNK), _slots(dreq, 2 * CHUNK), strict=True)):
        for layer in range(3):
            for kv in range(2):
                assert torch.equal(
                    bits(naive_token(dst, layer, kv, s2)), bits(naive_token(original, layer, kv, s1))
                ), (t, layer, kv)


def test_background_runner_returns_results_and_exceptions_in_order() -> None:
    r = BackgroundRunner("test-runner")
    r.submit("a", lambda: 1)
    r.submit("b", lambda: 1 / 0)
    out = r.close(timeout=5)
    assert [t for t, _ in out] == ["a", "b"]
    assert out[0][1] == 1 and isinstance(out[1][1], ZeroDivisionError)


# ---------------------------------------------------------------------------- the worker side


def _worker(server: ServerProcess, case: CacheCase, **cfg: Any) -> Any:
    from maru.vllm.worker import MaruWorkerConnector

    c = MaruConnectorConfig(server_url=server.url, kv_chunk_tokens=CHUNK, **cfg)
    w = MaruWorkerConnector(
        c,
        block_size=BS,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        client_factory=lambda: MaruHandler(server.url, timeout_s=5),
    )
    assert isinstance(case.caches, list)
    w.register_kv_caches({NAMES[i]: case.caches[i] for i in (2, 0, 1)})
    return w


def _until_finished(w: Any, req_ids: set[str], timeout: float = 30.0) -> list[set[str]]:
    """Poll ``get_finished`` like vLLM does each step until every request was reported once."""
    seen: list[set[str]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _, recving = w.get_finished(set())
        if recving:
            seen.append(set(recving))
        if set().union(*seen) >= req_ids:
            return seen
        time.sleep(0.01)
    raise AssertionError(f"only {seen} of {req_ids} reported in finished_recving")


def test_worker_async_load_reports_finished_after_placing_and_fails_whole_on_a_missing_chunk(
    server: ServerProcess, client: MaruHandler
) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    src = _case("blocks_first", "HND", 11)
    ok = _request("async-ok", [5, 9, 1, 3], 2 * CHUNK)
    bad = _request("async-bad", [6, 7, 8, 10], 2 * CHUNK)
    _engine(src, client).store([ok, bad])
    assert client.delete([bad.chunks[1].key]) == [True]
    ref = _case("blocks_first", "HND", 12)
    dok = RequestTransfer(ok.req_id, (0, 2, 4, 6), ok.chunks)
    _engine(ref, client).load([dok])
    dst, before = _case("blocks_first", "HND", 12), _case("blocks_first", "HND", 12)
    dbad = RequestTransfer(bad.req_id, (11, 12, 13, 14), bad.chunks)
    w = _worker(server, dst, async_load=True)
    try:
        w.start_load_kv(MaruConnectorMetadata(async_loads=[dok, dbad]))
        seen = _until_finished(w, {ok.req_id, bad.req_id})
        assert sum(len(s) for s in seen) == 2  # each reported exactly once
        assert w.get_block_ids_with_load_errors() == {11, 12, 13, 14}
        assert _same(dst, ref)  # ok placed exactly; nothing of bad placed (ref never had it)
        assert not _same(dst, before)
        assert (w.stats.async_loads, w.stats.async_load_failures, w.stats.loads) == (2, 1, 1)
    finally:
        stop_worker(w)


def test_worker_overlap_load_waits_per_layer_and_reports_a_missing_chunk_after_the_forward(
    server: ServerProcess, client: MaruHandler
) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    src = _case("kv_first", "HND", 13)
    ok = _request("overlap-ok", [5, 9, 1, 3], 2 * CHUNK)
    bad = _request("overlap-bad", [6, 7, 8, 10], 2 * CHUNK)
    _engine(src, client).store([ok, bad])
    assert client.delete([bad.chunks[0].key]) == [True]
    dok = RequestTransfer(ok.req_id, (0, 2, 4, 6), ok.chunks)
    dbad = RequestTransfer(bad.req_id, (11, 12, 13, 14), bad.chunks)
    ref = _case("kv_first", "HND", 14)
    _engine(ref, client).load([dok])
    dst = _case("kv_first", "HND", 14)
    w = _worker(server, dst, overlap_load_with_compute=True)
    try:
        meta = MaruConnectorMetadata(loads=[dok, dbad])
        w.start_load_kv(meta)
        for i in range(3):  # what vLLM does before each attention layer
            w.wait_for_layer_load(NAMES[i])
            assert _layer_equal(dst, ref, i, _slots(dok, 2 * CHUNK))
        w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == {11, 12, 13, 14}
        assert _same(dst, ref)
        assert (w.stats.overlap_loads, w.stats.loads, w.stats.load_errors) == (1, 1, 1)
        assert w.stats.layer_waits == 3
    finally:
        stop_worker(w)


def test_worker_write_behind_store_commits_on_the_drain_thread(
    server: ServerProcess, client: MaruHandler
) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata

    src = _case("kv_first", "NHD", 15)
    req = _request("drain", [5, 9, 1, 3], 2 * CHUNK)
    w = _worker(server, src, async_store=True)
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


def test_a_lost_server_closes_the_engine_before_the_client_unmaps_the_pool(
    server: ServerProcess, client: MaruHandler
) -> None:
    """The engine drains its transfers and drops its CUDA registration before the pool is unmapped."""
    pytest.importorskip("vllm")
    w = _worker(server, _case("kv_first", "NHD", 61))
    order: list[str] = []
    engine, real = w.engine, w._client
    assert engine is not None and real is not None
    engine_close, client_close = engine.close, real.close
    engine.close = lambda: (order.append("engine"), engine_close())[1]  # type: ignore[method-assign]
    real.close = lambda: (order.append("client"), client_close())[1]  # type: ignore[method-assign]
    w._lost("test: server gone")
    assert order == ["engine", "client"]
    assert w.engine is None and w._client is None
    w.shutdown()
