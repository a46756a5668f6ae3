"""Maru's LMCache backend on a GPU host: LMCache memory objects in CUDA memory go into the pool and
come back byte for byte, through the copying get and the zero-copy get (pool registered with CUDA).
Run on a GPU host: ``pytest -m gpu tests/lmcache``."""

from __future__ import annotations

import pytest
import torch

from maru.lmcache.objects import HEADER_BYTES
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
    # The pool's bytes first (read through Maru's own client), so a failure says which side broke.
    client = be.link.client()
    stored = client.batch_retrieve([be.key(k) for k in keys], pin=True, verify=True)
    for i, (h, t) in enumerate(zip(stored, data, strict=True)):
        assert h is not None, f"chunk {i} is not readable from the pool"
        n = t.numel() * t.element_size()
        pool_bytes = torch.frombuffer(bytearray(h.view[HEADER_BYTES : HEADER_BYTES + n]), dtype=torch.uint8)
        assert torch.equal(pool_bytes, t.view(torch.uint8).flatten().cpu()), (
            f"the put stored wrong bytes (chunk {i})"
        )
    client.batch_release(stored)
    got = be.batched_get_blocking(keys)
    for i, (g, t) in enumerate(zip(got, data, strict=True)):
        assert g is not None
        assert torch.equal(g.tensor.cpu().view(torch.uint8), t.view(torch.uint8).cpu()), (
            f"the get returned wrong bytes (chunk {i}; its tensor on {g.tensor.device}, pool bytes were right)"
        )
        g.ref_count_down()
    for o in objs:
        o.ref_count_down()
    if zero_copy:
        from maru.client.cuda_host import registrations

        pool = be.link.client().pool_mapping
        mine = [r for r in registrations() if r["address"] == pool.address]
        assert mine and mine[-1]["state"] == "registered", registrations()
