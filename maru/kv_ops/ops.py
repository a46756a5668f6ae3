"""The public placement operations: validate, pick the backend, dispatch.

Object format (what Maru stores, whatever the engine's layout): one chunk of T tokens of all L layers
is ``[L, KV, T, NH*HS]`` with KV = 2 (K plane, then V plane) or 1 (MLA), each plane's rows
contiguous. Several chunks in one call are just more tokens. ``out``/``obj`` may be a view into a
larger buffer (for example a tensor over a pool mapping made with ``torch.frombuffer``) as long as
each plane's ``[T, NH*HS]`` rows are contiguous.

Slot semantics: ``slot = block * block_size + offset``; a negative slot is skipped (the cache is not
touched; a gathered object keeps what ``out`` held there, zeros for a fresh one). On CPU tensors an
out-of-range slot raises; on CUDA the check would cost a device sync per call, so slots are trusted
there (vLLM's slot mappings are in range by construction).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from operator import is_
from typing import Any

import torch

from maru.kv_ops import reference
from maru.kv_ops.layout import KVLayout
from maru.kv_ops.selection import resolve

LayerRef = reference.LayerRef
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """The same memory as integers of the same width (a view; integer tensors are returned as they are).

    Moving integers is bit-exact for every float format (NaN payloads, -0.0, float8) and lets index
    ops run on dtypes torch cannot index directly.
    """
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        return t.view(_INT_OF_SIZE[t.element_size()])
    return t


def _check_tensor(cache: Any, layout: KVLayout, what: str) -> torch.Tensor:
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(cache).__name__}")
    if tuple(cache.shape) != layout.shape or tuple(cache.stride()) != layout.strides:
        raise ValueError(
            f"{what} has shape {list(cache.shape)} and strides {list(cache.stride())}, but the layout was detected "
            f"on shape {list(layout.shape)} and strides {list(layout.strides)}; detect the layout of these caches"
        )
    return cache


class _RefCache:
    """Validated layer refs of recently used cache sets, so a hot loop does not re-check every
    layer's shape and strides on every call (that host time can exceed a small copy's).

    Keyed by the identity of the layout and of the cache tensors (hashing the layout's fields on
    every call cost more than the rest of the lookup); an entry holds the layout and the tensors
    themselves, so an id cannot be reused by another object while its entry lives. An equal but
    distinct layout object is validated again, which is correct, only slower. (A tensor whose
    metadata is changed in place with ``set_``/``as_strided_`` after a call would not be re-checked;
    vLLM never does that to its caches.) The refs list returned is the same object on every hit:
    backends memoise what they derive from it by its identity.
    """

    def __init__(self, size: int = 8) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tuple[Any, list[LayerRef]]] = OrderedDict()
        # The last hit's (layout, caches container, its tensors, refs): a loop over one cache set
        # is answered by identity checks alone (about 1 us for 32 layers against 5 for the key).
        self._last: tuple[Any, Any, tuple, list[LayerRef]] | None = None

    def get(self, caches: Any, layout: KVLayout) -> list[LayerRef]:
        last = self._last
        if last is not None and last[0] is layout and last[1] is caches:
            kept = last[2]
            if isinstance(caches, torch.Tensor):
                return last[3]
            now = caches.values() if isinstance(caches, dict) else caches
            if len(now) == len(kept) and all(map(is_, now, kept)):  # the same tensors, in order
                return last[3]
        refs = self._get(caches, layout)
        kept = (
            (caches,)
            if isinstance(caches, torch.Tensor)
            else tuple(caches.values() if isinstance(caches, dict) else caches)
        )
        self._last = (layout, caches, kept, refs)
        return refs

    def _get(self, caches: Any, layout: KVLayout) -> list[LayerRef]:
        if isinstance(caches, torch.Tensor):
            key: tuple = (id(layout), id(caches))
        elif isinstance(caches, dict):
            key = (id(layout), *map(id, caches.values()))
        else:
            key = (id(layout), *map(id, caches))
        hit = self._entries.get(key)
        if hit is not None:
            self._entries.move_to_end(key)
            return hit[1]
        refs = _layer_refs(caches, layout)
        keep = (
            caches
            if isinstance(caches, torch.Tensor)
            else tuple(caches.values() if isinstance(caches, dict) else caches)
        )
        self._entries[key] = ((layout, keep), refs)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return refs


_REFS = _RefCache()


def layer_refs(caches: Any, layout: KVLayout) -> list[LayerRef]:
    """(bits tensor over the storage, absolute element offset of the layer base) for every layer."""
    return _REFS.get(caches, layout)


def _layer_refs(caches: Any, layout: KVLayout) -> list[LayerRef]:
    if layout.is_cross_layer:
        if not isinstance(caches, torch.Tensor):
            if isinstance(caches, Sequence) and len(caches) == 1:
                caches = caches[0]
            else:
                raise TypeError("a cross-layer layout takes the one cross-layer tensor as `caches`")
        cache = as_bits(_check_tensor(caches, layout, "the cross-layer cache"))
        assert layout.num_layers is not None
        return [(cache, cache.storage_offset() + i * layout.layer_stride) for i in range(layout.num_layers)]
    if isinstance(caches, dict):
        caches = list(caches.values())
    if isinstance(caches, torch.Tensor):
        caches = [caches]
    refs = []
    for i, cache in enumerate(caches):
        bits = as_bits(_check_tensor(cache, layout, f"layer {i}'s cache"))
        refs.append((bits, bits.storage_offset()))
    if not refs:
        raise ValueError("no layer caches given")
    return refs


def _one_layer_ref(cache: Any, layout: KVLayout, layer: int | None) -> LayerRef:
    if layout.is_cross_layer:
        if layer is None:
            raise ValueError("a cross-layer cache needs `layer=` for the single-layer operations")
        refs = layer_refs(cache, layout)
        if not 0 <= layer < len(refs):
            raise IndexError(f"layer {layer} out of range for {len(refs)} layers")
        return refs[layer]
    return layer_refs([cache], layout)[0]


def _check_index(index: torch.Tensor, device: torch.device, limit: int, what: str) -> torch.Tensor:
    if not isinstance(index, torch.Tensor):
        index = torch.as_tensor(index, dtype=torch.int64)
    if index.dim() != 1 or index.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"{what} must be a 1-D int32/int64 tensor, got shape {list(index.shape)} {index.dtype}"
        )
    if index.device != device:
        index = index.to(device, non_blocking=True)
    if index.device.type == "cpu" and index.numel() and int(index.max()) >= limit:
        raise IndexError(f"{what} holds {int(index.max())}, beyond the cache's {limit} entries")
    return index.contiguous()


def _check_obj(obj: torch.Tensor, shape: tuple[int, ...], cache: torch.Tensor, what: str) -> None:
    if obj.shape != shape:  # torch.Size is a tuple
        raise ValueError(f"{what} has shape {list(obj.shape)}, expected {list(shape)} ([L, KV, T, NH*HS])")
    if obj.dtype != cache.dtype or obj.device != cache.device:
        raise ValueError(
            f"{what} is {obj.dtype} on {obj.device}, the cache is {cache.dtype} on {cache.device}"
        )
    rows_ok = obj.stride(-1) == 1 and (shape[-2] <= 1 or obj.stride(-2) == shape[-1])
    if not rows_ok:
        raise ValueError(
            f"{what} must have contiguous rows in each plane (strides [..., {shape[-1]}, 1]), got {list(obj.stride())}"
        )


def _first_tensor(caches: Any) -> torch.Tensor:
    if isinstance(caches, torch.Tensor):
        return caches
    if isinstance(caches, dict):
        return next(iter(caches.values()))
    return caches[0]


def _run(
    refs: list[LayerRef],
    layout: KVLayout,
    index: torch.Tensor,
    obj: torch.Tensor,
    *,
    gather: bool,
    backend: str | None,
    blockwise: bool = False,
    single_layer: bool = False,
) -> None:
    name = resolve(backend, obj.device.type)
    if name == "triton":  # moves bits whatever the dtype (its launcher views tensors as integers)
        from maru.kv_ops import triton_kernels

        triton_kernels.place(
            refs, layout, index, obj, gather=gather, blockwise=blockwise, single_layer=single_layer
        )
        return
    bits_obj = as_bits(obj)
    if blockwise:
        offsets = torch.arange(layout.block_size, device=index.device, dtype=torch.int64)
        index = (index.to(torch.int64)[:, None] * layout.block_size + offsets[None, :]).reshape(-1)
        index = torch.where(index >= 0, index, -1)
    if gather:
        reference.gather(refs, layout, index, bits_obj)
    else:
        reference.scatter(refs, layout, index, bits_obj)


def gather(
    caches: Any,
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Copy the slots' KV of every layer out of the paged caches into an object ``[L, KV, T, NH*HS]``.

    ``caches``: the list (or dict) of per-layer tensors, or the one cross-layer tensor.
    Returns ``out`` (allocated zeroed when None).
    """
    refs = layer_refs(caches, layout)
    first = _first_tensor(caches)
    slots = _check_index(slot_mapping, first.device, layout.num_slots, "slot_mapping")
    shape = (len(refs), layout.num_kv, slots.numel(), layout.row_size)
    if out is None:
        out = torch.zeros(shape, dtype=first.dtype, device=first.device)
    _check_obj(out, shape, first, "out")
    _run(refs, layout, slots, out, gather=True, backend=backend)
    return out


