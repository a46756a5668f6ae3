"""Segment sums: an object's checksum split by token segments, so a partial load reads only what it places.

A chunk object is ``[L, KV, T, ROW]``. A reader often places only its last tokens (vLLM's own
prefix cache holds the first ones), yet a whole-object checksum makes it read every byte to
vouch for the few it places: on the H200 a warm step read 690 MiB to place 450 MiB
(bench/RESULTS.md, pass 34).

The checksum (``maru.checksum``) is a sum mod 2**64 of a term per 64-bit word, each word mixed
with its index in the object. So it splits exactly: segment ``s`` holds the tokens
``[s*S, min((s+1)*S, T))`` of every layer and plane, its *raw sum* is the sum of the terms of
those words (indices absolute in the object), and

    checksum == (sum of every segment's raw sum mod 2**64) ^ nbytes.

The writer commits the raw sums with the checksum; the server keeps them with the entry and
refuses a COMMIT whose sums do not add up to its checksum (``consistent``). A reader that places
tokens of some segments only reads the rows of those segments, starts its accumulator at the
committed raw sums of the others (``SegmentSums.raw_of``), and compares the finished sum with the
committed checksum as before. The comparison is exactly the whole-object one: every byte a reader
places was read and summed, and what it did not read is counted at its committed value, so the
check passes iff the bytes read match what the writer committed for them.

Invariants: ``tokens >= 1``; ``1 <= len(raws) <= MAX_SEGMENTS``; every raw in ``[0, 2**64)``.
A reader uses segment sums only when ``len(raws) == ceil(T / tokens)`` for its object (``fits``);
else it reads the whole object (the whole checksum still holds).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from maru.checksum import MASK64

MAX_SEGMENTS = 4096  # 32 KiB of sums an object at most: the server's bound on a COMMIT's item
MAX_SEGMENT_TOKENS = 1 << 20
TARGET_SEGMENTS = 64  # a writer's S: its block size, grown until a chunk has at most this many


@dataclass(frozen=True)
class SegmentSums:
    """The raw sums of an object's token segments of ``tokens`` tokens each (the last may be shorter)."""

    tokens: int
    raws: tuple[int, ...]

    def __post_init__(self) -> None:
        _check_tokens(self.tokens)
        if not 1 <= len(self.raws) <= MAX_SEGMENTS:
            raise ValueError(f"an object has 1 to {MAX_SEGMENTS} segment sums, got {len(self.raws)}")
        if any(type(r) is not int or not 0 <= r <= MASK64 for r in self.raws):
            raise ValueError("segment sums must be unsigned 64-bit ints")

    @property
    def total(self) -> int:
        """The object's raw sum (mod 2**64): its checksum is ``total ^ nbytes``."""
        return sum(self.raws) & MASK64

    def checksum(self, nbytes: int) -> int:
        return self.total ^ int(nbytes)

    def consistent(self, checksum: int, nbytes: int) -> bool:
        """Whether these sums add up to ``checksum`` for an object of ``nbytes`` bytes."""
        return self.checksum(nbytes) == int(checksum)

    def fits(self, tokens: int) -> bool:
        """Whether these are the segments of an object of ``tokens`` tokens."""
        return len(self.raws) == math.ceil(tokens / self.tokens)

    def raw_of(self, segments: Iterable[int]) -> int:
        """The raw sum (mod 2**64) of the given segments."""
        raws = self.raws
        return sum(raws[s] for s in segments) & MASK64

    # -- the wire (msgpack) and SQLite form: [tokens, little-endian uint64 bytes] ------------------

    def to_wire(self) -> list[Any]:
        return [self.tokens, np.asarray(self.raws, dtype="<u8").tobytes()]

    @classmethod
    def from_wire(cls, value: Any) -> SegmentSums:
        """Parse ``[tokens, bytes]``; raises ValueError (with what was wrong) on anything else."""
        if type(value) is not list or len(value) != 2:
            raise ValueError("segment sums must be [tokens: int, sums: bytes]")
        tokens, blob = value
        if type(blob) is not bytes or not blob or len(blob) % 8:
            raise ValueError("segment sums' bytes must be a non-empty multiple of 8 (little-endian uint64)")
        if len(blob) // 8 > MAX_SEGMENTS:
            raise ValueError(f"an object has at most {MAX_SEGMENTS} segment sums, got {len(blob) // 8}")
        _check_tokens(tokens)
        # Made without ``__post_init__``'s check of each sum: unsigned 64-bit ints by construction
        # (read as "<u8"). That check was most of a pin reply's handle on vLLM's scheduling thread.
        out = object.__new__(cls)
        object.__setattr__(out, "tokens", tokens)
        object.__setattr__(out, "raws", tuple(np.frombuffer(blob, dtype="<u8").tolist()))
        return out


