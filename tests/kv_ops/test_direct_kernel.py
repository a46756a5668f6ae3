"""The direct layer kernel's grid (``direct_kernel.tile_programs``).

Its placements and fused checksums, with a program a tile and with two programs looping over every
tile, are compared against the reference by ``python -m maru.kv_ops.selfcheck`` (interpreter:
``test_kv_ops_triton.py``; CUDA: ``test_kv_ops_gpu.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from maru.kv_ops import direct_kernel  # noqa: E402
from maru.kv_ops.triton_kernels import TuneParams  # noqa: E402


def test_a_program_a_tile_unless_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TuneParams, "direct_programs", 0)
    assert direct_kernel.tile_programs(3600, 4) == 900
    assert direct_kernel.tile_programs(3601, 4) == 901
    assert direct_kernel.tile_programs(3600, 4, 64) == 64
    assert direct_kernel.tile_programs(10, 4, 64) == 3  # never more programs than tiles
    monkeypatch.setattr(TuneParams, "direct_programs", 132)
    assert direct_kernel.tile_programs(3600, 4) == 132
    assert direct_kernel.tile_programs(3600, 4, 0) == 900  # an explicit 0: no cap
    assert direct_kernel.tile_programs(1, 4) == 1
