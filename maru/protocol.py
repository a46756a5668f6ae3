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

Requests (all carry ``client_id``: a random id the handler picks once) and their replies. Leases,
reservations and pins belong to the *connection* that made them (its routing id and, under CURVE,
its client key) together with the ``client_id``: the same id sent from another connection names
another session (docs/security.md). With ``--tenants``, requests on keys need rights on the key's
namespace (``denied``) and commits stay within quotas (``quota``); a full lease table answers a new
HANDSHAKE with ``too_many_clients``. Request bodies are decoded within ``MAX_FRAME_ELEMENTS`` and
``MAX_FRAME_DEPTH`` (``malformed`` past them).

===========  ============================================  =======================================
op           request fields                                reply fields
===========  ============================================  =======================================
HANDSHAKE    client_id, host, pid,                         server_id, pool_path, pool_uuid,
             info (optional, see "Client info" below),     pool_size, data_offset, data_size,
             boot_id, pid_ns, pid_start (optional: where
             the client runs, see "Quarantine" below),
             fenced (optional bool, see "Quarantine")
                                                           alignment, max_object_size,
                                                           lease_timeout_s, protocol_version,
                                                           pool_kind ("file" | "dax"), max_batch,
                                                           max_key_bytes, max_client_info_bytes
                                                           (absent: an older server, which ignores
                                                           ``info``)
RESERVE      client_id, sizes: [int]                       allocs: [[alloc_id, offset, size] | None]
                                                           (None: does not fit even after eviction),
                                                           quarantined: int (bytes held in
                                                           quarantine; only when some is None)
COMMIT       client_id, items: [[key, alloc_id]],          results: ["stored" | "present" |
             checksums: [int | None] (optional, one per    "unknown_alloc"]; "present" frees the
             item: ``maru.checksum`` of the bytes),        duplicate's space (keys are write-once)
             segments: [None | [tokens, sums]] (optional,
             one per item, see "Segment sums" below)
ABORT        client_id, alloc_ids: [int]                   freed: int
LOOKUP       client_id, keys: [key], pin: bool,            entries: [[offset, size] | None],
             segments: bool (optional, default false)      checksums: [int | None] (one per key: the
                                                           committed checksum; None: miss or none),
                                                           segments: [None | [tokens, sums]] (only
                                                           when asked: one per key, see below)
