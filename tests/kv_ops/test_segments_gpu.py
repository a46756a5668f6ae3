"""Segment sums on a real GPU: every store way commits sums that match the pool bytes, and a direct
layer load that skips a chunk's first tokens reads only the segments it places.

The shapes and the registered pool are those of ``test_device_pipeline_gpu``. Skipped without CUDA.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

from maru import kv_ops  # noqa: E402
from maru import segments as sg  # noqa: E402
from maru.checksum import checksum  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402
from tests.kv_ops.test_device_pipeline_gpu import (  # noqa: E402
    BACKEND,
    CHUNK,
    HS,
    NH,
    RegisteredPool,
    _reference_gather,
    _slots,
    make_caches,
)

SEG = 16


@pytest.fixture(scope="module")
def pool() -> Iterator[RegisteredPool]:
    p = RegisteredPool(1 << 30)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _rewind(pool: RegisteredPool) -> None:
    pool.next = 0


def _host_sums(obj: torch.Tensor) -> sg.SegmentSums:
    return sg.host_segment_sums(obj.reshape(-1).view(torch.uint8).numpy(), obj.shape, 2, SEG)


@pytest.mark.parametrize(
    "way", ["staged", "staged_eager", "staged_torch", "direct", "paced", "sync"]
)  # fmt: skip
def test_every_store_way_commits_segment_sums_of_the_bytes_it_wrote(pool: RegisteredPool, way: str) -> None:
    src = make_caches("flash_attn_HND", 31)
    engine = pl.DevicePipeline(
        src.layers,
        src.layout(),
        backend=BACKEND,
        use_graphs=not way.endswith("_eager"),
        raw_cuda=not way.endswith("_torch"),
        store_path="direct" if way == "direct" else "staged",
    )
    sizes = [CHUNK, CHUNK, 37]  # 37: a last segment of 5 tokens
    slots = _slots(src, sum(sizes), 32)
    objs = [pool.alloc(engine, t) for t in sizes]
    handle = engine.store(
        objs, slots, checksums=True, segment_tokens=SEG, paced=way == "paced", pipelined=way != "sync"
    )
    handle.wait()
    got = handle.segment_sums()
    assert got == [_host_sums(o) for o in objs]
    sums = handle.checksums()
    assert sums == [checksum(o.reshape(-1).view(torch.uint8).numpy()) for o in objs]
    assert all(s.consistent(c, o.numel() * 2) for s, c, o in zip(got, sums, objs, strict=True))


@pytest.mark.parametrize("raw", [True, False])
def test_stores_in_a_row_reuse_the_kept_segment_buffers_and_each_sums_its_own_bytes(
    pool: RegisteredPool, raw: bool
) -> None:
    """The raw way (no torch op but the launch: the table in a pinned scratch buffer, the
    accumulators in device buffers kept per stream) gives each of several stores in a row, small
    after large after small, the sums of its own bytes; without raw calls the torch way runs and
    keeps nothing."""
    src = make_caches("flash_attn_HND", 35)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND, raw_cuda=raw)
    for i, sizes in enumerate(([37], [CHUNK, CHUNK, CHUNK, 21], [CHUNK // 2], [CHUNK, 5])):
        slots = _slots(src, sum(sizes), 3 + 7 * i)
        objs = [pool.alloc(engine, t) for t in sizes]
        handle = engine.store(objs, slots, checksums=True, segment_tokens=SEG, paced=True)
        handle.wait()
        assert handle.segment_sums() == [_host_sums(o) for o in objs], sizes
    kept = engine._segment_bufs
    if raw and engine._sync.raw:
        assert len(kept) == 1 and set(next(iter(kept.values()))) == {"tab", "acc"}
    else:
        assert kept == {}


def test_warm_compiles_the_segment_kernel_before_the_first_store(pool: RegisteredPool) -> None:
    """A store's first segment-sum launch finds the kernel ``warm`` compiled (left to first use, a
    fresh instance's first write-behind store compiled it on the drain thread: 0.4-1 s on an H200)."""
    if BACKEND == "reference":
        pytest.skip("warm compiles no kernels for the reference backend")
    from maru.kv_ops import segment_kernels as sk

    sk._SEGMENTS._kernels.clear()  # as in a fresh process: no launch of this key kept yet
    src = make_caches("flash_attn_HND", 33)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    before = sk._SEGMENTS.triton_calls
    engine.warm(CHUNK)
    assert sk._SEGMENTS.triton_calls == before + 1  # warm went through Triton once
    sizes = [CHUNK, CHUNK // 2]
    slots = _slots(src, sum(sizes), 5)
    objs = [pool.alloc(engine, t) for t in sizes]
    handle = engine.store(objs, slots, checksums=True, segment_tokens=SEG, paced=True)
    handle.wait()
    assert sk._SEGMENTS.triton_calls == before + 1  # the store launched the warmed kernel directly
    assert handle.segment_sums() == [_host_sums(o) for o in objs]


@pytest.mark.parametrize("way", ["copied", "direct", "direct_eager"])
def test_a_layer_load_skipping_first_tokens_reads_only_the_segments_it_places(
    pool: RegisteredPool, way: str
) -> None:
    src = make_caches("flashinfer_NHD", 41)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    sizes = [CHUNK, CHUNK, CHUNK, 100]  # two requests: chunks 0-1 and 2-3
    slots = _slots(src, sum(sizes), 42)
    objs = [pool.alloc(engine, t) for t in sizes]
    store = engine.store(objs, slots, checksums=True, segment_tokens=SEG)
    store.wait()
    segs = store.segment_sums()
    whole = [checksum(o.reshape(-1).view(torch.uint8).numpy()) for o in objs]
    # Request 1 skips 40 tokens of chunk 0 (segments 0 and 1 unread, segment 2 read from token 32);
    # request 2 skips all of chunk 2 but its last 8 tokens (segments 0-14 unread).
    load_slots = slots.clone()
    load_slots[:40] = -1
    load_slots[2 * CHUNK : 3 * CHUNK - 8] = -1
    fresh = make_caches("flashinfer_NHD", 43)
    expected = fresh.clone()
    kv_ops.scatter(
        _reference_gather(src, slots), expected.layers, fresh.layout(), load_slots.cuda(), backend="reference"
    )
    loader = pl.DevicePipeline(
        fresh.layers, fresh.layout(), backend=BACKEND, use_graphs=way != "direct_eager",
        layer_path=way.split("_")[0],
    )  # fmt: skip
    handle = loader.load_layers(objs, load_slots, checksums=True, segments=segs)
    handle.wait()
    assert handle.path == f"layers-{way.split('_')[0]}"
    assert handle.checksums() == whole
    row_bytes = 32 * 2 * NH * HS * 2  # every layer and plane of one token
    assert handle.unread_bytes == (32 + 15 * SEG) * row_bytes
    assert torch.equal(fresh.bits(), expected.bits())

    # A changed byte in a segment nobody places goes unread; one in a read segment is caught.
    for token, caught in ((5, False), (35, True)):
        saved = objs[0].clone()
        objs[0].view(torch.uint8)[7, 1, token, 3] ^= 0x21
        again = loader.load_layers(objs, load_slots, checksums=True, segments=segs)
        again.wait()
        assert (again.checksums()[0] != whole[0]) == caught
        assert again.checksums()[1:] == whole[1:]
        objs[0].copy_(saved)

    # Without segment sums the same load reads everything and vouches with the whole checksum.
    plain = loader.load_layers(objs, load_slots, checksums=True)
    plain.wait()
    assert plain.checksums() == whole and plain.unread_bytes == 0
