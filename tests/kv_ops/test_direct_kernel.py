"""The direct layer kernel's grid (``direct_kernel.tile_programs``).

Its placements and fused checksums, with a program a tile and with two programs a plane looping over
every tile, are compared against the reference by ``python -m maru.kv_ops.selfcheck`` (interpreter:
``test_kv_ops_triton.py``; CUDA: ``test_kv_ops_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from maru.kv_ops import direct_kernel  # noqa: E402
from maru.kv_ops.triton_kernels import TuneParams  # noqa: E402

CPU = torch.device("cpu")


def test_a_program_a_tile_or_capped_over_both_planes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TuneParams, "direct_programs", 0)
    assert direct_kernel.tile_programs(3600, 4, 2, CPU) == 900
    assert direct_kernel.tile_programs(3601, 4, 2, CPU) == 901
    assert direct_kernel.tile_programs(3600, 4, 2, CPU, 128) == 64  # 128 over two planes
    assert direct_kernel.tile_programs(3600, 4, 1, CPU, 128) == 128  # MLA: one plane
    assert direct_kernel.tile_programs(10, 4, 2, CPU, 128) == 3  # never more programs than tiles
    assert direct_kernel.tile_programs(3600, 4, 2, CPU, 1) == 1  # at least one a plane
    monkeypatch.setattr(TuneParams, "direct_programs", 132)
    assert direct_kernel.tile_programs(3600, 4, 2, CPU) == 66
    assert direct_kernel.tile_programs(3600, 4, 2, CPU, 0) == 900  # an explicit 0: no cap


def test_one_program_an_sm_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TuneParams, "direct_programs", -1)
    # No SMs to count on the CPU (the interpreter): a program a tile.
    assert direct_kernel.tile_programs(3600, 4, 2, CPU) == 900
    monkeypatch.setitem(direct_kernel._SMS, "gpu-like", 132)  # an H200's 132 SMs
    assert direct_kernel.tile_programs(3600, 4, 2, "gpu-like") == 66
    assert direct_kernel.tile_programs(100, 4, 2, "gpu-like") == 25


def test_the_default_is_one_an_sm_unless_the_environment_says_otherwise() -> None:
    import os
    import subprocess
    import sys

    code = "from maru.kv_ops.triton_kernels import TuneParams as T; print(T.direct_programs)"
    env = {k: v for k, v in os.environ.items() if k != "MARU_DIRECT_PROGRAMS"}
    out = [
        subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True).stdout
        for e in (env, dict(env, MARU_DIRECT_PROGRAMS="0"))
    ]
    assert [o.strip() for o in out] == ["-1", "0"]


def test_a_grid_left_set_by_the_environment_is_reported_as_a_slow_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from maru.kv_ops.layer_copies import CopiedLayers

    direct_way = SimpleNamespace(_copied_ok=False, copies_oom=None, copied_off=None)
    monkeypatch.setattr(TuneParams, "direct_programs", -1)
    assert direct_kernel.grid_override() is None
    assert CopiedLayers.layer_way(direct_way) == (None, None)  # type: ignore[arg-type]
    for cap, grid in ((0, "a program a token tile"), (64, "at most 64 programs")):
        monkeypatch.setattr(TuneParams, "direct_programs", cap)
        way, why = CopiedLayers.layer_way(direct_way)  # type: ignore[arg-type]
        assert way == f"direct, grid of MARU_DIRECT_PROGRAMS={cap}"
        assert why is not None and grid in why and "Fix: unset MARU_DIRECT_PROGRAMS" in why
