"""The transfer engine (maru.kv_ops.device_pipeline) and CUDA host registration on a machine without a GPU.

On CPU caches the engine degrades to direct kv_ops calls between the pool and the cache; these tests
drive it through a real shared-memory pool (a /dev/shm file, mmapped) and compare every byte of the
caches with the naive per-token oracle of kv_ops.testing. Block size != head count everywhere.
"""

from __future__ import annotations

import logging
import mmap
import os
import uuid
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from maru import announce  # noqa: E402
from maru.client import cuda_host  # noqa: E402
from maru.kv_ops import detect_layouts  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402
from maru.kv_ops.testing import (  # noqa: E402
    CacheCase,
    bits,
    make_cache,
    naive_gather,
    naive_scatter,
    random_slots,
)

GEOM = dict(num_blocks=12, block_size=4, num_kv_heads=3, head_size=8, num_layers=5)
CASES = [
    ("kv_first", "NHD"),
    ("kv_first", "HND"),
    ("blocks_first", "HND"),
    ("mla", "NHD"),
    ("cpu_attn", "HND"),
]


class ShmPool:
    """A pool file under /dev/shm mapped read-write; objects are tensors over the mapping."""

    def __init__(self, size: int) -> None:
        self.path = f"/dev/shm/maru-test-pipeline-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.next = 0

    def alloc(self, engine: pl.DevicePipeline, tokens: int) -> torch.Tensor:
        offset = self.next
        self.next += (engine.object_bytes(tokens) + 4095) // 4096 * 4096
        obj = engine.host_object(self.mm, tokens, offset)
        obj.view(torch.uint8).fill_(0xA5)  # poison: an unwritten element cannot pass
        return obj

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass  # a test still holds a tensor over it; the OS unmaps when it goes
        os.unlink(self.path)


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    p = ShmPool(8 << 20)
    yield p
    p.close()


def _case(fmt: str, physical: str, seed: int) -> CacheCase:
    g = torch.Generator().manual_seed(seed)
    return make_cache(fmt, physical, dtype=torch.bfloat16, generator=g, **GEOM)


def _engine(case: CacheCase, **kw) -> pl.DevicePipeline:
    layout = detect_layouts(case.caches, **case.detect_kwargs())
    return pl.DevicePipeline(case.caches, layout, **kw)


def _same_storage(a: CacheCase, b: CacheCase) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.snapshot(), b.snapshot(), strict=True))


def _chunks(pool: ShmPool, engine: pl.DevicePipeline, sizes: list[int]) -> list[torch.Tensor]:
    return [pool.alloc(engine, t) for t in sizes]


@pytest.mark.parametrize("fmt,physical", CASES)
def test_store_writes_the_oracles_bytes_into_pool_pages(pool: ShmPool, fmt: str, physical: str) -> None:
    case = _case(fmt, physical, 1)
    engine = _engine(case)
    sizes = [8, 8, 5]
    slots = random_slots(GEOM["num_blocks"] * GEOM["block_size"], sum(sizes))
    objs = _chunks(pool, engine, sizes)
    handle = engine.store(objs, torch.tensor(slots))
    handle.wait()
    assert handle.done() and handle.path == "cpu-direct"
    token0 = 0
    for obj, t in zip(objs, sizes, strict=True):
        expected = naive_gather(case, slots[token0 : token0 + t], torch.zeros_like(obj))
        assert torch.equal(bits(obj), bits(expected))
        token0 += t


@pytest.mark.parametrize("fmt,physical", CASES)
@pytest.mark.parametrize("path", ["load", "load_layers"])
def test_store_then_load_into_a_fresh_cache_reproduces_it_byte_for_byte(
    pool: ShmPool, fmt: str, physical: str, path: str
) -> None:
    src = _case(fmt, physical, 2)
    sizes = [8, 3, 8]
    g = torch.Generator().manual_seed(7)
    slots = torch.tensor(random_slots(48, sum(sizes), negatives=2, generator=g))
    objs = _chunks(pool, _engine(src), sizes)
    _engine(src).store(objs, slots).wait()

    fresh, expected = _case(fmt, physical, 3), _case(fmt, physical, 3)  # identical random poison
    engine = _engine(fresh)
    handle = engine.load(objs, slots) if path == "load" else engine.load_layers(objs, slots)
    handle.wait()
    token0 = 0
    for obj, t in zip(objs, sizes, strict=True):
        naive_scatter(expected, slots[token0 : token0 + t].tolist(), obj)
        token0 += t
    assert _same_storage(fresh, expected)
    # And every stored slot now holds the source's bytes.
    valid = [s for s in slots.tolist() if s >= 0]
    blank = torch.zeros(engine.object_shape(len(valid)), dtype=torch.bfloat16)
    assert torch.equal(
        bits(naive_gather(fresh, valid, blank.clone())), bits(naive_gather(src, valid, blank.clone()))
    )


