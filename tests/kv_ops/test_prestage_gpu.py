"""A load's first chunk copied before the load is prepared (``DevicePipeline.issuing``) on a real GPU.

The engine queues the copy of a load's first placed chunk into the next staging slot as soon as it
knows the page, then checks the requests, makes the objects and issues the load, which starts with
that copy if its first object is those bytes. Checked here: the load that starts with it places
byte for byte what the reference does (one copy fewer queued), a prestage the load does not start
with is dropped and every later transfer through the ring (a load, a store's gather and checksum)
is still right, and a ring store's checksum read is covered by the slot's ``free`` event (the
next user of a ring slot may be a load's copy on another stream).

Real geometry (32 layers, 8 KV heads of 128, bf16, block size 16 != heads), objects in a
CUDA-registered /dev/shm mapping, poisoned. Skipped where no CUDA device is visible (CI).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

from maru import kv_ops  # noqa: E402
from maru.checksum import checksum  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402
from maru.kv_ops.cuda_sync import D2D, D2H  # noqa: E402
from tests.kv_ops import test_device_pipeline_gpu as base  # noqa: E402
from tests.kv_ops.test_paced_store_gpu import RecordingSync  # noqa: E402

# The device pipeline tests' geometry, helpers and fixtures (one registered pool a module, rewound).
BACKEND, CHUNK, RegisteredPool, make_caches = base.BACKEND, base.CHUNK, base.RegisteredPool, base.make_caches
_reference_gather, _slots, pool, _rewind = base._reference_gather, base._slots, base.pool, base._rewind

SIZES = [CHUNK, CHUNK, CHUNK, 70]  # more chunks than a ring of two, a short last one


def _sum(obj: Any) -> int:
    return checksum(obj.contiguous().view(-1).view(torch.uint8).cpu().numpy())


def _stored(pool: RegisteredPool, name: str, seed: int) -> tuple[Any, list[Any], Any]:
    """Caches of ``name``, objects stored from them at random slots (some -1), and those slots."""
    src = make_caches(name, seed)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    objs = [pool.alloc(engine, t) for t in SIZES]
    slots = _slots(src, sum(SIZES), seed + 1, negatives=7)
    engine.store(objs, slots).wait()
    return src, objs, slots


def _expected(src: Any, fresh: Any, slots: Any) -> Any:
    want = fresh.clone()
    kv_ops.scatter(
        _reference_gather(src, slots), want.layers, fresh.layout(), slots.cuda(), backend="reference"
    )
    return want


def _counting(loader: Any) -> list[int]:
    copies: list[int] = []
    real = loader._h2d
    loader._h2d = lambda stage, host: (copies.append(host.data_ptr()), real(stage, host))[1]
    return copies


@pytest.mark.parametrize("graphs", [True, False])
def test_a_load_starts_with_its_prestaged_first_chunk_and_places_the_same(
    pool: RegisteredPool, graphs: bool
) -> None:
    """The load's first object is the prestaged page: that copy is not queued again, the cache and
    every checksum equal the reference's, and nothing was dropped."""
    src, objs, slots = _stored(pool, "flash_attn_HND", 201)
    fresh = make_caches("flash_attn_HND", 203)
    want = _expected(src, fresh, slots)
    loader = pl.DevicePipeline(fresh.layers, fresh.layout(), backend=BACKEND, ring_slots=2, use_graphs=graphs)
    if not loader._sync.raw:
        pytest.skip("libcudart not reachable: prestaging needs the raw copies")
    copies = _counting(loader)
    first = objs[0]
    with loader.issuing(first.data_ptr(), first.numel() * first.element_size(), SIZES[0]):
        assert loader._prestaged is not None
        handle = loader.load(objs, slots, checksums=True)
    handle.wait()
    assert copies == [o.data_ptr() for o in objs[1:]]  # the first was queued by the prestage
    assert loader.prestages_unused == 0
    assert torch.equal(fresh.bits(), want.bits())
    assert handle.checksums() == [_sum(o) for o in objs]


