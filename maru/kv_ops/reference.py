"""PyTorch reference placement: the oracle for every kernel, and the CPU hot path.

Works on any device torch does. Per layer and plane (K or V) it builds a strided view of the cache's
storage from the ``KVLayout`` numbers (never from the shape's axis order), then moves all tokens with
one vectorised index op:

* the "row" path: where a token's elements of one plane are ``runs`` contiguous runs of ``run``
  elements (one run of NH*HS for tight NHD, NH runs of HS for HND, packed and the CPU backend's V),
  the storage is viewed as ``[rows, run]`` and ``index_select`` / ``index_copy_`` move whole runs
  (memcpy speed on the CPU);
* the whole-block path: when the valid tokens are whole blocks in offset order (a chunk load, the
  block-granular API), one ``index_select``/``index_copy_`` over the plane view's block axis;
* the generic path (the CPU backend's transposed K, unusual strides): advanced indexing on the
  ``[NB, BS, NH, HS]`` plane view, element by element but still one C++ loop.

Negative slots are never read or written. For gather, their object rows keep what ``out`` held.
"""

from __future__ import annotations

import torch

from maru.kv_ops.layout import KVLayout

LayerRef = tuple[
    torch.Tensor, int
]  # (a tensor over the cache's storage, absolute element offset of the layer)


def plane_view(ref: LayerRef, layout: KVLayout, kv: int) -> torch.Tensor:
    """The ``[NB, BS, NH, HS]`` view of one layer's plane ``kv``, in the cache's own memory."""
    tensor, base = ref
    sizes = (layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_size)
    return torch.as_strided(tensor, sizes, layout.plane_strides(kv), base + kv * layout.kv_stride)


def _row_geometry(layout: KVLayout, kv: int) -> tuple[int, int] | None:
    """(run, runs_per_token) when a token's plane data is whole contiguous runs, else None."""
    sb, st, sh, sd = layout.plane_strides(kv)
    hs, nh = layout.head_size, layout.num_kv_heads
    if sd != 1:
        return None
    if sh == hs or nh == 1:
        run, runs = nh * hs, 1
    else:
        run, runs = hs, nh
    if sb % run or st % run or (runs > 1 and sh % run):
        return None
    return run, runs


