"""KV-cache layout detection: from a cache tensor's shape and strides to a ``KVLayout``.

Pure Python: works on anything with ``.shape`` and ``.stride()`` (torch is not imported).

The invariant every ``KVLayout`` keeps: for layer ``l``, plane ``kv`` (0 = K, 1 = V; MLA has only 0),
block ``b``, token offset ``o`` in the block, head ``h`` and element ``d`` of the head, the element
lives at

    layer_base(l) + kv * kv_stride + b * block_stride + o * token_stride[kv] + h * head_stride
                  + d * dim_stride[kv]

elements from the start of the (per-layer, or cross-layer) tensor's data, where ``layer_base(l)``
is ``0`` for a list of per-layer tensors (each has its own data pointer) and ``l * layer_stride``
for the single cross-layer tensor. Every copy (reference or kernel) uses exactly these numbers, so
NHD, HND, padded blocks, packed K|V and the CPU backend's transposed K are all the same arithmetic
over *physical* addresses; no code path ever reads an axis by its position in the shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from maru.errors import UnsupportedLayout

LayoutFormat = Literal["kv_first", "blocks_first", "packed", "cpu_attn", "mla", "cross_layer"]

# vLLM attention-backend names whose packed [NB, NH, BS, 2*HS] cache holds K transposed per
# (block, head) slab, and whose older 5-D cache [2, NB, NH, BS, HS] is head-major in the shape.
CPU_BACKENDS = frozenset({"CPU_ATTN", "CPU", "TORCH_SDPA"})

EXPECTED = (
    "expected one of: [2, NB, BS, NH, HS] or [NB, 2, BS, NH, HS] (NHD or HND in the strides), "
    "[NB, NH, BS, 2*HS] (packed K|V; attn_backend='CPU_ATTN' for vLLM's CPU backend), "
    "[NB, BS, D] (MLA, num_kv_heads=1, head_size=D), [NB, NL, 2, BS, NH, HS] (cross-layer)"
)


@dataclass(frozen=True)
class KVLayout:
    """Where every element of a paged KV cache lives (strides in elements; see the module docstring).

    ``shape``/``strides`` are those of the tensor it was detected from (one layer's tensor, or the
    cross-layer tensor). ``physical`` is the order of the token and head axes in memory ("NHD":
    tokens outer, "HND": heads outer), whatever order the shape shows.
    """

    format: LayoutFormat
    physical: Literal["NHD", "HND"]
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    num_kv: int  # 2 (K and V planes) or 1 (MLA)
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    block_stride: int
    head_stride: int
    kv_stride: int  # offset of the V plane from the K plane (0 for MLA)
    k_token_stride: int
    k_dim_stride: int
    v_token_stride: int
    v_dim_stride: int
    num_layers: int | None = None  # cross-layer only
    layer_stride: int = 0  # cross-layer only
    attn_backend: str | None = None

    @property
    def row_size(self) -> int:
        """Elements of one token of one plane in the object format: ``num_kv_heads * head_size``."""
        return self.num_kv_heads * self.head_size

    @property
    def num_slots(self) -> int:
        """Token slots per layer (``num_blocks * block_size``); a valid slot is in ``[0, num_slots)``."""
        return self.num_blocks * self.block_size

    @property
    def is_hnd(self) -> bool:
        return self.physical == "HND"

    @property
    def is_mla(self) -> bool:
        return self.format == "mla"

    @property
    def is_cross_layer(self) -> bool:
        return self.format == "cross_layer"

    @property
    def block_content(self) -> int:
        """Elements one block's content spans when tightly packed (all planes of the block)."""
        per_plane = self.block_size * self.num_kv_heads * self.head_size
        if self.format == "kv_first":
            return per_plane
        return per_plane * self.num_kv * (self.num_layers or 1)

    @property
    def is_padded(self) -> bool:
        """True when blocks are further apart than their content (vLLM pads pages of hybrid models)."""
        return self.block_stride > self.block_content

    def plane_strides(self, kv: int) -> tuple[int, int, int, int]:
        """(block, token, head, dim) strides in elements of plane ``kv`` (0 = K, 1 = V)."""
        if kv == 0:
            return (self.block_stride, self.k_token_stride, self.head_stride, self.k_dim_stride)
        return (self.block_stride, self.v_token_stride, self.head_stride, self.v_dim_stride)

    def max_offset(self) -> int:
        """Largest element offset (from one layer's base) any valid slot can touch."""
        worst = 0
        for kv in range(self.num_kv):
            sb, st, sh, sd = self.plane_strides(kv)
            end = (
                kv * self.kv_stride
                + (self.num_blocks - 1) * sb
                + (self.block_size - 1) * st
                + (self.num_kv_heads - 1) * sh
                + (self.head_size - 1) * sd
            )
            worst = max(worst, end)
        return worst

    def describe(self) -> str:
        extra = f", {self.num_layers} layers" if self.num_layers else ""
        pad = ", padded blocks" if self.is_padded else ""
        return (
            f"{self.format} {self.physical} NB={self.num_blocks} BS={self.block_size} "
            f"NH={self.num_kv_heads} HS={self.head_size}{extra}{pad}"
        )


