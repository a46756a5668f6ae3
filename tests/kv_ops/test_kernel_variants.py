"""The benchmark's kernel variants (bench/kernel_variants.py) against the PyTorch reference, byte for byte.

A benchmark number means something only if the kernel it times moves the right bytes. The
destination-ordered variant (``place_variant(..., index=sorted_slots, order=perm)``) with the
streaming and layer-fast switches on must write exactly what the reference writes for the unsorted
mapping: every layout (NHD, HND, packed, the CPU backend's transposed K, cross-layer, padded blocks),
negative slots, skip-prefix, multi-layer and single-layer, gather into poisoned objects and scatter
into poisoned caches. Runs on CPU tensors under TRITON_INTERPRET=1, which must be set before triton
is imported: the comparisons run in a fresh subprocess (this file executed as a script).
``test_kv_ops_variants_gpu.py`` runs the same checks on a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

CASES = [
    # fmt, physical, dtype name, block_pad
    ("kv_first", "NHD", "bfloat16", 0),
    ("kv_first", "HND", "float16", 7),
    ("blocks_first", "HND", "uint8", 0),
    ("packed", "NHD", "float32", 16),
    ("cpu_attn", "NHD", "bfloat16", 0),
    ("cross_layer", "NHD", "float16", 0),
    ("mla", "NHD", "bfloat16", 0),
]


def _run_checks(device: str = "cpu", seed: int = 0) -> list[str]:
    """Every case: ordered kernel vs reference; returns failures (empty when all matched)."""
    import torch

    from bench.kernel_variants import Variant, place_variant
    from maru import kv_ops
    from maru.kv_ops.ops import as_bits, layer_refs
    from maru.kv_ops.testing import bits, make_cache, random_bits_, random_slots

    variant = Variant(stream=True, layer_fast=True)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(bits(a).cpu(), bits(b).cpu())

    def moved(case):
        if device == "cpu":
            return case
        src = [case.caches] if isinstance(case.caches, torch.Tensor) else case.caches
        dst = [s.to(device) for s in case.storages()]
        views = [
            torch.as_strided(m, c.shape, c.stride(), c.storage_offset())
            for m, c in zip(dst, src, strict=True)
        ]
        case.caches = views[0] if isinstance(case.caches, torch.Tensor) else views
        return case

    gen = torch.Generator().manual_seed(seed)
    failures: list[str] = []
    for fmt, physical, dname, pad in CASES:
        dtype = getattr(torch, dname)
        geom = dict(
            num_blocks=7, block_size=4, num_kv_heads=3, head_size=8, num_layers=3, dtype=dtype, block_pad=pad
        )

        def make(s: int, fmt=fmt, physical=physical, geom=geom):
            return moved(make_cache(fmt, physical, generator=torch.Generator().manual_seed(s), **geom))

        src = make(seed + 1)
        layout = kv_ops.detect_layouts(src.caches, **src.detect_kwargs())
        n = 13
        slots = torch.tensor(random_slots(layout.num_slots, n, negatives=3, generator=gen), device=device)
        sorted_slots, order = torch.sort(slots)
        shape = (geom["num_layers"], layout.num_kv, n, layout.row_size)
        poison = random_bits_(torch.empty(shape, dtype=dtype), gen).to(device)
        name = f"{fmt}/{physical}/{dname}/pad{pad}"
        # gather: rows of negative slots keep the poison
        ref = kv_ops.gather(src.caches, layout, slots, backend="reference", out=poison.clone())
        got = poison.clone()
        refs = layer_refs(src.caches, layout)
        place_variant(refs, layout, sorted_slots, as_bits(got), gather=True, variant=variant, order=order)
        if not same(ref, got):
            failures.append(f"ordered gather {name}")
        # scatter with a skipped prefix into two identical caches: whole storages must agree
        for skip in (0, 2):
            a, b = make(seed + 2), make(seed + 2)
            kv_ops.scatter(poison, a.caches, layout, slots, backend="reference", skip_tokens=skip)
            place_variant(
                layer_refs(b.caches, layout),
                layout,
                sorted_slots,
                as_bits(poison),
                gather=False,
                variant=variant,
                skip=skip,
                order=order,
            )
            if not all(same(x, y) for x, y in zip(a.storages(), b.storages(), strict=True)):
                failures.append(f"ordered scatter skip={skip} {name}")
        # single layer (the layer-overlap path)
        layer = geom["num_layers"] - 1
        c, d = make(seed + 3), make(seed + 3)
        lk = {"layer": layer} if layout.is_cross_layer else {}
        cl = c.caches if layout.is_cross_layer else c.caches[layer]
        kv_ops.scatter_layer(poison[layer], cl, layout, slots, backend="reference", **lk)
        dref = layer_refs(d.caches, layout)[layer]
        place_variant(
            [dref],
            layout,
            sorted_slots,
            as_bits(poison[layer : layer + 1]),
            gather=False,
            variant=variant,
            single_layer=True,
            order=order,
        )
        if not all(same(x, y) for x, y in zip(c.storages(), d.storages(), strict=True)):
            failures.append(f"ordered scatter_layer {name}")
    return failures


def test_ordered_variant_matches_the_reference_byte_for_byte_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, __file__], env=env, capture_output=True, text=True, timeout=300, cwd=os.getcwd()
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


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    found = _run_checks(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    for f in found:
        print("FAIL", f)
    print("ordered: all matched" if not found else f"ordered: {len(found)} failures")
    sys.exit(1 if found else 0)
