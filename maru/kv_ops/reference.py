"""PyTorch reference placement: the oracle for every kernel, and the CPU hot path.

Works on any device torch does. Per layer and plane (K or V) it builds a strided view of the cache's
storage from the ``KVLayout`` numbers (never from the shape's axis order), then moves the tokens with
a few vectorised torch ops (never a Python loop over tokens):

* the "row" path: where a token's elements of one plane are ``runs`` contiguous runs of ``run``
  elements (one run of NH*HS for tight NHD, NH runs of HS for HND, packed and the CPU backend's V),
  the storage is viewed as ``[rows, run]`` and ``index_select`` / ``index_copy_`` move whole runs
  (memcpy speed on the CPU);
* the whole-block path (``_WholeBlocks``, taken first): tokens that fill whole blocks in offset
  order, as chunk loads and the block-granular API give them. Whole blocks at consecutive ids are one
  strided ``copy_`` per layer and plane between the object rows and a slice of the block axis (no
  index op; torch's copy kernel also transposes the CPU backend's K); scattered ids one
  ``index_select``/``index_copy_`` over the block axis, or one ``copy_`` per block where that is
  faster (``scatter_blocks_plane``). The remaining tokens (a partial first or last block, scattered
  slots) take the paths below;
* the generic path (the CPU backend's transposed K, unusual strides): advanced indexing on the
  ``[NB, BS, NH, HS]`` plane view, element by element but still one C++ loop.

Why a whole-block scatter into a transposed plane (the CPU backend's K) first copies the object's rows
into a staging buffer whose rows are ``STAGE_PAD_BYTES`` longer: the transposing copy walks the
destination's contiguous axis (tokens) and reads the source with the row stride, ``NH*HS`` elements,
usually a power of two (2 KiB for 8 heads of 64 fp32). Thirty-two loads 2 KiB apart fall into the same
few L1 sets and evict each other; with one more cache line per row they spread over all sets. The
extra memcpy-speed pass costs less than it saves (measurements: docs/kv_ops.md, bench/RESULTS.md).

Negative slots are never read or written. For gather, their object rows keep what ``out`` held.
"""

from __future__ import annotations

import bisect
import threading

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
    plan = split.plan(layout, kv)
    if plan is not None:
        rows = plan.rows(ref, layout, kv)
        rows.index_copy_(0, plan.index, values.reshape(-1, plan.run))
    else:
        view = plane_view(ref, layout, kv)
        view.index_put_(
            (split.blocks, split.offsets), values.reshape(split.count, layout.num_kv_heads, layout.head_size)
        )


class _Segment:
    """Whole blocks at consecutive token positions: tokens ``[t0, t0 + n*BS)`` are blocks ``ids``.

    ``b0`` is the first block id when ``ids`` are consecutive too (``b0 .. b0+n-1``), so the segment
    is a plain slice of the cache's block axis; else None.
    """

    def __init__(self, t0: int, ids: torch.Tensor, b0: int | None) -> None:
        self.t0, self.ids, self.b0 = t0, ids, b0
        self.n = int(ids.numel())


