"""How one LMCache memory object sits in a pool object, and LMCache memory objects over pool pages.

A pool object is a 256-byte header, then the memory object's bytes exactly as LMCache laid them
out (``raw_data[:get_size()]``):

    b"MLMC" | u32 little-endian length n | n bytes of JSON {shape, dtype, fmt, shapes, dtypes, size}

The header lets any reader rebuild the memory object without knowing the model; payloads start
256 bytes in, so they keep the pool's alignment (64-byte multiples) for DMA.

``pool_memory_obj`` wraps a *pinned* lookup of the pool as an LMCache ``TensorMemoryObj`` with no
copy: its tensor is the pool's own pages. Invariant: the Maru pin is released exactly once, when
LMCache frees the object (its reference count and LMCache pin count both reach zero).
"""

from __future__ import annotations

import ctypes
import json
import struct
from typing import Any

import torch

HEADER_BYTES = 256
_MAGIC = b"MLMC"


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r} in a stored LMCache object header")
    return dt


def encode_header(memory_obj: Any) -> bytes:
    """The header of one LMCache memory object (its shape, dtype, format and logical size)."""
    meta = memory_obj.meta
    doc = {
        "shape": list(meta.shape),
        "dtype": _dtype_name(meta.dtype),
        "fmt": int(meta.fmt.value),
        "shapes": [list(s) for s in meta.shapes] if meta.shapes else None,
        "dtypes": [_dtype_name(d) for d in meta.dtypes] if meta.dtypes else None,
        "size": int(memory_obj.get_size()),
    }
    blob = json.dumps(doc, separators=(",", ":")).encode()
    if len(blob) + 8 > HEADER_BYTES:
        raise ValueError(
            f"LMCache object metadata needs {len(blob) + 8} bytes; the header has {HEADER_BYTES}"
        )
    return (_MAGIC + struct.pack("<I", len(blob)) + blob).ljust(HEADER_BYTES, b"\0")


def decode_header(view: memoryview | bytes) -> dict[str, Any]:
    """Parse a header written by ``encode_header``; ValueError if it is not one."""
    head = bytes(view[:8])
    if len(head) < 8 or head[:4] != _MAGIC:
        raise ValueError("not an LMCache object stored by Maru (bad header magic)")
    (n,) = struct.unpack("<I", head[4:8])
    if n + 8 > HEADER_BYTES:
        raise ValueError(f"LMCache object header claims {n} bytes of metadata")
    doc = json.loads(bytes(view[8 : 8 + n]))
    if int(doc["size"]) + HEADER_BYTES > len(view):
        raise ValueError(
            f"stored LMCache object is {len(view)} bytes, its header says {doc['size']} + header"
        )
    return doc


def write_object(dst: memoryview, header: bytes, src: torch.Tensor) -> None:
    """Copy header and payload into the pool allocation ``dst`` (``src``: flat uint8, CPU or GPU)."""
    dst[:HEADER_BYTES] = header
    out = torch.frombuffer(dst, dtype=torch.uint8, count=src.numel(), offset=HEADER_BYTES)
    out.copy_(src)


def payload_bytes(memory_obj: Any) -> torch.Tensor:
    """The memory object's logical bytes as a flat uint8 tensor (a view, no copy)."""
    n = int(memory_obj.get_size())
    return memory_obj.raw_data.view(-1).view(torch.uint8)[:n]


def tensor_at(address: int, size: int) -> torch.Tensor:
    """A writable uint8 CPU tensor over ``size`` bytes at ``address`` (no copy; the caller keeps it mapped)."""
    return torch.frombuffer((ctypes.c_ubyte * size).from_address(address), dtype=torch.uint8)


class PinReleaser:
    """LMCache's allocator interface for memory objects over pinned pool pages: ``free`` releases
    the Maru pin (once). Allocation is not its job; LMCache never asks it to allocate."""

    def __init__(self, release: Any) -> None:
        self._release = release

    def free(self, memory_obj: Any, allocator_type: str | None = None) -> None:
        handle = getattr(memory_obj, "_maru_handle", None)
        if handle is None:
            return
        memory_obj._maru_handle = None
        memory_obj.invalidate()
        self._release(handle)

    def batched_free(
        self, memory_objs: list[Any], allocator_type: str | None = None, update_stats: bool = True
    ) -> None:
        for m in memory_objs:
            self.free(m)

    def allocate(self, *args: Any, **kwargs: Any) -> None:
        return None

    def batched_allocate(self, *args: Any, **kwargs: Any) -> None:
        return None

    def close(self) -> None:
        return None

    def memcheck(self) -> bool:
        return True


def pool_memory_obj(handle: Any, pool_address: int, releaser: PinReleaser) -> Any:
    """An LMCache ``TensorMemoryObj`` whose tensor is the pinned pool object of ``handle`` (a
    ``maru.client.Retrieved``), reference count 1. ValueError (handle left to the caller) if the
    stored bytes are not an LMCache object."""
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    doc = decode_header(handle.view)
    size = int(doc["size"])
    raw = tensor_at(pool_address + handle.offset + HEADER_BYTES, size)
    meta = MemoryObjMetadata(
        shape=torch.Size(doc["shape"]),
        dtype=dtype_from_name(doc["dtype"]),
        address=handle.offset,
        phy_size=size,
        ref_count=1,
        fmt=MemoryFormat(doc["fmt"]),
        shapes=[torch.Size(s) for s in doc["shapes"]] if doc["shapes"] else None,
        dtypes=[dtype_from_name(d) for d in doc["dtypes"]] if doc["dtypes"] else None,
    )
    obj = TensorMemoryObj(raw, meta, parent_allocator=releaser)  # type: ignore[arg-type]
    obj._maru_handle = handle  # type: ignore[attr-defined]
    return obj
