"""The paced store (``DevicePipeline.store(..., paced=True)``, ``kv_ops.paced_store``) on a real GPU.

Real geometry (32 layers, 8 KV heads of 128, bf16, block size 16 != heads), NHD and HND, objects in
a CUDA-registered /dev/shm mapping, poisoned before each store. Every comparison is on raw bits
against the kv_ops reference gather. Skipped where no CUDA device is visible (CI).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu]

from maru import kv_ops  # noqa: E402
from maru.checksum import checksum  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402
from tests.kv_ops.test_device_pipeline_gpu import (  # noqa: E402
    CHUNK,
    RegisteredPool,
    _reference_gather,
    _slots,
    make_caches,
)

SIZES = [CHUNK, CHUNK, CHUNK, 100]  # a short last chunk


@pytest.fixture(scope="module")
def pool() -> Iterator[RegisteredPool]:
    p = RegisteredPool(1 << 30)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _rewind(pool: RegisteredPool) -> None:
    pool.next = 0


def _check_objects(objs: list[Any], want: Any, slots: Any) -> None:
    """Each object's rows of valid slots equal the reference gather's (skipped rows: unspecified)."""
    token0 = 0
    for obj, t in zip(objs, SIZES, strict=True):
        valid = (slots[token0 : token0 + t] >= 0).nonzero().reshape(-1)
        got = obj.view(torch.int16)[:, :, valid]
        assert torch.equal(got, want[:, :, token0 : token0 + t].view(torch.int16)[:, :, valid])
        token0 += t


class RecordingSync:
    """Passes every call to the engine's raw sync and logs copies, records and host waits in order."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.log: list[tuple[str, Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def copy(self, dst: int, src: int, nbytes: int, stream: int, kind: int = 1) -> None:
        self.log.append(("copy", dst))
        self._inner.copy(dst, src, nbytes, stream, kind)

    def record(self, event: Any, stream: Any) -> None:
        self.log.append(("record", event))
        self._inner.record(event, stream)

    def synchronize(self, event: Any) -> None:
        self.log.append(("synchronize", event))
        self._inner.synchronize(event)


@pytest.mark.parametrize("name", ["flash_attn_NHD", "flash_attn_HND", "flashinfer_HND"])
def test_paced_store_writes_the_reference_bytes_and_their_checksums_once_waited(
    pool: RegisteredPool, name: str
) -> None:
    src = make_caches(name, 41)
    engine = pl.DevicePipeline(src.layers, src.layout())
    slots = _slots(src, sum(SIZES), 42, negatives=5)
    objs = [pool.alloc(engine, t) for t in SIZES]
    h = engine.store(objs, slots, paced=True, checksums=True)
    assert isinstance(h, pl.PacedStore) and h.path == "paced"
    torch.cuda.synchronize()
    assert not h.done()  # nothing is issued before wait()
    assert all(torch.all(o.view(torch.uint8) == 0xA5) for o in objs)  # the pages are still poisoned
    h.wait()
    assert h.done()
    _check_objects(objs, _reference_gather(src, slots).cpu(), slots)
    sums = h.checksums()
    assert sums == [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]


def test_each_chunk_copy_is_queued_only_after_the_previous_one_completed(pool: RegisteredPool) -> None:
    src = make_caches("flash_attn_NHD", 43)
    engine = pl.DevicePipeline(src.layers, src.layout())
    if not engine._sync.raw:
        pytest.skip("libcudart not reachable: the copies go through torch, not the recorded sync")
    engine._sync = rec = RecordingSync(engine._sync)
    slots = _slots(src, sum(SIZES), 44)
    objs = [pool.alloc(engine, t) for t in SIZES]
    h = engine.store(objs, slots, paced=True)
    h.wait()
    _check_objects(objs, _reference_gather(src, slots).cpu(), slots)
    log = rec.log
    copies = [i for i, (op, _) in enumerate(log) if op == "copy"]
    assert [log[i][1] for i in copies] == [o.data_ptr() for o in objs]  # one copy a chunk, in order
    for prev, nxt in zip(copies, copies[1:], strict=False):
        after = log[prev + 1]  # the event recorded right behind the previous copy
        assert after[0] == "record"
        # Between the two copies the host waited for that event: the copy stream ran dry.
        assert ("synchronize", after[1]) in log[prev + 1 : nxt], log[prev:nxt]


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