def _shape_strides(cache: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
    try:
        shape = tuple(int(x) for x in cache.shape)
        strides = tuple(int(x) for x in cache.stride())
    except (AttributeError, TypeError) as exc:
        raise UnsupportedLayout(
            f"cannot read shape and strides of a {type(cache).__name__}: pass a tensor (or an object "
            f"with .shape and .stride()); {EXPECTED}"
        ) from exc
    if len(shape) != len(strides):
        raise UnsupportedLayout(f"shape {shape} and strides {strides} have different ranks")
    return shape, strides


def _fail(shape: tuple[int, ...], strides: tuple[int, ...], why: str, geometry: str) -> UnsupportedLayout:
    return UnsupportedLayout(
        f"unsupported KV-cache layout: shape {list(shape)}, strides {list(strides)} ({geometry}): {why}; "
        f"{EXPECTED}. Maru keeps the connector off for this cache rather than guess (a wrong guess "
        f"writes scrambled KV)."
    )


def _check_no_overlap(
    shape: tuple[int, ...], strides: tuple[int, ...], geometry: str, dims: list[tuple[int, int]]
) -> None:
    """Refuse strides under which two logical elements share one address (scatter would be ambiguous).

    ``dims`` is the list of (size, stride) of the independent axes. Sufficient condition: sorted by
    stride, each axis steps over the whole extent of the axes inside it.
    """
    extent = 1  # 1 + the largest offset the inner axes reach
    for st, sz in sorted((st, sz) for sz, st in dims if sz > 1):
        if st <= 0:
            raise _fail(shape, strides, f"stride {st} is not positive", geometry)
        if st < extent:
            raise _fail(
                shape,
                strides,
                "axes overlap in memory (a stride is smaller than the extent it steps over)",
                geometry,
            )
        extent += st * (sz - 1)


def _token_head_axes(
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    i: int,
    block_size: int,
    num_kv_heads: int,
    head_major_shape: bool,
    geometry: str,
) -> tuple[int, int, str]:
    """Find which of axes ``i``, ``i+1`` holds tokens and which heads, and their physical order.

    Returns (token_axis, head_axis, "NHD"|"HND"). When block_size == num_kv_heads the shape cannot
    say which is which: vLLM's convention decides (the shape is the backend's logical shape; it is
    head-major only for the CPU backends and the packed layout) and the strides decide the physical
    order; equal strides cannot decide and raise.
    """
    a, b = shape[i], shape[i + 1]
    if (a, b) == (block_size, num_kv_heads) and (a != b or not head_major_shape):
        tok, head = i, i + 1
    elif (a, b) == (num_kv_heads, block_size):
        tok, head = i + 1, i
    else:
        raise _fail(
            shape,
            strides,
            f"axes {i} and {i + 1} are {a} and {b}, expected block_size={block_size} and "
            f"num_kv_heads={num_kv_heads} (in either order)",
            geometry,
        )
    st_tok, st_head = strides[tok], strides[head]
    if block_size == 1 or num_kv_heads == 1:
        # One of the two axes has a single element: NHD and HND are the same memory.
        return tok, head, "NHD"
    if st_tok == st_head:
        raise _fail(
            shape,
            strides,
            f"the token axis and the head axis have the same stride {st_tok}; the physical order "
            f"(NHD or HND) cannot be decided",
            geometry,
        )
    return tok, head, ("NHD" if st_tok > st_head else "HND")


def detect_layout(
    cache: Any,
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    attn_backend: str | None = None,
) -> KVLayout:
    """Detect the layout of one layer's paged KV cache (or of the one cross-layer tensor).

    ``attn_backend`` is vLLM's backend name (e.g. ``"CPU_ATTN"``): needed only where the shape is the
    same for two layouts (the packed GPU layout and the CPU backend's K-transposed one).
    Raises ``UnsupportedLayout`` (naming shape, strides and what was expected) for anything else.
    """
    shape, strides = _shape_strides(cache)
    bs, nh, hs = int(block_size), int(num_kv_heads), int(head_size)
    if bs <= 0 or nh <= 0 or hs <= 0:
        raise UnsupportedLayout(
            f"block_size={bs}, num_kv_heads={nh}, head_size={hs}: all must be positive (read them from the model config)"
        )
    geometry = f"block_size={bs}, num_kv_heads={nh}, head_size={hs}, attn_backend={attn_backend!r}"
    backend = attn_backend.upper() if attn_backend else None
    is_cpu = backend in CPU_BACKENDS
    nd = len(shape)
    common = dict(
        block_size=bs, num_kv_heads=nh, head_size=hs, shape=shape, strides=strides, attn_backend=attn_backend
    )

    if nd == 3:
        nb, s_bs, d = shape
        if s_bs != bs or d != hs or nh != 1:
            raise _fail(
                shape,
                strides,
                "a 3-D cache is MLA [NB, BS, D] and needs num_kv_heads=1, head_size=D",
                geometry,
            )
        _check_no_overlap(shape, strides, geometry, [(nb, strides[0]), (bs, strides[1]), (hs, strides[2])])
        return KVLayout(
            format="mla", physical="NHD", num_blocks=nb, num_kv=1, block_stride=strides[0],
            head_stride=0, kv_stride=0, k_token_stride=strides[1], k_dim_stride=strides[2],
            v_token_stride=strides[1], v_dim_stride=strides[2], **common,
        )  # fmt: skip

    if nd == 4:
        nb = shape[0]
        if shape[3] != 2 * hs:
            raise _fail(
                shape,
                strides,
                f"a 4-D cache is packed K|V [NB, NH, BS, 2*HS]: last axis must be {2 * hs}",
                geometry,
            )
        if is_cpu:
            if shape[1:3] != (nh, bs):
                raise _fail(shape, strides, "the CPU backend's cache is [NB, NH, BS, 2*HS]", geometry)
            slab = bs * 2 * hs
            if strides[3] != 1 or strides[2] != 2 * hs or strides[1] != slab:
                raise _fail(
                    shape,
                    strides,
                    f"the CPU backend's (block, head) slabs must be contiguous (strides [*, {slab}, {2 * hs}, 1]): "
                    f"their inner layout (K transposed [HS, BS], then V [BS, HS]) is defined on raw memory",
                    geometry,
                )
            _check_no_overlap(shape, strides, geometry, [(nb, strides[0]), (nh * slab, 1)])
            return KVLayout(
                format="cpu_attn", physical="HND", num_blocks=nb, num_kv=2, block_stride=strides[0],
                head_stride=slab, kv_stride=bs * hs, k_token_stride=1, k_dim_stride=bs,
                v_token_stride=hs, v_dim_stride=1, **common,
            )  # fmt: skip
        tok, head, physical = _token_head_axes(shape, strides, 1, bs, nh, True, geometry)
        sd = strides[3]
        _check_no_overlap(
            shape,
            strides,
            geometry,
            [(nb, strides[0]), (bs, strides[tok]), (nh, strides[head]), (2 * hs, sd)],
        )
        return KVLayout(
            format="packed", physical=physical, num_blocks=nb, num_kv=2, block_stride=strides[0],
            head_stride=strides[head], kv_stride=hs * sd, k_token_stride=strides[tok], k_dim_stride=sd,
            v_token_stride=strides[tok], v_dim_stride=sd, **common,
        )  # fmt: skip

    if nd == 5:
        if shape[0] == 2 and shape[1] != 2:
            fmt, kv_axis, nb_axis = "kv_first", 0, 1
        elif shape[1] == 2 and shape[0] != 2:
            fmt, kv_axis, nb_axis = "blocks_first", 1, 0
        elif shape[0] == 2 and shape[1] == 2:
            raise _fail(
                shape,
                strides,
                "a cache of exactly 2 blocks cannot tell [2, NB, ...] from [NB, 2, ...]",
                geometry,
            )
        else:
            raise _fail(shape, strides, "a 5-D cache needs a K/V axis of size 2 at position 0 or 1", geometry)
        if shape[4] != hs:
            raise _fail(shape, strides, f"last axis must be head_size={hs}", geometry)
        tok, head, physical = _token_head_axes(shape, strides, 2, bs, nh, is_cpu, geometry)
        nb = shape[nb_axis]
        _check_no_overlap(
            shape,
            strides,
            geometry,
            [
                (2, strides[kv_axis]),
                (nb, strides[nb_axis]),
                (bs, strides[tok]),
                (nh, strides[head]),
                (hs, strides[4]),
            ],
        )
        return KVLayout(
            format=fmt, physical=physical, num_blocks=nb, num_kv=2, block_stride=strides[nb_axis],
            head_stride=strides[head], kv_stride=strides[kv_axis], k_token_stride=strides[tok],
            k_dim_stride=strides[4], v_token_stride=strides[tok], v_dim_stride=strides[4], **common,
        )  # fmt: skip

    if nd == 6:
        nb, nl, two = shape[0], shape[1], shape[2]
        if two != 2 or shape[5] != hs:
            raise _fail(shape, strides, "a 6-D cache is cross-layer [NB, NL, 2, BS, NH, HS]", geometry)
        tok, head, physical = _token_head_axes(shape, strides, 3, bs, nh, False, geometry)
        _check_no_overlap(
            shape,
            strides,
            geometry,
            [
                (nb, strides[0]),
                (nl, strides[1]),
                (2, strides[2]),
                (bs, strides[tok]),
                (nh, strides[head]),
                (hs, strides[5]),
            ],
        )
        return KVLayout(
            format="cross_layer", physical=physical, num_blocks=nb, num_kv=2, block_stride=strides[0],
            head_stride=strides[head], kv_stride=strides[2], k_token_stride=strides[tok],
            k_dim_stride=strides[5], v_token_stride=strides[tok], v_dim_stride=strides[5],
            num_layers=nl, layer_stride=strides[1], **common,
        )  # fmt: skip

    raise _fail(shape, strides, f"{nd}-D tensors are not KV caches Maru knows", geometry)


def detect_layouts(
    caches: Any,
    *,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    attn_backend: str | None = None,
) -> KVLayout:
    """Detect one layout for a whole set of caches: a sequence (or dict) of per-layer tensors, or the
    single cross-layer tensor.

    All per-layer tensors must share one layout (same shape and strides, and the same dtype and device
    where the objects have them): one object format and one kernel launch cover them all. A mixed set
    (a hybrid model's groups) raises ``UnsupportedLayout`` naming the first layer that differs.
    """
    if isinstance(caches, dict):
        caches = list(caches.values())
    if not isinstance(caches, Sequence):
        layout = detect_layout(
            caches,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            attn_backend=attn_backend,
        )
        if not layout.is_cross_layer:
            raise UnsupportedLayout(
                f"a single tensor of shape {list(layout.shape)} was given for all layers, but it is a per-layer "
                f"layout ({layout.describe()}); pass the list of per-layer tensors"
            )
        return layout
    if len(caches) == 0:
        raise UnsupportedLayout("no KV caches given (an empty list of layers)")
    first = detect_layout(
        caches[0],
        block_size=block_size,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        attn_backend=attn_backend,
    )
    if first.is_cross_layer:
        raise UnsupportedLayout(
            "a list of cross-layer tensors was given; pass the one cross-layer tensor itself"
        )
    ref_dtype = getattr(caches[0], "dtype", None)
    ref_device = getattr(caches[0], "device", None)
    for i, cache in enumerate(caches[1:], start=1):
        shape, strides = _shape_strides(cache)
        if shape != first.shape or strides != first.strides:
            raise UnsupportedLayout(
                f"layer {i} has shape {list(shape)} and strides {list(strides)}, layer 0 has shape "
                f"{list(first.shape)} and strides {list(first.strides)}: Maru needs one layout for all layers "
                f"(hybrid models with several KV groups are not supported yet)"
            )
        if getattr(cache, "dtype", None) != ref_dtype or getattr(cache, "device", None) != ref_device:
            raise UnsupportedLayout(
                f"layer {i} is {getattr(cache, 'dtype', None)} on {getattr(cache, 'device', None)}, layer 0 is "
                f"{ref_dtype} on {ref_device}: all layers must share dtype and device"
            )
    return first
