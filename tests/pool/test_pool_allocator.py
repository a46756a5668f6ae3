"""The extent allocator: alignment, merging, reuse, and the fragmentation promise."""

from __future__ import annotations

import random

import pytest

from maru.errors import PoolError
from maru.pool.allocator import ExtentAllocator

A = 4096


def make(units: int = 1024) -> ExtentAllocator:
    return ExtentAllocator(A, A + units * A, A)


def test_allocations_are_aligned_disjoint_and_inside_the_data_region() -> None:
    alloc = make(256)
    rng = random.Random(3)
    spans = []
    while True:
        size = rng.randint(1, 5 * A)
        off = alloc.allocate(size)
        if off is None:
            break
        spans.append((off, alloc.round_up(size)))
    alloc.check()
    spans.sort()
    assert spans[0][0] >= alloc.base and spans[-1][0] + spans[-1][1] <= alloc.end
    assert all(o % A == 0 for o, _ in spans)
    assert all(a[0] + a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    assert alloc.free_bytes < 5 * A  # it only gave up when (almost) nothing was left


def test_free_merges_both_neighbours_into_one_extent() -> None:
    alloc = make(3)
    a, b, c = (alloc.allocate(A) for _ in range(3))
    assert alloc.allocate(1) is None
    alloc.free(a)
    alloc.free(c)
    assert alloc.free_extents == 2 and alloc.largest_free == A
    alloc.free(b)
    alloc.check()
    assert alloc.free_extents == 1 and alloc.largest_free == 3 * A
    assert alloc.allocate(3 * A) == alloc.base


def test_best_fit_keeps_the_large_hole_for_a_large_object() -> None:
    alloc = make(10)
    offs = [alloc.allocate(A) for _ in range(10)]
    alloc.free(offs[1])  # a 1-unit hole
    for o in offs[4:9]:  # a 5-unit hole
        alloc.free(o)
    assert alloc.allocate(A) == offs[1]  # the small object takes the small hole
    assert alloc.allocate(5 * A) == offs[4]  # so the large one still fits


def test_double_free_and_unknown_offset_are_refused() -> None:
    alloc = make(4)
    off = alloc.allocate(100)
    alloc.free(off)
    with pytest.raises(PoolError, match="double free"):
        alloc.free(off)
    with pytest.raises(PoolError):
        alloc.free(alloc.base + A)


def test_from_used_rebuilds_the_free_map_and_rejects_overlaps() -> None:
    used = [(A, 100), (3 * A, 2 * A), (4 * A, A), (99 * A, A), (6 * A + 1, 10), (A, 100)]
    alloc, rejected = ExtentAllocator.from_used(A, 11 * A, A, used)
    alloc.check()
    assert rejected == [2, 3, 4, 5]  # overlap, outside, unaligned, a duplicate of entry 0
    assert alloc.used_bytes == 3 * A
    assert alloc.free_bytes == 7 * A and alloc.largest_free == 6 * A


@pytest.mark.parametrize("policy", ["fifo", "random"])
@pytest.mark.parametrize("sizes", [(64 << 10, 1 << 20), (3 * A, 8 * A), (5000, 70000)])
def test_ten_thousand_fill_evict_operations_keep_90_percent_of_the_pool_usable(
    policy: str, sizes: tuple[int, int]
) -> None:
    alloc = ExtentAllocator(A, A + (64 << 20), A)
    rng = random.Random(hash((policy, sizes)) & 0xFFFF)
    live: list[int] = []
    fill_at_failure: list[float] = []
    for _ in range(10_000):
        size = rng.choice(sizes)
        off = alloc.allocate(size)
        if off is None:
            # The pool refused: how full was it? Fragmentation shows up as refusals at low fill.
            fill_at_failure.append(alloc.used_bytes / alloc.capacity)
        while off is None:
            victim = live.pop(0) if policy == "fifo" else live.pop(rng.randrange(len(live)))
            alloc.free(victim)
            off = alloc.allocate(size)
        live.append(off)
    alloc.check()
    assert len(fill_at_failure) > 1000  # the workload really ran the pool full, many times
    assert min(fill_at_failure) >= 0.90, f"refused an object at {min(fill_at_failure):.1%} full"
    for off in live:
        alloc.free(off)
    alloc.check()
    assert alloc.largest_free == alloc.capacity  # everything merged back into one extent