def test_a_load_issued_between_the_store_and_its_wait_shares_nothing_with_it(pool: RegisteredPool) -> None:
    src, other = make_caches("flash_attn_NHD", 48), make_caches("flash_attn_NHD", 49)
    engine = pl.DevicePipeline(src.layers, src.layout(), ring_slots=2)
    layout = src.layout()
    perm = torch.randperm(layout.num_slots, generator=torch.Generator().manual_seed(50))
    n = sum(SIZES)
    store_slots, load_slots = perm[:n], perm[n : 2 * n]
    objs = [pool.alloc(engine, t) for t in SIZES]
    want = _reference_gather(src, store_slots).cpu()
    # Objects to load: another cache's tokens, written into src's other slots.
    incoming = [pool.alloc(engine, t) for t in SIZES]
    got = _reference_gather(other, load_slots).cpu()
    token0 = 0
    for obj, t in zip(incoming, SIZES, strict=True):
        obj.copy_(got[:, :, token0 : token0 + t])
        token0 += t
    expected = src.clone()
    kv_ops.scatter(got.cuda(), expected.layers, layout, load_slots.cuda(), backend="reference")

    h = engine.store(objs, store_slots, paced=True)
    load = engine.load(incoming, load_slots)  # uses the ring while the store waits to be issued
    load.wait()
    h.wait()
    torch.cuda.synchronize()
    _check_objects(objs, want, store_slots)
    assert torch.equal(src.bits(), expected.bits())


def test_two_threads_waiting_issue_the_store_once(pool: RegisteredPool) -> None:
    src = make_caches("flashinfer_NHD", 51)
    engine = pl.DevicePipeline(src.layers, src.layout())
    slots = _slots(src, sum(SIZES), 52)
    objs = [pool.alloc(engine, t) for t in SIZES]
    calls = []
    pump = engine._pump
    engine._pump = lambda h: (calls.append(h), pump(h))  # type: ignore[method-assign]
    h = engine.store(objs, slots, paced=True, checksums=True)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            h.wait()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and len(calls) == 1 and h.done()
    _check_objects(objs, _reference_gather(src, slots).cpu(), slots)
    assert h.checksums() == [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]


def test_a_failure_while_issuing_is_raised_to_every_waiter_and_the_engine_stays_usable(
    pool: RegisteredPool,
) -> None:
    src = make_caches("flash_attn_NHD", 53)
    engine = pl.DevicePipeline(src.layers, src.layout())
    slots = _slots(src, sum(SIZES), 54)
    objs = [pool.alloc(engine, t) for t in SIZES]
    real_d2h = engine._d2h
    seen = []

    def failing(host: Any, stage: Any, stream: Any = None) -> None:
        seen.append(host)
        if len(seen) == 2:
            raise RuntimeError("cudaMemcpyAsync failed: cudaError 1")
        real_d2h(host, stage, stream)

    engine._d2h = failing  # type: ignore[method-assign]
    h = engine.store(objs, slots, paced=True)
    for _ in range(2):
        with pytest.raises(RuntimeError, match="cudaError 1"):
            h.wait()
    assert not h.done()
    assert len(seen) == 2  # nothing was issued after the failure
    engine.synchronize()
    engine._d2h = real_d2h  # type: ignore[method-assign]
    again = engine.store(objs, slots, paced=True)
    again.wait()
    _check_objects(objs, _reference_gather(src, slots).cpu(), slots)