def test_load_with_skip_tokens_leaves_the_shared_prefix_untouched(pool: ShmPool) -> None:
    src = _case("blocks_first", "HND", 4)
    slots = torch.tensor(random_slots(48, 16, generator=torch.Generator().manual_seed(3)))
    objs = _chunks(pool, _engine(src), [8, 8])
    _engine(src).store(objs, slots).wait()
    for path in ("load", "load_layers"):
        fresh, expected = _case("blocks_first", "HND", 5), _case("blocks_first", "HND", 5)
        engine = _engine(fresh)
        (engine.load if path == "load" else engine.load_layers)(objs, slots, skip_tokens=5).wait()
        naive_scatter(expected, slots[:8].tolist(), objs[0], skip=5)
        naive_scatter(expected, slots[8:].tolist(), objs[1])
        assert _same_storage(fresh, expected), path


def test_a_prestage_on_cpu_caches_queues_nothing_and_the_load_inside_places_the_same(pool: ShmPool) -> None:
    """``issuing(address, ...)`` around a load: on CPU caches there is no copy to queue early (the
    load places straight from the pool), so nothing is prestaged or dropped, and the load is exact."""
    src = _case("kv_first", "NHD", 6)
    slots = torch.tensor(random_slots(48, 16, generator=torch.Generator().manual_seed(4)))
    objs = _chunks(pool, _engine(src), [8, 8])
    _engine(src).store(objs, slots).wait()
    fresh, expected = _case("kv_first", "NHD", 7), _case("kv_first", "NHD", 7)
    engine = _engine(fresh)
    first = objs[0]
    with engine.issuing(first.data_ptr(), first.numel() * first.element_size(), 8):
        assert engine._prestaged is None
        engine.load(objs, slots).wait()
    assert (engine.prestages, engine.prestages_unused) == (0, 0)
    naive_scatter(expected, slots[:8].tolist(), objs[0])
    naive_scatter(expected, slots[8:].tolist(), objs[1])
    assert _same_storage(fresh, expected)


def test_cpu_engine_announces_direct_placement_once_at_info(caplog: pytest.LogCaptureFixture) -> None:
    announce.forget("kv_ops.cpu-direct")  # announced again in this test
    with caplog.at_level(logging.INFO, logger="maru.kv_ops"):
        _engine(_case("kv_first", "NHD", 1))
        _engine(_case("kv_first", "NHD", 1))
    msgs = [r for r in caplog.records if "no CUDA: direct CPU placement" in r.getMessage()]
    assert len(msgs) == 1 and msgs[0].levelno == logging.INFO


def test_bad_inputs_get_errors_that_name_the_problem(pool: ShmPool) -> None:
    case = _case("kv_first", "NHD", 1)
    engine = _engine(case)
    obj = pool.alloc(engine, 8)
    with pytest.raises(ValueError, match=r"slot_mapping has shape \[7\], expected \[8\]"):
        engine.load([obj], torch.arange(7))
    with pytest.raises(ValueError, match="float32, the caches are torch.bfloat16"):
        engine.load([torch.zeros(engine.object_shape(8))], torch.arange(8))
    with pytest.raises(ValueError, match="not a whole number of tokens"):
        engine.load([obj.view(-1)[:100]], torch.arange(8))
    with pytest.raises(ValueError, match="skip_tokens=9"):
        engine.load([obj], torch.arange(8), skip_tokens=9)
    L, KV, T, ROW = engine.object_shape(8)
    wrong = torch.zeros((L, KV + 1, T, ROW), dtype=obj.dtype)
    with pytest.raises(
        ValueError, match=rf"chunk object 1 has shape \[{L}, {KV + 1}, {T}, {ROW}\], expected"
    ):
        engine.load([obj, wrong], torch.arange(16))
    with pytest.raises(ValueError, match="chunk object 0 must be contiguous"):
        engine.load([obj.transpose(0, 1)], torch.arange(8))
    with pytest.raises(ValueError, match="chunk object 0 is on meta"):
        engine.load([torch.zeros(engine.object_shape(8), dtype=obj.dtype, device="meta")], torch.arange(8))
    layout = detect_layouts(case.caches, **case.detect_kwargs())
    with pytest.raises(ValueError, match=r"store_path must be one of \('staged', 'direct'\), got 'inplace'"):
        pl.DevicePipeline(case.caches, layout, store_path="inplace")


