"""Shared builders and checks of the transfer tests (no tests here; test modules import this, never each other).

Synthetic caches built the way vLLM builds them (block size 4 != 3 heads, so a swapped axis cannot
hide), requests of ``CHUNK``-token chunks, a client proxy counting pins (``CountingPins``), the
worker connector over CPU caches, and the scenarios shared by a CPU test and its GPU twin
(``check_round_trip``, ``check_connector_load``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
import time
from typing import Any

import pytest
import torch

from maru import kv_ops
from maru.client import MaruHandler
from maru.kv_ops.device_pipeline import DevicePipeline
from maru.kv_ops.testing import CacheCase, bits, make_cache, naive_token
from maru.transfer.background import AsyncLoader
from maru.transfer.device_path import PipelinedPath
from maru.transfer.engine import KVTransferEngine
from maru.transfer.records import ChunkRef, RequestTransfer
from maru.vllm.config import MaruConnectorConfig
from tests.helpers import ServerProcess

BS = 4  # block size; heads = 3
CHUNK = 8


def case(
    fmt: str,
    physical: str,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    **geometry: int,
) -> CacheCase:
    """A 3-layer cache of 16 blocks of ``BS`` tokens, 3 KV heads of 8, random contents from ``seed``.

    ``geometry`` overrides any of ``num_blocks``, ``block_size``, ``num_kv_heads``, ``head_size``,
    ``num_layers`` (a cache for a model of another shape).
    """
    g = torch.Generator().manual_seed(seed)
    geom = {
        "num_blocks": 16,
        "block_size": BS,
        "num_kv_heads": 3,
        "head_size": 8,
        "num_layers": 3,
        **geometry,
    }
    return make_cache(fmt, physical, device=device, dtype=dtype, generator=g, **geom)


def request(tag: str, blocks: list[int], n_tokens: int) -> RequestTransfer:
    chunks = [ChunkRef(f"test/{tag}/c{i}", i * CHUNK, CHUNK) for i in range(n_tokens // CHUNK)]
    if n_tokens % CHUNK:
        s = n_tokens // CHUNK * CHUNK
        chunks.append(ChunkRef(f"test/{tag}/tail{n_tokens - s}", s, n_tokens - s))
    return RequestTransfer("r-" + tag, tuple(blocks), tuple(chunks))


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    from maru.kv_ops.testing import bits

    return torch.equal(bits(a.cpu()), bits(b.cpu()))


NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(3)]


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

    def batch_release(self, handles: list[Any], **kw: Any) -> Any:
        self.released += sum(h is not None for h in handles)
        return self.inner.batch_release(handles, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def plain_engine(case: CacheCase, client: Any) -> KVTransferEngine:
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    caches = [case.caches] if isinstance(case.caches, torch.Tensor) else case.caches
    return KVTransferEngine(caches, layout, client)


def same(a: CacheCase, b: CacheCase) -> bool:
    """Every byte of every storage of ``a`` equals ``b``'s."""
    return all(torch.equal(bits(x), bits(y)) for x, y in zip(a.snapshot(), b.snapshot(), strict=True))


def layer_equal(a: CacheCase, b: CacheCase, layer: int, slots: list[int]) -> bool:
    n_kv = 1 if a.fmt == "mla" else 2
    return all(
        torch.equal(bits(naive_token(a, layer, kv, s)), bits(naive_token(b, layer, kv, s)))
        for s in slots
        for kv in range(n_kv)
    )


