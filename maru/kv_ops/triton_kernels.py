"""Triton placement kernels: one kernel, specialised at compile time into the three operations.

* multi-layer: grid (token tiles, layers x planes); each layer's base is ``cache_ptr + layer_offs[layer]``
  (an int64 table of element offsets from layer 0, so per-layer tensors anywhere in memory and the
  cross-layer tensor are the same code);
* single-layer (``USE_TABLE=False``): grid (token tiles, planes), no table load: the layer-overlap path;
* block-granular (``BLOCKWISE=True``): the index array holds block ids; token ``t`` of the object is
  offset ``t % BS`` of block ``ids[t // BS]``.

``direct_scatter_layer`` is a fourth kernel: one layer placed straight from chunk objects in
GPU-addressable host memory (a registered pool), whose addresses a small table gives.

Every address is computed from the ``KVLayout`` strides in physical memory (block, token, head, dim
strides per K/V plane), never from the shape's axis order, so NHD, HND, padded, packed and the CPU
backend's transposed K are all stride arithmetic. Elements are moved as same-width integers
(bit-exact, whatever the float format). Masks are block-shaped tensors (the interpreter rejects a
scalar-and-vector mask). ``row_offsets``, ``tiles``, ``row_is_contiguous``, ``layer_table`` and
``base_view`` are public so that ``bench/kernel_variants.py`` builds its experimental kernels from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from maru.kv_ops.checksum import row_terms
from maru.kv_ops.launch import Launcher
from maru.kv_ops.layout import KVLayout
from maru.kv_ops.ops import as_bits

__all__ = [
    "DIRECT_ROWS",
    "DIRECT_SUMS_ROW",
    "TuneParams",
    "as_bits",
    "base_view",
    "direct_checksum_ok",
    "direct_scatter_layer",
    "direct_table_host",
    "layer_table",
    "place",
    "row_is_contiguous",
    "row_offsets",
    "tiles",
]


@triton.jit
def row_offsets(
    c,
    kv,
    s_head,
    K_S_DIM: tl.constexpr,
    V_S_DIM: tl.constexpr,
    HS: tl.constexpr,
    ROW_CONTIG: tl.constexpr,
):
    """Element offsets in the cache of row positions ``c`` (head-major: head c // HS, dim c % HS)."""
    if ROW_CONTIG:
        # A token's plane is one contiguous run (tight NHD, MLA): the compiler sees it whole.
        off = c
    elif K_S_DIM == V_S_DIM:
        off = (c // HS) * s_head + (c % HS) * K_S_DIM
    else:
        # The CPU backend's K is transposed: K and V planes step through a head differently.
        off = (c // HS) * s_head + (c % HS) * tl.where(kv == 0, K_S_DIM, V_S_DIM)
    return off


@triton.jit
def _place_kernel(
    obj_ptr,
    cache_ptr,
    layer_offs_ptr,
    idx_ptr,
    num_tokens,
    skip,
    obj_s_layer,
    obj_s_kv,
    obj_s_tok,
    s_block,
    s_head,
    kv_stride,
    k_s_tok,
    v_s_tok,
    K_S_DIM: tl.constexpr,
    V_S_DIM: tl.constexpr,
    BS: tl.constexpr,
    HS: tl.constexpr,
    ROW: tl.constexpr,
    NUM_KV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    GATHER: tl.constexpr,
    BLOCKWISE: tl.constexpr,
    USE_TABLE: tl.constexpr,
    LAYER_ALIGN: tl.constexpr,
    ROW_CONTIG: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_lk = tl.program_id(1)
    # One program per (token tile, layer, plane): twice the parallelism of a program doing K then V.
    layer = pid_lk // NUM_KV
    kv = pid_lk % NUM_KV
    if USE_TABLE:
        layer_off = tl.load(layer_offs_ptr + layer)
        # Python checked the alignment; the hint lets the compiler keep 16-byte accesses.
        layer_off = tl.multiple_of(layer_off, LAYER_ALIGN)
        base = cache_ptr + layer_off
    else:
        base = cache_ptr
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = (t < num_tokens) & (t >= skip)
    if BLOCKWISE:
        blk = tl.load(idx_ptr + t // BS, mask=tmask, other=-1).to(tl.int64)
        off_in_block = (t % BS).to(tl.int64)
        valid = tmask & (blk >= 0)
    else:
        slot = tl.load(idx_ptr + t, mask=tmask, other=-1).to(tl.int64)
        valid = tmask & (slot >= 0)
        slot = tl.where(valid, slot, 0)
        blk = slot // BS
        off_in_block = slot % BS
    s_tok = tl.where(kv == 0, k_s_tok, v_s_tok)
    cache_row = base + kv * kv_stride + blk * s_block + off_in_block * s_tok
    obj_row = obj_ptr + layer.to(tl.int64) * obj_s_layer + kv * obj_s_kv + t.to(tl.int64) * obj_s_tok
    for r0 in range(0, ROW, BLOCK_R):
        c = r0 + tl.arange(0, BLOCK_R)
        c_off = row_offsets(c, kv, s_head, K_S_DIM, V_S_DIM, HS, ROW_CONTIG)
        m = valid[:, None] & (c < ROW)[None, :]
        cache_p = cache_row[:, None] + c_off[None, :]
        obj_p = obj_row[:, None] + c[None, :]
        if GATHER:
            tl.store(obj_p, tl.load(cache_p, mask=m), mask=m)
        else:
            tl.store(cache_p, tl.load(obj_p, mask=m), mask=m)


class TuneParams:
    """Tile sizes of the placement kernels (``bench/kv_ops.py --sweep`` compares others; the chosen
    values and their measurements are in bench/RESULTS.md)."""

    block_t: int = 4
    max_block_r: int = 1024
    num_warps: int = 4


def tiles(
    layout: KVLayout, num_tokens: int, block_t: int | None = None, num_warps: int | None = None
) -> tuple[int, int, int]:
    """(tokens a program, row elements a step, warps) for ``num_tokens`` tokens of ``layout``;
    ``block_t``/``num_warps`` override ``TuneParams``. Memoised (a launch's host time is the budget
    of a small call); the key holds ``TuneParams``' values, so a sweep that changes them is seen."""
    key = (
        layout.row_size,
        num_tokens,
        block_t,
        num_warps,
        TuneParams.block_t,
        TuneParams.max_block_r,
        TuneParams.num_warps,
    )
    hit = _TILES.get(key)
    if hit is None:
        if len(_TILES) > 4096:  # token counts are few in practice; never grow without bound
            _TILES.clear()
        hit = _TILES[key] = _tiles(layout, num_tokens, block_t, num_warps)
    return hit


_TILES: dict[tuple, tuple[int, int, int]] = {}


def _tiles(
    layout: KVLayout, num_tokens: int, block_t: int | None, num_warps: int | None
) -> tuple[int, int, int]:
    row = layout.row_size
    block_r = min(triton.next_power_of_2(row), TuneParams.max_block_r)
    base_t = TuneParams.block_t if block_t is None else block_t
    warps = TuneParams.num_warps if num_warps is None else num_warps
    # Keep a tile at about 8K elements: enough bytes in flight per program, few registers.
    tile_t = max(1, min(base_t * max(1, 1024 // block_r), 64))
    tile_t = min(tile_t, triton.next_power_of_2(max(1, num_tokens)))
    return tile_t, block_r, warps


def row_is_contiguous(layout: KVLayout) -> bool:
    """Whether a token's row of one plane is one contiguous run in the cache (tight NHD, MLA)."""
    return (
        layout.k_dim_stride == 1
        and layout.v_dim_stride == 1
        and (layout.head_stride == layout.head_size or layout.num_kv_heads == 1)
    )


def _align_of(value: int) -> int:
    """Largest power of two (at most 16) dividing ``value`` (0 divides by anything)."""
    if value == 0:
        return 16
    align = 1
    while align < 16 and value % (align * 2) == 0:
        align *= 2
    return align


class LayerTable:
    """Device-resident int64 table of per-layer element offsets from layer 0, cached by addresses.

    Building it costs a host-to-device copy; the caches of a serving process never move, so one
    table per set of caches is built once and reused.
    """

    def __init__(self) -> None:
        self._tables: dict[tuple, tuple[torch.Tensor, int]] = {}

    def get(self, ptrs: tuple[int, ...], esize: int, device: torch.device) -> tuple[torch.Tensor, int]:
        key = (ptrs, esize, str(device))
        hit = self._tables.get(key)
        if hit is not None:
            return hit
        base = ptrs[0]
        offs = []
        for p in ptrs:
            delta = p - base
            if delta % esize:
                raise ValueError(
                    f"layer caches are not element-aligned relative to each other ({delta} bytes)"
                )
            offs.append(delta // esize)
        align = 16
        for o in offs:
            align = min(align, _align_of(o))
        table = torch.tensor(offs, dtype=torch.int64).to(device)
        if len(self._tables) > 64:
            self._tables.clear()
        self._tables[key] = (table, align)
        return table, align


_TABLES = LayerTable()


def layer_table(refs: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, int]:
    """The device table of per-layer element offsets from layer 0 for ``refs``, and the largest
    power of two (at most 16) dividing every offset."""
    ptrs = tuple(t.data_ptr() + (b - t.storage_offset()) * t.element_size() for t, b in refs)
    cache0 = refs[0][0]
    return _TABLES.get(ptrs, cache0.element_size(), cache0.device)


class _Prepared:
    """The host-side launch arguments derived from a refs list (base pointer view, layer table),
    memoised by the identity of the list: ``ops`` hands the same validated list for the same caches
    (``ops._RefCache``), and deriving them costs more host time than the launch itself. An entry holds
    the list, so its id cannot be reused by another list while the entry lives."""

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._entries: dict[int, tuple[Any, torch.Tensor, torch.Tensor | None, int]] = {}

    def get(
        self, refs: list[tuple[torch.Tensor, int]], table: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        hit = self._entries.get(id(refs))
        if hit is not None and hit[0] is refs and (hit[2] is not None or not table):
            return hit[1], hit[2], hit[3]
        cache0 = base_view(refs[0])
        tab, align = layer_table(refs) if table else (None, 16)
        if len(self._entries) >= self.size:
            self._entries.pop(next(iter(self._entries)))
        self._entries[id(refs)] = (refs, cache0, tab, align)
        return cache0, tab, align


_PREPARED = _Prepared()


def prepared(refs: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """(base pointer view of layer 0, layer table, alignment) for a multi-layer launch over ``refs``."""
    return _PREPARED.get(refs, True)


def base_view(ref: tuple[torch.Tensor, int]) -> torch.Tensor:
    """A one-element tensor starting at the layer base of ``ref``: the pointer a kernel receives."""
    tensor, base = ref
    return torch.as_strided(tensor, (1,), (1,), base)


def place(
    refs: list[tuple[torch.Tensor, int]],
    layout: KVLayout,
    index: torch.Tensor,
    obj: torch.Tensor,
    *,
    gather: bool,
    blockwise: bool = False,
    skip: int = 0,
    single_layer: bool = False,
) -> None:
    """Launch one kernel moving ``obj`` ([L, KV, T, ROW], planes row-contiguous) to/from the caches.

    ``refs`` are (bits tensor over the cache storage, absolute element offset of the layer base);
    ``obj`` is of the cache's dtype or its same-width integer view (the kernel moves bits either
    way). ``index``: one slot per token (or one block id per block with ``blockwise``); negative
    entries are skipped, and so are the first ``skip`` tokens.
    """
    num_layers, num_kv, num_tokens, row = obj.shape
    if num_tokens == 0 or num_layers == 0:
        return
    if single_layer or num_layers == 1:
        cache0 = base_view(refs[0])
        table, align, use_table = index, 16, False
    else:
        cache0, tab, align = _PREPARED.get(refs, True)
        assert tab is not None
        table, use_table = tab, True
    block_t, block_r, num_warps = tiles(layout, num_tokens)
    grid = (triton.cdiv(num_tokens, block_t), num_layers * num_kv)
    _PLACE.launch(
        grid,
        num_warps,
        obj,
        cache0,
        table,
        index,
        num_tokens,
        skip,
        *obj.stride()[:3],
        layout.block_stride,
        layout.head_stride,
        layout.kv_stride,
        layout.k_token_stride,
        layout.v_token_stride,
        layout.k_dim_stride,  # K_S_DIM and the rest: the constexprs, in the kernel's order
        layout.v_dim_stride,
        layout.block_size,
        layout.head_size,
        row,
        num_kv,
        block_t,
        block_r,
        gather,
        blockwise,
        use_table,
        align,
        row_is_contiguous(layout),
    )


# Triton compiles for the tensors' integer views; the direct launch passes addresses (no views per call).
_PLACE = Launcher(_place_kernel, triton_view=as_bits)


# ---------------------------------------------------------------------- direct (zero-copy) layer load

DIRECT_ROWS = 6  # source address, plane stride, slot, object (per token), token in object, checksum sums
DIRECT_SUMS_ROW = 5  # where the checksum variant adds each object's terms


@triton.jit
def _direct_layer_kernel(
    tab_ptr,
    cache_ptr,
    layer,
    stage_off,
    num_tokens,
    tab_stride,
    s_block,
    s_head,
    kv_stride,
    k_s_tok,
    v_s_tok,
    K_S_DIM: tl.constexpr,
    V_S_DIM: tl.constexpr,
    BS: tl.constexpr,
    HS: tl.constexpr,
    ROW: tl.constexpr,
    NUM_KV: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    ROW_CONTIG: tl.constexpr,
    CHECKSUM: tl.constexpr,
    ESIZE: tl.constexpr,
    STAGED: tl.constexpr,
):
    # One program per (token tile, plane). The table's last column, row 0, says how rows 0 and 1 are
    # indexed (read at run time, so one captured graph serves both):
    # * C > 0 ("per chunk"): every chunk but the last holds C tokens; entry k of row 0 is the byte
    #   address of chunk k's object (host memory the GPU can address: a registered pool), entry k of
    #   row 1 its elements per plane (its T * ROW); token t is row t - k*C of chunk k = t // C;
    # * 0 ("per token"): entry t of row 0 is the address of token t's row in layer 0, plane 0 of its
    #   object, entry t of row 1 that object's plane size, entry t of rows 3 and 4 its object and
    #   its row in that object (read only with CHECKSUM).
    # Row 2 is always per token: the slot (-1: not written; -2: not written and, with CHECKSUM,
    # not read). The last column of row 1 holds the call's real token count (the rest of a graph
    # bucket is padding). With CHECKSUM the kernel also reads the rows it does not write (skipped
    # tokens: part of the object) unless their slot is -2, and adds the ``maru.checksum`` terms of
    # this layer and plane of each object into its entry of row 5 (which the table starts at the
    # committed sums of the segments left unread: ``direct_table_host``'s ``prefill``).
    # STAGED: the table names a device slot holding layer ``layer`` of each object in its layer
    # layout, read ``stage_off`` bytes further (``kv_ops.layer_copies``); else the objects.
    pid_t = tl.program_id(0)
    kv = tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < num_tokens
    slot = tl.load(tab_ptr + 2 * tab_stride + t, mask=tmask, other=-1)
    valid = tmask & (slot >= 0)
    readable = slot > -2  # -2: a row of a segment the load does not place (``maru.segments``)
    slot = tl.where(valid, slot, 0)
    chunk_t = tl.load(tab_ptr + tab_stride - 1)
    per_chunk = chunk_t > 0
    div = tl.maximum(chunk_t, 1)
    if CHECKSUM:
        total = tl.load(tab_ptr + 2 * tab_stride - 1)
        read = tmask & (t < total) & readable
    else:
        read = valid
    k = tl.where(per_chunk, t // div, t)
    within = tl.where(per_chunk, t - k * div, 0)
    addr = tl.load(tab_ptr + k, mask=read, other=0)
    plane = tl.load(tab_ptr + tab_stride + k, mask=read, other=0)
    if STAGED:
        src_row = (
            (addr + stage_off).to(tl.pointer_type(cache_ptr.dtype.element_ty))
            + kv * plane
            + within.to(tl.int64) * ROW
        )
    else:
        src_row = (
            addr.to(tl.pointer_type(cache_ptr.dtype.element_ty))
            + (layer * NUM_KV + kv) * plane
            + within.to(tl.int64) * ROW
        )
    blk = slot // BS
    off_in_block = slot % BS
    s_tok = tl.where(kv == 0, k_s_tok, v_s_tok)
    cache_row = cache_ptr + kv * kv_stride + blk * s_block + off_in_block * s_tok
    if CHECKSUM:
        EPW: tl.constexpr = 8 // ESIZE  # elements a word
        obj = tl.where(per_chunk, k, tl.load(tab_ptr + 3 * tab_stride + t, mask=read, other=0))
        row_in_obj = tl.where(per_chunk, within, tl.load(tab_ptr + 4 * tab_stride + t, mask=read, other=0))
        # Word index of the row's first element in its object (ROW * ESIZE % 8 == 0: rows are words).
        word0 = ((layer * NUM_KV + kv) * plane + row_in_obj * ROW) // EPW
        sums = tl.zeros([BLOCK_T], dtype=tl.uint64)
    for r0 in range(0, ROW, BLOCK_R):
        c = r0 + tl.arange(0, BLOCK_R)
        c_off = row_offsets(c, kv, s_head, K_S_DIM, V_S_DIM, HS, ROW_CONTIG)
        m = valid[:, None] & (c < ROW)[None, :]
        rm = read[:, None] & (c < ROW)[None, :]
        vals = tl.load(src_row[:, None] + c[None, :], mask=rm, other=0)
        tl.store(cache_row[:, None] + c_off[None, :], vals, mask=m)
        if CHECKSUM:
            sums += row_terms(vals, word0, r0, read, ROW, BLOCK_T, BLOCK_R, ESIZE)
    if CHECKSUM:
        acc = tab_ptr + 5 * tab_stride
        first = tl.min(tl.where(read, obj, 1 << 62), axis=0)
        last = tl.max(tl.where(read, obj, -1), axis=0)
        if first == last:  # the usual tile: one object, one atomic
            tl.atomic_add(acc + first, tl.sum(sums, axis=0).to(tl.int64, bitcast=True))
        else:
            tl.atomic_add(acc + obj, sums.to(tl.int64, bitcast=True), mask=read)


def direct_table_host(
    chunks: list[tuple[int, int]],
    slots: torch.Tensor,
    row: int,
    esize: int,
    width: int | None = None,
    out: torch.Tensor | None = None,
    prefill: np.ndarray | None = None,
) -> torch.Tensor:
    """The ``[DIRECT_ROWS, width + 1]`` int64 table ``direct_scatter_layer`` reads, built on the host.

    ``chunks``: (address of the object's first byte, tokens) per chunk object ``[L, KV, T, ROW]``, in
    order; ``slots``: one slot per token of all chunks (CPU, int64; negative = not written). Columns
    past the tokens (``width`` > tokens) get slot -1. When every chunk but the last has the same
    length C and the last at most C (the connector's usual step: whole chunks, one tail), the
    addresses are per chunk (n entries, whatever the token count); otherwise per token. Pinned when
    CUDA is available, so the upload is asynchronous. ``out``: a flat int64 host tensor of at least
    ``DIRECT_ROWS * (width + 1)`` entries to build it in (``HostScratch``), instead of a new one.
    ``prefill``: per object, the raw sum its checksum accumulator starts at (uint64: the committed
    sums of the segments whose rows are marked -2, left unread); zeros when not given.
    """
    total = int(slots.numel())
    width = total if width is None else int(width)
    if width < total:
        raise ValueError(f"table width {width} < {total} tokens")
    lengths = [t for _, t in chunks]
    if sum(lengths) != total:
        raise ValueError(f"the chunks hold {sum(lengths)} tokens, the slot mapping {total}")
    if out is not None:
        tab = out[: DIRECT_ROWS * (width + 1)].view(DIRECT_ROWS, width + 1)
    else:
        tab = torch.empty((DIRECT_ROWS, width + 1), dtype=torch.int64, pin_memory=torch.cuda.is_available())
    # numpy over the same memory: this runs on the layer load's issue path, and a numpy op costs a
    # fraction of torch's per-op overhead.
    out = tab.numpy()
    n = len(chunks)
    ptrs = np.fromiter((p for p, _ in chunks), dtype=np.int64, count=n)
    counts = np.asarray(lengths, dtype=np.int64)
    first = lengths[0] if lengths else 0
    if first > 0 and all(t == first for t in lengths[:-1]) and lengths[-1] <= first:
        out[0, :n] = ptrs
        out[1, :n] = counts * row
        out[0, width] = first
    else:
        starts = np.cumsum(counts) - counts
        within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        out[0, :total] = np.repeat(ptrs, counts) + within * (row * esize)
        out[1, :total] = np.repeat(counts * row, counts)
        out[3, :total] = np.repeat(np.arange(n, dtype=np.int64), counts)
        out[4, :total] = within
        out[0, width] = 0
    # Rows 0, 1, 3 and 4 past the used entries are never read (tokens past the count): not cleared.
    out[1, width] = total
    out[2, :total] = slots.numpy()
    out[2, total:] = -1
    # The checksum accumulators, set by the upload itself.
    out[5, :n] = 0 if prefill is None else np.asarray(prefill, dtype=np.uint64).view(np.int64)
    return tab


def direct_scatter_layer(
    tab: torch.Tensor,
    ref: tuple[torch.Tensor, int],
    layout: KVLayout,
    layer: int,
    num_tokens: int,
    *,
    checksum: bool = False,
    stage_off: int | None = None,
) -> None:
    """Place layer ``layer`` of the chunk objects a direct table names into one layer's cache.

    The kernel reads the objects where they are (zero-copy: host memory registered with CUDA, read
    over the bus by the SMs), so one launch per layer places every chunk of the call, with no staging
    buffer and no per-chunk copy to issue. ``tab``: ``[DIRECT_ROWS, W + 1]`` int64 on the caches'
    device (see ``direct_table_host``; ``num_tokens`` <= W); ``ref``: (bits tensor over the cache
    storage, element offset of this layer's base), as ``ops.layer_refs`` gives. With ``checksum``
    it also reads the skipped rows (slot -1; not those marked -2: rows of segments left unread) and
    adds this layer's ``maru.checksum`` terms of every object into row 5 of the table (object k at
    entry k, which starts at the table's ``prefill``): after every layer ran, entry k is the raw sum
    of object k (``kv_ops.checksum.finalize``). Needs ``direct_checksum_ok(layout, esize)``.
    ``stage_off``: the table names a device staging slot holding layer ``layer`` of every object
    in the object's own layer layout ([KV, T, ROW] at each address; ``kv_ops.layer_copies``): read
    the rows there, ``stage_off`` bytes further. None: read layer ``layer`` of the objects.
    """
    if num_tokens == 0:
        return
    cache = base_view(ref)
    esize = cache.element_size()
    if checksum and not direct_checksum_ok(layout, esize):
        raise ValueError(
            f"the direct kernel checksums whole 64-bit words of each row: a row of {layout.row_size} "
            f"elements of {esize} bytes is not a multiple of 8 bytes"
        )
    block_t, block_r, num_warps = tiles(layout, num_tokens)
    grid = (triton.cdiv(num_tokens, block_t), layout.num_kv)
    _DIRECT.launch(
        grid,
        num_warps,
        tab,
        cache,
        layer,
        0 if stage_off is None else stage_off,
        num_tokens,
        tab.stride(0),
        layout.block_stride,
        layout.head_stride,
        layout.kv_stride,
        layout.k_token_stride,
        layout.v_token_stride,
        layout.k_dim_stride,  # K_S_DIM and the rest: the constexprs, in the kernel's order
        layout.v_dim_stride,
        layout.block_size,
        layout.head_size,
        layout.row_size,
        layout.num_kv,
        block_t,
        block_r,
        row_is_contiguous(layout),
        checksum,
        esize,
        stage_off is not None,
    )


_DIRECT = Launcher(_direct_layer_kernel)


def direct_checksum_ok(layout: KVLayout, esize: int) -> bool:
    """Whether ``direct_scatter_layer`` can checksum objects of ``layout``: rows of whole words
    (every real model's: head sizes are multiples of 4 elements)."""
    return esize in (1, 2, 4, 8) and (layout.row_size * esize) % 8 == 0
