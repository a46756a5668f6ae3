"""Test helpers for KV placement: caches of every layout the way vLLM builds them, and a naive oracle.

Used by the CPU tests, the Triton-interpreter check, the GPU tests and the benchmark. The caches are
allocated in *physical* order and viewed back to the backend's logical shape (vLLM's permute trick),
so HND and padded blocks show only in the strides. ``naive_gather`` reads each token through the
logical tensor's own indexing and the formats' published definitions, independently of
``KVLayout``'s stride arithmetic: it is the oracle's oracle.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from maru.kv_ops.ops import as_bits

# format -> (logical axis names, physical axis names for NHD, for HND)
_AXES: dict[str, tuple[list[str], list[str], list[str]]] = {
    "kv_first": (
        ["kv", "nb", "bs", "nh", "hs"],
        ["kv", "nb", "bs", "nh", "hs"],
        ["kv", "nb", "nh", "bs", "hs"],
    ),
    "blocks_first": (
        ["nb", "kv", "bs", "nh", "hs"],
        ["nb", "kv", "bs", "nh", "hs"],
        ["nb", "kv", "nh", "bs", "hs"],
    ),
    "packed": (["nb", "nh", "bs", "c"], ["nb", "bs", "nh", "c"], ["nb", "nh", "bs", "c"]),
    "cpu_attn": (["nb", "nh", "bs", "c"], ["nb", "nh", "bs", "c"], ["nb", "nh", "bs", "c"]),
    "mla": (["nb", "bs", "hs"], ["nb", "bs", "hs"], ["nb", "bs", "hs"]),
    "cross_layer": (
        ["nb", "nl", "kv", "bs", "nh", "hs"],
        ["nb", "nl", "kv", "bs", "nh", "hs"],
        ["nb", "nl", "kv", "nh", "bs", "hs"],
    ),
}

FORMATS = tuple(_AXES)


@dataclass
class CacheCase:
    """A set of caches of one layout plus the model facts detection needs."""

    fmt: str
    physical: str
    caches: list[torch.Tensor] | torch.Tensor  # per-layer list, or the cross-layer tensor
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_size: int
    attn_backend: str | None

    def detect_kwargs(self) -> dict:
        return dict(
            block_size=self.block_size,
            num_kv_heads=self.num_kv_heads,
            head_size=self.head_size,
            attn_backend=self.attn_backend,
        )

    def layer_tensors(self) -> list[torch.Tensor]:
        if isinstance(self.caches, torch.Tensor):
            return [self.caches[:, i] for i in range(self.num_layers)]
        return list(self.caches)

    def snapshot(self) -> list[torch.Tensor]:
        """Bit copies of the whole storage behind each cache (to check untouched bytes)."""
        return [bits(t).clone() for t in self.storages()]

    def storages(self) -> list[torch.Tensor]:
        src = [self.caches] if isinstance(self.caches, torch.Tensor) else self.caches
        return [flat_storage(t) for t in src]


bits = as_bits  # the name the tests use


def flat_storage(t: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over the whole storage of ``t`` (padding included)."""
    n = t.untyped_storage().nbytes() // t.element_size()
    return torch.as_strided(t, (n,), (1,), 0)


