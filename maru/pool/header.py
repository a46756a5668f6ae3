"""The pool header: a small record at offset 0 of every pool (emulated file or DAX device).

It lets a host that sees the same device under a different path (``/dev/dax0.0`` here,
``/dev/dax1.0`` there) recognise it by UUID, and lets a restarted server check that its saved
state belongs to this pool. Layout (little-endian, ``HEADER_STRUCT``)::

    magic        8s   b"MARUPOOL"
    version      u32  HEADER_VERSION
    header_size  u32  bytes covered by the CRC (this struct without the CRC)
    pool_size    u64  bytes of the whole pool, header included
    data_offset  u64  first byte objects may occupy (one alignment unit)
    alignment    u64  every object's offset and size are multiples of this
    uuid         16s  random UUID4 chosen when the pool was initialised
    crc32        u32  CRC-32 of everything above (catches a torn or foreign header)

The data region is ``[data_offset, pool_size)``; the header never shares a page with data.
"""

from __future__ import annotations

import struct
import uuid as uuidlib
import zlib
from dataclasses import dataclass

from maru.errors import PoolError

MAGIC = b"MARUPOOL"
HEADER_VERSION = 1
_BODY = struct.Struct("<8sIIQQQ16s")
HEADER_STRUCT = struct.Struct("<8sIIQQQ16sI")
HEADER_BYTES = HEADER_STRUCT.size


@dataclass(frozen=True)
class PoolHeader:
    """The decoded header of one pool. ``uuid`` is the canonical hyphenated string."""

    uuid: str
    pool_size: int
    data_offset: int
    alignment: int
    version: int = HEADER_VERSION

    @classmethod
    def new(cls, pool_size: int, data_offset: int, alignment: int) -> PoolHeader:
        return cls(str(uuidlib.uuid4()), pool_size, data_offset, alignment)

    def pack(self) -> bytes:
        body = _BODY.pack(
            MAGIC,
            self.version,
            _BODY.size,
            self.pool_size,
            self.data_offset,
            self.alignment,
            uuidlib.UUID(self.uuid).bytes,
        )
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def unpack(cls, raw: bytes, where: str) -> PoolHeader | None:
        """Decode ``raw``; None if it carries no Maru magic (an uninitialised pool).

        Raises ``PoolError`` for a header with our magic that is corrupt or of another version,
        because overwriting it would throw away somebody's pool identity.
        """
        if len(raw) < HEADER_BYTES or raw[:8] != MAGIC:
            return None
        magic, version, hsize, pool_size, data_offset, alignment, uid, crc = HEADER_STRUCT.unpack_from(raw)
        if zlib.crc32(raw[: _BODY.size]) != crc:
            raise PoolError(
                f"pool header of {where} is corrupt (CRC mismatch); if the pool holds nothing you need, "
                "delete the file (or zero the first 4 KiB of the device) and start the server again"
            )
        if version != HEADER_VERSION:
            raise PoolError(
                f"pool header of {where} has version {version}, this Maru reads version {HEADER_VERSION}; "
                "use a matching Maru version or re-initialise the pool"
            )
        return cls(str(uuidlib.UUID(bytes=uid)), pool_size, data_offset, alignment, version)