class _WholeBlocks:
    """The whole blocks among a slot mapping, grouped into ``_Segment``s; ``rest`` is what remains.

    A whole block is ``block_size`` consecutive tokens whose slots are ``b*BS + 0 .. b*BS + BS-1`` in
    that order (a chunk load: all of it but perhaps a partial first and last block). ``rest`` is the
    slot mapping with the whole blocks' tokens replaced by -1, for the token paths; None when the whole
    blocks cover every token. Windows of whole blocks cannot overlap (each starts at an offset-0 slot
    and holds offsets 0..BS-1), so detection tests every start at once, vectorised, without a scan.
    """

    def __init__(self, layout: KVLayout, slots: torch.Tensor) -> None:
        bs = layout.block_size
        n = slots.numel()
        self.segments: list[_Segment] = []
        self.rest: torch.Tensor | None = slots
        if n < bs:
            return
        if n % bs == 0 and self._all_whole(slots, bs):
            return
        if bs == 1:
            starts = torch.nonzero(slots >= 0).reshape(-1)
        else:
            # step[i]: slot i+1 follows slot i. A window [i, i+BS) is one block in order when it
            # starts at an offset-0 slot and all its BS-1 steps are +1 (prefix sums count them).
            steps = torch.zeros(n, dtype=torch.int32, device=slots.device)
            torch.cumsum((slots[1:] - slots[:-1]) == 1, 0, dtype=torch.int32, out=steps[1:])
            first = slots[: n - bs + 1]
            ok = (first >= 0) & (first % bs == 0) & (steps[bs - 1 :] - steps[: n - bs + 1] == bs - 1)
            starts = torch.nonzero(ok).reshape(-1)
        count = int(starts.numel())
        if count == 0:
            return
        blocks = torch.div(slots[starts], bs, rounding_mode="floor")
        # A segment ends where the next whole block does not follow in the token list; a segment's
        # ids are a slice of the block axis when each id is the previous one plus one.
        if count > 1:
            tok_next = starts[1:] - starts[:-1] == bs
            id_next = blocks[1:] - blocks[:-1] == 1
            cuts = (torch.nonzero(~tok_next).reshape(-1) + 1).tolist()
            id_breaks = torch.nonzero(tok_next & ~id_next).reshape(-1) + 1
        else:
            cuts, id_breaks = [], torch.zeros(0, dtype=torch.int64)
        breaks = id_breaks.tolist()  # sorted
        bounds = [0, *cuts, count]
        t_list = starts.tolist()
        for i, j in zip(bounds[:-1], bounds[1:], strict=True):
            # consecutive ids unless an id break falls strictly inside (i, j)
            k = bisect.bisect_right(breaks, i)
            b0 = int(blocks[i]) if k == len(breaks) or breaks[k] >= j else None
            self.segments.append(_Segment(t_list[i], blocks[i:j], b0))
        if count * bs == n:
            self.rest = None
            return
        covered = (starts[:, None] + torch.arange(bs, device=slots.device)[None, :]).reshape(-1)
        self.rest = slots.index_fill(0, covered, -1)

    def _all_whole(self, slots: torch.Tensor, bs: int) -> bool:
        """The common case in half the host time of the general test: every token in whole blocks."""
        grid = slots.reshape(-1, bs)
        first = grid[:, 0]
        offsets = torch.arange(bs, device=slots.device)
        ok = ((grid - first[:, None]) == offsets).all() & (first >= 0).all() & (first % bs == 0).all()
        if not bool(ok):
            return False
        ids = torch.div(first, bs, rounding_mode="floor")
        consecutive = ids.numel() == 1 or bool((ids[1:] - ids[:-1] == 1).all())
        self.segments.append(_Segment(0, ids, int(ids[0]) if consecutive else None))
        self.rest = None
        return True


# Staging rows are this many bytes longer than the object's (one cache line; see the module docstring).
STAGE_PAD_BYTES = 64


def _transposed(layout: KVLayout, kv: int) -> bool:
    """True when the plane's contiguous axis is not the head dimension (the CPU backend's K^T)."""
    _, st, _, sd = layout.plane_strides(kv)
    return sd != 1 and st < sd