def test_flat_pool_pages_are_accepted_as_objects(pool: ShmPool) -> None:
    src = _case("kv_first", "HND", 8)
    engine = _engine(src)
    slots = torch.tensor(random_slots(48, 8, generator=torch.Generator().manual_seed(1)))
    obj = pool.alloc(engine, 8)
    engine.store([obj.view(-1)], slots).wait()  # a flat page: the engine derives T from its size
    assert torch.equal(bits(obj), bits(naive_gather(src, slots.tolist(), torch.zeros_like(obj))))


def test_checked_objects_carry_each_objects_tokens_and_address(pool: ShmPool) -> None:
    """``_objects`` reads each object's token count and first byte's address once, for the load
    paths: they must be the objects' own, in order, flat pages (viewed as objects) included."""
    engine = _engine(_case("kv_first", "HND", 8))
    objs = [pool.alloc(engine, t) for t in (8, 3, 5)]
    given = [objs[0], objs[1].view(-1), objs[2]]  # a flat page among shaped ones
    checked = engine._objects(given)
    assert checked.tokens == [8, 3, 5]
    assert checked.ptrs == [o.data_ptr() for o in objs]
    assert [list(o.shape) for o in checked] == [list(o.shape) for o in objs]
    assert len({checked.ptrs[0], checked.ptrs[1], checked.ptrs[2]}) == 3


# ---------------------------------------------------------------- CUDA host registration


class FakeRuntime:
    """Stands in for cudart where there is no GPU: records calls, fails on request."""

    def __init__(self, fail_at: int | None = None, code: int = 2) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.fail_at, self.code = fail_at, code

    def register(self, address: int, size: int, flags: int) -> int:
        self.calls.append(("register", address, size))
        if self.fail_at is not None and len([c for c in self.calls if c[0] == "register"]) > self.fail_at:
            return self.code
        return 0

    def unregister(self, address: int) -> int:
        self.calls.append(("unregister", address, 0))
        return 0

    def error_name(self, code: int) -> str:
        return f"cudaErrorMemoryAllocation (cudaError {code})" if code == 2 else f"cudaError {code}"


def test_registration_is_idempotent_and_reports_slices_and_progress() -> None:
    rt = FakeRuntime()
    reg = cuda_host.CudaHostRegistry(lambda: rt)
    seen: list[tuple[int, int]] = []
    rec = reg.register(
        1 << 20, 10 * 4096, name="pool x", slice_bytes=4 * 4096, progress=lambda d, t, s: seen.append((d, t))
    )
    again = reg.register(1 << 20, 10 * 4096, name="pool x", slice_bytes=4 * 4096)
    assert rec is again and rec.registered and rec.registered_bytes == 10 * 4096 and rec.slices == 3
    assert [c[2] for c in rt.calls] == [4 * 4096, 4 * 4096, 2 * 4096]  # registered once, in 3 slices
    assert seen == [(4 * 4096, 10 * 4096), (8 * 4096, 10 * 4096), (10 * 4096, 10 * 4096)]
    assert reg.lookup((1 << 20) + 5 * 4096, 4096) is rec
    assert "registered with CUDA" in rec.describe() and rec.as_dict()["state"] == "registered"
    reg.unregister(1 << 20, 10 * 4096)
    assert [c[1] for c in rt.calls if c[0] == "unregister"] == [
        1 << 20,
        (1 << 20) + 4 * 4096,
        (1 << 20) + 8 * 4096,
    ]
    assert rec.state == "unregistered" and reg.lookup(1 << 20) is None


def test_failed_registration_rolls_back_and_is_announced_once_with_reason_consequence_and_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = FakeRuntime(fail_at=2)
    reg = cuda_host.CudaHostRegistry(lambda: rt)
    with caplog.at_level(logging.INFO, logger="maru.client"):
        rec = reg.register(1 << 30, 4 * 4096, name="pool /dev/shm/p", slice_bytes=4096)
        reg.register(1 << 30, 4 * 4096, name="pool /dev/shm/p", slice_bytes=4096)
    assert rec.state == "failed" and rec.registered_bytes == 0
    assert "cudaErrorMemoryAllocation" in (rec.reason or "") and "after 8192 of 16384 bytes" in (
        rec.reason or ""
    )
    # The two slices that did register are unpinned again: never a half-pinned pool.
    assert [c for c in rt.calls if c[0] == "unregister"] == [
        ("unregister", 1 << 30, 0),
        ("unregister", (1 << 30) + 4096, 0),
    ]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    text = warnings[0].getMessage()
    assert "NOT registered" in text and "pageable" in text and "11x slower" in text and "Fix:" in text