def _check_tokens(tokens: Any) -> None:
    if type(tokens) is not int or not 1 <= tokens <= MAX_SEGMENT_TOKENS:
        raise ValueError(f"segment tokens {tokens!r:.40} must be an int in [1, {MAX_SEGMENT_TOKENS}]")


def segment_tokens(block_size: int, chunk_tokens: int) -> int:
    """The segment size a writer uses: the cache's block size (where vLLM's own prefix hits end),
    doubled until a chunk has at most ``TARGET_SEGMENTS`` segments."""
    s = max(1, int(block_size))
    while math.ceil(chunk_tokens / s) > TARGET_SEGMENTS:
        s *= 2
    return s


def pieces(shape: Sequence[int], esize: int, seg_tokens: int) -> list[tuple[int, int, int]]:
    """The contiguous word ranges of each segment of an object ``[L, KV, T, ROW]`` of ``esize``-byte
    elements: ``(segment, first word, end word)``, word indices absolute in the object. Rows must be
    whole words (``ROW * esize % 8 == 0``)."""
    L, KV, T, row = (int(x) for x in shape)
    row_words = _row_words(row, esize)
    out = []
    for plane in range(L * KV):
        base = plane * T
        for s, t0 in enumerate(range(0, T, seg_tokens)):
            t1 = min(t0 + seg_tokens, T)
            out.append((s, (base + t0) * row_words, (base + t1) * row_words))
    return out


def _row_words(row: int, esize: int) -> int:
    """The 8-byte words of an object row of ``row`` elements of ``esize`` bytes (segment sums read
    whole words); ValueError where a row is not a whole number of them."""
    row_words, rem = divmod(row * esize, 8)
    if rem:
        raise ValueError(f"segment sums need rows of whole 8-byte words; a row here is {row * esize} bytes")
    return row_words


