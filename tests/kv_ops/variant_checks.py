"""The kernel-variant checks shared by ``test_kernel_variants.py`` (CPU, under the Triton
interpreter) and ``test_kv_ops_variants_gpu.py`` (a GPU): the destination-ordered variant against
the PyTorch reference on every layout. No tests here. Run as a script (``TRITON_INTERPRET=1`` must
be set before triton is imported, so the CPU test runs it in a fresh process): prints
``ordered: all matched`` or the failures.
"""

from __future__ import annotations

import os
import sys

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


def run_checks(device: str = "cpu", seed: int = 0) -> list[str]:
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


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    found = run_checks(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    for f in found:
        print("FAIL", f)
    print("ordered: all matched" if not found else f"ordered: {len(found)} failures")
    sys.exit(1 if found else 0)
