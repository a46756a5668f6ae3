"""Triton placement kernels on a real GPU against the PyTorch reference, byte for byte.

The same self-check the CPU suite runs under the interpreter (every layout, NHD/HND, padding, five
dtypes, negative slots, skip-prefix, single-layer and block kernels, poisoned outputs, the axis-swap
proof), then a realistic geometry (8 KV heads, head size 128, bf16, block size 16) and the graphed
placer. Skipped where no CUDA device is visible (CI).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
]

from maru import kv_ops  # noqa: E402
from maru.kv_ops import selfcheck  # noqa: E402
from maru.kv_ops.testing import bits, make_cache, random_bits_, random_slots  # noqa: E402


def _to_cuda(case):
    """Move a CacheCase's storages to the GPU, keeping every view's strides and offsets."""
    src = [case.caches] if isinstance(case.caches, torch.Tensor) else case.caches
    moved = [s.cuda() for s in case.storages()]
    views = [
        torch.as_strided(m, c.shape, c.stride(), c.storage_offset()) for m, c in zip(moved, src, strict=True)
    ]
    case.caches = views[0] if isinstance(case.caches, torch.Tensor) else views
    return case


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


def test_backend_on_cuda_is_triton() -> None:
    choice = kv_ops.backend("cuda")
    assert choice.name == "triton", str(choice)


def test_triton_matches_reference_on_every_layout_on_the_gpu() -> None:
    failures = selfcheck.run(device="cuda", seed=1)
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize(
    ("fmt", "physical"),
    [("kv_first", "NHD"), ("kv_first", "HND"), ("blocks_first", "HND"), ("packed", "NHD")],
)
def test_realistic_geometry_matches_reference(fmt: str, physical: str) -> None:
    gen = torch.Generator().manual_seed(5)
    geom = dict(
        num_blocks=256, block_size=16, num_kv_heads=8, head_size=128, num_layers=4, dtype=torch.bfloat16
    )
    src = _to_cuda(make_cache(fmt, physical, generator=gen, **geom))
    layout = kv_ops.detect_layouts(src.caches, **src.detect_kwargs())
    slots = torch.tensor(random_slots(layout.num_slots, 700, negatives=20, generator=gen), device="cuda")
    poison = random_bits_(torch.empty(4, 2, 700, layout.row_size, dtype=torch.bfloat16), gen).cuda()
    ref = kv_ops.gather(src.caches, layout, slots, backend="reference", out=poison.clone())
    tri = kv_ops.gather(src.caches, layout, slots, backend="triton", out=poison.clone())
    assert _same(ref, tri)
    a = _to_cuda(make_cache(fmt, physical, generator=torch.Generator().manual_seed(6), **geom))
    b = _to_cuda(make_cache(fmt, physical, generator=torch.Generator().manual_seed(6), **geom))
    kv_ops.scatter(poison, a.caches, layout, slots, backend="reference", skip_tokens=5)
    kv_ops.scatter(poison, b.caches, layout, slots, backend="triton", skip_tokens=5)
    assert all(_same(x, y) for x, y in zip(a.storages(), b.storages(), strict=True))


def _diagnose(placer, a, b, obj, slots, layout, skip) -> str:
    """Say how the graphed scatter differs: which layers, and whether an eager launch of the same
    arguments fixes it (graph problem) or not (argument problem)."""
    diffs = [int((bits(x) != bits(y)).sum()) for x, y in zip(a.storages(), b.storages(), strict=True)]
    placer._launch(("scatter", slots.numel(), None))
    torch.cuda.synchronize()
    after_eager = [int((bits(x) != bits(y)).sum()) for x, y in zip(a.storages(), b.storages(), strict=True)]
    return f"differing elements per storage {diffs}; after an eager launch with the placer's arguments {after_eager}"


def test_graphed_placer_writes_what_the_reference_writes() -> None:
    gen = torch.Generator().manual_seed(7)
    geom = dict(
        num_blocks=128, block_size=16, num_kv_heads=8, head_size=128, num_layers=4, dtype=torch.bfloat16
    )
    a = _to_cuda(make_cache("kv_first", "HND", generator=torch.Generator().manual_seed(8), **geom))
    b = _to_cuda(make_cache("kv_first", "HND", generator=torch.Generator().manual_seed(8), **geom))
    layout = kv_ops.detect_layouts(a.caches, **a.detect_kwargs())
    placer = kv_ops.GraphedPlacer(b.caches, layout)
    problems: list[str] = []
    for round_ in range(3):  # replays with new data and new slots each time
        slots = torch.tensor(random_slots(layout.num_slots, 256, negatives=4, generator=gen), device="cuda")
        obj = random_bits_(torch.empty(4, 2, 256, layout.row_size, dtype=torch.bfloat16), gen).cuda()
        placer.staging(256).copy_(obj)
        placer.set_slots(slots, skip_tokens=round_)
        if round_ == 1:
            for layer in range(4):
                placer.scatter_layer(layer, 256)
        else:
            placer.scatter(256)
        kv_ops.scatter(obj, a.caches, layout, slots, backend="reference", skip_tokens=round_)
        torch.cuda.synchronize()
        ok = all(_same(x, y) for x, y in zip(a.storages(), b.storages(), strict=True))
        if not ok:
            problems.append(f"round {round_}: " + _diagnose(placer, a, b, obj, slots, layout, round_))
            for x, y in zip(a.storages(), b.storages(), strict=True):
                y.copy_(x)  # resync so the next round is judged on its own
        placer.set_slots(slots)
        got = placer.gather(256).clone()
        want = kv_ops.gather(a.caches, layout, slots, backend="reference", out=got.clone())
        if not _same(got, want):
            problems.append(
                f"round {round_}: graphed gather differs in {int((bits(got) != bits(want)).sum())} elements"
            )
    assert not problems, "\n".join(problems)
