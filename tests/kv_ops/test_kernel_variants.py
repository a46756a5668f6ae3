"""The benchmark's kernel variants (bench/kernel_variants.py) against the PyTorch reference, byte for byte.

A benchmark number means something only if the kernel it times moves the right bytes. The
destination-ordered variant (``place_variant(..., index=sorted_slots, order=perm)``) with the
streaming and layer-fast switches on must write exactly what the reference writes for the unsorted
mapping: every layout (NHD, HND, packed, the CPU backend's transposed K, cross-layer, padded blocks),
negative slots, skip-prefix, multi-layer and single-layer, gather into poisoned objects and scatter
into poisoned caches. Runs on CPU tensors under TRITON_INTERPRET=1, which must be set before triton
is imported: the comparisons run in a fresh subprocess (``variant_checks.py`` run as a script).
``test_kv_ops_variants_gpu.py`` runs the same checks on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.kv_ops import variant_checks


def test_ordered_variant_matches_the_reference_byte_for_byte_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, variant_checks.__file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.getcwd(),
    )
    report = proc.stdout + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    assert "ordered: all matched" in proc.stdout, report


def test_ordered_variant_refuses_a_permutation_of_another_length() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from bench.kernel_variants import place_variant
    from maru import kv_ops
    from maru.kv_ops.ops import as_bits, layer_refs
    from maru.kv_ops.testing import make_cache

    case = make_cache("kv_first", "NHD", num_layers=2)
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    refs = layer_refs(case.caches, layout)
    obj = as_bits(torch.zeros(2, 2, 4, layout.row_size, dtype=torch.float16))
    idx = torch.arange(4)
    with pytest.raises(ValueError, match="must equal"):
        place_variant(refs, layout, idx, obj, gather=True, order=idx[:3])
