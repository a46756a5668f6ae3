"""The paced store (``DevicePipeline.store(..., paced=True)``, ``kv_ops.paced_store``) on a real GPU.

Structure (one stream of its own, each chunk's gather graph between two chunk copies) is checked
on the calls the engine makes; what it is for (another stream's copy waits for one chunk, not the store) is
measured in bench/copy_interference.py, not asserted here.

Real geometry (32 layers, 8 KV heads of 128, bf16, block size 16 != heads), NHD and HND, objects in
a CUDA-registered /dev/shm mapping, poisoned before each store. Every comparison is on raw bits
against the kv_ops reference gather. Skipped where no CUDA device is visible (CI).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

from maru import kv_ops  # noqa: E402
from maru.checksum import checksum  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402
from maru.kv_ops import paced_store  # noqa: E402
from tests.kv_ops import test_device_pipeline_gpu as base  # noqa: E402
from tests.kv_ops.test_device_pipeline_gpu import (  # noqa: E402
    CHUNK,
    RegisteredPool,
    _reference_gather,
    _slots,
    make_caches,
)

pool, _rewind = base.pool, base._rewind  # the same fixtures: one registered pool a module, rewound

SIZES = [CHUNK, CHUNK, CHUNK, 100]  # a short last chunk


def _check_objects(objs: list[Any], want: Any, slots: Any) -> None:
    """Each object's rows of valid slots equal the reference gather's (skipped rows: unspecified)."""
    token0 = 0
    for obj, t in zip(objs, SIZES, strict=True):
        valid = (slots[token0 : token0 + t] >= 0).nonzero().reshape(-1)
        got = obj.view(torch.int16)[:, :, valid]
        assert torch.equal(got, want[:, :, token0 : token0 + t].view(torch.int16)[:, :, valid])
        token0 += t


class RecordingSync:
    """Passes every call to the engine's raw sync and logs its copies (with their stream) in order."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.log: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def copy(self, dst: int, src: int, nbytes: int, stream: int, kind: int = 1) -> None:
        if kind == 2:  # device to host: a chunk's copy to the pool
            self.log.append(("copy", (dst, stream)))
        self._inner.copy(dst, src, nbytes, stream, kind)

    def launch_graph(self, exe: int, stream: int) -> None:
        self.log.append(("graph", (exe, stream)))
        self._inner.launch_graph(exe, stream)


WAYS = ["libcudart", "torch"]  # torch: the pipeline built without raw libcudart calls


def _engine(src: Any, way: str, **kw: Any) -> Any:
    return pl.DevicePipeline(src.layers, src.layout(), raw_cuda=way != "torch", **kw)