def random_bits_(t: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """Fill with random bit patterns (every byte random; NaN payloads included for float types)."""
    b = bits(t)
    info = torch.iinfo(b.dtype)
    # Draw where the generator lives (a CPU generator for reproducible tests; on-device otherwise).
    where = generator.device if generator is not None else b.device
    b.copy_(torch.randint(info.min, info.max, b.shape, dtype=b.dtype, generator=generator, device=where))
    return t


def make_cache(
    fmt: str,
    physical: str = "NHD",
    *,
    num_blocks: int = 5,
    block_size: int = 4,
    num_kv_heads: int = 3,
    head_size: int = 8,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float16,
    device: str | torch.device = "cpu",
    block_pad: int = 0,
    generator: torch.Generator | None = None,
) -> CacheCase:
    """Caches of ``fmt`` with random contents, allocated in physical order, viewed logically.

    ``block_pad`` extra elements between blocks (vLLM pads pages of hybrid models). Per-layer caches
    are views into one shared storage, like vLLM's, at layer offsets that are not multiples of a page.
    """
    logical, nhd, hnd = _AXES[fmt]
    order = hnd if physical == "HND" else nhd
    nh = 1 if fmt == "mla" else num_kv_heads
    sizes = {"kv": 2, "nb": num_blocks, "bs": block_size, "nh": nh, "hs": head_size, "c": 2 * head_size}
    sizes["nl"] = num_layers
    strides: dict[str, int] = {}
    running = 1
    for name in reversed(order):
        if name == "nb":
            strides[name] = running + block_pad
            running = strides[name] * sizes[name]
        else:
            strides[name] = running
            running *= sizes[name]
    layer_numel = running
    lsize = [sizes[n] for n in logical]
    lstride = [strides[n] for n in logical]
    attn = "CPU_ATTN" if fmt == "cpu_attn" else None
    if fmt == "cross_layer":
        buf = random_bits_(torch.empty(layer_numel + 3, dtype=dtype, device=device), generator)
        cache = torch.as_strided(buf, lsize, lstride, 3)
        return CacheCase(fmt, physical, cache, num_layers, block_size, nh, head_size, attn)
    gap = 5  # layers are views of one storage, 5 elements apart beyond their extent
    buf = random_bits_(torch.empty(num_layers * (layer_numel + gap), dtype=dtype, device=device), generator)
    caches = [torch.as_strided(buf, lsize, lstride, i * (layer_numel + gap)) for i in range(num_layers)]
    return CacheCase(fmt, physical, caches, num_layers, block_size, nh, head_size, attn)


def naive_token(case: CacheCase, layer: int, kv: int, slot: int) -> torch.Tensor:
    """One token's ``[NH*HS]`` row of plane ``kv``, read through the format's own definition."""
    bs, hs = case.block_size, case.head_size
    b, o = divmod(slot, bs)
    fmt = case.fmt
    if fmt == "cross_layer":
        assert isinstance(case.caches, torch.Tensor)
        return case.caches[b, layer, kv, o].reshape(-1)
    cache = case.caches[layer]
    if fmt == "kv_first":
        return cache[kv, b, o].reshape(-1)
    if fmt == "blocks_first":
        return cache[b, kv, o].reshape(-1)
    if fmt == "packed":
        return cache[b, :, o, kv * hs : (kv + 1) * hs].reshape(-1)
    if fmt == "mla":
        return cache[b, o].reshape(-1)
    if fmt == "cpu_attn":
        rows = []
        for h in range(case.num_kv_heads):
            slab = cache[b, h].reshape(-1)  # contiguous [BS, 2*HS] slab: K^T [HS, BS] then V [BS, HS]
            if kv == 0:
                rows.append(slab[: bs * hs].view(hs, bs)[:, o])
            else:
                rows.append(slab[bs * hs :].view(bs, hs)[o])
        return torch.cat(rows)
    raise ValueError(fmt)


def naive_gather(case: CacheCase, slots: list[int], out: torch.Tensor) -> torch.Tensor:
    """Per-token Python loop; rows of negative slots keep ``out``'s contents."""
    num_kv = 1 if case.fmt == "mla" else 2
    for layer in range(case.num_layers):
        for kv in range(num_kv):
            for t, s in enumerate(slots):
                if s >= 0:
                    out[layer, kv, t] = naive_token(case, layer, kv, s)
    return out


def naive_scatter(case: CacheCase, slots: list[int], obj: torch.Tensor, skip: int = 0) -> None:
    """Per-token Python loop writing through the same definitions as ``naive_token``."""
    num_kv = 1 if case.fmt == "mla" else 2
    bs, hs = case.block_size, case.head_size
    for layer in range(case.num_layers):
        for kv in range(num_kv):
            for t, s in enumerate(slots):
                if s < 0 or t < skip:
                    continue
                b, o = divmod(s, bs)
                row = obj[layer, kv, t]
                fmt = case.fmt
                if fmt == "cross_layer":
                    case.caches[b, layer, kv, o] = row.view(case.num_kv_heads, hs)
                elif fmt == "kv_first":
                    case.caches[layer][kv, b, o] = row.view(case.num_kv_heads, hs)
                elif fmt == "blocks_first":
                    case.caches[layer][b, kv, o] = row.view(case.num_kv_heads, hs)
                elif fmt == "packed":
                    case.caches[layer][b, :, o, kv * hs : (kv + 1) * hs] = row.view(case.num_kv_heads, hs)
                elif fmt == "mla":
                    case.caches[layer][b, o] = row
                elif fmt == "cpu_attn":
                    for h in range(case.num_kv_heads):
                        slab = case.caches[layer][b, h].view(-1)
                        part = row[h * hs : (h + 1) * hs]
                        if kv == 0:
                            slab[: bs * hs].view(hs, bs)[:, o] = part
                        else:
                            slab[bs * hs :].view(bs, hs)[o] = part


def random_slots(
    num_slots: int, count: int, *, negatives: int = 0, generator: torch.Generator | None = None
) -> list[int]:
    """``count`` distinct slots in random (non-contiguous) order, ``negatives`` of them replaced by -1."""
    perm = torch.randperm(num_slots, generator=generator)[:count].tolist()
    if negatives:
        where = torch.randperm(count, generator=generator)[:negatives].tolist()
        for i in where:
            perm[i] = -1
    return perm
