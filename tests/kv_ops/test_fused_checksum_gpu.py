"""The chunk load's checksum inside its scatter (``MARU_FUSED_LOAD_CHECKSUM=1``) on a real GPU.

With ``fuse_checksums`` the first object of each staged copy is placed by the placer's
``scatter+checksum`` graph, whose kernel sums every row of the staged object as it reads it (the
skipped ones too), and that raw sum goes into the load's accumulator by an 8-byte device copy
before the slot is freed. Checked here: the caches and every checksum equal the reference's and
the host's, a changed byte in a row the load skips changes the object's sum (it is read, not
placed), objects sharing one copy keep their own sums, the switch off takes the two-kernel way
with the same results, and without lazy capture only warmed sizes fuse.

Real geometry (32 layers, 8 KV heads of 128, bf16, block size 16 != heads), objects in a
CUDA-registered /dev/shm mapping. Skipped where no CUDA device is visible (CI).
"""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

from maru.kv_ops import device_pipeline as pl  # noqa: E402
from tests.kv_ops import test_device_pipeline_gpu as base  # noqa: E402
from tests.kv_ops.test_prestage_gpu import SIZES, _expected, _stored, _sum  # noqa: E402

BACKEND, CHUNK, RegisteredPool, make_caches = base.BACKEND, base.CHUNK, base.RegisteredPool, base.make_caches
pool, _rewind = base.pool, base._rewind


def _loader(fresh: Any, **kw: Any) -> Any:
    loader = pl.DevicePipeline(fresh.layers, fresh.layout(), backend=BACKEND, ring_slots=2, **kw)
    if not loader._sync.raw or not loader.graphs:
        pytest.skip("libcudart or graphs not reachable: the load takes the torch way (never fused)")
    return loader


def _load_checked(pool: RegisteredPool, name: str, seed: int, warm: bool = False, **kw: Any) -> Any:
    """Store SIZES from caches of ``name``, load them into fresh ones with checksums (``kw``: the
    pipeline's); the caches and every checksum must be the reference's. Returns the loader."""
    src, objs, slots = _stored(pool, name, seed)
    fresh = make_caches(name, seed + 2)
    want = _expected(src, fresh, slots)
    loader = _loader(fresh, **kw)
    if warm:
        loader.warm(CHUNK)
        assert all(s.placer.has_scatter_checksum(CHUNK) for s in loader._ring)
    handle = loader.load(objs, slots, checksums=True)
    handle.wait()
    assert torch.equal(fresh.bits(), want.bits())
    assert handle.checksums() == [_sum(o) for o in objs]
    return loader


@pytest.mark.parametrize("name", ["flash_attn_HND", "flashinfer_NHD"])
def test_a_fused_load_places_and_sums_what_the_reference_does(pool: RegisteredPool, name: str) -> None:
    loader = _load_checked(pool, name, 301, fuse_checksums=True)
    n = len(SIZES)
    assert loader.fused_checksums == n  # lazy capture: every size, the short one too
    assert loader.load_checksum_way() == (f"fused ({n} objects)", None)


def test_a_changed_byte_in_a_skipped_row_changes_the_fused_sum(pool: RegisteredPool) -> None:
    src, objs, slots = _stored(pool, "flash_attn_NHD", 311)
    neg = int((slots < 0).nonzero()[0, 0])  # a token the load does not place
    k = next(i for i in range(len(SIZES)) if neg < sum(SIZES[: i + 1]))
    row = neg - sum(SIZES[:k])
    before = _sum(objs[k])
    objs[k].view(torch.uint8)[-1, -1, row, 3] ^= 0x44
    fresh = make_caches("flash_attn_NHD", 313)
    want = _expected(src, fresh, slots)  # the reference reads the caches: unchanged placement
    loader = _loader(fresh, fuse_checksums=True)
    handle = loader.load(objs, slots, checksums=True)
    handle.wait()
    got = handle.checksums()
    assert got[k] == _sum(objs[k]) != before
    assert got == [_sum(o) for o in objs]
    assert torch.equal(fresh.bits(), want.bits())  # the changed row was not placed


