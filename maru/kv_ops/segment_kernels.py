"""Segment sums on the device: a store's per-segment checksum sums, read from the caches themselves.

A store commits, with each chunk's checksum, the raw sums of its token segments
(``maru.segments``), so a later load that places only some tokens reads only their segments.
``queue_cache_segments`` computes them with one kernel over *the caches* at the store's slots,
queued on the caller's stream before the store's own work (which waits for that stream), with
each word mixed at the index it has in the chunk object ``[L, KV, T, ROW]``.

Reading the caches rather than the bytes the store wrote is deliberate: the store's own
checksum covers what reached the pool, these sums cover what the forward computed, and the
writer commits only objects where the two agree (``SegmentSums.consistent``). A store path that
wrote any byte wrong is caught before the key is published, not after a reader loaded it.
The caches are read from device memory (HBM), not over the bus; on the H200 the storing
instance's steps showed no added time (bench/RESULTS.md, pass 35; not timed alone).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from maru.kv_ops import ops
from maru.kv_ops.checksum import row_terms
from maru.kv_ops.launch import Launcher
from maru.kv_ops.layout import KVLayout
from maru.kv_ops.triton_kernels import prepared, row_is_contiguous, row_offsets, tiles

SEG_ROWS = 4  # slot, row in its object, the object's tokens, accumulator (object's segment)


@triton.jit
def _cache_segments_kernel(
    cache_ptr,
    layer_offs_ptr,
    tab_ptr,
    acc_ptr,
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
    ESIZE: tl.constexpr,
):
    # One program per (token tile, layer x plane). Per token the table gives its slot, its row in
    # its object, that object's token count and the accumulator of its segment; the program adds
    # the ``maru.checksum`` terms of this layer and plane of each token's row, at the word index
    # the row has in its object, into that accumulator.
    pid_t = tl.program_id(0)
    pid_lk = tl.program_id(1)
    layer = pid_lk // NUM_KV
    kv = pid_lk % NUM_KV
    base = cache_ptr + tl.load(layer_offs_ptr + layer)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < num_tokens
    slot = tl.load(tab_ptr + t, mask=tmask, other=-1)
    valid = tmask & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    within = tl.load(tab_ptr + tab_stride + t, mask=valid, other=0)
    tokens = tl.load(tab_ptr + 2 * tab_stride + t, mask=valid, other=0)
    gid = tl.load(tab_ptr + 3 * tab_stride + t, mask=valid, other=0)
    blk = slot // BS
    off_in_block = slot % BS
    s_tok = tl.where(kv == 0, k_s_tok, v_s_tok)
    cache_row = base + kv * kv_stride + blk * s_block + off_in_block * s_tok
    EPW: tl.constexpr = 8 // ESIZE  # elements a word
    word0 = ((layer * NUM_KV + kv) * tokens + within) * ROW // EPW
    sums = tl.zeros([BLOCK_T], dtype=tl.uint64)
    for r0 in range(0, ROW, BLOCK_R):
        c = r0 + tl.arange(0, BLOCK_R)
        c_off = row_offsets(c, kv, s_head, K_S_DIM, V_S_DIM, HS, ROW_CONTIG)
        m = valid[:, None] & (c < ROW)[None, :]
        vals = tl.load(cache_row[:, None] + c_off[None, :], mask=m, other=0)
        sums += row_terms(vals, word0, r0, valid, ROW, BLOCK_T, BLOCK_R, ESIZE)
    first = tl.min(tl.where(valid, gid, 1 << 62), axis=0)
    last = tl.max(tl.where(valid, gid, -1), axis=0)
    if first == last:  # the usual tile: one segment, one atomic
        tl.atomic_add(acc_ptr + first, tl.sum(sums, axis=0).to(tl.int64, bitcast=True))
    else:
        tl.atomic_add(acc_ptr + gid, sums.to(tl.int64, bitcast=True), mask=valid)


_SEGMENTS = Launcher(_cache_segments_kernel)


def supported(layout: KVLayout, esize: int) -> bool:
    """Whether segment sums can be computed for this layout: rows of whole 8-byte words."""
    return esize in (1, 2, 4, 8) and (layout.row_size * esize) % 8 == 0


def segments_table(
    lengths: list[int], slots: np.ndarray, seg_tokens: int, out: np.ndarray | None = None
) -> tuple[np.ndarray, int]:
    """The host ``[SEG_ROWS, total]`` int64 table of ``queue_cache_segments`` and the segments an
    object has at most (accumulator ``k * most + s`` is segment ``s`` of object ``k``); written
    into ``out`` (``SEG_ROWS * total`` int64, e.g. a pinned scratch buffer's) where given."""
    counts = np.asarray(lengths, dtype=np.int64)
    total = int(counts.sum())
    if slots.size != total:
        raise ValueError(f"the objects hold {total} tokens, the slot mapping {slots.size}")
    most = max(math.ceil(int(t) / seg_tokens) for t in lengths)
    starts = np.cumsum(counts) - counts
    within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
    tab = np.empty((SEG_ROWS, total), dtype=np.int64) if out is None else out.reshape(SEG_ROWS, total)
    tab[0] = slots
    tab[1] = within
    tab[2] = np.repeat(counts, counts)
    tab[3] = np.repeat(np.arange(len(lengths), dtype=np.int64) * most, counts) + within // seg_tokens
    return tab, most


def queue_cache_segments(
    caches: Any,
    layout: KVLayout,
    lengths: list[int],
    slots: np.ndarray,
    seg_tokens: int,
    device: torch.device,
) -> tuple[torch.Tensor, int]:
    """Queue, on the current stream, the segment sums of the chunk objects a store of ``lengths``
    tokens per object at ``slots`` (host int64, every slot >= 0) will write.

    Returns (device int64 accumulators, ``[n * most]``; ``most``). Raw sums: segment ``s`` of object
    ``k`` is entry ``k * most + s``; entries past an object's last segment stay 0. Needs
    ``supported(layout, esize)``. Nothing needs keeping alive by the caller: the device tensors
    are used on the current stream alone, where torch's caching allocator orders any reuse of their
    memory after this work, and torch's host allocator holds the pinned table until its upload ran.
    (The pipeline's raw way, ``StoreSegments``, builds the table in its own buffers and calls
    ``launch_cache_segments``.)
    """
    host, most = segments_table(lengths, slots, seg_tokens)
    acc = torch.zeros(len(lengths) * most, dtype=torch.int64, device=device)
    if host.shape[1] == 0:
        return acc, most
    pinned = torch.from_numpy(host)
    if device.type == "cuda":
        pinned = pinned.pin_memory()
    launch_cache_segments(caches, layout, pinned.to(device, non_blocking=True), acc)
    return acc, most


def launch_cache_segments(caches: Any, layout: KVLayout, tab: torch.Tensor, acc: torch.Tensor) -> None:
    """Launch the segment-sum kernel on the current stream over the device table ``tab``
    (``[SEG_ROWS, total]`` int64, ``segments_table``'s rows) into the zeroed accumulators ``acc``."""
    refs = ops.layer_refs(caches, layout)
    cache0, offsets, _align = prepared(refs)
    esize = cache0.element_size()
    if not supported(layout, esize):
        raise ValueError(
            f"segment sums need rows of whole 8-byte words; a row here is {layout.row_size * esize} bytes"
        )
    total = int(tab.shape[1])
    block_t, block_r, num_warps = tiles(layout, total)
    grid = (triton.cdiv(total, block_t), len(refs) * layout.num_kv)
    _SEGMENTS.launch(
        grid,
        num_warps,
        cache0,
        offsets,
        tab,
        acc,
        total,
        tab.stride(0),
        layout.block_stride,
        layout.head_stride,
        layout.kv_stride,
        layout.k_token_stride,
        layout.v_token_stride,
        layout.k_dim_stride,
        layout.v_dim_stride,
        layout.block_size,
        layout.head_size,
        layout.row_size,
        layout.num_kv,
        block_t,
        block_r,
        row_is_contiguous(layout),
        esize,
    )
