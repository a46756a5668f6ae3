"""On CUDA caches the connector's engine moves KV through ``kv_ops.device_pipeline.DevicePipeline``
(``-m gpu``; skipped without CUDA).

Real geometry (8 KV heads of 128, bf16, block size 16 != heads), NHD and HND, a real server:
store three chunks and a partial tail, load them into a poisoned cache skipping the first block
and stopping short of the tail's end; byte for byte against the staged path (``pipelined=False``)
on an identical cache and against the source tokens. The scenario is shared with the CPU test
of the same wiring (``tests/transfer/test_transfer_wiring.py``).
"""

from __future__ import annotations

import pytest
import torch

from maru.client import MaruHandler
from maru.kv_ops.device_pipeline import DevicePipeline
from tests.pool_fixtures import module_client
from tests.transfer.helpers import check_round_trip, engine, make_case

pytestmark = [
    pytest.mark.gpu,
]

GEOM = dict(
    device="cuda",
    num_blocks=64,
    block_size=16,
    num_kv_heads=8,
    head_size=128,
    num_layers=8,
    dtype=torch.bfloat16,
)
CHUNK = 256


client = module_client("wiring-gpu", pool_size="1G")


def test_cuda_caches_use_the_transfer_engine_over_a_registered_pool(client: MaruHandler) -> None:
    eng = engine(make_case("NHD", 1, GEOM), client)
    assert eng.data_path == "pipelined" and isinstance(eng.path.pipeline, DevicePipeline)
    reg = eng.host_registration
    assert reg is not None and reg.registered, reg.describe() if reg is not None else "no registration"


def test_cuda_caches_can_still_take_the_staged_path(client: MaruHandler) -> None:
    eng = engine(make_case("NHD", 1, GEOM), client, pipelined=False)
    assert eng.data_path == "staged" and eng.path.pipeline is None


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_pipelined_connector_round_trips_skip_and_partial_tail_byte_exact_on_cuda(
    physical: str, client: MaruHandler
) -> None:
    eng = check_round_trip(physical, client, GEOM, CHUNK, inject=False)
    assert eng.data_path == "pipelined"
    pipe = eng.path.pipeline
    # The load's first chunk was copied before the load was prepared, and the load started with it.
    assert (pipe.prestages, pipe.prestages_unused) == (1, 0)