def scatter(
    obj: torch.Tensor,
    caches: Any,
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    *,
    backend: str | None = None,
    skip_tokens: int = 0,
) -> None:
    """Write an object ``[L, KV, T, NH*HS]`` into the paged caches at the slots.

    ``skip_tokens=n`` leaves the first n tokens unwritten (a block shared with the engine's own prefix
    cache must not be written while attention may read it).
    """
    refs = layer_refs(caches, layout)
    first = _first_tensor(caches)
    slots = _check_index(slot_mapping, first.device, layout.num_slots, "slot_mapping")
    _check_obj(obj, (len(refs), layout.num_kv, slots.numel(), layout.row_size), first, "obj")
    if skip_tokens < 0:
        raise ValueError(f"skip_tokens={skip_tokens} must be >= 0")
    if skip_tokens:
        slots, obj = slots[skip_tokens:], obj[:, :, skip_tokens:]
    _run(refs, layout, slots, obj, gather=False, backend=backend)


def gather_layer(
    cache: torch.Tensor,
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    *,
    layer: int | None = None,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One layer's slots into ``[KV, T, NH*HS]`` (``layer=`` picks the layer of a cross-layer cache)."""
    ref = _one_layer_ref(cache, layout, layer)
    slots = _check_index(slot_mapping, cache.device, layout.num_slots, "slot_mapping")
    shape = (layout.num_kv, slots.numel(), layout.row_size)
    if out is None:
        out = torch.zeros(shape, dtype=cache.dtype, device=cache.device)
    _check_obj(out, shape, cache, "out")
    _run([ref], layout, slots, out.unsqueeze(0), gather=True, backend=backend, single_layer=True)
    return out


def scatter_layer(
    obj: torch.Tensor,
    cache: torch.Tensor,
    layout: KVLayout,
    slot_mapping: torch.Tensor,
    *,
    layer: int | None = None,
    backend: str | None = None,
    skip_tokens: int = 0,
) -> None:
    """Write one layer's ``[KV, T, NH*HS]`` into its cache at the slots (the layer-overlap load)."""
    ref = _one_layer_ref(cache, layout, layer)
    slots = _check_index(slot_mapping, cache.device, layout.num_slots, "slot_mapping")
    _check_obj(obj, (layout.num_kv, slots.numel(), layout.row_size), cache, "obj")
    if skip_tokens < 0:
        raise ValueError(f"skip_tokens={skip_tokens} must be >= 0")
    if skip_tokens:
        slots, obj = slots[skip_tokens:], obj[:, skip_tokens:]
    _run([ref], layout, slots, obj.unsqueeze(0), gather=False, backend=backend, single_layer=True)


def gather_blocks(
    caches: Any,
    layout: KVLayout,
    block_ids: torch.Tensor,
    *,
    backend: str | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Whole blocks into ``[L, KV, len(block_ids)*BS, NH*HS]`` (token t = offset t % BS of block
    ``block_ids[t // BS]``); a negative block id is skipped like a negative slot."""
    refs = layer_refs(caches, layout)
    first = _first_tensor(caches)
    ids = _check_index(block_ids, first.device, layout.num_blocks, "block_ids")
    shape = (len(refs), layout.num_kv, ids.numel() * layout.block_size, layout.row_size)
    if out is None:
        out = torch.zeros(shape, dtype=first.dtype, device=first.device)
    _check_obj(out, shape, first, "out")
    _run(refs, layout, ids, out, gather=True, backend=backend, blockwise=True)
    return out


def scatter_blocks(
    obj: torch.Tensor,
    caches: Any,
    layout: KVLayout,
    block_ids: torch.Tensor,
    *,
    backend: str | None = None,
    skip_blocks: int = 0,
) -> None:
    """Write ``[L, KV, len(block_ids)*BS, NH*HS]`` into whole blocks; ``skip_blocks=n`` leaves the
    first n blocks unwritten."""
    refs = layer_refs(caches, layout)
    first = _first_tensor(caches)
    ids = _check_index(block_ids, first.device, layout.num_blocks, "block_ids")
    _check_obj(
        obj, (len(refs), layout.num_kv, ids.numel() * layout.block_size, layout.row_size), first, "obj"
    )
    if skip_blocks < 0:
        raise ValueError(f"skip_blocks={skip_blocks} must be >= 0")
    if skip_blocks:
        ids, obj = ids[skip_blocks:], obj[:, :, skip_blocks * layout.block_size :]
    _run(refs, layout, ids, obj, gather=False, backend=backend, blockwise=True)