def test_a_range_registered_by_someone_else_is_used_but_never_unregistered() -> None:
    rt = FakeRuntime(fail_at=0, code=cuda_host._ERR_ALREADY_REGISTERED)
    reg = cuda_host.CudaHostRegistry(lambda: rt)
    rec = reg.register(4096, 8192)
    assert rec.registered and not rec.owned
    reg.close()
    assert not [c for c in rt.calls if c[0] == "unregister"]


def test_registration_can_be_disabled_and_says_so(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setenv("MARU_CUDA_REGISTER", "0")
    rt = FakeRuntime()
    reg = cuda_host.CudaHostRegistry(lambda: rt)
    with caplog.at_level(logging.WARNING, logger="maru.client"):
        rec = reg.register(4096, 8192, name="pool q")
    assert rec.state == "disabled" and not rt.calls
    assert any("MARU_CUDA_REGISTER" in r.getMessage() for r in caplog.records)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA outcome")
def test_without_cuda_a_real_mapping_reports_unavailable_at_info(pool: ShmPool, caplog) -> None:
    reg = cuda_host.CudaHostRegistry()
    with caplog.at_level(logging.INFO, logger="maru.client"):
        rec = cuda_host.register_host_mapping(pool.mm, name="pool t", registry=reg)
    address, size = cuda_host.buffer_address(pool.mm)
    assert (rec.address, rec.size, rec.state) == (address, size, "unavailable")
    assert rec.reason and ("CPU build" in rec.reason or "no CUDA device" in rec.reason)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert reg.registrations() == [rec]


def test_warm_is_a_no_op_without_graphs() -> None:
    engine = _engine(_case("kv_first", "NHD", 1))
    engine.warm(8, layer_tokens=[16])  # CPU: nothing to capture, must not fail
    assert not engine.graphs


def test_probe_registration_registers_then_releases_the_pool_file(pool: ShmPool) -> None:
    rt = FakeRuntime()
    rec = cuda_host.probe_registration(pool.path, registry=cuda_host.CudaHostRegistry(lambda: rt))
    assert rec.registered and rec.size == 8 << 20 and rec.registered_bytes == 8 << 20
    assert [c[0] for c in rt.calls] == ["register", "unregister"]  # pinned only for the probe


def test_segment_sums_on_cpu_caches_match_the_pool_bytes_and_partial_loads_read_less(pool: ShmPool) -> None:
    from maru import segments as sg
    from maru.checksum import checksum

    src = _case("cpu_attn", "HND", 8)
    sizes = [8, 8, 5]
    slots = torch.tensor(random_slots(48, sum(sizes), generator=torch.Generator().manual_seed(9)))
    objs = _chunks(pool, _engine(src), sizes)
    store = _engine(src).store(objs, slots, checksums=True, segment_tokens=4)
    store.wait()
    segs = store.segment_sums()
    raw = [o.reshape(-1).view(torch.uint8).numpy() for o in objs]
    assert segs == [sg.host_segment_sums(r, o.shape, 2, 4) for r, o in zip(raw, objs, strict=True)]
    assert store.checksums() == [checksum(r) for r in raw]
    # A load skipping the first 5 tokens of the first object: segment 0 (4 tokens) is not read.
    load = slots.clone()
    load[:5] = -1
    fresh, expected = _case("cpu_attn", "HND", 10), _case("cpu_attn", "HND", 10)
    handle = _engine(fresh).load_layers(objs, load, checksums=True, segments=segs)
    handle.wait()
    assert handle.checksums() == store.checksums()
    row = objs[0].numel() // sizes[0] * 2  # bytes of one token, every layer and plane
    assert handle.unread_bytes == 4 * row
    token0 = 0
    for obj, t in zip(objs, sizes, strict=True):
        naive_scatter(expected, load[token0 : token0 + t].tolist(), obj)
        token0 += t
    assert _same_storage(fresh, expected)


def test_a_store_that_cannot_have_segment_sums_says_why_once(caplog: pytest.LogCaptureFixture) -> None:
    announce.forget("kv_ops.no-segment-sums")
    engine = _engine(_case("kv_first", "NHD", 11))
    objs = [torch.zeros(engine.object_shape(4), dtype=torch.bfloat16)]
    with caplog.at_level(logging.WARNING, logger="maru.kv_ops"):
        assert engine._queue_segments(objs, torch.tensor([3, -1, 5, 6]), 4) is None
        assert engine._queue_segments(objs, torch.tensor([3, -1, 5, 6]), 4) is None
    said = [r.getMessage() for r in caplog.records if "segment sums" in r.getMessage()]
    assert len(said) == 1 and "negative slots" in said[0] and "Fix:" in said[0]
