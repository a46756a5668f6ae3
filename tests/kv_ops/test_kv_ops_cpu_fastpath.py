"""The reference's whole-block path (chunk loads on the CPU) and its boundaries, against the naive oracle.

Slot mappings are built from block ids the way the vLLM connector builds them (tokens in order within
whole blocks), then broken at the edges the fast path must respect: a partial first or last block, a
run that starts mid-block, negative slots before, inside and between blocks, a gap in the token list,
a swapped or reversed block, scattered and consecutive block ids, ``skip_tokens``. Block size 4 !=
3 heads throughout.
"""

from __future__ import annotations

import pytest
import torch

from maru.kv_ops import detect_layouts, gather, scatter, scatter_layer
from maru.kv_ops.reference import _WholeBlocks
from maru.kv_ops.testing import FORMATS, bits, make_cache, naive_gather, naive_scatter, random_bits_

BS, NH, HS, NB, NL = 4, 3, 8, 12, 2


def blocks(*ids: int) -> list[int]:
    """Whole blocks ``ids``, each in offset order."""
    return [b * BS + o for b in ids for o in range(BS)]


# name -> (slots, token ranges [start, end) that are whole blocks the fast path must take)
PATTERNS: dict[str, tuple[list[int], list[tuple[int, int]]]] = {
    "consecutive blocks": (blocks(3, 4, 5), [(0, 12)]),
    "scattered blocks": (blocks(7, 2, 10), [(0, 12)]),
    "consecutive ids broken in the middle": (blocks(5, 6, 9, 10), [(0, 16)]),
    "partial first block": ([2 * BS + 2, 2 * BS + 3, *blocks(3, 4)], [(2, 10)]),
    "partial last block": ([*blocks(8, 9), 10 * BS, 10 * BS + 1], [(0, 8)]),
    "run starting mid-block": ([5 * BS + o for o in range(1, BS)] + blocks(6), [(3, 7)]),
    "slots consecutive across blocks but starting mid-block": (
        list(range(BS + 1, 4 * BS + 1)),
        [(3, 7), (7, 11)],
    ),
    "negative prefix then blocks": ([-1] * 3 + blocks(1, 2), [(3, 11)]),
    "negative slot inside a block": ([*blocks(1)[:2], -1, *blocks(1)[3:], *blocks(2)], [(4, 8)]),
    "gap between consecutive blocks": ([*blocks(3), -1, -1, *blocks(4)], [(0, 4), (6, 10)]),
    "swapped tokens inside a block": ([*blocks(0), 5, 4, 6, 7, *blocks(2)], [(0, 4), (8, 12)]),
    "reversed block": (blocks(6)[::-1] + blocks(7), [(4, 8)]),
    "block repeated in two places": ([*blocks(3), *blocks(3)], [(0, 8)]),
    "segments with and without id breaks": (
        [*blocks(1, 2), -1, *blocks(5, 7), -1, *blocks(8, 9), *blocks(11)],
        [(0, 8), (9, 17), (18, 30)],
    ),
    "only negatives": ([-1] * 8, []),
    "fewer tokens than a block": ([9 * BS, 9 * BS + 1], []),
}


