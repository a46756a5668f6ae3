"""The handler's COMMIT and LOOKUP bodies: objects' checksums and segment sums, out and back.

COMMIT. ``commit_sums`` settles what each object is committed with (its checksum, computed here
unless given, and its segment sums, only with a given checksum they add up to) before anything is
sent; ``commit_bodies`` splits the batch into COMMIT bodies the server accepts: at most
``MAX_BATCH`` items, and with segment sums at most ``MAX_SEGMENT_BATCH`` items and
``SEGMENT_FRAME_BYTES`` of sums (the decode limits of a request count them, ``maru.protocol``).
``segments`` is sent only in a body where some object has them, so a batch without any sends
what it always sent.

LOOKUP. ``lookup_checksums`` and ``lookup_segments`` read the reply's per-key fields; either may be
missing (an older server), which means nothing to verify against and whole-object reads.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Any

from maru.announce import announce_once
from maru.checksum import checksum
from maru.client.objects import Allocation
from maru.protocol import MAX_BATCH, MAX_SEGMENT_BATCH, SEGMENT_FRAME_BYTES
from maru.segments import SegmentSums

log = logging.getLogger("maru.client")

BAD_SEGMENTS_ANNOUNCEMENT = "maru.client.bad-segments"


def commit_sums(
    keys: Sequence[str],
    objs: Sequence[Any],
    checksums: Sequence[int] | None,
    segments: Sequence[SegmentSums | None] | None,
) -> tuple[list[int | None], list[list[Any] | None] | None]:
    """Per object, the checksum and the wire form of the segment sums it is committed with.

    Checksums are computed over ``obj.buf`` unless given (one unsigned 64-bit int per object).
    Segment sums (one ``SegmentSums`` or None per object) need given checksums, and each must add up
    to its object's checksum for its size: a writer's bug caught here raises ``ValueError`` before
    anything is sent. The second value is None when no object has segment sums.
    """
    if checksums is None:
        if segments is not None and any(s is not None for s in segments):
            raise ValueError(
                "batch_store got segment sums without checksums: pass the checksums they add up to "
                "(checksums=[...]) with them"
            )
        # Called outside the connection lock: other threads keep talking to the server meanwhile.
        sums: list[int | None] = [
            checksum(o.buf) if isinstance(o, Allocation) and o.buf is not None else None for o in objs
        ]
    else:
        sums = [int(c) for c in checksums]
        if len(sums) != len(objs) or any(not 0 <= c < 1 << 64 for c in sums):
            raise ValueError(
                f"batch_store needs one unsigned 64-bit checksum per object, got {checksums!r:.100}"
            )
    if segments is None:
        return sums, None
    segs = list(segments)
    if len(segs) != len(objs):
        raise ValueError(
            f"batch_store got {len(segs)} segment sums for {len(objs)} objects (one each, or None)"
        )
    wires: list[list[Any] | None] = []
    for k, o, c, s in zip(keys, objs, sums, segs, strict=True):
        if s is None:
            wires.append(None)
            continue
        if not isinstance(s, SegmentSums):
            raise TypeError(
                f"segment sums of key {k!r} must be a SegmentSums or None, got {type(s).__name__}"
            )
        size = getattr(o, "size", None)
        if c is not None and isinstance(size, int) and not s.consistent(c, size):
            raise ValueError(
                f"the segment sums of key {k!r} do not add up to its checksum for its {size}-byte object "
                "(the writer's sums or checksum are wrong); nothing was stored"
            )
        wires.append(s.to_wire())
    return sums, wires if any(w is not None for w in wires) else None


def commit_bodies(
    keys: list[str], objs: list[Allocation], sums: list[int | None], wires: list[list[Any] | None] | None
) -> Iterator[tuple[list[str], list[Allocation], dict[str, Any]]]:
    """The batch as ``(keys, objects, COMMIT body)`` per request, in order (see the module docstring)."""
    n = len(keys)
    start = 0
    while start < n:
        if wires is None:
            end = min(n, start + MAX_BATCH)
        else:
            end, budget = start, SEGMENT_FRAME_BYTES
            while end < n and end - start < MAX_SEGMENT_BATCH:
                w = wires[end]
                cost = 0 if w is None else len(w[1])
                if end > start and cost > budget:
                    break
                budget -= cost
                end += 1
        body: dict[str, Any] = {
            "items": [[k, o.alloc_id] for k, o in zip(keys[start:end], objs[start:end], strict=True)],
            "checksums": sums[start:end],
        }
        if wires is not None and any(w is not None for w in wires[start:end]):
            body["segments"] = wires[start:end]
        yield keys[start:end], objs[start:end], body
        start = end


def lookup_checksums(reply: dict[str, Any], n: int) -> list[Any]:
    """The LOOKUP reply's ``checksums`` (all None from an older server: nothing to verify against)."""
    sums = reply.get("checksums")
    return sums if isinstance(sums, list) and len(sums) == n else [None] * n


def lookup_segments(reply: dict[str, Any], n: int) -> list[SegmentSums | None]:
    """The LOOKUP reply's ``segments``, parsed (all None where the server sent none: an older one).

    A value that does not parse is None, announced once at WARNING: it only means that reader
    verifies the whole object.
    """
    raw = reply.get("segments")
    if not isinstance(raw, list) or len(raw) != n:
        if raw is not None:
            _announce_bad(f"the field is not a list of {n} entries: {raw!r:.80}")
        return [None] * n
    out: list[SegmentSums | None] = []
    for wire in raw:
        if wire is None:
            out.append(None)
            continue
        try:
            out.append(SegmentSums.from_wire(wire))
        except ValueError as e:
            _announce_bad(str(e))
            out.append(None)
    return out


# Why this process last got segment sums it could not parse (maru doctor shows it through the
# connector's reported paths); None: never.
bad_segments_seen: str | None = None


def _announce_bad(why: str) -> None:
    global bad_segments_seen
    bad_segments_seen = why
    announce_once(
        log,
        BAD_SEGMENTS_ANNOUNCEMENT,
        logging.WARNING,
        "maru: the server sent segment sums that do not parse (%s); those objects are verified whole "
        "(slower, still checked). Are client and server versions matched?",
        why,
    )