def host_segment_sums(
    buffer: Any, shape: Sequence[int], esize: int, seg_tokens: int, only: np.ndarray | None = None
) -> SegmentSums:
    """The segment sums of an object in host memory (C-contiguous ``[L, KV, T, ROW]``): each word read
    once, compiled where ``maru.checksum`` is (numpy otherwise). ``only``: a bool per segment; the
    others are not read (their sums are 0)."""
    from maru.checksum import _as_bytes, _native, numpy_words_sum

    data = _as_bytes(buffer)
    words = data[: data.size // 8 * 8].view("<u8")
    T = int(shape[2])
    raws = [0] * math.ceil(T / seg_tokens)
    nat = _native()
    if nat is not None and nat.segment_sums is not None:
        # One compiled call for every piece (a 256-token chunk of 32 layers: 1024 of them).
        L, KV, _, row = (int(x) for x in shape)
        row_words = _row_words(row, esize)
        if data.size < L * KV * T * row * esize:
            raise ValueError(f"the object has {data.size} bytes, its shape {list(shape)} needs more")
        out = np.zeros(len(raws), dtype=np.uint64)
        mask = None if only is None else np.ascontiguousarray(only, dtype=np.uint8)
        if mask is not None and mask.size < len(raws):
            raise ValueError(f"{mask.size} segment flags for {len(raws)} segments")
        nat.segment_sums(
            data.ctypes.data, L * KV, T, row_words, seg_tokens,
            0 if mask is None else mask.ctypes.data, out.ctypes.data,
        )  # fmt: skip
        return SegmentSums(seg_tokens, tuple(out.tolist()))
    # The address once: ``ndarray.ctypes`` makes an object a read (~1 us; 1024 pieces a 256-token
    # chunk of 32 layers).
    addr = data.ctypes.data if nat is not None else 0
    for s, a, b in pieces(shape, esize, seg_tokens):
        if only is not None and not only[s]:
            continue
        if nat is not None:
            raws[s] += int(nat.words_sum(addr, a, b))  # type: ignore[misc]
        else:
            raws[s] += numpy_words_sum(words, a, b)
    return SegmentSums(seg_tokens, tuple(r & MASK64 for r in raws))


def host_checksum(
    buffer: Any, shape: Sequence[int], esize: int, written: np.ndarray, segs: SegmentSums | None
) -> tuple[int, int]:
    """(the checksum a verifying load of a host object vouches with, the bytes it left unread):
    read over the segments holding a ``written`` token (bool per token), the others counted at
    their committed sums (``segs``). Without usable segment sums, or with every segment written,
    the whole object's checksum; also for objects whose part to read is large enough for
    ``maru.checksum`` to split a whole read over threads (the pieces are read on this thread, and
    such a whole read is faster)."""
    from maru.checksum import PARALLEL_BYTES, _as_bytes, _threads, checksum

    shape = tuple(int(x) for x in shape)
    if segs is None or not segs.fits(shape[2]):
        return checksum(buffer), 0
    need = read_segments(written, segs.tokens)
    nbytes = _as_bytes(buffer).size
    if need.all() or (nbytes * need.mean() >= PARALLEL_BYTES and _threads() > 1):
        return checksum(buffer), 0
    read = host_segment_sums(buffer, shape, esize, segs.tokens, only=need)
    skipped = np.flatnonzero(~need).tolist()
    unread = int(np.repeat(~need, segs.tokens)[: shape[2]].sum())
    return (read.total + segs.raw_of(skipped)) & MASK64 ^ nbytes, unread * (nbytes // shape[2])


def read_segments(written: np.ndarray, seg_tokens: int) -> np.ndarray:
    """Which segments a placement must read: those holding a written token (``written``: per token
    of the object, bool)."""
    n = math.ceil(written.size / seg_tokens)
    padded = np.zeros(n * seg_tokens, dtype=bool)
    padded[: written.size] = written
    return padded.reshape(n, seg_tokens).any(axis=1)


def _partly_written(slots: np.ndarray, lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """(object, first token, end) of each non-empty object whose first or last token is not
    written (slot < 0): the only ones a partial read can apply to. In a few array operations, not a
    loop over the objects (64 for a 16k-token load: ~20 -> ~5 us on the CI machine)."""
    counts = np.asarray(lengths, dtype=np.int64)
    if not counts.size or not slots.size:
        return []
    ends = np.cumsum(counts)
    starts = ends - counts
    last = slots.size - 1
    # An empty object's start may be past the last token: clipped, and masked out below.
    edge = (slots[np.minimum(starts, last)] < 0) | (slots[np.minimum(ends - 1, last)] < 0)
    found = np.flatnonzero(edge & (counts > 0))
    return [(k, int(starts[k]), int(ends[k])) for k in found.tolist()]


def mark_unread(
    slots: np.ndarray, lengths: Sequence[int], segments: Sequence[SegmentSums | None]
) -> tuple[np.ndarray | None, int]:
    """Plan a verifying load's partial reads: in ``slots`` (int64 per token of every object in order,
    negative = not written; changed in place) set to -2 the rows of the segments wholly before an
    object's first written token or wholly after its last, and return (per object the raw sum of
    those segments as uint64, None when every row is read; how many tokens are left unread).

    Only objects whose first or last token is not written are looked at (a load skips the tokens
    vLLM's own prefix cache holds, at the start of a request's first chunk, and a turn's hit ends
    inside its last chunk): any other object is read whole, which is always correct. So is a
    segment between the first and the last written token that holds none (a hole, which the
    connector never makes): it is read, only bytes the bus carries in vain. Segment sums that do
    not fit their object are not used. A few array operations an object, whatever its shape: this
    runs on the layer load's issue path.
    """
    prefill: np.ndarray | None = None
    unread = 0
    for k, start, end in _partly_written(slots, lengths):
        tokens = end - start
        segs = segments[k]
        if segs is None or not segs.fits(tokens):
            continue
        seg, count = segs.tokens, len(segs.raws)
        written = np.flatnonzero(slots[start:end] >= 0)
        if written.size:
            lo = int(written[0]) // seg  # segments wholly before the first written token
            hi = -(-(int(written[-1]) + 1) // seg)  # the first segment wholly after the last
        else:
            lo = hi = count  # nothing written: every segment unread
        head = min(lo * seg, tokens)  # the last segment may be shorter than ``seg``
        tail = tokens - hi * seg if hi < count else 0
        if head:
            slots[start : start + head] = -2
        if tail:
            slots[end - tail : end] = -2
        skipped = [*range(lo), *range(hi, count)]
        if skipped:
            unread += head + tail
            if prefill is None:
                prefill = np.zeros(len(lengths), dtype=np.uint64)
            prefill[k] = segs.raw_of(skipped)
    return prefill, unread
