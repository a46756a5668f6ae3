"""The scheduler-to-worker contract: which chunks of which request move, and what came of it.

Plain, picklable records (in vLLM's multi-process mode they cross a process boundary) and
torch-free, so a scheduler side imports them without torch. ``slot_mapping`` imports torch only
when called (the worker side).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# ``_contiguous_plan``'s plan of one request's slots: (first block, end block, tokens of the first
# block before the first chunk, tokens, placed runs).
Plan = tuple[int, int, int, int, tuple[tuple[int, int], ...]]


@dataclass(frozen=True)
class ChunkRef:
    """One pool object of a request: ``num_tokens`` tokens starting at request token ``start``.

    Only object tokens ``[place_begin, place_end)`` are placed into (load) the paged cache; the
    others are skipped (they are already computed locally, or beyond what the engine takes). A
    store gathers the whole object (``place_*`` are ignored).
    """

    key: str
    start: int
    num_tokens: int
    place_begin: int = 0
    place_end: int = -1  # -1: num_tokens

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    def placed(self) -> tuple[int, int]:
        pe = self.num_tokens if self.place_end < 0 else self.place_end
        return self.place_begin, pe

    def places(self) -> bool:
        """Whether any token of this chunk is placed (a chunk with none is not copied at all)."""
        return (self.num_tokens if self.place_end < 0 else self.place_end) > self.place_begin


@dataclass(frozen=True)
class HeldChunk:
    """Where a pool object another client holds pinned for this load lies: ``size`` bytes at pool
    ``offset``, committed with ``checksum``. The scheduler side pins what it offers to vLLM and
    hands the locations to the worker with the load, so the worker places the bytes without a
    lookup round trip; the pin is the scheduler's, released once the worker reports the load's
    ``ticket`` done (``maru.vllm.offer_pins``). The bytes are still checked against ``checksum``
    after they are placed, as for any load; with its committed ``segments`` (``maru.segments``), a
    load that places only its last tokens reads only their segments."""

    key: str
    offset: int
    size: int
    checksum: int | None
    segments: Any = None


@dataclass(frozen=True)
class RequestTransfer:
    """The chunks of one request moved in one step, and the request's block table.

    ``block_ids[i]`` holds request tokens ``[i*BS, (i+1)*BS)``; it must cover every placed token.
    ``held``: chunks (by key, every tensor-parallel rank's) pinned for this load by the scheduler
    side, and ``ticket`` the name under which the worker reports it no longer reads them (a load
    without ``held`` is looked up and pinned by the worker itself).
    """

    req_id: str
    block_ids: tuple[int, ...]
    chunks: tuple[ChunkRef, ...]
    held: tuple[HeldChunk, ...] = ()
    ticket: str = ""

    def num_placed_tokens(self) -> int:
        return sum(pe - pb for pb, pe in (c.placed() for c in self.chunks))

    def block_ids_of(self, begin: int, end: int, block_size: int) -> set[int]:
        """Block ids holding request tokens ``[begin, end)``."""
        if end <= begin:
            return set()
        return set(self.block_ids[begin // block_size : (end + block_size - 1) // block_size])

    def placed_block_ids(self, block_size: int) -> set[int]:
        out: set[int] = set()
        for c in self.chunks:
            pb, pe = c.placed()
            out |= self.block_ids_of(c.start + pb, c.start + pe, block_size)
        return out


@dataclass
class StoreReport:
    """What came of one store: chunks published (``stored``), already there (``present``), lost."""

    stored: int = 0
    present: int = 0
    failed: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    error: str | None = None
    server_lost: bool = False  # the failure was the server itself (unreachable, timed out)
    # The calling thread's CPU seconds by phase of the store (``time.thread_time``): "reserve" (the
    # RESERVE round trip), "issue" (the gather's issue), "complete" (waiting for it and reading its
    # checksums: the wait itself sleeps on the device), "publish" (the COMMIT round trip).
    cpu: dict[str, float] = field(default_factory=dict)


@dataclass
class LoadReport:
    """What came of one load: each request either in ``loaded_req_ids`` or in ``failed`` (why)."""

    loaded_req_ids: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    chunks: int = 0
    tokens: int = 0
    bytes: int = 0
    seconds: float = 0.0
    server_lost: bool = False
    # Chunks placed from another request's copy of the same pool entry (one copy served several
    # requests of the step: a shared prefix); counted in ``chunks``/``bytes`` like the others.
    copies_shared: int = 0
    # Of ``bytes``: bytes of segments the load neither placed nor read (``maru.segments``: a chunk
    # whose first tokens vLLM's own cache holds is read from the first segment it places).
    unread_bytes: int = 0
    # Where ``seconds`` went (host wall time, seconds). A chunk load: "lookup" (the lookup-and-pin
    # round trip), "prepare" (checks, object views), "issue" (the path call, the slot mappings in
    # it), "wait" (from issue to completion, as seen by ``collect``). A layer load: "pin"
    # (``KVTransferEngine.pin``: checks, objects, slot mappings), "prepare" (its per-request
    # lists), "issue" (the path call). A diagnosis's breakdown, not a contract.
    phases: dict[str, float] = field(default_factory=dict)

    def phases_line(self) -> str:
        """``pin 0.31 / prepare 0.05 / issue 0.62 ms`` (in the order they ran); "" when none."""
        if not self.phases:
            return ""
        return " / ".join(f"{k} {v * 1e3:.2f}" for k, v in self.phases.items()) + " ms"


def unique_keys(requests: Sequence[RequestTransfer]) -> tuple[list[str], dict[str, int]]:
    """Every chunk key of ``requests`` once, in first-seen order, and each key's position.

    Requests sharing a prefix share chunks: one lookup (and one pin) per key, not per request.
    """
    keys: list[str] = []
    index: dict[str, int] = {}
    for req in requests:
        for c in req.chunks:
            if c.key not in index:
                index[c.key] = len(keys)
                keys.append(c.key)
    return keys, index


def slot_mapping(
    block_ids: Sequence[int],
    block_size: int,
    start: int,
    num_tokens: int,
    place: tuple[int, int] | None = None,
    *,
    table: Any = None,
) -> Any:
    """Slots (int64 tensor) of request tokens ``[start, start+num_tokens)``; -1 outside ``place``.

    ``place`` is in object offsets. Only the placed tokens need blocks: the engine may not have
    allocated blocks for the rest. A chunk's cost does not grow with its position in the request.
    ``table``: ``block_table(block_ids)``, made once per request by callers mapping many chunks
    (numpy here: a chunk costs a few microseconds, against ~60 through torch's small ops).
    """
    import numpy as np
    import torch

    pb, pe = place if place is not None else (0, num_tokens)
    slots = np.full(num_tokens, -1, dtype=np.int64)
    if pe > pb:
        first, last = start + pb, start + pe
        nblocks = (last + block_size - 1) // block_size
        if nblocks > len(block_ids):
            raise ValueError(
                f"tokens up to {last} need {nblocks} blocks of {block_size}, the request has {len(block_ids)}"
            )
        if table is None:
            table = block_table(block_ids[first // block_size : nblocks])
            base = first // block_size
        else:
            base = 0
        pos = np.arange(first, last, dtype=np.int64)
        blocks, within = np.divmod(pos, block_size)
        slots[pb:pe] = table[blocks - base] * block_size + within
    return torch.from_numpy(slots)


def too_few_blocks(need: int, block_size: int, have: int) -> str:
    """Why a request's slots cannot be made (``chunk_slots``' error, the engine's check)."""
    return f"its placed tokens need {need} blocks of {block_size}, the request has {have}"


def blocks_needed(block_size: int, chunks: Sequence[ChunkRef], *, whole: bool = False) -> int:
    """The blocks a request needs for the placed tokens of ``chunks`` (``whole``: all of them):
    ``chunk_slots`` raises where the request has fewer (it checks with this)."""
    last = 0
    for c in chunks:
        n = c.num_tokens
        if whole:
            pb, pe = 0, n
        else:  # ChunkRef.placed(), inlined: it runs for every chunk of every load's pin
            pb, pe = c.place_begin, n if c.place_end < 0 else c.place_end
        if pe > pb and c.start + pe > last:
            last = c.start + pe
    return -(-last // block_size)


def chunk_slots(
    block_ids: Sequence[int],
    block_size: int,
    chunks: Sequence[ChunkRef],
    *,
    whole: bool = False,
) -> Any:
    """Slots of every token of ``chunks`` (one request's, in order), concatenated: an int64 tensor.

    Chunk k's tokens are rows ``[o_k, o_k + T_k)`` (``o_k`` the tokens of the chunks before it).
    A token outside its chunk's ``placed()`` range is -1 (``whole``: every token is placed, as a
    store gathers). Equal to concatenating ``slot_mapping`` of each chunk, in one numpy pass for the
    whole request: a chunk costs a slice assignment, not ~30 us of small numpy and torch calls.
    """
    import numpy as np
    import torch

    n = len(chunks)
    nblocks = blocks_needed(block_size, chunks, whole=whole)
    if nblocks > len(block_ids):
        raise ValueError(too_few_blocks(nblocks, block_size, len(block_ids)))
    plan = _contiguous_plan(block_ids, block_size, chunks, whole)
    if plan is not None:
        # The usual step: chunks one after the other (a store's whole chunks, a load's placed
        # ranges): a block's slots at once, a chunk's placed range one slice (``_planned``).
        return _planned([(block_ids, chunks)], [plan], block_size)[0]
    total = sum(c.num_tokens for c in chunks)
    counts = np.fromiter((c.num_tokens for c in chunks), dtype=np.int64, count=n)
    starts = np.fromiter((c.start for c in chunks), dtype=np.int64, count=n)
    offs = np.cumsum(counts) - counts
    pos = np.arange(total, dtype=np.int64) + np.repeat(starts - offs, counts)
    placed = np.zeros(total, dtype=bool)
    for c, o in zip(chunks, offs.tolist(), strict=True):
        pb, pe = (0, c.num_tokens) if whole else c.placed()
        placed[o + pb : o + pe] = True
    table = block_table(block_ids)
    blocks, within = np.divmod(pos, block_size)
    if not len(table):
        return torch.full((total,), -1, dtype=torch.int64)
    np.minimum(blocks, len(table) - 1, out=blocks)  # unplaced tokens may have no block
    out = np.where(placed, table[blocks] * block_size + within, -1)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.int64))


def many_chunk_slots(
    requests: Sequence[tuple[Sequence[int], Sequence[ChunkRef]]],
    block_size: int,
    *,
    whole: bool = False,
) -> list[Any]:
    """``chunk_slots`` of each (block ids, chunks) of a step's requests, in one numpy pass for all
    of them: one int64 tensor a request (views of one buffer: read them, never write them).

    A step's requests are mostly chunks one after the other; their blocks are converted to slots in
    one broadcast and each chunk's placed range copied by one slice, so a request costs a few slice
    copies, not ``chunk_slots``' half-dozen numpy calls (~30 us a request on the CI machine). A
    request whose chunks are not contiguous, or which lacks the blocks its placed tokens need, is
    made by ``chunk_slots`` alone; where that raises (too few blocks) the request's entry is None
    and the others are made: a request that cannot be placed fails alone, its caller says why.
    """
    plans = [_contiguous_plan(ids, block_size, chunks, whole) for ids, chunks in requests]
    made = _planned(requests, plans, block_size)
    return [
        _alone(ids, block_size, chunks, whole) if m is None else m
        for (ids, chunks), m in zip(requests, made, strict=True)
    ]


def _alone(block_ids: Sequence[int], block_size: int, chunks: Sequence[ChunkRef], whole: bool) -> Any:
    """``chunk_slots`` of one request, or None where it cannot be made (``many_chunk_slots``)."""
    try:
        return chunk_slots(block_ids, block_size, chunks, whole=whole)
    except ValueError:
        return None


def _planned(
    requests: Sequence[tuple[Sequence[int], Sequence[ChunkRef]]],
    plans: Sequence[Plan | None],
    block_size: int,
) -> list[Any]:
    """The slots of each request with a plan (``_contiguous_plan``), None for the others: their
    blocks turned into slots in one broadcast, each chunk's placed range one slice."""
    import itertools

    import numpy as np
    import torch

    ids_total = sum(p[1] - p[0] for p in plans if p is not None)
    tokens_total = sum(p[3] for p in plans if p is not None)
    if tokens_total == 0:
        return [None] * len(requests)
    ids = np.fromiter(
        itertools.chain.from_iterable(
            r[0][p[0] : p[1]] for r, p in zip(requests, plans, strict=True) if p is not None
        ),
        dtype=np.int64,
        count=ids_total,
    )
    rows = (ids[:, None] * block_size + _block_offsets(block_size)).reshape(-1)
    # Every token placed (a store, a load of whole chunks): each request's slots are a run of rows.
    direct = all(p is None or p[4] == ((0, p[3]),) for p in plans)
    out = rows if direct else np.full(tokens_total, -1, dtype=np.int64)
    row0 = out0 = 0
    spans: list[tuple[int, int] | None] = []
    for p in plans:
        if p is None:
            spans.append(None)
            continue
        lo, nb, skip, total, runs = p
        r = row0 + skip  # rows[r + t] is the slot of this request's token t (of its chunks)
        if direct:
            spans.append((r, total))
            row0 += (nb - lo) * block_size
            continue
        for a, b in runs:  # a held turn's placed tokens are one run: one slice, not one a chunk
            out[out0 + a : out0 + b] = rows[r + a : r + b]
        spans.append((out0, total))
        row0 += (nb - lo) * block_size
        out0 += total
    flat = torch.from_numpy(out)
    return [None if span is None else flat[span[0] : span[0] + span[1]] for span in spans]


def _contiguous_plan(
    block_ids: Sequence[int], block_size: int, chunks: Sequence[ChunkRef], whole: bool
) -> Plan | None:
    """(first block, end of the blocks up to the last placed token, tokens of the first block
    before the first chunk, tokens, the placed runs) of a request whose chunks follow one another
    and whose blocks suffice; None otherwise (``chunk_slots`` makes it alone). The placed runs:
    ``(begin, end)`` in the request's chunk tokens, disjoint, ascending, adjacent ranges merged
    (every token placed: ``((0, tokens),)``; a held turn, placed from inside its first chunk to
    inside its last: one run)."""
    if not chunks:
        return None
    runs: list[tuple[int, int]] = []
    total, last = 0, 0
    end = chunks[0].start
    for c in chunks:
        if c.start != end:
            return None
        n = c.num_tokens
        if whole:
            pb, pe = 0, n
        else:
            pb = c.place_begin
            pe = n if c.place_end < 0 else c.place_end  # ChunkRef.placed(), inlined: 64 a load
        if pe > pb:
            last = end + pe
            if runs and runs[-1][1] == total + pb:
                runs[-1] = (runs[-1][0], total + pe)
            else:
                runs.append((total + pb, total + pe))
        end += n
        total += n
    nblocks = -(-last // block_size)
    if total == 0 or nblocks > len(block_ids):
        return None
    lo = chunks[0].start // block_size
    return lo, max(lo, nblocks), chunks[0].start - lo * block_size, total, tuple(runs)


@functools.lru_cache(maxsize=8)
def _block_offsets(block_size: int) -> Any:
    """``[[0, 1, ..., block_size - 1]]`` (int64, read only): a block's slots are its first plus these."""
    import numpy as np

    row = np.arange(block_size, dtype=np.int64)[None, :]
    row.flags.writeable = False
    return row


def block_table(block_ids: Sequence[int]) -> Any:
    """``block_ids`` as an int64 numpy array (``slot_mapping``'s ``table``)."""
    import numpy as np

    return np.asarray(block_ids, dtype=np.int64)