def slots_of(rt: RequestTransfer, n_tokens: int) -> list[int]:
    return [rt.block_ids[t // BS] * BS + t % BS for t in range(n_tokens)]


def assert_loads_back(
    client: Any, req: RequestTransfer, original: CacheCase, dst_blocks: tuple[int, ...], seed: int = 77
) -> None:
    """Load ``req``'s chunks into a fresh cache (random contents from ``seed``) at ``dst_blocks``;
    every token of every layer must equal ``original`` at ``req``'s slots, bit for bit."""
    n = max(c.end for c in req.chunks)
    dst = case(original.fmt, original.physical, seed)
    dreq = RequestTransfer(req.req_id, tuple(dst_blocks), req.chunks)
    assert plain_engine(dst, client).load([dreq]).loaded_req_ids == [req.req_id]
    for t, (s1, s2) in enumerate(zip(slots_of(req, n), slots_of(dreq, n), strict=True)):
        for layer in range(original.num_layers):
            for kv in range(1 if original.fmt == "mla" else 2):
                assert torch.equal(
                    bits(naive_token(dst, layer, kv, s2)), bits(naive_token(original, layer, kv, s1))
                ), (t, layer, kv)


def worker(server: ServerProcess, case: CacheCase, **cfg: Any) -> Any:
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


def counting_worker(
    server: ServerProcess, case: CacheCase, *, block_size: int = BS, chunk: int = CHUNK, **cfg: Any
) -> tuple[Any, list[CountingPins]]:
    """The worker connector over ``case``'s three layers, its clients counting their lookups."""
    from maru.vllm.worker import MaruWorkerConnector

    clients: list[CountingPins] = []

    def factory() -> CountingPins:
        clients.append(CountingPins(MaruHandler(server.url, timeout_s=5)))
        return clients[-1]

    w = MaruWorkerConnector(
        MaruConnectorConfig(server_url=server.url, kv_chunk_tokens=chunk, **cfg),
        block_size=block_size,
        num_kv_heads=case.num_kv_heads,
        head_size=case.head_size,
        client_factory=factory,
    )
    assert isinstance(case.caches, list)
    w.register_kv_caches(dict(zip(NAMES, case.caches, strict=True)))
    assert w.engine is not None
    return w, clients


def until_finished(w: Any, req_ids: set[str], timeout: float = 30.0) -> list[set[str]]:
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


GEOM_CPU = dict(
    device="cpu", num_blocks=16, block_size=4, num_kv_heads=3, head_size=8, num_layers=3, dtype=torch.float32
)


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


POISON = 0x5A  # every byte of a fresh destination cache: an unwritten slot keeps it


def poison(case: CacheCase) -> None:
    for st in case.storages():
        bits(st).view(torch.uint8).fill_(POISON)


def gather_slots(case: CacheCase, slots: list[int]) -> torch.Tensor:
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
    assert torch.equal(gather_slots(dst, [d for _, d in pairs]), gather_slots(src, [s for s, _ in pairs]))
    tail = dst_req.chunks[-1]
    last = tail.start + tail.num_tokens - 1
    skipped = [dst_req.block_ids[t // bs] * bs + t % bs for t in [*range(bs), last]]
    assert bool((gather_slots(dst, skipped).view(torch.uint8) == POISON).all())


needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="the worker connector needs vLLM"
)


def MaruConnectorMetadata(**kw: Any) -> Any:  # noqa: N802 (stands for the class)
    """The worker's step metadata (vLLM's connector metadata: skips where vLLM is not installed,
    so that this module stays importable without vLLM)."""
    pytest.importorskip("vllm")
    from maru.vllm.metadata import MaruConnectorMetadata as Meta

    return Meta(**kw)


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


def inject_pipeline(w: Any) -> tuple[CountingPins, list[int]]:
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


def until(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        time.sleep(0.005)


def blocks_outside(used: tuple[int, ...], n: int, num_blocks: int = 16) -> tuple[int, ...]:
    return tuple(b for b in range(num_blocks) if b not in used)[:n]


def flip_behind(srv: ServerProcess, client: MaruHandler, key: str, at: int) -> None:
    """Another process xors one byte at ``at`` of ``key``'s committed object in the pool file."""
    r = client.retrieve(key, verify=False)
    assert r is not None
    offset = r.offset
    r.release()
    code = (
        "import mmap,sys\n"
        "f=open(sys.argv[1],'r+b'); m=mmap.mmap(f.fileno(),0); o=int(sys.argv[2])\n"
        "m[o]=m[o]^0x5A; m.flush(); m.close(); f.close()\n"
    )
    subprocess.run([sys.executable, "-c", code, str(srv.pool_path), str(offset + at)], check=True, timeout=60)


def load_in_mode(eng: KVTransferEngine, reqs: list[RequestTransfer], mode: str) -> Any:
    if mode == "sync":
        return eng.load(reqs)
    if mode == "async":
        inflight = eng.start_load(reqs)
        while not inflight.done():
            pass
        rep = inflight.collect()
        inflight.release()
        return rep
    ll = eng.start_layer_load(eng.pin(reqs))
    ll.wait_all()
    assert ll.done()  # a verifying layer load knows its checksums once every layer is waited for
    rep = ll.finish()
    ll.release()
    return rep


def overlap_setup(
    server: ServerProcess, client: MaruHandler, tag: str, seed: int, **cfg: Any
) -> tuple[Any, CacheCase, CacheCase, CacheCase, RequestTransfer, RequestTransfer]:
    """A request with skipped head and cut tail (``place_begin``/``place_end``) and one missing a
    chunk, stored; the worker (overlap on, more settings in ``cfg``) over a fresh cache; the
    reference cache holds what a load places."""
    src_a, dst_a = requests(tag, BS, CHUNK, 16)
    bad = request(f"{tag}-bad", list(blocks_outside(src_a.block_ids, 4)), 2 * CHUNK)
    src = case("kv_first", "NHD", seed)
    assert plain_engine(src, client).store([src_a, bad]).stored == 6
    assert client.delete([bad.chunks[1].key]) == [True]
    dbad = RequestTransfer(bad.req_id, blocks_outside(dst_a.block_ids, 4), bad.chunks)
    ref, dst, before = (case("kv_first", "NHD", seed + 1) for _ in range(3))
    assert plain_engine(ref, client).load([dst_a]).loaded_req_ids == [dst_a.req_id]
    w = worker(server, dst, **{"overlap_load_with_compute": True, **cfg})
    return w, ref, dst, before, dst_a, dbad


def ready_helper(w: Any, timeout: float = 180.0) -> Any:
    """A worker connector's store helper (``maru_store_helper``), once it reported ready."""
    import time

    h = w.write_behind.helper
    assert h is not None, "no store helper"
    deadline = time.monotonic() + timeout
    while not h.ready():
        assert h.state == "starting", h.why
        assert time.monotonic() < deadline, "the store helper never reported ready"
        time.sleep(0.05)
    return h
