"""Integrity on CUDA caches: the device checksums and every GPU load path (H200; marked gpu).

* ``kv_ops.checksum`` on CUDA equals ``maru.checksum`` bit for bit;
* ``DevicePipeline`` with ``checksums=True``: chunk load (the staging slot) and store (the staging slot
  of the ring store, or read back from the objects written in place), the direct
  layer load (fused into the kernel) and the staged layer load give each object's checksum; a
  byte changed in a host object shows;
* the engine against a real server, bf16, NHD and HND, block size 4 != 3 heads: a byte changed
  behind a committed chunk fails its request on the pipelined, staged and layer-by-layer paths,
  the request next to it loads byte for byte, the counter and the server show it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from maru import kv_ops
from maru.checksum import checksum
from maru.client import MaruHandler
from maru.kv_ops import checksum as ck
from maru.kv_ops.testing import CacheCase, bits, make_cache, naive_token
from maru.transfer.engine import KVTransferEngine
from maru.transfer.paths import StagedPath
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client
from tests.transfer.helpers import BS, CHUNK, flip_behind, load_in_mode, request

pytestmark = [pytest.mark.gpu]

server = module_server("integrity-gpu", pool_size="256M")
client = pool_client()


def _case(physical: str, seed: int, num_blocks: int = 32) -> CacheCase:
    g = torch.Generator().manual_seed(seed)
    return make_cache(
        "kv_first",
        physical,
        device="cuda",
        num_blocks=num_blocks,
        block_size=BS,
        num_kv_heads=3,
        head_size=64,
        num_layers=4,
        dtype=torch.bfloat16,
        generator=g,
    )


def _np(t: torch.Tensor) -> int:
    return checksum(t.contiguous().view(-1).view(torch.uint8).cpu().numpy())


@pytest.mark.parametrize("size", [1, 7, 8, 4096 * 8 + 3, 5 << 20])
def test_the_kernel_on_cuda_matches_maru_checksum(size: int) -> None:
    g = torch.Generator().manual_seed(size)
    t = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    assert ck.checksums([t.cuda()]) == [checksum(t.numpy())]
    acc = torch.zeros(1, dtype=torch.int64, device="cuda")
    ck.accumulate_many([t.pin_memory()], acc)  # zero-copy over the bus, as from the pool
    assert ck.finalize(int(acc[0]), size) == checksum(t.numpy())


@pytest.mark.parametrize("physical", ["NHD", "HND"])
@pytest.mark.parametrize("how", ["chunks", "chunks-direct-store", "direct", "copied", "staged-layers"])
def test_device_pipeline_checksums_are_of_the_bytes_it_moved(physical: str, how: str) -> None:
    from maru.kv_ops.device_pipeline import DevicePipeline

    case = _case(physical, 1)
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    lp = {"direct": "direct", "copied": "copied", "staged-layers": "staged"}.get(how, "auto")
    sp = "direct" if how == "chunks-direct-store" else "staged"  # the store in place, or the ring
    pipe = DevicePipeline(case.caches, layout, layer_path=lp, layer_checksums=True, store_path=sp)
    tokens = [16, 16, 5]
    objs = [torch.empty(pipe.object_shape(t), dtype=torch.bfloat16).pin_memory() for t in tokens]
    slots = torch.arange(sum(tokens), dtype=torch.int64) + 3
    st = pipe.store(objs, slots, checksums=True)
    st.wait()
    assert st.checksums() == [_np(o) for o in objs]
    objs[1].view(-1).view(torch.uint8)[77] ^= 1  # a byte changed behind the store
    dst = _case(physical, 2)
    dpipe = DevicePipeline(dst.caches, layout, layer_path=lp, layer_checksums=True)
    if how.startswith("chunks"):
        ld = dpipe.load(objs, slots, skip_tokens=4, checksums=True)
    else:
        ld = dpipe.load_layers(objs, slots, skip_tokens=4, checksums=True)
    ld.wait()
    got = ld.checksums()
    assert got == [_np(o) for o in objs] and got[1] != st.checksums()[1]


@pytest.fixture(params=["NHD", "HND"])
def physical(request: Any) -> str:
    return request.param


@pytest.mark.parametrize(
    "path,mode",
    [
        ("pipelined", "sync"),
        ("pipelined", "async"),
        ("pipelined", "layers"),
        ("staged", "sync"),
        ("staged", "layers"),
    ],
)
def test_a_byte_changed_behind_a_chunk_fails_its_request_on_every_gpu_path(
    path: str, mode: str, physical: str, server: ServerProcess, client: MaruHandler
) -> None:
    tag = f"gpu-integ-{path}-{mode}-{physical}"
    src = _case(physical, 3)
    layout = kv_ops.detect_layouts(src.caches, **src.detect_kwargs())
    store = KVTransferEngine(list(src.caches), layout, client)
    victim = request(tag + "-v", [9, 3, 14, 0, 7], 2 * CHUNK + BS)
    good = request(tag + "-g", [1, 12, 5, 10, 6], 2 * CHUNK)
    assert store.store([victim, good]).stored == 5
    store.close()
    for req in (victim, good):  # the device-computed checksums are those of the pool bytes
        got = client.batch_retrieve([c.key for c in req.chunks])
        assert all(r is not None for r in got)
        client.batch_release(got)
    flip_behind(server, client, victim.chunks[1].key, store.geometry.nbytes(CHUNK) // 2 + 3)
    before = client.integrity()["integrity_failures"]
    dst, ref = _case(physical, 4), _case(physical, 4)
    ref_eng = KVTransferEngine(list(ref.caches), layout, client)
    assert ref_eng.load([good]).loaded_req_ids == [good.req_id]
    ref_eng.close()
    p = StagedPath(list(dst.caches), layout) if path == "staged" else None
    eng = KVTransferEngine(list(dst.caches), layout, client, path=p)
    try:
        assert eng.data_path == path
        rep = load_in_mode(eng, [victim, good], mode)
    finally:
        eng.close()
    assert rep.loaded_req_ids == [good.req_id]
    assert "checksum" in rep.failed[victim.req_id]
    torch.cuda.synchronize()
    for layer in range(4):
        for kv in range(2):
            for t in range(2 * CHUNK):
                s = good.block_ids[t // BS] * BS + t % BS
                assert torch.equal(bits(naive_token(dst, layer, kv, s)), bits(naive_token(ref, layer, kv, s)))
    assert client.integrity()["integrity_failures"] == before + 1
    assert client.usage()["pinned"] == 0
