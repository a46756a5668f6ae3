"""A scatter's slot mappings, computed when the data path first asks for them (``DeferredSlots``).

A load's copies into the GPU's staging need only the chunk objects; its placements need the
slots. The GPU path queues its first chunk copy, then asks for the mapping, so the mapping's host
work (one numpy pass a request, the upload) runs while the bus is already busy: a one-chunk load's
copy used to start only after it (bench/RESULTS.md, forty-second pass).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from maru.transfer.records import RequestTransfer, chunk_slots, many_chunk_slots


class LayerGroup:
    """One request's placed chunks for a layer load (``DataPath.scatter_layers``): object ``i``
    (``[L, KV, T_i, ROW]`` over its pool page) goes to ``slots[o_i : o_i + tokens[i]]``, ``o_i`` the
    tokens of the objects before it.

    Invariant: ``slots`` is one host int64 mapping of ``sum(tokens)`` entries in object order, and
    ``tokens[i]`` is object i's T (the request's chunk sizes, checked against the pages' sizes at
    the pin). Why one mapping, not one a chunk: a 16k-token request's 64 slices and their re-join
    cost ~100 us of host time on every layer-overlap load's issue (the CI machine), and the device
    path wants the joined mapping anyway; ``chunks()`` slices it for the paths that go chunk by chunk.
    """

    __slots__ = ("objs", "slots", "tokens")

    def __init__(self, objs: Sequence[torch.Tensor], slots: torch.Tensor, tokens: list[int]) -> None:
        self.objs = objs
        self.slots = slots
        self.tokens = tokens

    def chunks(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(object, its slots) of each object, in order."""
        out, o = [], 0
        for obj, t in zip(self.objs, self.tokens, strict=True):
            out.append((obj, self.slots[o : o + t]))
            o += t
        return out


def joined_slots(slots: Sequence[torch.Tensor]) -> torch.Tensor:
    """The chunks' slot mappings as one (no ``torch.cat`` for a single chunk: ~20 us on the
    H200 host, on every load's issue path)."""
    if len(slots) == 1:
        return slots[0]
    return torch.cat(list(slots)) if slots else torch.empty(0, dtype=torch.int64)


class DeferredSlots:
    """The slot mapping of each item of a scatter, in item order, made on first use.

    Items are slices of their request's mapping: ``add_request`` registers a request (its blocks
    and chunks), ``add_item`` one of its chunks by token offset and count. Invariant: ``per_item()``
    equals ``chunk_slots`` of each item's request, sliced to the item, in the current item order
    (``reorder`` permutes items, never their slices); each request's mapping is computed once.
    The caller checks beforehand that every request has the blocks its placed tokens need
    (``blocks_needed``), so making the mappings raises only on a bug.
    """

    def __init__(self) -> None:
        self._requests: list[tuple[Sequence[int], int, Sequence[Any]]] = []
        self._items: list[tuple[int, int, int]] = []  # (request, token offset, tokens)
        self._made: list[torch.Tensor] | None = None

    def __len__(self) -> int:
        return len(self._items)

    def add_request(self, req: RequestTransfer, block_size: int) -> int:
        """Register ``req``'s mapping (its blocks and chunks); returns its index for ``add_item``."""
        self._requests.append((req.block_ids, block_size, req.chunks))
        return len(self._requests) - 1

    def add_item(self, request: int, offset: int, tokens: int) -> None:
        """One item: rows ``[offset, offset + tokens)`` of request ``request``'s mapping."""
        self._items.append((request, offset, tokens))
        self._made = None

    def reorder(self, order: Sequence[int]) -> None:
        """Items in the order ``order`` (a permutation of their positions)."""
        self._items = [self._items[i] for i in order]
        self._made = None

    def per_item(self) -> list[torch.Tensor]:
        """Each item's host slot mapping (int64; -1 where a token is not placed)."""
        if self._made is None:
            flat = self._per_request()
            self._made = [flat[r][o : o + t] for r, o, t in self._items]
        return self._made

    def _per_request(self) -> list[torch.Tensor]:
        """Each request's mapping: all of them in one pass (``many_chunk_slots``) where they share
        a block size (always, from one engine), else one at a time."""
        sizes = {bs for _, bs, _ in self._requests}
        made: list[torch.Tensor | None] = [None] * len(self._requests)
        if len(sizes) == 1:
            made = many_chunk_slots([(ids, chunks) for ids, _, chunks in self._requests], sizes.pop())
        # One that could not be made (too few blocks): made alone, which raises why.
        return [
            chunk_slots(ids, bs, chunks) if m is None else m
            for (ids, bs, chunks), m in zip(self._requests, made, strict=True)
        ]

    def joined(self) -> torch.Tensor:
        """Every item's mapping, concatenated in item order."""
        return joined_slots(self.per_item())


def listed(slots: Sequence[torch.Tensor] | DeferredSlots) -> list[torch.Tensor]:
    """Per-item mappings from either form a data path's ``scatter`` accepts."""
    return slots.per_item() if isinstance(slots, DeferredSlots) else list(slots)
