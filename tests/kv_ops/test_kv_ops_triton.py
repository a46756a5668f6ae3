"""Triton kernels vs the PyTorch reference, byte for byte, on CPU under TRITON_INTERPRET=1.

TRITON_INTERPRET must be set before triton is imported, so the comparisons run in a fresh
subprocess (``python -m maru.kv_ops.selfcheck``) and this process stays uninterpreted for the
other tests. The self-check poisons every output, covers every layout (NHD and HND, padded blocks),
fp16/bf16/fp32/uint8/float8, random slot orders with negative slots, skip-prefix, the single-layer
and block-granular kernels, and proves that logical (token-major) strides on an HND cache are caught.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def test_triton_kernels_match_the_reference_byte_for_byte_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-m", "maru.kv_ops.selfcheck"],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    report = proc.stdout + proc.stderr[-3000:]
    assert "FAIL" not in proc.stdout, report
    assert proc.returncode == 0, report
    assert "comparisons matched on cpu" in proc.stdout, report


def test_tile_sizes_are_memoised_per_tuning_and_follow_a_change_of_it() -> None:
    from maru.kv_ops import triton_kernels as tk

    row = type("L", (), {"row_size": 1024})()  # tiles reads only the row size
    saved = (tk.TuneParams.block_t, tk.TuneParams.num_warps)
    try:
        for tokens in (1, 3, 16, 256, 4096):
            assert tk.tiles(row, tokens) == tk._tiles(row, tokens, None, None)  # type: ignore[arg-type]
            assert tk.tiles(row, tokens) == tk.tiles(row, tokens)  # type: ignore[arg-type]
        before = tk.tiles(row, 4096)  # type: ignore[arg-type]
        tk.TuneParams.block_t, tk.TuneParams.num_warps = 16, 8
        after = tk.tiles(row, 4096)  # type: ignore[arg-type]
        assert after == tk._tiles(row, 4096, None, None) != before  # type: ignore[arg-type]
        assert tk.tiles(row, 4096, block_t=2, num_warps=2) == tk._tiles(row, 4096, 2, 2)  # type: ignore[arg-type]
    finally:
        tk.TuneParams.block_t, tk.TuneParams.num_warps = saved