class _Staging(threading.local):
    """One reusable staging buffer per thread (a fresh multi-MiB tensor per call would page-fault its
    whole size in again, which costs more than the copy it serves)."""

    buf: torch.Tensor | None = None

    def rows(self, like: torch.Tensor, num_rows: int, row: int) -> torch.Tensor:
        """A ``[num_rows, row + pad]`` tensor of ``like``'s dtype and device (contents undefined)."""
        pad = max(1, STAGE_PAD_BYTES // like.element_size())
        need = num_rows * (row + pad)
        buf = self.buf
        if buf is None or buf.dtype != like.dtype or buf.device != like.device or buf.numel() < need:
            buf = self.buf = torch.empty(need, dtype=like.dtype, device=like.device)
        return buf[:need].view(num_rows, row + pad)


_STAGING = _Staging()


def _blocks_of(rows: torch.Tensor, layout: KVLayout, t0: int, n: int) -> torch.Tensor:
    """Tokens ``[t0, t0 + n*BS)`` of ``rows`` ([T, >= ROW], unit element stride) as ``[n, BS, NH, HS]``."""
    part = rows[t0 : t0 + n * layout.block_size, : layout.row_size]
    return part.view(n, layout.block_size, layout.num_kv_heads, layout.head_size)


def gather_blocks_plane(
    ref: LayerRef, layout: KVLayout, kv: int, segments: list[_Segment], out: torch.Tensor
) -> None:
    """Whole blocks of one layer's plane into ``out``'s rows: one ``index_select`` per segment over
    the block axis (as fast as a slice copy for consecutive ids, and faster for scattered ones).
    ``out``'s rows are contiguous (``ops`` checks it), so a segment's rows are one contiguous tensor."""
    view = plane_view(ref, layout, kv)
    for seg in segments:
        torch.index_select(view, 0, seg.ids, out=_blocks_of(out, layout, seg.t0, seg.n))


def scatter_blocks_plane(
    ref: LayerRef, layout: KVLayout, kv: int, segments: list[_Segment], rows: torch.Tensor
) -> None:
    """Whole blocks of ``rows`` into one layer's plane.

    A segment of consecutive block ids is one strided ``copy_`` into a slice of the block axis. For
    scattered ids one ``index_copy_`` over the block axis, except for a plane whose block is several
    contiguous pieces (HND, packed, the CPU backend's V) on one CPU thread: there one ``copy_`` per
    block is faster (for tight NHD, where a block's plane is one contiguous run, and for the staged
    transposed K, ``index_copy_`` wins; docs/kv_ops.md has the numbers). With more threads
    ``index_copy_`` again (torch splits it across threads, not a one-block copy), and on a GPU
    (per-block launches would cost more).
    """
    view = plane_view(ref, layout, kv)
    _, st, sh, sd = layout.plane_strides(kv)
    one_run = (st, sh, sd) == (layout.row_size, layout.head_size, 1)  # a block's plane is contiguous
    per_block = not (one_run or _transposed(layout, kv)) and view.device.type == "cpu"
    per_block = per_block and torch.get_num_threads() == 1
    for seg in segments:
        src = _blocks_of(rows, layout, seg.t0, seg.n)
        if seg.b0 is not None:
            view[seg.b0 : seg.b0 + seg.n].copy_(src)
        elif not per_block:
            view.index_copy_(0, seg.ids, src)
        else:
            for j, b in enumerate(seg.ids.tolist()):
                view[b].copy_(src[j])


def gather(refs: list[LayerRef], layout: KVLayout, slot_mapping: torch.Tensor, out: torch.Tensor) -> None:
    """``out[l, kv, t] = cache_l[kv, slot_mapping[t]]`` for every valid slot (``out`` is [L, KV, T, ROW])."""
    whole = _WholeBlocks(layout, slot_mapping.to(torch.int64))
    if whole.segments:
        for layer, ref in enumerate(refs):
            for kv in range(layout.num_kv):
                gather_blocks_plane(ref, layout, kv, whole.segments, out[layer, kv])
    if whole.rest is None:
        return
    split = _SlotSplit(layout, whole.rest)
    for layer, ref in enumerate(refs):
        for kv in range(layout.num_kv):
            gather_plane(ref, layout, kv, split, out[layer, kv])


def scatter(refs: list[LayerRef], layout: KVLayout, slot_mapping: torch.Tensor, obj: torch.Tensor) -> None:
    """``cache_l[kv, slot_mapping[t]] = obj[l, kv, t]`` for every valid slot."""
    whole = _WholeBlocks(layout, slot_mapping.to(torch.int64))
    if whole.segments:
        for kv in range(layout.num_kv):
            stage = _transposed(layout, kv) and obj.device.type == "cpu"
            for layer, ref in enumerate(refs):
                rows = obj[layer, kv]
                if stage:
                    # Rows one cache line longer break the power-of-two read stride (module docstring);
                    # one layer at a time, so the staged rows are still in L2 when the copy reads them.
                    staged = _STAGING.rows(rows, rows.shape[0], layout.row_size)
                    staged[:, : layout.row_size].copy_(rows)
                    rows = staged
                scatter_blocks_plane(ref, layout, kv, whole.segments, rows)
    if whole.rest is None:
        return
    split = _SlotSplit(layout, whole.rest)
    for layer, ref in enumerate(refs):
        for kv in range(layout.num_kv):
            scatter_plane(ref, layout, kv, split, obj[layer, kv])