class _RowPlan:
    """Row indices of one plane for a fixed set of valid slots (shared by K and V when they agree)."""

    def __init__(self, layout: KVLayout, kv: int, blocks: torch.Tensor, offsets: torch.Tensor) -> None:
        geom = _row_geometry(layout, kv)
        assert geom is not None
        self.run, self.runs = geom
        sb, st, sh, _ = layout.plane_strides(kv)
        first = (blocks * (sb // self.run)) + offsets * (st // self.run)
        if self.runs > 1:
            heads = torch.arange(self.runs, device=blocks.device, dtype=first.dtype) * (sh // self.run)
            first = (first[:, None] + heads[None, :]).reshape(-1)
        self.index = first
        # The last row any slot can start; a row then spans ``run`` elements that the tensor owns.
        reach = (layout.num_blocks - 1) * sb + (layout.block_size - 1) * st + (self.runs - 1) * sh
        self.num_rows = reach // self.run + 1

    def rows(self, ref: LayerRef, layout: KVLayout, kv: int) -> torch.Tensor:
        tensor, base = ref
        return torch.as_strided(
            tensor, (self.num_rows, self.run), (self.run, 1), base + kv * layout.kv_stride
        )


class _SlotSplit:
    """Valid slots of a mapping, split into (block, offset), plus where they sit in the token list."""

    def __init__(self, layout: KVLayout, slot_mapping: torch.Tensor) -> None:
        slots = slot_mapping.to(torch.int64)
        valid = slots >= 0
        self.all_valid = bool(valid.all()) if slots.numel() else True
        if self.all_valid:
            self.positions = None
            chosen = slots
        else:
            self.positions = torch.nonzero(valid).reshape(-1)
            chosen = slots[self.positions]
        self.count = int(chosen.numel())
        self.blocks = torch.div(chosen, layout.block_size, rounding_mode="floor")
        self.offsets = chosen - self.blocks * layout.block_size
        self._plans: dict[int, _RowPlan | None] = {}
        self.whole_blocks = self._whole_blocks(layout.block_size)

    def _whole_blocks(self, block_size: int) -> torch.Tensor | None:
        """Block ids when the valid tokens are whole blocks, each in offset order (a chunk load), else None.

        Then one ``index_select``/``index_copy_`` over the plane's block axis moves everything, with
        the layout's own (possibly transposed) inner order handled inside that one C++ copy.
        """
        if self.count == 0 or self.count % block_size:
            return None
        groups = self.blocks.view(-1, block_size)
        offs = self.offsets.view(-1, block_size)
        expected = torch.arange(block_size, device=offs.device, dtype=offs.dtype)
        if bool((groups == groups[:, :1]).all()) and bool((offs == expected).all()):
            return groups[:, 0].contiguous()
        return None

    def plan(self, layout: KVLayout, kv: int) -> _RowPlan | None:
        key = kv if layout.plane_strides(0) != layout.plane_strides(1) else 0
        if key not in self._plans:
            geom = _row_geometry(layout, kv)
            self._plans[key] = _RowPlan(layout, kv, self.blocks, self.offsets) if geom else None
        return self._plans[key]


def gather_plane(ref: LayerRef, layout: KVLayout, kv: int, split: _SlotSplit, out: torch.Tensor) -> None:
    """Copy the valid slots' plane-``kv`` rows of one layer into ``out`` ([T, NH*HS], rows contiguous)."""
    if split.count == 0:
        return
    if split.whole_blocks is not None:
        view = plane_view(ref, layout, kv)
        if split.positions is None and out.is_contiguous():
            shape = (split.whole_blocks.numel(), layout.block_size, layout.num_kv_heads, layout.head_size)
            torch.index_select(view, 0, split.whole_blocks, out=out.view(shape))
            return
        picked = view.index_select(0, split.whole_blocks).reshape(split.count, -1)
        if split.positions is None:
            out.copy_(picked)
        else:
            out.index_copy_(0, split.positions, picked)
        return
    plan = split.plan(layout, kv)
    if plan is not None:
        rows = plan.rows(ref, layout, kv)
        if split.positions is None and out.is_contiguous():
            torch.index_select(rows, 0, plan.index, out=out.view(-1, plan.run))
            return
        picked = rows.index_select(0, plan.index).view(split.count, -1)
    else:
        picked = plane_view(ref, layout, kv)[split.blocks, split.offsets].reshape(split.count, -1)
    if split.positions is None:
        out.copy_(picked)
    else:
        out.index_copy_(0, split.positions, picked)


def scatter_plane(ref: LayerRef, layout: KVLayout, kv: int, split: _SlotSplit, src: torch.Tensor) -> None:
    """Write ``src``'s rows ([T, NH*HS]) of the valid slots into one layer's plane ``kv``."""
    if split.count == 0:
        return
    values = src if split.positions is None else src.index_select(0, split.positions)
    if split.whole_blocks is not None:
        shape = (split.whole_blocks.numel(), layout.block_size, layout.num_kv_heads, layout.head_size)
        plane_view(ref, layout, kv).index_copy_(0, split.whole_blocks, values.reshape(shape))
        return
    plan = split.plan(layout, kv)
    if plan is not None:
        rows = plan.rows(ref, layout, kv)
        rows.index_copy_(0, plan.index, values.reshape(-1, plan.run))
    else:
        view = plane_view(ref, layout, kv)
        view.index_put_(
            (split.blocks, split.offsets), values.reshape(split.count, layout.num_kv_heads, layout.head_size)
        )


def gather(refs: list[LayerRef], layout: KVLayout, slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """``out[l, kv, t] = cache_l[kv, slot_mapping[t]]`` for every valid slot (``out`` is [L, KV, T, ROW])."""
    split = _SlotSplit(layout, slot_mapping)
    for layer, ref in enumerate(refs):
        for kv in range(layout.num_kv):
            gather_plane(ref, layout, kv, split, out[layer, kv])


def scatter(refs: list[LayerRef], layout: KVLayout, slot_mapping: torch.Tensor, obj: torch.Tensor) -> None:
    """``cache_l[kv, slot_mapping[t]] = obj[l, kv, t]`` for every valid slot."""
    split = _SlotSplit(layout, slot_mapping)
    for layer, ref in enumerate(refs):
        for kv in range(layout.num_kv):
            scatter_plane(ref, layout, kv, split, obj[layer, kv])