EXISTS       client_id, keys: [key]                        present: [bool], prefix: int (leading hits)
PIN          client_id, keys: [key]                        pinned: [bool]
UNPIN        client_id, keys: [key]                        unpinned: [bool]
DELETE       client_id, keys: [key]                        deleted: [bool]
HEARTBEAT    client_id, info (optional: replaces the       server_id, known: bool (False: the lease
             client's info when it has a lease)            expired or the server restarted;
                                                           handshake again; the info was not kept),
                                                           pins: int (this session's pins now)
STATS        client_id                                     counters: {name: int}, requests: {op: int},
                                                           errors: {code: int}, gauges: {name: int},
                                                           uptime_s, server_id, url, pool_path,
                                                           pool_kind, pool_uuid, pool_size,
                                                           max_object_size, lease_timeout_s,
                                                           protocol_version, pid,
                                                           clients: [{client_id, host, pid, age_s,
                                                           idle_s, info}] (live leases, those with
                                                           info first, then oldest first; at most
                                                           MAX_STATS_CLIENTS), clients_total: int,
                                                           clients_truncated: bool
                                                           (names: maru/server/stats.py, docs/server.md)
USAGE        client_id                                     pool_size, data_size, used, free,
                                                           largest_free, reserved, committed,
                                                           entries, pinned, clients,
                                                           evictable, reservations, quarantined,
                                                           quarantined_extents
REPORT       client_id, corrupt: [[key, offset]]           deleted: [bool] (the entry at that offset
                                                           was deleted: its bytes failed the check)
===========  ============================================  =======================================

Leases: RESERVE, COMMIT, ABORT, PIN, UNPIN and LOOKUP with ``pin: true`` need a live lease
(a HANDSHAKE not followed by ``lease_timeout_s`` of silence); without one they get
``unknown_client``. Every request of a known client renews its lease. EXISTS, LOOKUP without pin,
DELETE, STATS and USAGE work without a handshake. ``client_id`` is a str (or bytes/int), at most
256 long. Sizes in USAGE are bytes of the pool (rounded up to ``alignment``); sizes in RESERVE and
LOOKUP replies are the object sizes the client asked for.

Quarantine. When a lease expires its reservations and pins are taken from the client but their
space is not reused while the client may still touch it: it is released when the server sees the
client's process gone (only when ``boot_id`` and ``pid_ns`` equal the server's own: then ``pid``
and ``pid_start``, its start time in clock ticks from /proc/<pid>/stat, name it), when the client
handshakes again with ``fenced: true`` (it promises it made its old reservations and pinned views
unable to touch the pool), or ``--quarantine-timeout`` after the expiry. A client reports an
object whose bytes fail their checksum with REPORT; the server counts it (``integrity_failures``)
and deletes the entry if it still sits at that offset, so the key can be stored again.

Segment sums (``maru.segments``). A COMMIT item with a checksum may carry its object's segment
sums, ``[tokens: int, sums: bytes]`` (``SegmentSums.to_wire``: segment size in tokens, then one
little-endian uint64 raw sum per token segment), so that a reader placing only some tokens reads
only their segments. The server refuses the whole COMMIT with ``bad_request`` (nothing stored, the
reservations still the client's) when ``segments`` is not a list of one entry per item, an entry
does not parse (``SegmentSums.from_wire``: tokens in [1, 2**20], 1 to 4096 sums), an item has
segments but no checksum, or an item's sums do not add up to its checksum for its reservation's
size (``SegmentSums.consistent``). LOOKUP with ``segments: true`` answers the committed sums of each
hit (None: a miss, none committed, or past ``SEGMENT_FRAME_BYTES`` of sums in this reply); without
it the reply has no ``segments`` field. A server that predates them ignores both fields (its LOOKUP
reply has no ``segments``). A client splits a COMMIT with sums by ``MAX_SEGMENT_BATCH`` items and
``SEGMENT_FRAME_BYTES`` of sums (a frame's decode limits count them).

Offsets are absolute byte offsets into the pool (the file or device the client maps).
Keys are strings of at most ``MAX_KEY_BYTES`` UTF-8 bytes.

Client info. A client may describe itself to operators (``maru stats``, ``maru doctor``) with an
``info`` map: str keys (at most ``MAX_CLIENT_INFO_KEY_LEN`` characters), values None, bool, int
(64-bit), finite float, str, or lists/maps of those, nested at most ``MAX_CLIENT_INFO_DEPTH``
deep, at most ``MAX_CLIENT_INFO_BYTES`` bytes as MessagePack. HANDSHAKE sets it (absent: none),
HEARTBEAT with ``info`` replaces it. The server keeps it in memory with the lease only: it goes
when the lease expires and a restarted server knows none, so a client sends its info again in
every handshake (``MaruHandler.set_client_info`` does). A bad ``info`` gets ``bad_request``, an
oversized one ``too_large``; either way the request changes nothing (no lease, no info).
Convention (what ``maru doctor`` judges; other keys are shown, not judged)::

    {"role": "vllm-connector",                 # what the client is
     "paths": {"<data path>": "<what runs>"},  # e.g. {"load": "pipelined-gpu", "pool": "cuda-registered"}
     "slow": ["<sentence: which path is slow, why, and the fix>", ...]}  # empty/absent: all fast

``maru doctor`` warns iff some client reports a non-empty ``slow`` list.
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
MAX_CLIENT_INFO_BYTES = 4096  # a client's info map, MessagePack-encoded
MAX_CLIENT_INFO_DEPTH = 4  # the top map is depth 1
MAX_CLIENT_INFO_KEY_LEN = 128
MAX_STATS_CLIENTS = 256  # entries of the STATS reply's ``clients`` list
# Decode limits of one request (see ``decode_request``): the most elements all its arrays and maps
# hold together, each container counting one more (a full COMMIT batch of [key, alloc_id] pairs
# costs 4 * MAX_BATCH; an info map at most 2 per encoded byte), and how deep its containers nest
# (the request map, a field, an info map nested MAX_CLIENT_INFO_DEPTH deep).
MAX_FRAME_ELEMENTS = 4 * MAX_BATCH + 2 * MAX_CLIENT_INFO_BYTES + 64
MAX_FRAME_DEPTH = 1 + MAX_CLIENT_INFO_DEPTH + 1
# Replies carry more (RESERVE's [alloc_id, offset, size] triples; STATS's client list with info maps).
MAX_REPLY_ELEMENTS = 8 * MAX_BATCH + MAX_STATS_CLIENTS * (2 * MAX_CLIENT_INFO_BYTES + 16) + 1024
MAX_REPLY_DEPTH = MAX_FRAME_DEPTH + 2
# Segment sums (see "Segment sums" above). A COMMIT item with sums costs nine decode elements (its
# [key, alloc_id] pair, its checksum, its [tokens, sums]), so a client sends at most
# MAX_SEGMENT_BATCH such items, and at most SEGMENT_FRAME_BYTES of sums, in one COMMIT: within
# MAX_FRAME_ELEMENTS and MAX_FRAME_BYTES whatever the keys (a server of any version counts the
# field). A LOOKUP reply carries at most SEGMENT_FRAME_BYTES of sums (the hits past it get None).
MAX_SEGMENT_BATCH = MAX_BATCH // 2
SEGMENT_FRAME_BYTES = MAX_FRAME_BYTES // 2


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
    REPORT = 13


class ErrorCode(str, enum.Enum):
    MALFORMED = "malformed"  # header or body cannot be decoded
    VERSION = "version"  # protocol version mismatch
    UNKNOWN_OP = "unknown_op"
    BAD_REQUEST = "bad_request"  # a field is missing, of the wrong type, or out of range
    TOO_LARGE = "too_large"  # frame, batch, key or object over a limit
    UNKNOWN_CLIENT = "unknown_client"  # no handshake (or the lease expired): handshake again
    POOL_FULL = "pool_full"
    # The state database cannot take writes (disk full or failing): RESERVE, COMMIT and DELETE
    # are refused until it can; reads, pins and heartbeats work. Nothing refused was applied.
    STATE_UNWRITABLE = "state_unwritable"
    INTERNAL = "internal"
    DENIED = "denied"  # the caller's key has no right to this namespace (or is not an admin)
    QUOTA = "quota"  # the namespace is over its bytes or objects quota
    TOO_MANY_CLIENTS = "too_many_clients"  # the server's lease cap (--max-clients) is reached


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


class _ElementBudget:
    """Counts the elements of every array and map as msgpack finishes it; raises past the budget.

    msgpack bounds each container (``max_array_len``) and the nesting (its parser stack), but not
    their sum: a frame of millions of empty arrays inside arrays would decode into millions of
    Python lists. msgpack calls these hooks as each container completes, so a frame over budget
    stops after at most ``MAX_FRAME_ELEMENTS`` elements (plus one container) were built.
    """

    __slots__ = ("limit", "left", "containers")

    def __init__(self, limit: int) -> None:
        self.limit = self.left = limit
        self.containers = 0

    def _spend(self, n: int) -> None:
        self.containers += 1
        self.left -= n + 1
        if self.left < 0:
            raise ProtocolError(f"frame holds more than {self.limit} array and map elements; split the batch")

    def list_hook(self, value: list[Any]) -> list[Any]:
        self._spend(len(value))
        return value

    def object_hook(self, value: dict[str, Any]) -> dict[str, Any]:
        self._spend(2 * len(value))
        return value


def _depth(value: Any, limit: int) -> int:
    """How deep ``value``'s containers nest (a scalar is 0), exploring at most ``limit`` + 1 levels."""
    if type(value) is dict:
        children: Any = value.values()
    elif type(value) is list:
        children = value
    else:
        return 0
    if limit <= 0:
        return 1
    deepest = 0
    for v in children:
        if type(v) is list or type(v) is dict:
            deepest = max(deepest, _depth(v, limit - 1))
            if deepest >= limit:
                break
    return 1 + deepest


def namespace_of(key: str) -> str:
    """The namespace of ``key``: the text before its first ``/`` ("" when it has none). Rights under
    ``--tenants`` and the key index's per-namespace fingerprints follow it."""
    i = key.find("/")
    return key[:i] if i > 0 else ""


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


def decode_request(frame: bytes) -> dict[str, Any]:
    """Decode a request's body (the server's decoder): ``decode_body`` with the request limits."""
    return decode_body(frame, MAX_FRAME_ELEMENTS, MAX_FRAME_DEPTH)


def decode_body(
    frame: bytes, max_elements: int = MAX_REPLY_ELEMENTS, max_depth: int = MAX_REPLY_DEPTH
) -> dict[str, Any]:
    """Decode the MessagePack map after the header. Raises ``ProtocolError`` if it is not one.

    Bounded work whatever the bytes: at most ``MAX_FRAME_BYTES``, ``max_elements`` elements in all
    its arrays and maps, nested at most ``max_depth`` deep; a frame past a limit is refused after
    at most that much decoding. The defaults fit any reply; requests use ``decode_request``.
    """
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes is over the {MAX_FRAME_BYTES}-byte limit")
    budget = _ElementBudget(max_elements)
    try:
        body = msgpack.unpackb(
            frame[HEADER_SIZE:],
            raw=False,
            strict_map_key=True,
            list_hook=budget.list_hook,
            object_hook=budget.object_hook,
            **_UNPACK_LIMITS,
        )
    except ProtocolError:
        raise
    except Exception as e:  # msgpack raises many types for garbage input
        raise ProtocolError(f"body is not valid MessagePack: {type(e).__name__}: {e}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"body must be a map, got {type(body).__name__}")
    # Depth can only exceed the limit when there are more containers than levels: the common
    # request (a map and a list or two) skips the walk.
    if budget.containers > max_depth and _depth(body, max_depth) > max_depth:
        raise ProtocolError(f"body nests deeper than {max_depth} levels of arrays and maps")
    return body


def ok(**fields: Any) -> dict[str, Any]:
    """A success reply body."""
    return {"ok": True, **fields}


def error(code: ErrorCode, message: str) -> dict[str, Any]:
    """A failure reply body."""
    return {"ok": False, "code": code.value, "message": message}


_INT_RANGE = (-(1 << 63), (1 << 64) - 1)  # what MessagePack carries


def client_info_problem(info: Any) -> tuple[ErrorCode, str] | None:
    """Why ``info`` is not a valid client info map (see "Client info" above), or None if it is.

    Checks shape first (bounded: the walk stops at ``MAX_CLIENT_INFO_DEPTH``), then the encoded
    size, so a client and the server agree on what is refused and why.
    """
    if not isinstance(info, dict):
        return ErrorCode.BAD_REQUEST, f"info must be a map, got {type(info).__name__}"
    problem = _info_value_problem(info, "info", 1)
    if problem is not None:
        return ErrorCode.BAD_REQUEST, problem
    size = len(msgpack.packb(info, use_bin_type=True))
    if size > MAX_CLIENT_INFO_BYTES:
        return (
            ErrorCode.TOO_LARGE,
            f"info is {size} bytes encoded, over the {MAX_CLIENT_INFO_BYTES}-byte limit: report less "
            "(short path names and sentences)",
        )
    return None


def _info_value_problem(value: Any, where: str, depth: int) -> str | None:
    t = type(value)
    if value is None or t is bool or t is str:
        return None
    if t is int:
        lo, hi = _INT_RANGE
        return None if lo <= value <= hi else f"{where} = {value} does not fit in 64 bits"
    if t is float:
        return None if value == value and abs(value) != float("inf") else f"{where} must be a finite number"
    if t is list or t is dict:
        if depth > MAX_CLIENT_INFO_DEPTH:
            return f"{where} nests deeper than {MAX_CLIENT_INFO_DEPTH} levels"
        if t is list:
            for i, v in enumerate(value):
                p = _info_value_problem(v, f"{where}[{i}]", depth + 1)
                if p is not None:
                    return p
            return None
        for k, v in value.items():
            if type(k) is not str:
                return f"{where} has a key of type {type(k).__name__}; keys must be strings"
            if len(k) > MAX_CLIENT_INFO_KEY_LEN:
                return f"{where} has a key of {len(k)} characters; the limit is {MAX_CLIENT_INFO_KEY_LEN}"
            p = _info_value_problem(v, f"{where}[{k!r:.40}]", depth + 1)
            if p is not None:
                return p
        return None
    return (
        f"{where} is of type {t.__name__}; info values are None, bool, int, float, str, or lists and "
        "maps of those"
    )
