"""The connector's background-thread load paths on CUDA caches (``-m gpu``; skipped without CUDA).

The layer-overlap load (``LayerwiseLoad``) and a load run on a loader thread (``load``) queue their
kernels from a background thread; a layer (or a request) may be reported placed only once those
kernels ran (``KVTransferEngine.sync_device``, or the transfer's own wait). Real head
geometry (8 KV heads of 128, bf16, block size 16 != heads), NHD and HND; the reference is the
synchronous load on the calling thread, compared byte for byte.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from maru import kv_ops
from maru.client import MaruHandler
from maru.kv_ops.testing import CacheCase, make_cache
from maru.transfer.background import BackgroundRunner
from maru.transfer.engine import KVTransferEngine
from maru.transfer.records import RequestTransfer
from tests.pool_fixtures import module_client
from tests.transfer.helpers import CountingPins, layer_equal, same

pytestmark = [
    pytest.mark.gpu,
]

BS, CHUNK, LAYERS = 16, 256, 8


client = module_client("datapath-gpu", pool_size="1G")


def _case(physical: str, seed: int) -> CacheCase:
    g = torch.Generator().manual_seed(seed)
    return make_cache(
        "kv_first",
        physical,
        device="cuda",
        num_blocks=64,
        block_size=BS,
        num_kv_heads=8,
        head_size=128,
        num_layers=LAYERS,
        dtype=torch.bfloat16,
        generator=g,
    )


def _engine(case: CacheCase, client: object) -> KVTransferEngine:
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    return KVTransferEngine(list(case.caches), layout, client)


def _requests(tag: str) -> tuple[RequestTransfer, RequestTransfer]:
    from maru.transfer.records import ChunkRef

    chunks = tuple(ChunkRef(f"gpu/{tag}/c{i}", i * CHUNK, CHUNK) for i in range(2))
    g = torch.Generator().manual_seed(zlib.crc32(tag.encode()))
    src_blocks = tuple(int(b) for b in torch.randperm(64, generator=g)[:32])
    dst_blocks = tuple(int(b) for b in torch.randperm(64, generator=g)[:32])
    return RequestTransfer("r-" + tag, src_blocks, chunks), RequestTransfer("r-" + tag, dst_blocks, chunks)


def _slots(rt: RequestTransfer) -> list[int]:
    return [rt.block_ids[t // BS] * BS + t % BS for t in range(2 * CHUNK)]


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_layer_overlap_load_on_cuda_reports_each_layer_only_once_placed(
    physical: str, client: MaruHandler
) -> None:
    src_req, dst_req = _requests(f"layers-{physical}")
    assert _engine(_case(physical, 1), client).store([src_req]).stored == 2
    ref = _case(physical, 2)
    assert _engine(ref, client).load([dst_req]).loaded_req_ids == [dst_req.req_id]
    torch.cuda.synchronize()
    dst = _case(physical, 2)
    pins = CountingPins(client)
    eng = _engine(dst, pins)
    ll = eng.start_layer_load(eng.pin([dst_req]))
    for layer in reversed(range(LAYERS)):
        ll.wait_for_layer(layer)
        assert layer_equal(dst, ref, layer, _slots(dst_req))
    assert ll.wait().loaded_req_ids == [dst_req.req_id]
    assert same(dst, ref) and pins.pinned == pins.released == 2


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_async_load_on_cuda_is_placed_when_the_loader_thread_reports_it(
    physical: str, client: MaruHandler
) -> None:
    src_req, dst_req = _requests(f"async-{physical}")
    assert _engine(_case(physical, 3), client).store([src_req]).stored == 2
    ref = _case(physical, 4)
    _engine(ref, client).load([dst_req])
    torch.cuda.synchronize()
    dst = _case(physical, 4)
    runner = BackgroundRunner("test-loader")
    runner.submit(dst_req.req_id, _engine(dst, client).load, [dst_req])
    ((tag, rep),) = runner.close(timeout=60)
    assert tag == dst_req.req_id and rep.loaded_req_ids == [dst_req.req_id]
    assert same(dst, ref)