def test_objects_sharing_a_copy_keep_their_own_sums(pool: RegisteredPool) -> None:
    src, objs, slots = _stored(pool, "flash_attn_HND", 321)
    # One page wanted twice in a row (a shared prefix chunk), then the others.
    load_objs = [objs[0], objs[0], objs[1]]
    again = slots[: 3 * CHUNK]
    fresh = make_caches("flash_attn_HND", 323)
    loader = _loader(fresh, fuse_checksums=True)
    handle = loader.load(load_objs, again, checksums=True)
    handle.wait()
    assert handle.copies_shared == 1
    assert handle.checksums() == [_sum(o) for o in load_objs]
    assert loader.fused_checksums == 2  # the first object of each of the two copies


def test_the_switch_off_takes_the_two_kernel_way_with_the_same_results(pool: RegisteredPool) -> None:
    loader = _load_checked(pool, "flashinfer_NHD", 331, fuse_checksums=False)
    assert loader.fused_checksums == 0
    assert loader.load_checksum_way() == ("separate kernel", None)


def test_without_lazy_capture_only_warmed_sizes_fuse(pool: RegisteredPool) -> None:
    loader = _load_checked(pool, "flash_attn_HND", 341, warm=True, fuse_checksums=True, lazy_capture=False)
    assert loader.fused_checksums == sum(1 for t in SIZES if t == CHUNK)  # 70 tokens: not warmed, eager


def test_a_load_without_checksums_never_fuses(pool: RegisteredPool) -> None:
    src, objs, slots = _stored(pool, "flash_attn_NHD", 351)
    fresh = make_caches("flash_attn_NHD", 353)
    want = _expected(src, fresh, slots)
    loader = _loader(fresh, fuse_checksums=True)
    loader.load(objs, slots, checksums=False).wait()
    assert torch.equal(fresh.bits(), want.bits())
    assert loader.fused_checksums == 0


def test_a_refused_fused_kernel_leaves_the_load_right_on_the_two_kernel_way(
    pool: RegisteredPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused variant refused when its graph is first captured (as Triton's compiler refused a
    fused variant of the direct kernel on one layout): the load places and sums the two-kernel
    way, every result the reference's, and the way says why."""
    from maru.kv_ops import triton_kernels

    real = triton_kernels.place

    def place(*a: Any, checksum_into: Any = None, **k: Any) -> None:
        if checksum_into is not None:
            raise RuntimeError("PassManager::run failed (stand-in)")
        real(*a, **k)

    monkeypatch.setattr(triton_kernels, "place", place)
    loader = _load_checked(pool, "flash_attn_HND", 361, fuse_checksums=True)
    assert loader.fused_checksums == 0
    name, why = loader.load_checksum_way()
    assert name == "separate kernel" and "stand-in" in why


@pytest.mark.parametrize("fused", [True, False])
def test_a_partial_tail_of_whole_blocks_loads_from_its_warmed_graphs(
    pool: RegisteredPool, fused: bool
) -> None:
    """The ring's slots warm every block multiple below the chunk (a prompt's tail): without lazy
    capture, a load of a full chunk and a 96-token tail (6 blocks of 16) replays graphs for both,
    no eager placement, every byte and checksum the reference's (the fused way for both where on)."""
    from maru.kv_ops import staging_slot

    src = make_caches("flashinfer_HND", 371)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    objs = [pool.alloc(engine, t) for t in (CHUNK, 96)]
    slots = base._slots(src, CHUNK + 96, 372, negatives=5)
    engine.store(objs, slots).wait()
    fresh = make_caches("flashinfer_HND", 373)
    want = _expected(src, fresh, slots)
    loader = _loader(fresh, fuse_checksums=fused, lazy_capture=False)
    loader.warm(CHUNK)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(staging_slot.StagingSlot, "place", lambda *a, **k: pytest.fail("an eager placement"))
        handle = loader.load(objs, slots, checksums=True)
    handle.wait()
    assert torch.equal(fresh.bits(), want.bits())
    assert handle.checksums() == [_sum(o) for o in objs]
    assert loader.fused_checksums == (2 if fused else 0)
