"""The shape and size of one chunk object, computed in one place for every layer of Maru.

A chunk object is ``[num_layers, num_kv, tokens, row]`` in the cache's dtype (``num_kv`` = 2: the
K plane then the V plane of each layer; 1 for MLA), layer-major, so one layer of a chunk is one
contiguous slice. ``ObjectGeometry`` answers its shape and byte size for a token count and views
a buffer (a pool page) as one, without a copy.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from maru.kv_ops.layout import KVLayout


@dataclass(frozen=True)
class ObjectGeometry:
    """Chunk-object geometry of one set of caches (``of``); immutable."""

    num_layers: int
    num_kv: int
    row: int
    dtype: torch.dtype

    @classmethod
    def of(cls, caches: Any, layout: KVLayout) -> ObjectGeometry:
        """The geometry of ``caches`` (per-layer tensors, or one cross-layer tensor) as detected."""
        if isinstance(caches, torch.Tensor):
            first, count = caches, 1
        else:
            caches = list(caches)
            first, count = caches[0], len(caches)
        num_layers = int(layout.num_layers) if layout.is_cross_layer else count
        return cls(num_layers, int(layout.num_kv), int(layout.row_size), first.dtype)

    @property
    def elem(self) -> int:
        return self.dtype.itemsize

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of one token of one layer (K and V)."""
        return self.num_kv * self.row * self.elem

    def shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (self.num_layers, self.num_kv, int(tokens), self.row)

    def nbytes(self, tokens: int) -> int:
        return self.num_layers * self.layer_token_bytes * int(tokens)

    def over(self, buffer: Any, tokens: int, offset: int = 0) -> torch.Tensor:
        """A chunk object of ``tokens`` tokens over ``buffer`` at byte ``offset`` (no copy)."""
        return host_object(buffer, self.shape(tokens), self.dtype, offset)

    def over_many(self, parts: Iterable[tuple[Any, int]]) -> list[torch.Tensor]:
        """``over`` of each ``(buffer, tokens)`` (a request's retrieved pages): one warnings scope
        for all of them, where ``over`` on a read-only buffer enters one each (~4 us a chunk)."""
        with _readonly_ok():
            return [_view(buf, self.shape(t), self.dtype, 0) for buf, t in parts]


def host_object(buffer: Any, shape: Sequence[int], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over ``buffer`` (an mmap, a pool memoryview), no copy.

    Read-only buffers (a retrieved entry's view) are allowed: loads only read them.
    """
    if getattr(buffer, "readonly", None) is False:  # a writable memoryview: nothing to silence
        return _view(buffer, shape, dtype, offset)
    with _readonly_ok():
        return _view(buffer, shape, dtype, offset)


def _view(buffer: Any, shape: Sequence[int], dtype: torch.dtype, offset: int) -> torch.Tensor:
    count = 1
    for n in shape:
        count *= int(n)
    return torch.frombuffer(buffer, dtype=dtype, count=count, offset=offset).view(*shape)


@contextmanager
def _readonly_ok() -> Iterator[None]:
    with warnings.catch_warnings():
        # torch warns that writing through a tensor over a read-only buffer is undefined; loads never do.
        warnings.simplefilter("ignore", UserWarning)
        yield
