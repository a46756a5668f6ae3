"""Experimental placement kernels the benchmark compares against the production one.

Built from the public pieces of ``maru.kv_ops.triton_kernels`` (``row_offsets``, ``tiles``,
``layer_table``, ...); nothing in ``maru`` imports this file. ``place_variant`` moves the same
bytes as ``triton_kernels.place`` for slot mappings (``tests/kv_ops/test_kernel_variants.py``
checks it against the reference), with these switches:

* ``order``: destination-ordered. ``index`` holds the slots *sorted* ascending and ``order[i]`` is the
  object token of ``sorted[i]`` (``torch.sort``'s two outputs), so programs walk the cache in address
  order and a scatter's random side becomes its reads;
* ``stream``: ``evict_first`` hints on every load and store;
* ``layer_fast``: consecutive programs take other layers and planes of the same token tile;
* ``scatter_store_cache``: the PTX cache operator of a scatter's (random) cache stores: ``""``
  (write-back), ``".cs"``, ``".cg"``, ``".wt"``.

What each switch measured is in bench/RESULTS.md (kv_ops): none beat the production kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from maru.kv_ops.layout import KVLayout
from maru.kv_ops.triton_kernels import base_view, layer_table, row_is_contiguous, row_offsets, tiles

CACHE_OPERATORS = ("", ".cs", ".cg", ".wt")


@dataclass
class Variant:
    """One experimental configuration; the defaults are the production kernel's behaviour."""

    stream: bool = False
    layer_fast: bool = False
    scatter_store_cache: str = ""
    # Tiles of a destination-ordered launch (its random side is the read, so its best tiles differ).
    ordered_block_t: int = 2
    ordered_num_warps: int = 4


@triton.jit
def _variant_kernel(
    obj_ptr,
    cache_ptr,
    layer_offs_ptr,
    idx_ptr,
    order_ptr,
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
    USE_TABLE: tl.constexpr,
    LAYER_ALIGN: tl.constexpr,
    ROW_CONTIG: tl.constexpr,
    STREAM: tl.constexpr,
    LAYER_FAST: tl.constexpr,
    ORDERED: tl.constexpr,
    SCATTER_STORE_CM: tl.constexpr,
):
    if LAYER_FAST:
        pid_lk = tl.program_id(0)
        pid_t = tl.program_id(1)
    else:
        pid_t = tl.program_id(0)
        pid_lk = tl.program_id(1)
    layer = pid_lk // NUM_KV
    kv = pid_lk % NUM_KV
    if USE_TABLE:
        layer_off = tl.multiple_of(tl.load(layer_offs_ptr + layer), LAYER_ALIGN)
        base = cache_ptr + layer_off
    else:
        base = cache_ptr
    pos = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    if ORDERED:
        # Position i of the sorted slots belongs to object token order[i] (a permutation of 0..T-1);
        # the sorted slots are read at their position (coalesced), not at the token.
        t = tl.load(order_ptr + pos, mask=pos < num_tokens, other=0)
        tmask = (pos < num_tokens) & (t >= skip)
        slot = tl.load(idx_ptr + pos, mask=tmask, other=-1).to(tl.int64)
    else:
        t = pos
        tmask = (t < num_tokens) & (t >= skip)
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
            if STREAM:
                vals = tl.load(cache_p, mask=m, eviction_policy="evict_first")
                tl.store(obj_p, vals, mask=m, eviction_policy="evict_first")
            else:
                tl.store(obj_p, tl.load(cache_p, mask=m), mask=m)
        else:
            if STREAM:
                vals = tl.load(obj_p, mask=m, eviction_policy="evict_first")
                tl.store(cache_p, vals, mask=m, eviction_policy="evict_first")
            else:
                tl.store(cache_p, tl.load(obj_p, mask=m), mask=m, cache_modifier=SCATTER_STORE_CM)


def place_variant(
    refs: list[tuple[torch.Tensor, int]],
    layout: KVLayout,
    index: torch.Tensor,
    obj: torch.Tensor,
    *,
    gather: bool,
    variant: Variant | None = None,
    order: torch.Tensor | None = None,
    skip: int = 0,
    single_layer: bool = False,
) -> None:
    """``triton_kernels.place`` for slot mappings, through the experimental kernel.

    ``order``: when given, ``index`` must be the slots sorted ascending and ``order`` the int64
    permutation ``torch.sort`` returned with them (``sorted[i] == slots[order[i]]``).
    """
    v = variant or Variant()
    if v.scatter_store_cache not in CACHE_OPERATORS:
        raise ValueError(f"scatter_store_cache {v.scatter_store_cache!r} is not one of {CACHE_OPERATORS}")
    num_layers, num_kv, num_tokens, row = obj.shape
    if num_tokens == 0 or num_layers == 0:
        return
    if order is not None and (order.numel() != num_tokens or index.numel() != num_tokens):
        raise ValueError(
            f"order has {order.numel()} and the sorted slots {index.numel()} entries; both must equal "
            f"the object's {num_tokens} tokens"
        )
    if single_layer or num_layers == 1:
        table, align, use_table = index, 16, False
    else:
        table, align = layer_table(refs)
        use_table = True
    if order is None:
        block_t, block_r, num_warps = tiles(layout, num_tokens)
    else:
        block_t, block_r, num_warps = tiles(layout, num_tokens, v.ordered_block_t, v.ordered_num_warps)
    n_tiles = triton.cdiv(num_tokens, block_t)
    layer_fast = v.layer_fast and n_tiles <= 65535  # grid y is limited to 65535
    grid = (num_layers * num_kv, n_tiles) if layer_fast else (n_tiles, num_layers * num_kv)
    _variant_kernel[grid](
        obj,
        base_view(refs[0]),
        table,
        index,
        index if order is None else order,
        num_tokens,
        skip,
        obj.stride(0),
        obj.stride(1),
        obj.stride(2),
        layout.block_stride,
        layout.head_stride,
        layout.kv_stride,
        layout.k_token_stride,
        layout.v_token_stride,
        K_S_DIM=layout.k_dim_stride,
        V_S_DIM=layout.v_dim_stride,
        BS=layout.block_size,
        HS=layout.head_size,
        ROW=row,
        NUM_KV=num_kv,
        BLOCK_T=block_t,
        BLOCK_R=block_r,
        GATHER=gather,
        USE_TABLE=use_table,
        LAYER_ALIGN=align,
        ROW_CONTIG=row_is_contiguous(layout),
        STREAM=v.stream,
        LAYER_FAST=layer_fast,
        ORDERED=order is not None,
        SCATTER_STORE_CM=v.scatter_store_cache,
        num_warps=num_warps,
    )