def case_of(fmt: str, physical: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    case = make_cache(
        fmt, physical, num_blocks=NB, block_size=BS, num_kv_heads=NH, head_size=HS, num_layers=NL,
        dtype=dtype, generator=gen,
    )  # fmt: skip
    return case, detect_layouts(case.caches, **case.detect_kwargs()), gen


def layouts() -> list[tuple[str, str]]:
    out = [(f, p) for f in FORMATS for p in ("NHD", "HND") if f not in ("cpu_attn", "mla")]
    return [("cpu_attn", "HND"), ("mla", "NHD"), *out]


@pytest.mark.parametrize("name", list(PATTERNS))
def test_whole_block_detection_covers_exactly_the_whole_blocks_in_order(name: str) -> None:
    slots, expected = PATTERNS[name]
    _, layout, _ = case_of("cpu_attn", "HND")
    found = _WholeBlocks(layout, torch.tensor(slots, dtype=torch.int64))
    covered = [(s.t0 + i * BS, s.t0 + (i + 1) * BS) for s in found.segments for i in range(s.n)]
    want = [(a + i, a + i + BS) for a, b in expected for i in range(0, b - a, BS)]
    assert covered == want
    for seg in found.segments:  # a segment's ids are the blocks its tokens hold
        assert seg.ids.tolist() == [slots[seg.t0 + i * BS] // BS for i in range(seg.n)]
        consecutive = all(b - a == 1 for a, b in zip(seg.ids.tolist(), seg.ids.tolist()[1:], strict=False))
        assert (seg.b0 is not None) == consecutive
    rest = found.rest.tolist() if found.rest is not None else [-1] * len(slots)
    inside = {t for a, b in covered for t in range(a, b)}
    assert rest == [-1 if t in inside else s for t, s in enumerate(slots)]


def test_whole_blocks_of_consecutive_ids_form_one_slice_segment() -> None:
    _, layout, _ = case_of("cpu_attn", "HND")
    found = _WholeBlocks(layout, torch.tensor(blocks(3, 4, 5, 7, 8)))
    assert [(s.t0, s.n, s.b0) for s in found.segments] == [(0, 5, None)]
    found = _WholeBlocks(layout, torch.tensor([-1, *blocks(3, 4, 5)]))
    assert [(s.t0, s.n, s.b0) for s in found.segments] == [(1, 3, 3)]
    assert found.rest is not None and found.rest.tolist() == [-1] * 13


@pytest.mark.parametrize("fmt,physical", layouts())
@pytest.mark.parametrize("name", list(PATTERNS))
def test_gather_of_block_patterns_matches_the_naive_oracle(fmt: str, physical: str, name: str) -> None:
    slots, _ = PATTERNS[name]
    case, layout, gen = case_of(fmt, physical, seed=len(name))
    poison = random_bits_(torch.empty(NL, layout.num_kv, len(slots), layout.row_size), gen)
    expected = naive_gather(case, slots, poison.clone())
    got = gather(case.caches, layout, torch.tensor(slots), backend="reference", out=poison.clone())
    assert torch.equal(bits(got), bits(expected))


# Two tokens for one slot: which one lands is not defined, so scatter leaves that pattern out.
SCATTER_PATTERNS = [name for name in PATTERNS if name != "block repeated in two places"]


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}thr")
def torch_threads(request):
    """Scattered whole blocks take per-block copies on one thread and ``index_copy_`` on more."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("fmt,physical", layouts())
@pytest.mark.parametrize("name", SCATTER_PATTERNS)
def test_scatter_of_block_patterns_matches_the_naive_oracle(
    fmt: str, physical: str, name: str, torch_threads: int
) -> None:
    slots, _ = PATTERNS[name]
    got_case, layout, gen = case_of(fmt, physical, seed=len(name))
    want_case, _, _ = case_of(fmt, physical, seed=len(name))
    obj = random_bits_(torch.empty(NL, layout.num_kv, len(slots), layout.row_size), gen)
    scatter(obj, got_case.caches, layout, torch.tensor(slots), backend="reference")
    naive_scatter(want_case, slots, obj)
    for got, want in zip(got_case.storages(), want_case.storages(), strict=True):
        assert torch.equal(bits(got), bits(want))


@pytest.mark.parametrize("skip", [1, BS, BS + 2])
@pytest.mark.parametrize("fmt,physical", [("cpu_attn", "HND"), ("kv_first", "HND"), ("blocks_first", "NHD")])
def test_skip_tokens_cut_into_whole_blocks_write_only_the_rest(fmt: str, physical: str, skip: int) -> None:
    slots = [-1, *blocks(2, 3, 9, 10), 11 * BS]
    got_case, layout, gen = case_of(fmt, physical, dtype=torch.bfloat16, seed=skip)
    want_case, _, _ = case_of(fmt, physical, dtype=torch.bfloat16, seed=skip)
    obj = random_bits_(torch.empty(NL, 2, len(slots), layout.row_size, dtype=torch.bfloat16), gen)
    scatter(obj, got_case.caches, layout, torch.tensor(slots), backend="reference", skip_tokens=skip)
    naive_scatter(want_case, slots, obj, skip=skip)
    for got, want in zip(got_case.storages(), want_case.storages(), strict=True):
        assert torch.equal(bits(got), bits(want))


def test_the_staging_buffer_carries_nothing_between_calls_of_other_sizes_and_dtypes() -> None:
    # The transposed plane's scatter reuses one staging buffer per thread; a larger earlier object or
    # another dtype must never leak into a later load.
    for dtype, ids in ((torch.float32, (1, 2, 3, 4, 5)), (torch.float32, (7,)), (torch.float16, (8, 9))):
        got_case, layout, gen = case_of("cpu_attn", "HND", dtype=dtype, seed=len(ids))
        want_case, _, _ = case_of("cpu_attn", "HND", dtype=dtype, seed=len(ids))
        slots = blocks(*ids)
        obj = random_bits_(torch.empty(NL, 2, len(slots), layout.row_size, dtype=dtype), gen)
        scatter(obj, got_case.caches, layout, torch.tensor(slots), backend="reference")
        naive_scatter(want_case, slots, obj)
        for got, want in zip(got_case.storages(), want_case.storages(), strict=True):
            assert torch.equal(bits(got), bits(want)), dtype


def test_single_layer_scatter_of_whole_blocks_matches_the_oracle() -> None:
    got_case, layout, gen = case_of("cpu_attn", "HND", seed=3)
    want_case, _, _ = case_of("cpu_attn", "HND", seed=3)
    slots = [3 * BS + 3, *blocks(4, 6, 7)]
    obj = random_bits_(torch.empty(NL, 2, len(slots), layout.row_size), gen)
    for layer in range(NL):
        scatter_layer(obj[layer], got_case.caches[layer], layout, torch.tensor(slots), backend="reference")
    naive_scatter(want_case, slots, obj)
    for got, want in zip(got_case.storages(), want_case.storages(), strict=True):
        assert torch.equal(bits(got), bits(want))


def random_chunk(gen: torch.Generator, block_size: int, num_blocks: int) -> list[int]:
    """Whole blocks (random or consecutive ids) with random partial ends, negatives and breaks."""
    count = int(torch.randint(1, 6, (1,), generator=gen))
    if bool(torch.rand(1, generator=gen) < 0.5):
        start = int(torch.randint(0, num_blocks - count + 1, (1,), generator=gen))
        ids = list(range(start, start + count))
    else:
        ids = torch.randperm(num_blocks, generator=gen)[:count].tolist()
    slots = [b * block_size + o for b in ids for o in range(block_size)]
    cut_front = int(torch.randint(0, block_size + 1, (1,), generator=gen))
    cut_back = int(torch.randint(0, block_size + 1, (1,), generator=gen))
    slots = slots[cut_front : len(slots) - cut_back] or slots
    for _ in range(int(torch.randint(0, 3, (1,), generator=gen))):
        slots[int(torch.randint(0, len(slots), (1,), generator=gen))] = -1
    return [-1] * int(torch.randint(0, 3, (1,), generator=gen)) + slots


@pytest.mark.parametrize("block_size", [1, 2, 5])
@pytest.mark.parametrize("fmt,physical", [("cpu_attn", "HND"), ("kv_first", "NHD"), ("packed", "HND")])
def test_random_chunk_loads_and_stores_match_the_oracle(fmt: str, physical: str, block_size: int) -> None:
    gen = torch.Generator().manual_seed(block_size * 31 + len(fmt))
    for _ in range(12):
        slots = random_chunk(gen, block_size, 9)
        geom = dict(num_blocks=9, block_size=block_size, num_kv_heads=NH, head_size=HS, num_layers=NL)
        seed = int(torch.randint(0, 1000, (1,), generator=gen))
        got_case = make_cache(fmt, physical, generator=torch.Generator().manual_seed(seed), **geom)
        want_case = make_cache(fmt, physical, generator=torch.Generator().manual_seed(seed), **geom)
        layout = detect_layouts(got_case.caches, **got_case.detect_kwargs())
        obj = random_bits_(torch.empty(NL, 2, len(slots), layout.row_size, dtype=torch.float16), gen)
        expected = naive_gather(want_case, slots, obj.clone())
        got = gather(got_case.caches, layout, torch.tensor(slots), backend="reference", out=obj.clone())
        assert torch.equal(bits(got), bits(expected)), slots
        scatter(obj, got_case.caches, layout, torch.tensor(slots), backend="reference")
        naive_scatter(want_case, slots, obj)
        for a, b in zip(got_case.storages(), want_case.storages(), strict=True):
            assert torch.equal(bits(a), bits(b)), slots
