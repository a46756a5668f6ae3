"""Triton placement kernels: one kernel, specialised at compile time into the three operations.

* multi-layer: grid (token tiles, layers x planes); each layer's base is ``cache_ptr + layer_offs[layer]``
  (an int64 table of element offsets from layer 0, so per-layer tensors anywhere in memory and the
  cross-layer tensor are the same code);
* single-layer (``USE_TABLE=False``): grid (token tiles, planes), no table load: the layer-overlap path;
* block-granular (``BLOCKWISE=True``): the index array holds block ids; token ``t`` of the object is
  offset ``t % BS`` of block ``ids[t // BS]``.

The direct (zero-copy) layer load's kernel, which reads chunk objects in GPU-addressable host
memory, is in ``kv_ops.direct_kernel``; it shares ``row_offsets``, ``tiles`` and ``base_view``.

Every address is computed from the ``KVLayout`` strides in physical memory (block, token, head, dim
strides per K/V plane), never from the shape's axis order, so NHD, HND, padded, packed and the CPU
backend's transposed K are all stride arithmetic. Elements are moved as same-width integers
(bit-exact, whatever the float format). Masks are block-shaped tensors (the interpreter rejects a
scalar-and-vector mask). ``row_offsets``, ``tiles``, ``row_is_contiguous``, ``layer_table`` and
``base_view`` are public so that ``bench/kernel_variants.py`` builds its experimental kernels from them.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import triton
import triton.language as tl

from maru.kv_ops.checksum import row_terms
from maru.kv_ops.launch import Launcher
from maru.kv_ops.layout import KVLayout
from maru.kv_ops.ops import as_bits

__all__ = [
    "TuneParams",
    "as_bits",
    "base_view",
    "fused_checksum_ok",
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
    acc_ptr,
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
    CHECKSUM: tl.constexpr,
    ESIZE: tl.constexpr,
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
    obj_off = layer.to(tl.int64) * obj_s_layer + kv * obj_s_kv + t.to(tl.int64) * obj_s_tok
    obj_row = obj_ptr + obj_off
    if CHECKSUM:
        # The object's checksum covers every row, placed or not (skipped tokens are part of it).
        read = t < num_tokens
        EPW: tl.constexpr = 8 // ESIZE  # elements a word
        word0 = obj_off // EPW  # the row's first word in the (contiguous) object: rows are words
        sums = tl.zeros([BLOCK_T], dtype=tl.uint64)
    for r0 in range(0, ROW, BLOCK_R):
        c = r0 + tl.arange(0, BLOCK_R)
        c_off = row_offsets(c, kv, s_head, K_S_DIM, V_S_DIM, HS, ROW_CONTIG)
        m = valid[:, None] & (c < ROW)[None, :]
        cache_p = cache_row[:, None] + c_off[None, :]
        obj_p = obj_row[:, None] + c[None, :]
        if GATHER:
            tl.store(obj_p, tl.load(cache_p, mask=m), mask=m)
        elif CHECKSUM:
            vals = tl.load(obj_p, mask=read[:, None] & (c < ROW)[None, :], other=0)
            tl.store(cache_p, vals, mask=m)
            sums += row_terms(vals, word0, r0, read, ROW, BLOCK_T, BLOCK_R, ESIZE)
        else:
            tl.store(cache_p, tl.load(obj_p, mask=m), mask=m)
    if CHECKSUM:
        # One atomic a program; the sum is order-free (wrapping integer addition commutes).
        tl.atomic_add(acc_ptr, tl.sum(sums, axis=0).to(tl.int64, bitcast=True))


class TuneParams:
    """Tile sizes of the placement kernels (``bench/kv_ops.py --sweep`` compares others; the chosen
    values and their measurements are in bench/RESULTS.md)."""

    block_t: int = 4
    max_block_r: int = 1024
    num_warps: int = 4
    # The direct layer kernel's programs, all planes together (``direct_kernel.tile_programs``): -1 is
    # one an SM of the device, 0 one a token tile. A program a tile queues ~1800 programs a layer for
    # a burst step, which take the SMs from the forward's GEMMs (3x slower beside the load, the load
    # itself 69% of pinned); one an SM: GEMMs 1.46x, the load 80%, alone unchanged (H200, bench/
    # layer_contention.py, RESULTS "thirty-eighth pass"). ``MARU_DIRECT_PROGRAMS`` overrides it (an
    # A/B of benches in real vLLM, not a setting).
    direct_programs: int = int(os.environ.get("MARU_DIRECT_PROGRAMS", "-1"))


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
    checksum_into: torch.Tensor | None = None,
) -> None:
    """Launch one kernel moving ``obj`` ([L, KV, T, ROW], planes row-contiguous) to/from the caches.

    ``refs`` are (bits tensor over the cache storage, absolute element offset of the layer base);
    ``obj`` is of the cache's dtype or its same-width integer view (the kernel moves bits either
    way). ``index``: one slot per token (or one block id per block with ``blockwise``); negative
    entries are skipped, and so are the first ``skip`` tokens.

    ``checksum_into`` (a scatter of a contiguous ``obj`` whose rows are whole 64-bit words:
    ``fused_checksum_ok``): an int64 device tensor whose first element the kernel adds the raw
    ``maru.checksum`` sum of all of ``obj``'s bytes into (every row, placed or skipped;
    ``kv_ops.checksum.finalize`` turns it into the checksum). The caller zeroes it. The load's
    check then costs no second pass over the staged bytes and no second launch.
    """
    num_layers, num_kv, num_tokens, row = obj.shape
    if num_tokens == 0 or num_layers == 0:
        return  # nothing to move; an empty object's raw sum is 0 (nothing to add)
    fused = checksum_into is not None
    if fused and (gather or not obj.is_contiguous() or not fused_checksum_ok(layout, obj.element_size())):
        raise ValueError(
            "a fused checksum needs a scatter of a contiguous object whose rows are whole 64-bit "
            f"words (gather={gather}, contiguous={obj.is_contiguous()}, row of {layout.row_size} "
            f"elements of {obj.element_size()} bytes)"
        )
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
        checksum_into if fused else index,  # unread without CHECKSUM: any tensor
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
        fused,
        obj.element_size(),
    )


def fused_checksum_ok(layout: KVLayout, esize: int) -> bool:
    """Whether a kernel can checksum a placement's rows as it moves them: rows of whole 64-bit words
    (every real model's: head sizes are multiples of 4 elements). The rule of ``place``'s
    ``checksum_into`` and of the direct layer kernel's checksum."""
    return esize in (1, 2, 4, 8) and (layout.row_size * esize) % 8 == 0


# Triton compiles for the tensors' integer views; the direct launch passes addresses (no views per call).
_PLACE = Launcher(_place_kernel, triton_view=as_bits)
