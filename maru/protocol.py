"""Maru's wire protocol, shared by client and server (the one contract between them).

Transport: ZeroMQ. The server binds a ROUTER socket; each client connects a DEALER, so a
client can time out a request and go on without wedging a REQ/REP lockstep.

Frame (one ZeroMQ message part)::

    offset 0   4 bytes  magic  b"MARU"
    offset 4   u16      protocol version (big-endian), currently PROTOCOL_VERSION
    offset 6   u16      op code (``Op``); a reply carries ``op | REPLY_BIT``
    offset 8   u64      request id, chosen by the client, echoed unchanged in the reply
    offset 16  ...      body: one MessagePack map (request fields / reply fields)

Every reply body has ``"ok"``. On failure it is ``{"ok": False, "code": <ErrorCode>,
"message": <text for a human>}``. A frame too short to carry a header gets no reply
(there is no request id to echo); anything with a readable header gets a reply.

Requests (all carry ``client_id``: a random id the handler picks once; leases, reservations
and pins belong to it) and their replies:

===========  ============================================  =======================================
op           request fields                                reply fields
===========  ============================================  =======================================
HANDSHAKE    client_id, host, pid                          server_id, pool_path, pool_uuid,
                                                           pool_size, data_offset, data_size,
                                                           alignment, max_object_size,
                                                           lease_timeout_s, protocol_version,
                                                           pool_kind ("file" | "dax"), max_batch,
                                                           max_key_bytes
RESERVE      client_id, sizes: [int]                       allocs: [[alloc_id, offset, size] | None]
                                                           (None: does not fit even after eviction)
COMMIT       client_id, items: [[key, alloc_id]]           results: ["stored" | "present" |
                                                           "unknown_alloc"]; "present" frees the
                                                           duplicate's space (keys are write-once)
ABORT        client_id, alloc_ids: [int]                   freed: int
LOOKUP       client_id, keys: [key], pin: bool             entries: [[offset, size] | None]
EXISTS       client_id, keys: [key]                        present: [bool], prefix: int (leading hits)
PIN          client_id, keys: [key]                        pinned: [bool]
UNPIN        client_id, keys: [key]                        unpinned: [bool]
DELETE       client_id, keys: [key]                        deleted: [bool]
HEARTBEAT    client_id                                     server_id, known: bool (False: the lease
                                                           expired or the server restarted;
                                                           handshake again)
STATS        client_id                                     counters: {name: int}, requests: {op: int},
                                                           errors: {code: int}, gauges: {name: int},
                                                           uptime_s, server_id, url, pool_path,
                                                           pool_kind, pool_uuid, pool_size,
                                                           max_object_size, lease_timeout_s,
                                                           protocol_version, pid
                                                           (names: maru/server/stats.py, docs/server.md)
USAGE        client_id                                     pool_size, data_size, used, free,
                                                           largest_free, reserved, committed,
                                                           entries, pinned, clients,
                                                           evictable, reservations
===========  ============================================  =======================================

Leases: RESERVE, COMMIT, ABORT, PIN, UNPIN and LOOKUP with ``pin: true`` need a live lease
(a HANDSHAKE not followed by ``lease_timeout_s`` of silence); without one they get
``unknown_client``. Every request of a known client renews its lease. EXISTS, LOOKUP without pin,
DELETE, STATS and USAGE work without a handshake. ``client_id`` is a str (or bytes/int), at most
256 long. Sizes in USAGE are bytes of the pool (rounded up to ``alignment``); sizes in RESERVE and
LOOKUP replies are the object sizes the client asked for.

Offsets are absolute byte offsets into the pool (the file or device the client maps).
Keys are strings of at most ``MAX_KEY_BYTES`` UTF-8 bytes.
"""

from __future__ import annotations

import enum
import struct
from typing import Any

import msgpack

from maru.errors import ProtocolError

MAGIC = b"MARU"
PROTOCOL_VERSION = 1
HEADER = struct.Struct("!4sHHQ")
HEADER_SIZE = HEADER.size  # 16
REPLY_BIT = 0x8000

MAX_FRAME_BYTES = 8 << 20
MAX_BATCH = 8192
MAX_KEY_BYTES = 512


class Op(enum.IntEnum):
    HANDSHAKE = 1
    RESERVE = 2
    COMMIT = 3
    ABORT = 4
    LOOKUP = 5
    EXISTS = 6
    PIN = 7
    UNPIN = 8
    DELETE = 9
    HEARTBEAT = 10
    STATS = 11
    USAGE = 12


class ErrorCode(str, enum.Enum):
    MALFORMED = "malformed"  # header or body cannot be decoded
    VERSION = "version"  # protocol version mismatch
    UNKNOWN_OP = "unknown_op"
    BAD_REQUEST = "bad_request"  # a field is missing, of the wrong type, or out of range
    TOO_LARGE = "too_large"  # frame, batch, key or object over a limit
    UNKNOWN_CLIENT = "unknown_client"  # no handshake (or the lease expired): handshake again
    POOL_FULL = "pool_full"
    INTERNAL = "internal"


class CommitResult(str, enum.Enum):
    STORED = "stored"
    PRESENT = "present"
    UNKNOWN_ALLOC = "unknown_alloc"


# (unpackb takes no max_buffer_size: decode_body checks the frame length before unpacking.)
_UNPACK_LIMITS = dict(
    max_str_len=MAX_FRAME_BYTES,
    max_bin_len=MAX_FRAME_BYTES,
    max_array_len=MAX_BATCH * 4,
    max_map_len=1024,
    max_ext_len=0,
)


def encode(op: int, req_id: int, body: dict[str, Any]) -> bytes:
    """Encode one frame. ``op`` already carries ``REPLY_BIT`` for a reply."""
    payload = msgpack.packb(body, use_bin_type=True)
    frame = HEADER.pack(MAGIC, PROTOCOL_VERSION, op, req_id & 0xFFFFFFFFFFFFFFFF) + payload
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(
            f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES}-byte limit; split the batch"
        )
    return frame


def decode_header(frame: bytes) -> tuple[int, int, int]:
    """Return ``(version, op, req_id)``. Raises ``ProtocolError`` if the header is unreadable."""
    if len(frame) < HEADER_SIZE:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than the {HEADER_SIZE}-byte header")
    magic, version, op, req_id = HEADER.unpack_from(frame)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a Maru frame")
    return version, op, req_id


def decode_body(frame: bytes) -> dict[str, Any]:
    """Decode the MessagePack map after the header. Raises ``ProtocolError`` if it is not one."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    try:
        body = msgpack.unpackb(frame[HEADER_SIZE:], raw=False, strict_map_key=True, **_UNPACK_LIMITS)
    except Exception as e:  # msgpack raises many types for garbage input
        raise ProtocolError(f"body is not valid MessagePack: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"body must be a map, got {type(body).__name__}")
    return body


def ok(**fields: Any) -> dict[str, Any]:
    """A success reply body."""
    return {"ok": True, **fields}


def error(code: ErrorCode, message: str) -> dict[str, Any]:
    """A failure reply body."""
    return {"ok": False, "code": code.value, "message": message}