def test_a_prestage_the_load_does_not_start_with_is_dropped_and_later_transfers_stay_right(
    pool: RegisteredPool,
) -> None:
    """A prestaged page that is not the load's first object (its request failed its checks), and
    one with no load at all: each is counted unused, the load copies its own first chunk, and a
    store through the same ring (a slot whose last writer was the dropped copy) gathers and sums
    what the reference does. A ring of one slot: every transfer reuses the dropped copy's slot."""
    src, objs, slots = _stored(pool, "flashinfer_NHD", 211)
    fresh = make_caches("flashinfer_NHD", 213)
    want = _expected(src, fresh, slots)
    loader = pl.DevicePipeline(fresh.layers, fresh.layout(), backend=BACKEND, ring_slots=1)
    if not loader._sync.raw:
        pytest.skip("libcudart not reachable: prestaging needs the raw copies")
    copies = _counting(loader)
    other = objs[2]
    with loader.issuing(other.data_ptr(), other.numel() * other.element_size(), CHUNK):
        handle = loader.load(objs, slots, checksums=True)
    handle.wait()
    assert loader.prestages_unused == 1
    assert copies == [o.data_ptr() for o in objs]  # the load queued its own first copy
    assert torch.equal(fresh.bits(), want.bits())
    assert handle.checksums() == [_sum(o) for o in objs]
    # A prestage with no load, then a store at once through the one slot it wrote.
    with loader.issuing(other.data_ptr(), other.numel() * other.element_size(), CHUNK):
        pass
    assert loader.prestages_unused == 2
    out = [pool.alloc(loader, t) for t in SIZES]
    new_slots = _slots(fresh, sum(SIZES), 214)
    stored = loader.store(out, new_slots, checksums=True)
    stored.wait()
    ref = _reference_gather(fresh, new_slots).cpu()
    token0 = 0
    for obj, t in zip(out, SIZES, strict=True):
        assert torch.equal(
            obj.view(torch.int16), ref[:, :, token0 : token0 + t].contiguous().view(torch.int16)
        )
        token0 += t
    assert stored.checksums() == [_sum(o) for o in out]


def test_prestage_refuses_an_object_of_another_geometry_and_queues_nothing(pool: RegisteredPool) -> None:
    src, objs, _ = _stored(pool, "flash_attn_NHD", 221)
    loader = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    copies = []
    real = loader._sync

    class Spy(RecordingSync):
        def copy(self, dst: int, src: int, nbytes: int, stream: int, kind: int = 1) -> None:
            copies.append(nbytes)
            real.copy(dst, src, nbytes, stream, kind)

    loader._sync = Spy(real)
    nbytes = objs[0].numel() * objs[0].element_size()
    with loader.issuing(objs[0].data_ptr(), nbytes - 2, CHUNK):
        assert loader._prestaged is None
    with loader.issuing(objs[0].data_ptr(), nbytes, CHUNK - 1):
        assert loader._prestaged is None
    assert copies == [] and loader.prestages_unused == 0


def test_a_ring_stores_checksum_is_queued_before_its_slot_is_ready(pool: RegisteredPool) -> None:
    """A store through the ring with checksums (the raw way): each chunk's sum is read from the slot
    before the slot's ``ready``, so before its copy to the pool and its ``free``: the sum's 8-byte
    device copy is queued before that chunk's copy to the pool. A load's next copy into the slot
    waits for ``free`` alone, and would otherwise overwrite the slot under the sum's read."""
    src = make_caches("flash_attn_NHD", 231)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    if not engine._sync.raw or not engine.graphs:
        pytest.skip("libcudart or graphs not reachable: the store takes the torch way")
    log: list[Any] = []
    real = engine._sync

    class Recorder(RecordingSync):
        def copy(self, dst: int, src: int, nbytes: int, stream: int, kind: int = 1) -> None:
            log.append((dst, nbytes, kind))
            real.copy(dst, src, nbytes, stream, kind)

    engine._sync = Recorder(real)
    objs = [pool.alloc(engine, t) for t in SIZES]
    slots = _slots(src, sum(SIZES), 232)
    handle = engine.store(objs, slots, checksums=True)
    handle.wait()
    pages = {o.data_ptr(): k for k, o in enumerate(objs)}
    order = [
        pages[dst] if kind == D2H and dst in pages else "sum"
        for dst, nbytes, kind in log
        if (kind == D2H and dst in pages) or (kind == D2D and nbytes == 8)
    ]
    assert order == [x for k in range(len(objs)) for x in ("sum", k)], order
    assert handle.checksums() == [_sum(o) for o in objs]