def _check_way(engine: Any, way: str) -> None:
    """Stores queued through libcudart where the pipeline has it, else through torch."""
    if way == "libcudart":
        assert "libcudart" in engine.store_ways, engine.store_ways
    else:
        assert engine.store_ways and all(w.startswith("torch (") for w in engine.store_ways), (
            engine.store_ways
        )


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("name", ["flash_attn_NHD", "flash_attn_HND", "flashinfer_HND"])
def test_paced_store_writes_the_reference_bytes_and_their_checksums(
    pool: RegisteredPool, name: str, way: str
) -> None:
    src = make_caches(name, 41)
    engine = _engine(src, way)
    slots = _slots(src, sum(SIZES), 42, negatives=5)
    objs = [pool.alloc(engine, t) for t in SIZES]
    h = engine.store(objs, slots, paced=True, checksums=True)
    assert h.path == "paced"
    h.wait()
    assert h.done()
    _check_objects(objs, _reference_gather(src, slots).cpu(), slots)
    assert h.checksums() == [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
    for o in objs:
        o.fill_(7)  # again, into the same objects through the slots' second use
    slots2 = _slots(src, sum(SIZES), 142, negatives=3)
    h = engine.store(objs, slots2, paced=True, checksums=True)
    h.wait()
    _check_objects(objs, _reference_gather(src, slots2).cpu(), slots2)
    assert h.checksums() == [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
    _check_way(engine, way)


@pytest.mark.parametrize("paced", [True, False])
def test_with_libcudart_a_store_queues_no_torch_call_a_chunk(pool: RegisteredPool, paced: bool) -> None:
    """The raw store: per chunk only libcudart calls (the drain thread keeps the GIL); checksums too."""
    src = make_caches("flash_attn_HND", 51)
    engine = pl.DevicePipeline(src.layers, src.layout())
    if not engine._sync.raw:
        pytest.skip("libcudart not reachable")
    engine.warm(CHUNK)
    slots = _slots(src, 4 * CHUNK, 52)
    objs = [pool.alloc(engine, CHUNK) for _ in range(4)]
    lane = (
        engine._paced()
        if paced
        else paced_store.StoreLane(
            engine._place_stream, engine._copy_stream, (), paced=False, path="pipelined"
        )
    )
    assert engine._raw_plan(lane, objs, torch.zeros(1, dtype=torch.int64, device="cuda"), True) is not None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paced_store.ck, "accumulate", lambda *a, **k: pytest.fail("a torch checksum launch"))
        mp.setattr(paced_store.StagingSlot, "place", lambda *a, **k: pytest.fail("a torch placement"))
        h = engine.store(objs, slots, paced=paced, checksums=True)
    h.wait()
    _check_objects_n(objs, _reference_gather(src, slots).cpu(), slots)
    assert h.checksums() == [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]


@pytest.mark.parametrize("paced", [True, False])
def test_partial_tails_of_whole_blocks_go_through_libcudart_on_the_paced_lane(
    pool: RegisteredPool, paced: bool
) -> None:
    """As the connector builds it (the chunk size and its block multiples warmed, nothing
    captured while serving): a store of full chunks with a prompt's 96-token tail (6 blocks of 16)
    and a 100-token one (not whole blocks) between them. The paced lane (write-behind) and the ring
    (sync stores) warmed every block multiple below the chunk: the 96-token tail goes through
    libcudart like the chunks, only the 100-token one the torch way, in turn on the same streams
    and slots; every byte and checksum is the reference's, twice over (the slots' second use)."""
    src = make_caches("flash_attn_HND", 61)
    engine = pl.DevicePipeline(src.layers, src.layout(), lazy_capture=False)
    if not engine._sync.raw:
        pytest.skip("libcudart not reachable")
    engine.warm(CHUNK)
    sizes = [CHUNK, 96, CHUNK, CHUNK, 100]
    objs = [pool.alloc(engine, t) for t in sizes]
    torch_chunks: list[int] = []
    real_place = paced_store.StagingSlot.place

    def place(slot: Any, stage: Any, graphed: bool, chunk_slots: Any, *, load: bool) -> None:
        torch_chunks.append(int(chunk_slots.numel()))
        real_place(slot, stage, graphed, chunk_slots, load=load)

    for seed in (62, 63):
        slots = _slots(src, sum(sizes), seed, negatives=4)
        for o in objs:
            o.fill_(7)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(paced_store.StagingSlot, "place", place)
            h = engine.store(objs, slots, paced=paced, checksums=True)
        h.wait()
        _check_objects_n(objs, _reference_gather(src, slots).cpu(), slots)
        assert h.checksums() == [
            checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs
        ]
    assert torch_chunks == [100, 100]
    assert "libcudart" in engine.store_ways and any(w.startswith("torch (") for w in engine.store_ways)
    # Every tail size is a view of the slot's one chunk-sized buffer: graphs, not memory.
    tails = paced_store.tail_sizes(CHUNK, 16)
    assert tails == list(range(16, CHUNK, 16))
    for placer, op in (
        (engine._paced().slots[0].placer, "paced-chunk"),
        (engine._ring[0].placer, "gather"),
    ):
        assert placer.staging(96).data_ptr() == placer.staging(CHUNK).data_ptr()
        assert all(placer.raw_exec((op, t, None), capture=False) for t in tails)
    assert all(engine._ring[0].placer.has_chunk_graphs(t) for t in tails)  # a ring slot loads too


def test_a_store_of_tails_only_goes_through_libcudart_on_the_paced_lane(pool: RegisteredPool) -> None:
    """Requests whose prompts fit in one partial chunk each: nothing the torch way, right bytes."""
    src = make_caches("flashinfer_NHD", 65)
    engine = pl.DevicePipeline(src.layers, src.layout(), lazy_capture=False)
    if not engine._sync.raw:
        pytest.skip("libcudart not reachable")
    engine.warm(CHUNK)
    sizes = [16, CHUNK - 16, 48, 16]
    objs = [pool.alloc(engine, t) for t in sizes]
    slots = _slots(src, sum(sizes), 66, negatives=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(paced_store.StagingSlot, "place", lambda *a, **k: pytest.fail("a torch placement"))
        mp.setattr(paced_store.ck, "accumulate", lambda *a, **k: pytest.fail("a torch checksum launch"))
        h = engine.store(objs, slots, paced=True, checksums=True)
    h.wait()
    _check_objects_n(objs, _reference_gather(src, slots).cpu(), slots)
    assert h.checksums() == [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
    assert engine.store_ways == frozenset({"libcudart"})


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("paced", [True, False])
def test_stores_queued_back_to_back_keep_their_own_checksums(
    pool: RegisteredPool, paced: bool, way: str
) -> None:
    """The lane keeps one device buffer for the stores' sums (no allocation a store): three
    stores queued without a wait between them, each into objects of its own from its own slot
    mapping, each hand back the checksums of its own bytes; the buffer is the lane's, the same
    across stores, and the ring's and the paced lane's are two."""
    src = make_caches("flash_attn_HND", 71)
    engine = _engine(src, way)
    engine.warm(CHUNK)
    sizes = [CHUNK, CHUNK, 96]
    handles = []
    for seed in (72, 73, 74):
        slots = _slots(src, sum(sizes), seed, negatives=2)
        objs = [pool.alloc(engine, t) for t in sizes]
        handles.append((engine.store(objs, slots, paced=paced, checksums=True), objs, slots))
    if paced and way != "torch":  # the paced lane's chunk graphs write the sums into its state
        name, kept = "", engine._paced().batch.acc
        assert not hasattr(engine, "_store_acc_pipelined") and not hasattr(engine, "_store_acc_paced")
    else:
        name = "_store_acc_paced" if paced else "_store_acc_pipelined"
        kept = getattr(engine, name)
        assert not hasattr(engine, "_store_acc_pipelined" if paced else "_store_acc_paced")
    sums_seen = set()
    for h, objs, slots in handles:
        h.wait()
        _check_objects_n(objs, _reference_gather(src, slots).cpu(), slots)
        want = [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
        assert h.checksums() == want
        sums_seen.add(tuple(want))
    assert len(sums_seen) == 3  # three different stores: a shared buffer mixing them would show
    assert (getattr(engine, name) if name else engine._paced().batch.acc).data_ptr() == kept.data_ptr()
    _check_way(engine, way)


def _check_objects_n(objs: list[Any], want: Any, slots: Any) -> None:
    token0 = 0
    for obj in objs:
        t = obj.shape[2]
        valid = (slots[token0 : token0 + t] >= 0).nonzero().reshape(-1)
        assert torch.equal(
            obj.view(torch.int16)[:, :, valid], want[:, :, token0 : token0 + t].view(torch.int16)[:, :, valid]
        )
        token0 += t


@pytest.mark.parametrize("checksums", [True, False])
def test_each_chunk_s_gather_is_queued_between_two_chunk_copies_on_one_stream_of_their_own(
    pool: RegisteredPool, checksums: bool
) -> None:
    """Per chunk on the paced lane: the gather graph (summing the staged bytes with checksums),
    then the copy to the pool in pieces with the lane's pause graph between two, all on one stream
    that is not the loads' copy stream: a kernel is the stream's next item between each two
    copies (the copy engine serves others there), and no event orders the slot's reuse (stream
    order does)."""
    src = make_caches("flash_attn_NHD", 43)
    engine = pl.DevicePipeline(src.layers, src.layout())
    if not engine._sync.raw:
        pytest.skip("libcudart not reachable: the copies go through torch, not the recorded sync")
    engine.warm(CHUNK)
    engine._sync = rec = RecordingSync(engine._sync)
    per_chunk_events: list[Any] = []  # the raw orderings (record_on / wait_on), with their streams
    rec.record_on = lambda *a: per_chunk_events.append(a) or rec._inner.record_on(*a)  # type: ignore[method-assign]
    rec.wait_on = lambda *a: per_chunk_events.append(a) or rec._inner.wait_on(*a)  # type: ignore[method-assign]
    sizes = [CHUNK, CHUNK, CHUNK, 96]  # a prompt's tail of whole blocks: warmed, raw too
    slots = _slots(src, sum(sizes), 44)
    objs = [pool.alloc(engine, t) for t in sizes]
    h = engine.store(objs, slots, paced=True, checksums=checksums)
    h.wait()
    _check_objects_n(objs, _reference_gather(src, slots).cpu(), slots)
    if checksums:
        assert h.checksums() == [
            checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs
        ]
    pause = engine._paced().batch.pause
    assert pause, "the warm-up captured no pause graph: every chunk's copy went whole"

    def in_an_object(dst: int) -> bool:
        return any(o.data_ptr() <= dst < o.data_ptr() + o.numel() * o.element_size() for o in objs)

    chunk_ops = [(op, arg) for op, arg in rec.log if op == "graph" or in_an_object(arg[0])]
    # Per chunk: its graph, then its copy in pieces with the pause graph between two pieces.
    want_ops: list[str] = []
    want_dsts: list[int] = []
    for o in objs:
        cut = paced_store.pieces(o.numel() * o.element_size())
        want_ops += ["graph", "copy"] + ["pause", "copy"] * (len(cut) - 1)
        want_dsts += [o.data_ptr() + at for at, _ in cut]
    assert len(paced_store.pieces(objs[0].numel() * objs[0].element_size())) > 1  # split for real
    got_ops = ["pause" if op == "graph" and arg[0] == pause else op for op, arg in chunk_ops]
    assert got_ops == want_ops
    assert [arg[0] for op, arg in chunk_ops if op == "copy"] == want_dsts  # in order
    streams = {arg[1] for _, arg in chunk_ops}
    assert len(streams) == 1 and streams != {engine._copy_stream.cuda_stream}  # not the loads' stream
    # Stream order alone: no event recorded or waited for on the lane's stream (the store's slot
    # mapping moved to the device records and waits on others, once a store).
    assert not [e for e in per_chunk_events if next(iter(streams)) in e], per_chunk_events
    rec.log.clear()
    engine.store(objs, slots).wait()  # an unpaced store: back to back on the copy stream
    rec.log[:] = [(op, arg) for op, arg in rec.log if op == "copy"]
    assert len(rec.log) == len(objs)
    assert {s for _, (_, s) in rec.log} == {engine._copy_stream.cuda_stream}


def test_gathers_read_what_the_caller_queued_before_the_store(pool: RegisteredPool) -> None:
    src, new = make_caches("flash_attn_HND", 45), make_caches("flash_attn_HND", 46)
    engine = pl.DevicePipeline(src.layers, src.layout())
    slots = _slots(src, sum(SIZES), 47)
    objs = [pool.alloc(engine, t) for t in SIZES]
    torch.cuda._sleep(100_000_000)  # the forward still runs when the store is called
    src.buffer.copy_(new.buffer, non_blocking=True)
    h = engine.store(objs, slots, paced=True)
    h.wait()
    _check_objects(objs, _reference_gather(new, slots).cpu(), slots)


def test_a_load_issued_while_a_paced_store_drains_does_not_wait_for_it(pool: RegisteredPool) -> None:
    src, other = make_caches("flash_attn_NHD", 48), make_caches("flash_attn_NHD", 49)
    engine = pl.DevicePipeline(src.layers, src.layout(), ring_slots=2)
    layout = src.layout()
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(50))
    n = sum(SIZES)
    store_slots, load_slots = perm[:n], perm[n : 2 * n]
    objs = [pool.alloc(engine, t) for t in SIZES]
    want = _reference_gather(src, store_slots).cpu()
    incoming = [pool.alloc(engine, t) for t in SIZES]  # another cache's tokens, for src's other slots
    got = _reference_gather(other, load_slots).cpu()
    token0 = 0
    for obj, t in zip(incoming, SIZES, strict=True):
        obj.copy_(got[:, :, token0 : token0 + t])
        token0 += t
    expected = src.clone()
    kv_ops.scatter(got.cuda(), expected.layers, layout, load_slots.cuda(), backend="reference")
    # Both paths once first: a size's first use captures its graphs, and a capture syncs the device
    # (the engine's build warms the chunk size; a tail size is captured on first use).
    engine.store(objs, store_slots, paced=True).wait()
    engine.load(incoming, load_slots).wait()
    for o in objs:
        o.view(torch.uint8).fill_(0xA5)  # poison again: the store below must write them
    d2h = engine._paced_state.copy
    with torch.cuda.stream(d2h):
        torch.cuda._sleep(400_000_000)  # the store's copies are held ~0.2 s behind this
    h = engine.store(objs, store_slots, paced=True)
    load = engine.load(incoming, load_slots)  # the next step's load, from the forward thread
    load.wait()
    held = not h.done()
    h.wait()
    torch.cuda.synchronize()
    assert held, "the load waited for the paced store (a shared stream or staging slot)"
    _check_objects(objs, want, store_slots)
    assert torch.equal(src.bits(), expected.bits())


def test_without_a_device_sleep_the_store_is_still_paced_and_says_nothing(
    pool: RegisteredPool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The paced lane's pause between two copies is the next chunk's gather: no device sleep needed."""
    src = make_caches("flash_attn_NHD", 55)
    engine = pl.DevicePipeline(src.layers, src.layout())
    monkeypatch.delattr(torch.cuda, "_sleep")
    slots = _slots(src, sum(SIZES), 56)
    objs = [pool.alloc(engine, t) for t in SIZES]
    with caplog.at_level("WARNING", logger="maru.kv_ops"):
        h = engine.store(objs, slots, paced=True)
    h.wait()
    assert h.path == "paced"
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    _check_objects(objs, _reference_gather(src, slots).cpu(), slots)
