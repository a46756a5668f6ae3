"""The connector's CUDA load paths: non-blocking asynchronous load and layer overlap through
``TransferEngine.load_layers`` (``-m gpu``; skipped without CUDA).

Real shapes (32 layers, 8 KV heads of 128, bf16, block size 16 != heads), NHD and HND, a real
server and its ``/dev/shm`` pool registered with CUDA by ``KVTransferEngine``. Three 256-token
chunks and a partial tail are stored, then loaded into a fresh poisoned cache, skipping the
first block (``place_begin``) and stopping one token short of the tail (``place_end``):

- ``async``: ``AsyncLoader`` (the worker's ``maru_async_load``): lookup, pin and ``pipeline.load``
  on the loader thread, completion polled with ``done()``, unpin after it;
- ``layers``: ``PipelinedLayerLoad`` (``maru_overlap_load_with_compute``): one ``load_layers``
  for the request's chunks, ``wait_for_layer`` for every layer, pins released after ``wait()``.

Checks (``tests/transfer/helpers.py::check_connector_load``, which also runs in CI on CPU caches
with a CPU TransferEngine, in ``test_async_load.py``): one pipelined call for the four chunks; every pin released
once; the whole storage byte for byte against the staged path into an identical poisoned cache;
every placed token against its source token (kv_ops reference gather); skipped slots poisoned.
"""

from __future__ import annotations

import pytest
import torch

from maru.client import MaruHandler
from tests.pool_fixtures import module_client
from tests.transfer.helpers import check_connector_load

pytestmark = [
    pytest.mark.gpu,
]

GEOM = dict(
    device="cuda",
    num_blocks=64,  # 49 blocks per request: three 256-token chunks and a 9-token tail
    block_size=16,
    num_kv_heads=8,
    head_size=128,
    num_layers=32,
    dtype=torch.bfloat16,
)
CHUNK = 256


# Each test stores ~97 MiB (4 objects of 32 MiB at most); four tests.
client = module_client("connector-load-gpu", pool_size="1G", timeout_s=30)


@pytest.mark.parametrize("path", ["async", "layers"])
@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_connector_cuda_load_paths_round_trip_byte_exact_and_leave_skipped_slots_poisoned(
    path: str, physical: str, client: MaruHandler
) -> None:
    check_connector_load(path, physical, client, GEOM, CHUNK, inject=False)
