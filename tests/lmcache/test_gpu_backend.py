"""Maru's LMCache backend on a GPU host: LMCache memory objects in CUDA memory go into the pool and
come back byte for byte, through the copying get and the zero-copy get (pool registered with CUDA).
Run on a GPU host: ``pytest -m gpu tests/lmcache``."""

from __future__ import annotations

import pytest
import torch

from tests.lmcache.conftest import NEEDS, WHY, backend, cache_keys

pytest.importorskip(NEEDS, reason=WHY)
pytestmark = pytest.mark.gpu


def _cuda_objects(n: int, shape: torch.Size, dtype: torch.dtype) -> tuple[list, list[torch.Tensor]]:
    from lmcache.v1.memory_allocators.gpu_memory_allocator import GPUMemoryAllocator
    from lmcache.v1.memory_management import MemoryFormat

    alloc = GPUMemoryAllocator(64 << 20, device="cuda")
    objs = alloc.batched_allocate(shape, dtype, n, fmt=MemoryFormat.KV_2LTD)
    assert objs is not None
    data = []
    for o in objs:
        t = (torch.randn(shape, device="cuda") * 8).to(dtype)
        o.tensor.copy_(t)
        data.append(t)
    assert objs[0].tensor.is_cuda
    return objs, data


@pytest.mark.parametrize("zero_copy", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_memory_objects_come_back_byte_for_byte(make_storage, zero_copy, dtype):
    sm = make_storage(dtype=dtype, maru_zero_copy_get=zero_copy)
    be = backend(sm)
    assert str(be.dst_device).startswith("cuda"), be.dst_device
    shape = torch.Size([2, 4, 256, 1024])
    keys = cache_keys(4, dtype=dtype)
    objs, data = _cuda_objects(4, shape, dtype)
    be.batched_submit_put_task(keys, objs)
    assert be.puts.flush(30)
    assert be.batched_contains(keys) == 4
    got = be.batched_get_blocking(keys)
    for g, t in zip(got, data, strict=True):
        assert g is not None
        on_gpu = g.tensor.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(on_gpu.view(torch.uint8), t.view(torch.uint8))
        g.ref_count_down()
    for o in objs:
        o.ref_count_down()
    if zero_copy:
        from maru.client.cuda_host import registrations

        pool = be.link.client().pool_mapping
        mine = [r for r in registrations() if r["address"] == pool.address]
        assert mine and mine[-1]["state"] == "registered", registrations()
