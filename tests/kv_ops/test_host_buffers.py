"""Host-side buffers of the GPU paths, on the CPU: chunk objects over pool pages, reused sums.

``ObjectGeometry.over_many`` must view exactly what ``over`` views (read-only buffers too, with no
warning escaping); ``HostSums`` must hand a buffer out again only after the transfer that owned it
read it once complete (a buffer given back while a copy could still write into it would let one
load's checksum be compared against another's bytes).
"""

from __future__ import annotations

import mmap
import warnings

import pytest
import torch

from maru.kv_ops.checksum import HostSums
from maru.kv_ops.device_handles import Transfer
from maru.kv_ops.geometry import ObjectGeometry, host_object
from maru.kv_ops.pool_objects import PoolObjects


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_objects_by_offset_over_one_tensor_are_the_pages_objects(dtype: torch.dtype) -> None:
    """``PoolObjects`` (the step's objects over ``PoolMapping.read_tensor``) view exactly what
    ``over_many`` views over each page: same address, shape, strides and bytes; an offset that is
    not element-aligned is refused, and so is an object past the pool."""
    geo = ObjectGeometry(num_layers=3, num_kv=2, row=40, dtype=dtype)
    tokens = [7, 16, 16, 5]
    size = geo.nbytes(max(tokens))
    mm, views = _pages(len(tokens), size, seed=4)
    whole = memoryview(mm)
    base = torch.frombuffer(whole, dtype=dtype)
    by_offset = list(PoolObjects.make(base, geo, [(k * size, t) for k, t in enumerate(tokens)]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        by_page = geo.over_many(zip(views, tokens, strict=True))
    for a, b in zip(by_offset, by_page, strict=True):
        assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride())
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if dtype.itemsize > 1:
        with pytest.raises(ValueError, match="multiple of the element size"):
            PoolObjects.make(base, geo, [(1, 5)])
    with pytest.raises(ValueError, match="does not fit"):
        PoolObjects.make(base, geo, [(len(tokens) * size - geo.nbytes(5) + dtype.itemsize, 5)])
    del by_offset, by_page, a, b, base
    whole.release()
    for v in views:
        v.release()
    mm.close()


def _pages(n: int, nbytes: int, seed: int) -> tuple[mmap.mmap, list[memoryview]]:
    mm = mmap.mmap(-1, n * nbytes)
    g = torch.Generator().manual_seed(seed)
    mm[:] = torch.randint(0, 256, (n * nbytes,), dtype=torch.uint8, generator=g).numpy().tobytes()
    whole = memoryview(mm)
    return mm, [whole[i * nbytes : (i + 1) * nbytes].toreadonly() for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8])
def test_over_many_views_what_over_views_on_read_only_pages(dtype: torch.dtype) -> None:
    geo = ObjectGeometry(num_layers=3, num_kv=2, row=40, dtype=dtype)
    tokens = [7, 16, 16, 5]
    size = geo.nbytes(max(tokens))
    mm, views = _pages(len(tokens), size, seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # neither call may let torch's read-only warning out
        many = geo.over_many(zip(views, tokens, strict=True))
        one = [geo.over(v, t) for v, t in zip(views, tokens, strict=True)]
    for a, b, t, v in zip(many, one, tokens, views, strict=True):
        assert a.shape == b.shape == (3, 2, t, 40)
        assert a.dtype == dtype
        assert a.data_ptr() == b.data_ptr()
        assert bytes(a.view(torch.uint8).flatten().numpy()) == bytes(v[: geo.nbytes(t)])
    del many, one, a, b
    for v in views:
        v.release()
    mm.close()


def test_host_object_over_a_writable_view_writes_through() -> None:
    mm = mmap.mmap(-1, 4096)
    view = memoryview(mm)[1024:3072]
    obj = host_object(view, (2, 2, 4, 8), torch.float32)
    obj.fill_(1.5)
    assert torch.frombuffer(mm, dtype=torch.float32, count=128, offset=1024).eq(1.5).all()
    assert torch.frombuffer(mm, dtype=torch.float32, count=1, offset=1020).item() == 0.0
    del obj
    view.release()
    mm.close()


class _Sync:
    """Stands in for the engine's event API: the transfer is complete when ``finished``."""

    def __init__(self) -> None:
        self.finished = False

    def query(self, _event: object) -> bool:
        return self.finished

    def synchronize(self, _event: object) -> None:
        self.finished = True


def _transfer(pool: HostSums, values: list[int]) -> tuple[Transfer, _Sync, torch.Tensor]:
    sync = _Sync()
    sums = pool.take(len(values))
    sums.copy_(torch.tensor(values, dtype=torch.int64))
    t = Transfer("load", "pipelined", 0, done_event=object(), sync=sync)
    t.set_checksums(sums, [8] * len(values), pool)
    return t, sync, sums


def test_host_sums_buffer_comes_back_only_after_its_transfer_completed_and_was_read() -> None:
    pool = HostSums(pin=False)
    t, sync, sums = _transfer(pool, [5, 6, 7])
    early = t.checksums()  # read before completion: not given back (a copy may still write)
    assert early == [5 ^ 8, 6 ^ 8, 7 ^ 8]
    other = pool.take(3)
    assert other.data_ptr() != sums.data_ptr()
    sync.finished = True
    assert t.checksums() == early  # now complete: values kept on the handle, buffer freed
    again = pool.take(2)
    assert again.data_ptr() == sums.data_ptr()
    again.fill_(0)  # the next owner overwrites it: the first handle's values do not change
    assert t.checksums() == early


def test_host_sums_handle_dropped_unread_keeps_its_buffer() -> None:
    pool = HostSums(pin=False)
    t, sync, sums = _transfer(pool, [1, 2])
    sync.finished = True
    ptr = sums.data_ptr()
    del t, sums
    assert len(pool._free) == 0  # never given back: nothing can hand it out again
    keep = pool.take(2)  # a new buffer (the old one may even sit at the same address once freed)
    assert keep.numel() == 2 and ptr


def test_host_sums_grow_past_capacity_and_keep_a_bounded_free_list() -> None:
    pool = HostSums(keep=2, pin=False)
    big = pool.take(HostSums.MIN_CAPACITY * 3)
    assert big.numel() == HostSums.MIN_CAPACITY * 3
    assert big._base is not None and big._base.numel() >= big.numel()
    bufs = [pool.take(4) for _ in range(4)]
    for b in bufs:
        pool.give_back(b)
    assert len(pool._free) == 2
    small = pool.take(1)
    pool.give_back(small)
    grown = pool.take(HostSums.MIN_CAPACITY * 2)  # the free buffer is too small: a new one
    assert grown.numel() == HostSums.MIN_CAPACITY * 2


def test_host_sums_two_threads_reading_one_handle_give_its_buffer_back_once() -> None:
    import threading

    for round_ in range(50):
        pool = HostSums(pin=False)
        t, sync, _ = _transfer(pool, [round_, 2 * round_ + 1])
        sync.finished = True
        want = [round_ ^ 8, (2 * round_ + 1) ^ 8]
        got: list[list[int] | None] = []
        start = threading.Barrier(2)

        def read(t: Transfer = t, got: list = got, start: threading.Barrier = start) -> None:
            start.wait()
            got.append(t.checksums())

        threads = [threading.Thread(target=read) for _ in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert got == [want, want]
        assert len(pool._free) == 1  # given back exactly once
