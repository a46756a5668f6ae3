"""The PyTorch reference against a naive per-token oracle, on every layout, byte for byte."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from maru.errors import BackendUnavailable
from maru.kv_ops import (
    backend,
    detect_layouts,
    gather,
    gather_blocks,
    gather_layer,
    scatter,
    scatter_blocks,
    scatter_layer,
)
from maru.kv_ops.selection import triton_interpreted
from maru.kv_ops.testing import (
    FORMATS,
    bits,
    make_cache,
    naive_gather,
    naive_scatter,
    random_bits_,
    random_slots,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.uint8]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
PHYSICAL = ["NHD", "HND"]
# block_size 4 != 3 heads, so a swapped token/head axis cannot hide.
GEOM = dict(num_blocks=5, block_size=4, num_kv_heads=3, head_size=8, num_layers=2)


def case_of(fmt: str, physical: str, dtype: torch.dtype, seed: int, block_pad: int = 0):
    gen = torch.Generator().manual_seed(seed)
    case = make_cache(fmt, physical, dtype=dtype, block_pad=block_pad, generator=gen, **GEOM)
    return case, detect_layouts(case.caches, **case.detect_kwargs()), gen


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("physical", PHYSICAL)
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_gather_matches_naive_oracle(fmt: str, physical: str, dtype: torch.dtype) -> None:
    for pad in (0, 7, 24):  # 24 keeps whole rows aligned (fast path); 7 forces the generic path
        case, layout, gen = case_of(
            fmt, physical, dtype, seed=hash((fmt, physical, pad)) % 1000, block_pad=pad
        )
        slots = random_slots(layout.num_slots, 11, negatives=2, generator=gen)
        poison = torch.empty(case.num_layers, layout.num_kv, len(slots), layout.row_size, dtype=dtype)

        random_bits_(poison, gen)
        expected = naive_gather(case, slots, poison.clone())
        got = gather(case.caches, layout, torch.tensor(slots), backend="reference", out=poison.clone())
        assert same_bits(got, expected), f"{fmt} {physical} pad={pad}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.uint8], ids=str)
@pytest.mark.parametrize("physical", PHYSICAL)
@pytest.mark.parametrize("fmt", FORMATS)
def test_reference_scatter_matches_naive_oracle_and_leaves_other_bytes_alone(fmt, physical, dtype) -> None:
    for pad, skip in ((0, 0), (7, 3), (24, 1)):
        seed = hash((fmt, physical, pad)) % 1000
        got_case, layout, gen = case_of(fmt, physical, dtype, seed, pad)
        want_case, _, _ = case_of(fmt, physical, dtype, seed, pad)  # identical bytes
        slots = random_slots(layout.num_slots, 10, negatives=2, generator=gen)
        obj = torch.empty(got_case.num_layers, layout.num_kv, 10, layout.row_size, dtype=dtype)

        random_bits_(obj, gen)
        scatter(obj, got_case.caches, layout, torch.tensor(slots), backend="reference", skip_tokens=skip)
        naive_scatter(want_case, slots, obj, skip=skip)
        for got, want in zip(got_case.storages(), want_case.storages(), strict=True):
            assert same_bits(got, want), f"{fmt} {physical} pad={pad} skip={skip}"


@pytest.mark.parametrize("physical", PHYSICAL)
@pytest.mark.parametrize("fmt", FORMATS)
def test_gather_then_scatter_into_a_poisoned_cache_reproduces_the_touched_slots_only(fmt, physical) -> None:
    source, layout, gen = case_of(fmt, physical, torch.bfloat16, seed=1)
    target, _, _ = case_of(fmt, physical, torch.bfloat16, seed=2)  # same layout, other (poison) bytes
    before = target.snapshot()
    slots = torch.tensor(random_slots(layout.num_slots, 12, negatives=3, generator=gen))
    obj = gather(source.caches, layout, slots, backend="reference")
    scatter(obj, target.caches, layout, slots, backend="reference")
    assert same_bits(gather(target.caches, layout, slots, backend="reference"), obj)
    # Everything else is untouched: rewriting the poison bytes at the same slots restores the snapshot.
    poison_obj = gather(_case_over(before, target), layout, slots, backend="reference")
    scatter(poison_obj, target.caches, layout, slots, backend="reference")
    for now, then in zip(target.storages(), before, strict=True):
        assert same_bits(now, then)


def _case_over(storages: list[torch.Tensor], like) -> object:
    """The caches of ``like`` re-viewed over other storages with the same geometry."""
    src = [like.caches] if isinstance(like.caches, torch.Tensor) else like.caches
    views = []
    for store, cache in zip(storages, src, strict=True):
        store = store.view(cache.dtype)
        views.append(torch.as_strided(store, cache.shape, cache.stride(), cache.storage_offset()))
    return views[0] if isinstance(like.caches, torch.Tensor) else views


def test_gather_leaves_rows_of_negative_slots_as_out_held_them() -> None:
    case, layout, _ = case_of("kv_first", "HND", torch.float32, seed=3)
    out = torch.full((2, 2, 4, layout.row_size), 7.0)
    gather(case.caches, layout, torch.tensor([5, -1, 2, -1]), backend="reference", out=out)
    assert torch.all(out[:, :, 1] == 7.0) and torch.all(out[:, :, 3] == 7.0)
    assert not torch.all(out[:, :, 0] == 7.0)
    fresh = gather(case.caches, layout, torch.tensor([-1, 3]), backend="reference")
    assert torch.all(fresh[:, :, 0] == 0)


@pytest.mark.parametrize("fmt", ["blocks_first", "cpu_attn", "cross_layer", "mla"])
def test_single_layer_and_block_variants_agree_with_the_multi_layer_gather(fmt: str) -> None:
    case, layout, gen = case_of(fmt, "HND", torch.float16, seed=4)
    slots = torch.tensor(random_slots(layout.num_slots, 9, negatives=1, generator=gen))
    full = gather(case.caches, layout, slots, backend="reference")
    for layer in range(case.num_layers):
        if layout.is_cross_layer:
            one = gather_layer(case.caches, layout, slots, layer=layer, backend="reference")
        else:
            one = gather_layer(case.caches[layer], layout, slots, backend="reference")
        assert same_bits(one, full[layer])
    blocks = torch.tensor([3, 0, 4])
    by_block = gather_blocks(case.caches, layout, blocks, backend="reference")
    block_slots = (blocks[:, None] * layout.block_size + torch.arange(layout.block_size)).reshape(-1)
    assert same_bits(by_block, gather(case.caches, layout, block_slots, backend="reference"))


def test_scatter_layer_and_scatter_blocks_write_like_scatter() -> None:
    a, layout, gen = case_of("kv_first", "HND", torch.float16, seed=5)
    b, _, _ = case_of("kv_first", "HND", torch.float16, seed=5)
    c, _, _ = case_of("kv_first", "HND", torch.float16, seed=5)
    blocks = torch.tensor([2, 4, 1])
    slots = (blocks[:, None] * layout.block_size + torch.arange(layout.block_size)).reshape(-1)
    obj = gather(
        case_of("kv_first", "HND", torch.float16, seed=6)[0].caches, layout, slots, backend="reference"
    )
    scatter(obj, a.caches, layout, slots, backend="reference", skip_tokens=layout.block_size)
    for layer in range(2):
        scatter_layer(
            obj[layer], b.caches[layer], layout, slots, backend="reference", skip_tokens=layout.block_size
        )
    scatter_blocks(obj, c.caches, layout, blocks, backend="reference", skip_blocks=1)
    for x, y, z in zip(a.storages(), b.storages(), c.storages(), strict=True):
        assert same_bits(x, y) and same_bits(x, z)


def test_objects_may_live_in_a_larger_buffer_such_as_a_pool_mapping() -> None:
    case, layout, gen = case_of("packed", "NHD", torch.bfloat16, seed=7)
    slots = torch.tensor(random_slots(layout.num_slots, 6, generator=gen))
    nbytes = 2 * 2 * 6 * layout.row_size * 2
    pool = bytearray(4096 + nbytes + 4096)
    page = torch.frombuffer(pool, dtype=torch.bfloat16, offset=4096, count=nbytes // 2).view(
        2, 2, 6, layout.row_size
    )
    gather(case.caches, layout, slots, backend="reference", out=page)
    assert same_bits(page, gather(case.caches, layout, slots, backend="reference"))
    assert pool[:4096] == bytearray(4096) and pool[-4096:] == bytearray(4096)
    two_chunks = torch.cat([slots, slots.flip(0)])
    assert gather(case.caches, layout, two_chunks, backend="reference").shape[2] == 12


def test_reading_the_logical_view_of_an_hnd_cache_gives_different_bytes() -> None:
    """The seed's bug: a placement that trusts the token-major shape of an HND cache is wrong.

    Proves the tests can see it: the same code fed a layout built from the shape alone (contiguous
    token-major strides) disagrees with the stride-detected one on an HND cache (block size != heads).
    """
    case, layout, gen = case_of("kv_first", "HND", torch.float32, seed=8)
    assert layout.physical == "HND"
    shape_only = dataclasses.replace(
        layout,
        physical="NHD",
        k_token_stride=layout.row_size,
        v_token_stride=layout.row_size,
        head_stride=layout.head_size,
    )
    slots = torch.tensor(random_slots(layout.num_slots, 8, generator=gen))
    right = gather(case.caches, layout, slots, backend="reference")
    wrong = gather(case.caches, shape_only, slots, backend="reference")
    assert not same_bits(right, wrong)
    assert same_bits(right, naive_gather(case, slots.tolist(), torch.zeros_like(right)))


def test_out_of_range_slots_and_mismatched_objects_are_refused() -> None:
    case, layout, _ = case_of("kv_first", "NHD", torch.float16, seed=9)
    with pytest.raises(IndexError, match="beyond"):
        gather(case.caches, layout, torch.tensor([layout.num_slots]), backend="reference")
    with pytest.raises(ValueError, match="expected"):
        scatter(torch.zeros(2, 2, 3, 5, dtype=torch.float16), case.caches, layout, torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="detected"):
        gather([c.contiguous().transpose(2, 3) for c in case.caches], layout, torch.tensor([0]))


def test_backend_on_cpu_is_the_reference_and_says_why(caplog) -> None:
    choice = backend("cpu")
    assert choice.name == "reference" and "no CUDA" in str(choice)
    case, layout, _ = case_of("mla", "NHD", torch.float32, seed=10)
    with caplog.at_level(logging.INFO, logger="maru.kv_ops"):
        gather(case.caches, layout, torch.tensor([0, 1]))
        gather(case.caches, layout, torch.tensor([0, 1]))
    assert len([r for r in caplog.records if "placing KV" in r.getMessage()]) <= 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.skipif(triton_interpreted(), reason="the interpreter makes triton legal on CPU tensors")
def test_asking_for_triton_on_cpu_tensors_raises_backend_unavailable() -> None:
    case, layout, _ = case_of("mla", "NHD", torch.float32, seed=11)
    with pytest.raises(BackendUnavailable, match="triton"):
        gather(case.caches, layout, torch.tensor([0]), backend="triton")
    with pytest.raises(BackendUnavailable, match="unknown"):
        gather(case.caches, layout, torch.tensor([0]), backend="cuda-magic")


@pytest.mark.parametrize("physical", PHYSICAL)
@pytest.mark.parametrize("fmt", FORMATS)
def test_whole_block_loads_match_the_naive_oracle(fmt: str, physical: str) -> None:
    """Chunk loads (whole blocks in offset order) take a faster path; it must write the same bytes."""
    for pad in (0, 7):
        seed = hash((fmt, physical, pad, "blocks")) % 1000
        got_case, layout, gen = case_of(fmt, physical, torch.float16, seed, pad)
        want_case, _, _ = case_of(fmt, physical, torch.float16, seed, pad)
        blocks = torch.randperm(layout.num_blocks, generator=gen)[:3]
        slots = (blocks[:, None] * layout.block_size + torch.arange(layout.block_size)).reshape(-1)
        expected = naive_gather(
            got_case,
            slots.tolist(),
            torch.zeros(2, layout.num_kv, len(slots), layout.row_size, dtype=torch.float16),
        )
        assert same_bits(gather(got_case.caches, layout, slots, backend="reference"), expected)
        obj = random_bits_(torch.empty_like(expected), gen)
        scatter(obj, got_case.caches, layout, slots, backend="reference")
        naive_scatter(want_case, slots.tolist(), obj)
        for got, want in zip(got_case.storages(), want_case.storages(), strict=True):
            assert same_bits(got, want), f"{fmt} {physical} pad={pad}"


def test_reference_on_a_gpu_without_triton_is_a_loud_warning_with_the_fix(monkeypatch, caplog) -> None:
    from maru.kv_ops import selection

    monkeypatch.setattr(selection, "triton_import_error", lambda: "ImportError: no module named 'triton'")
    from maru import announce

    announce.forget("kv_ops.backend:cuda:reference")  # announced again in this test
    choice = selection.choose("cuda")
    assert choice.name == "reference"
    assert "triton not importable: ImportError" in choice.reason and "install triton" in choice.reason
    with caplog.at_level(logging.INFO, logger="maru.kv_ops"):
        assert selection.resolve(None, "cuda") == "reference"
        assert selection.resolve(None, "cuda") == "reference"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "SLOW PATH" in warnings[0].getMessage()
    with pytest.raises(BackendUnavailable, match="not importable"):
        selection.resolve("triton", "cuda")
