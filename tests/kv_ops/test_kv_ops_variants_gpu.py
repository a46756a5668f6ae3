"""The benchmark's kernel variants on a real GPU, byte for byte: the destination-ordered variant on
every layout, and every scatter store cache operator the benchmark sweeps; and graph capture under
garbage collection.

Skipped where no CUDA device is visible (CI); the CPU suite runs the same variant checks under the
interpreter (``test_kernel_variants.py``; both run ``variant_checks.py``).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
]

from bench.kernel_variants import CACHE_OPERATORS, Variant, place_variant  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.kv_ops.ops import as_bits, layer_refs  # noqa: E402
from maru.kv_ops.testing import bits, make_cache, random_bits_, random_slots  # noqa: E402
from tests.kv_ops.variant_checks import run_checks  # noqa: E402


def test_ordered_variant_matches_reference_on_every_layout_on_the_gpu() -> None:
    failures = run_checks("cuda", seed=3)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("cache_modifier", CACHE_OPERATORS)
def test_scatter_with_each_store_cache_operator_writes_what_the_reference_writes(cache_modifier: str) -> None:
    gen = torch.Generator().manual_seed(21)
    geom = dict(
        num_blocks=300, block_size=16, num_kv_heads=8, head_size=128, num_layers=3, dtype=torch.bfloat16
    )
    a = make_cache("kv_first", "NHD", generator=torch.Generator().manual_seed(22), device="cuda", **geom)
    b = make_cache("kv_first", "NHD", generator=torch.Generator().manual_seed(22), device="cuda", **geom)
    layout = kv_ops.detect_layouts(a.caches, **a.detect_kwargs())
    slots = torch.tensor(random_slots(layout.num_slots, 1500, negatives=7, generator=gen), device="cuda")
    obj = random_bits_(torch.empty(3, 2, 1500, layout.row_size, dtype=torch.bfloat16), gen).cuda()
    variant = Variant(scatter_store_cache=cache_modifier)
    place_variant(
        layer_refs(b.caches, layout), layout, slots, as_bits(obj), gather=False, variant=variant, skip=3
    )
    kv_ops.scatter(obj, a.caches, layout, slots, backend="reference", skip_tokens=3)
    torch.cuda.synchronize()
    diff = [int((bits(x) != bits(y)).sum()) for x, y in zip(a.storages(), b.storages(), strict=True)]
    assert not any(diff), f"differing elements per storage: {diff}"


def test_graph_capture_survives_a_garbage_collection_that_frees_another_placers_graphs() -> None:
    """A dead placer (a reference cycle holding captured graphs) collected by Python's automatic GC
    in the middle of another placer's capture destroys graphs, which invalidates that capture unless
    the placer keeps the GC off while capturing (torch no longer collects before a capture)."""
    import gc

    gen = torch.Generator().manual_seed(31)
    geom = dict(
        num_blocks=64, block_size=16, num_kv_heads=8, head_size=128, num_layers=3, dtype=torch.bfloat16
    )
    a = make_cache("kv_first", "NHD", generator=torch.Generator().manual_seed(32), device="cuda", **geom)
    b = make_cache("kv_first", "NHD", generator=torch.Generator().manual_seed(32), device="cuda", **geom)
    layout = kv_ops.detect_layouts(a.caches, **a.detect_kwargs())
    saved = gc.get_threshold()
    try:
        gc.collect()
        gc.set_threshold(1_000_000_000)  # keep the garbage below alive until the capture starts
        old = kv_ops.GraphedPlacer(b.caches, layout)
        old.warm(32, per_layer=True)
        old.cycle = old  # garbage only a collection can free
        del old
        placer = kv_ops.GraphedPlacer(b.caches, layout)
        launch, calls = placer._launch, []

        def launch_with_collection_due(key):
            calls.append(key)
            if len(calls) == 2:  # the second call runs inside the capture (the first warms outside)
                gc.set_threshold(1)
                _ = [[] for _ in range(100)]  # container allocations: a collection is due now
            launch(key)

        placer._launch = launch_with_collection_due
        slots = torch.tensor(random_slots(layout.num_slots, 48, negatives=2, generator=gen), device="cuda")
        obj = random_bits_(torch.empty(3, 2, 48, layout.row_size, dtype=torch.bfloat16), gen).cuda()
        placer.staging(48).copy_(obj)
        placer.set_slots(slots)
        placer.scatter(48)
    finally:
        gc.set_threshold(*saved)
        gc.collect()
    assert len(calls) == 2
    kv_ops.scatter(obj, a.caches, layout, slots, backend="reference")
    torch.cuda.synchronize()
    assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a.storages(), b.storages(), strict=True))
