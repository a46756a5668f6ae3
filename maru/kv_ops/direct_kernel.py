"""The direct (zero-copy) layer load's kernel: ``direct_scatter_layer`` and the table it reads.

One layer placed straight from chunk objects in GPU-addressable host memory (a registered pool),
whose addresses a small int64 table gives (``direct_table_host``). The SMs read the pool over the
bus, so one launch per layer places every chunk of a call, with no staging buffer and no copy per
chunk to issue. Addresses in the cache come from the ``KVLayout`` strides, as in
``kv_ops.triton_kernels`` (whose ``row_offsets``, ``tiles`` and ``base_view`` it uses).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from maru.kv_ops.checksum import row_terms
from maru.kv_ops.launch import Launcher
from maru.kv_ops.layout import KVLayout
from maru.kv_ops.triton_kernels import (
    TuneParams,
    base_view,
    fused_checksum_ok,
    row_is_contiguous,
    row_offsets,
    tiles,
)
from maru.segments import mark_unread

__all__ = [
    "DIRECT_ROWS",
    "DIRECT_SUMS_ROW",
    "direct_scatter_layer",
    "direct_table_host",
    "direct_table_spans",
]


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
    # Programs per (token tiles, plane). The table's last column, row 0, says how rows 0 and 1 are
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
    # A program places token tiles pid_t, pid_t + P, ... (P: the grid's first axis). With one program
    # a tile (P = the tiles) that is one pass; a smaller grid (``TuneParams.direct_programs``: one an
    # SM) leaves SMs to the forward's kernels instead of queueing a program per tile.
    pid_t = tl.program_id(0)
    kv = tl.program_id(1)
    chunk_t = tl.load(tab_ptr + tab_stride - 1)
    per_chunk = chunk_t > 0
    div = tl.maximum(chunk_t, 1)
    if CHECKSUM:
        total = tl.load(tab_ptr + 2 * tab_stride - 1)
    s_tok = tl.where(kv == 0, k_s_tok, v_s_tok)
    for tile in range(pid_t, tl.cdiv(num_tokens, BLOCK_T), tl.num_programs(0)):
        t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
        tmask = t < num_tokens
        slot = tl.load(tab_ptr + 2 * tab_stride + t, mask=tmask, other=-1)
        valid = tmask & (slot >= 0)
        readable = slot > -2  # -2: a row of a segment the load does not place (``maru.segments``)
        slot = tl.where(valid, slot, 0)
        if CHECKSUM:
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
        cache_row = cache_ptr + kv * kv_stride + blk * s_block + off_in_block * s_tok
        if CHECKSUM:
            EPW: tl.constexpr = 8 // ESIZE  # elements a word
            obj = tl.where(per_chunk, k, tl.load(tab_ptr + 3 * tab_stride + t, mask=read, other=0))
            row_in_obj = tl.where(
                per_chunk, within, tl.load(tab_ptr + 4 * tab_stride + t, mask=read, other=0)
            )
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


def direct_host_slots(
    slot_mapping: torch.Tensor,
    lengths: list[int],
    skip_tokens: int = 0,
    segments: list[Any] | None = None,
) -> tuple[np.ndarray, np.ndarray | None, int]:
    """The host slots ``direct_table_host`` takes, for a direct layer load of objects of
    ``lengths`` tokens: (int64 slots as a numpy array, per object the raw sum its checksum starts
    at or None, tokens left unread). The first ``skip_tokens`` are -1 (not written); with
    ``segments`` (a verifying load: each object's committed segment sums or None), the rows of
    segments that place nothing are -2, left unread and counted at their committed sums
    (``maru.segments``: the bus carries only what is placed, and its checksum vouches for it). A
    device slot mapping gives all -1: the slots then come from the device, and every row is read.
    Never changes the caller's tensor. In numpy: a torch op costs several times a numpy one on the
    issue path, more with cold caches (bench/layer_issue_cpu.py)."""
    total = int(slot_mapping.numel())
    if slot_mapping.device.type != "cpu":
        return np.full(total, -1, dtype=np.int64), None, 0
    given = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    host = given.numpy()
    if not skip_tokens and segments is None:
        return host, None, 0  # read only from here on (direct_table_host copies it)
    host = host.copy()
    if skip_tokens:
        host[:skip_tokens] = -1
    if segments is None:
        return host, None, 0
    prefill, unread = mark_unread(host, lengths, segments)
    return host, prefill, unread


def direct_table_host(
    chunks: list[tuple[int, int]],
    slots: torch.Tensor | np.ndarray,
    row: int,
    esize: int,
    width: int | None = None,
    out: torch.Tensor | None = None,
    prefill: np.ndarray | None = None,
) -> torch.Tensor:
    """``direct_table_spans`` of ``chunks``: (address of the object's first byte, tokens) per chunk
    object ``[L, KV, T, ROW]``, in order."""
    return direct_table_spans(
        [p for p, _ in chunks], [t for _, t in chunks], slots, row, esize, width, out, prefill
    )


def direct_table_spans(
    ptrs: Sequence[int],
    lengths: Sequence[int],
    slots: torch.Tensor | np.ndarray,
    row: int,
    esize: int,
    width: int | None = None,
    out: torch.Tensor | None = None,
    prefill: np.ndarray | None = None,
) -> torch.Tensor:
    """The ``[DIRECT_ROWS, width + 1]`` int64 table ``direct_scatter_layer`` reads, built on the host.

    ``ptrs[i]``, ``lengths[i]``: the address of chunk object i's first byte and its tokens (objects
    ``[L, KV, T, ROW]``, in order); ``slots``: one slot per token of all chunks (CPU, int64, a tensor
    or a numpy array; negative = not written). Columns
    past the tokens (``width`` > tokens) get slot -1. When every chunk but the last has the same
    length C and the last at most C (the connector's usual step: whole chunks, one tail), the
    addresses are per chunk (n entries, whatever the token count); otherwise per token. Pinned when
    CUDA is available, so the upload is asynchronous. ``out``: a flat int64 host tensor of at least
    ``DIRECT_ROWS * (width + 1)`` entries to build it in (``HostScratch``), instead of a new one.
    ``prefill``: per object, the raw sum its checksum accumulator starts at (uint64: the committed
    sums of the segments whose rows are marked -2, left unread); zeros when not given.
    """
    slots = slots if isinstance(slots, np.ndarray) else slots.numpy()
    total = int(slots.size)
    width = total if width is None else int(width)
    if width < total:
        raise ValueError(f"table width {width} < {total} tokens")
    n = len(lengths)
    if len(ptrs) != n:
        raise ValueError(f"{len(ptrs)} object addresses for {n} token counts")
    if sum(lengths) != total:
        raise ValueError(f"the chunks hold {sum(lengths)} tokens, the slot mapping {total}")
    if out is not None:
        tab = out[: DIRECT_ROWS * (width + 1)].view(DIRECT_ROWS, width + 1)
    else:
        tab = torch.empty((DIRECT_ROWS, width + 1), dtype=torch.int64, pin_memory=torch.cuda.is_available())
    # numpy over the same memory: this runs on the layer load's issue path, and a numpy op costs a
    # fraction of torch's per-op overhead.
    out = tab.numpy()
    counts = np.asarray(lengths, dtype=np.int64)
    first = int(counts[0]) if n else 0
    if first > 0 and counts[-1] <= first and bool((counts[:-1] == first).all()):
        out[0, :n] = ptrs
        out[1, :n] = counts * row
        out[0, width] = first
    else:
        starts = np.cumsum(counts) - counts
        within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        out[0, :total] = np.repeat(np.asarray(ptrs, dtype=np.int64), counts) + within * (row * esize)
        out[1, :total] = np.repeat(counts * row, counts)
        out[3, :total] = np.repeat(np.arange(n, dtype=np.int64), counts)
        out[4, :total] = within
        out[0, width] = 0
    # Rows 0, 1, 3 and 4 past the used entries are never read (tokens past the count): not cleared.
    out[1, width] = total
    out[2, :total] = slots
    out[2, total:] = -1
    # The checksum accumulators, set by the upload itself.
    out[5, :n] = 0 if prefill is None else np.asarray(prefill, dtype=np.uint64).view(np.int64)
    return tab


def tile_programs(num_tokens: int, block_t: int, num_kv: int, device: Any, cap: int | None = None) -> int:
    """The direct kernel's programs a plane for ``num_tokens`` tokens in tiles of ``block_t``: one a
    tile, or fewer, each looping over its share. ``cap`` (None: ``TuneParams.direct_programs``) is
    the programs of all ``num_kv`` planes together: -1 one an SM of ``device`` (one a tile where
    that is unknown: no CUDA device), 0 one a tile, N at most N."""
    n = triton.cdiv(num_tokens, block_t)
    cap = TuneParams.direct_programs if cap is None else cap
    if cap < 0:
        cap = _sm_count(device)
    return min(n, max(1, cap // num_kv)) if cap > 0 else n


_SMS: dict[Any, int] = {}


def grid_override() -> str | None:
    """Why the direct kernel's grid is not the default (one program an SM), for ``maru doctor``:
    a bench's ``MARU_DIRECT_PROGRAMS`` left set; None when it is the default."""
    cap = TuneParams.direct_programs
    if cap == -1:
        return None
    grid = "a program a token tile" if cap == 0 else f"at most {cap} programs"
    return (
        f"{grid} (MARU_DIRECT_PROGRAMS={cap}), not one an SM: measured on an H200, a program a tile "
        "slowed the forward's GEMMs 2.7-3.0x beside a burst's layer load against 1.5-1.6x (bench/"
        "RESULTS.md, thirty-eighth pass). Fix: unset MARU_DIRECT_PROGRAMS (a bench setting)"
    )


def _sm_count(device: Any) -> int:
    """Streaming multiprocessors of a CUDA ``device`` (cached: asked once a device); 0 for others."""
    hit = _SMS.get(device)
    if hit is None:
        dev = torch.device(device)
        hit = _SMS[device] = (
            torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 0
        )
    return hit


def direct_scatter_layer(
    tab: torch.Tensor,
    ref: tuple[torch.Tensor, int],
    layout: KVLayout,
    layer: int,
    num_tokens: int,
    *,
    checksum: bool = False,
    stage_off: int | None = None,
    programs: int | None = None,
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
    of object k (``kv_ops.checksum.finalize``). Needs ``fused_checksum_ok(layout, esize)``.
    ``stage_off``: the table names a device staging slot holding layer ``layer`` of every object
    in the object's own layer layout ([KV, T, ROW] at each address; ``kv_ops.layer_copies``): read
    the rows there, ``stage_off`` bytes further. None: read layer ``layer`` of the objects.
    ``programs``: the grid's programs of all planes (``tile_programs``' cap; None: ``TuneParams``').
    """
    if num_tokens == 0:
        return
    cache = base_view(ref)
    esize = cache.element_size()
    if checksum and not fused_checksum_ok(layout, esize):
        raise ValueError(
            f"the direct kernel checksums whole 64-bit words of each row: a row of {layout.row_size} "
            f"elements of {esize} bytes is not a multiple of 8 bytes"
        )
    block_t, block_r, num_warps = tiles(layout, num_tokens)
    grid = (tile_programs(num_tokens, block_t, layout.num_kv, cache.device, programs), layout.num_kv)
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
