"""Extent allocator for the data region of a pool.

Best-fit over free extents, with three indexes kept in step:

- ``_free_by_start``: start -> length, and ``_free_by_end``: end -> start, so ``free`` finds both
  neighbours in O(1) and merges them;
- ``_by_size``: a sorted list of ``(length, start)`` so ``allocate`` finds the smallest extent
  that fits with one bisect (list insert/remove are memmoves: O(log n) search, tiny O(n) move).

Invariants (checked by ``check``):
- every offset and length is a multiple of ``alignment`` and lies in ``[base, end)``;
- free extents never touch each other (free merges neighbours at once), never overlap, and never
  overlap a used extent; ``used_bytes + free_bytes == end - base``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from maru.errors import PoolError


class ExtentAllocator:
    """Hands out aligned extents of ``[base, end)``; tracks which ones are in use."""

    def __init__(self, base: int, end: int, alignment: int) -> None:
        if alignment <= 0 or alignment & (alignment - 1):
            raise PoolError(f"alignment {alignment} must be a power of two")
        if base % alignment or end % alignment or end <= base:
            raise PoolError(f"data region [{base}, {end}) is empty or not aligned to {alignment}")
        self.base = base
        self.end = end
        self.alignment = alignment
        self._free_by_start: dict[int, int] = {}
        self._free_by_end: dict[int, int] = {}
        self._by_size: list[tuple[int, int]] = []
        self._used: dict[int, int] = {}
        self.used_bytes = 0
        self._add_free(base, end - base)

    # -- public API ---------------------------------------------------------------------------

    def round_up(self, size: int) -> int:
        a = self.alignment
        return (size + a - 1) & ~(a - 1)

    def allocate(self, size: int) -> int | None:
        """Return the offset of a new extent of at least ``size`` bytes, or None if none fits."""
        if size <= 0:
            raise ValueError(f"allocation size must be positive, got {size}")
        need = self.round_up(size)
        i = bisect.bisect_left(self._by_size, (need, -1))
        if i == len(self._by_size):
            return None
        length, start = self._by_size[i]
        self._remove_free(start, length, i)
        if length > need:
            self._add_free(start + need, length - need)
        self._used[start] = need
        self.used_bytes += need
        return start

    def free(self, offset: int) -> int:
        """Free the extent at ``offset``; returns its (aligned) length. Merges free neighbours."""
        length = self._used.pop(offset, None)
        if length is None:
            raise PoolError(f"free of offset {offset}: no extent in use starts there (double free?)")
        self.used_bytes -= length
        start, end = offset, offset + length
        right = self._free_by_start.get(end)
        if right is not None:
            self._remove_free(end, right)
            end += right
        left = self._free_by_end.get(start)
        if left is not None:
            self._remove_free(left, start - left)
            start = left
        self._add_free(start, end - start)
        return length

    def extent_size(self, offset: int) -> int | None:
        return self._used.get(offset)

    @property
    def capacity(self) -> int:
        return self.end - self.base

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    @property
    def largest_free(self) -> int:
        by_size = self._by_size
        return by_size[-1][0] if by_size else 0

    @property
    def free_extents(self) -> int:
        return len(self._by_size)

    @property
    def used_extents(self) -> int:
        return len(self._used)

    @classmethod
    def from_used(
        cls, base: int, end: int, alignment: int, used: Sequence[tuple[int, int]]
    ) -> tuple[ExtentAllocator, list[int]]:
        """Rebuild an allocator in which ``used`` extents ``(offset, size)`` are taken.

        Returns the allocator and the indices (into ``used``) of the extents it rejected: out of
        range, unaligned, or overlapping one at a lower offset, so the caller can say what it dropped.
        """
        alloc = cls(base, end, alignment)
        alloc._free_by_start.clear()
        alloc._free_by_end.clear()
        alloc._by_size.clear()
        rejected: list[int] = []
        cursor = base
        for i in sorted(range(len(used)), key=lambda j: used[j]):
            offset, size = used[i]
            length = alloc.round_up(size) if size > 0 else 0
            if length == 0 or offset % alignment or offset < cursor or offset + length > end:
                rejected.append(i)
                continue
            if offset > cursor:
                alloc._add_free(cursor, offset - cursor)
            alloc._used[offset] = length
            alloc.used_bytes += length
            cursor = offset + length
        if cursor < end:
            alloc._add_free(cursor, end - cursor)
        return alloc, sorted(rejected)

    def check(self) -> None:
        """Assert every invariant (tests call it; O(n log n))."""
        a = self.alignment
        spans = [(s, n, "free") for s, n in self._free_by_start.items()]
        spans += [(s, n, "used") for s, n in self._used.items()]
        spans.sort()
        cursor = self.base
        prev_kind = None
        for s, n, kind in spans:
            assert s % a == 0 and n % a == 0 and n > 0, (s, n)
            assert s == cursor, f"gap or overlap at {cursor}: next extent starts at {s}"
            assert not (kind == "free" and prev_kind == "free"), f"unmerged free neighbours at {s}"
            cursor = s + n
            prev_kind = kind
        assert cursor == self.end
        assert sorted((n, s) for s, n in self._free_by_start.items()) == self._by_size
        assert {s + n: s for s, n in self._free_by_start.items()} == self._free_by_end
        assert self.used_bytes == sum(self._used.values())

    # -- internals ----------------------------------------------------------------------------

    def _add_free(self, start: int, length: int) -> None:
        self._free_by_start[start] = length
        self._free_by_end[start + length] = start
        bisect.insort(self._by_size, (length, start))

    def _remove_free(self, start: int, length: int, index: int | None = None) -> None:
        del self._free_by_start[start]
        del self._free_by_end[start + length]
        if index is None:
            index = bisect.bisect_left(self._by_size, (length, start))
        del self._by_size[index]
