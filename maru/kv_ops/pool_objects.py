"""Chunk objects over one tensor of a whole pool mapping, each made when first used (``PoolObjects``).

A load's objects are views of pool pages. The layer-overlap load on a GPU reads only each one's
address and token count (the direct kernel reads the pages in place), yet making a view costs an
``as_strided`` (~1.5 us on the CI machine, more with the cold caches a load meets) and checking it
``PipelineInputs._objects``' per-object reads (~0.75 us): ~150 us for a 16k-token request of 64
chunks, on every load's issue path before the forward. ``PoolObjects`` carries the addresses and
token counts, checked once for the whole set, and makes a view only where a path asks for one
(the CPU paths, the staged ways, a probe's first object).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, overload

import torch

from maru.kv_ops.geometry import ObjectGeometry


class PoolObjects(Sequence[torch.Tensor]):
    """Objects ``[L, KV, T_i, ROW]`` over ``base`` at element offsets, made on first use.

    Invariants (checked by ``make``, never changed after): ``base`` is a 1-D contiguous host tensor
    of ``geometry``'s dtype; object i starts at element ``offsets[i]`` and lies inside ``base``;
    ``tokens[i]`` is its T and ``ptrs[i]`` its first byte's address, as ``CheckedObjects`` has them.
    An object, once made, is the same tensor every time it is read, here and in every set taken
    from this one (``take``, ``joined``: they share one cache, ``_cache[_slots[i]]``), so a key two
    requests share is one object. The pages must stay pinned while the objects are used: this type
    does not pin.
    """

    __slots__ = ("base", "geometry", "offsets", "tokens", "ptrs", "_slots", "_cache")

    def __init__(
        self,
        base: torch.Tensor,
        geometry: ObjectGeometry,
        offsets: list[int],
        tokens: list[int],
        ptrs: list[int],
        slots: list[int],
        cache: list[torch.Tensor | None],
    ) -> None:
        self.base = base
        self.geometry = geometry
        self.offsets = offsets
        self.tokens = tokens
        self.ptrs = ptrs
        self._slots = slots
        self._cache = cache

    @classmethod
    def make(
        cls, base: torch.Tensor, geometry: ObjectGeometry, parts: Sequence[tuple[int, int]]
    ) -> PoolObjects:
        """The objects of ``geometry`` at each ``(byte offset, tokens)`` of ``parts`` over ``base`` (a
        whole pool mapping as one tensor: ``PoolMapping.read_tensor``). Raises ValueError for a base
        that is not a contiguous 1-D host tensor of the geometry's dtype, an offset that is not
        element-aligned or an object that does not fit inside ``base``."""
        L, KV, ROW, dtype = geometry.num_layers, geometry.num_kv, geometry.row, geometry.dtype
        if base.dtype != dtype or base.dim() != 1 or not base.is_cpu or not base.is_contiguous():
            raise ValueError(
                f"pool tensor must be a contiguous 1-D host tensor of {dtype}, got {base.dtype} "
                f"{list(base.shape)} on {base.device}"
            )
        esize, size = base.element_size(), base.numel()
        per_token = L * KV * ROW
        addr = base.data_ptr()
        offsets, tokens, ptrs = [], [], []
        for offset, t in parts:
            if offset % esize or offset < 0:
                raise ValueError(
                    f"object offset {offset} is not a non-negative multiple of the element size {esize}"
                )
            e, t = offset // esize, int(t)
            if t < 0 or e + t * per_token > size:
                raise ValueError(
                    f"an object of {t} tokens at byte {offset} does not fit in the pool tensor of {size * esize} bytes"
                )
            offsets.append(e)
            tokens.append(t)
            ptrs.append(addr + offset)
        n = len(offsets)
        return cls(base, geometry, offsets, tokens, ptrs, list(range(n)), [None] * n)

    def take(self, positions: Sequence[int]) -> PoolObjects:
        """The objects at ``positions``, in that order (a request's chunks out of a step's keys);
        the objects made so far are shared."""
        o, t, p, s = self.offsets, self.tokens, self.ptrs, self._slots
        return PoolObjects(
            self.base, self.geometry, [o[i] for i in positions], [t[i] for i in positions],
            [p[i] for i in positions], [s[i] for i in positions], self._cache,
        )  # fmt: skip

    @staticmethod
    def joined(parts: Sequence[PoolObjects]) -> PoolObjects | None:
        """``parts`` one after the other, or None where they were not all taken from one set (the
        caller then lists them)."""
        if not parts:
            return None
        first = parts[0]
        if len(parts) == 1:
            return first
        if any(p._cache is not first._cache for p in parts):
            return None
        return PoolObjects(
            first.base, first.geometry, [x for p in parts for x in p.offsets], [x for p in parts for x in p.tokens],
            [x for p in parts for x in p.ptrs], [x for p in parts for x in p._slots], first._cache,
        )  # fmt: skip

    def __len__(self) -> int:
        return len(self.offsets)

    @overload
    def __getitem__(self, i: int) -> torch.Tensor: ...

    @overload
    def __getitem__(self, i: slice) -> list[torch.Tensor]: ...

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        slot = self._slots[i]
        obj = self._cache[slot]
        if obj is None:
            g = self.geometry
            L, KV, ROW = g.num_layers, g.num_kv, g.row
            t = self.tokens[i]
            # as_strided's offset counts from the storage's start, not from the base's.
            at = self.base.storage_offset() + self.offsets[i]
            obj = torch.as_strided(self.base, (L, KV, t, ROW), (KV * t * ROW, t * ROW, ROW, 1), at)
            self._cache[slot] = obj
        return obj

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(len(self)))

    def __repr__(self) -> str:
        return f"PoolObjects({len(self)} objects, {sum(self.tokens)} tokens, {self.geometry})"
