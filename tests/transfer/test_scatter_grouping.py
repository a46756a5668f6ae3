"""``IssuedScatter``: the items of one chunk several requests want become adjacent (so the GPU
path copies it once), every item keeping its own object, slots, handle and owner; the deferred
slots (``DeferredSlots``) equal the eager per-chunk mappings, in item order, after grouping too."""

from __future__ import annotations

import random

import pytest
import torch

from maru.transfer.loads import IssuedScatter
from maru.transfer.records import (
    ChunkRef,
    RequestTransfer,
    blocks_needed,
    chunk_slots,
    many_chunk_slots,
    slot_mapping,
)
from maru.transfer.slot_plan import DeferredSlots, joined_slots, listed

BS = 16  # block size; chunks of 48 tokens (not a multiple of anything else here)
CHUNK = 48


class _Handle:
    def __init__(self, key: str) -> None:
        self.key = key


def _request(rng: random.Random, name: str, keys: list[str]) -> RequestTransfer:
    """A request over ``keys`` in order, random blocks, its first and last chunks partly placed."""
    n = len(keys)
    chunks = []
    for i, key in enumerate(keys):
        pb = rng.randint(0, CHUNK - 1) if i == 0 else 0
        pe = rng.randint(pb, CHUNK) if i == n - 1 else -1
        chunks.append(ChunkRef(key, i * CHUNK, CHUNK, pb, pe))
    blocks = tuple(rng.sample(range(10_000), -(-n * CHUNK // BS)))
    return RequestTransfer(name, blocks, tuple(chunks))


def test_grouping_makes_repeats_adjacent_and_keeps_each_item_whole() -> None:
    rng = random.Random(5)
    for _ in range(200):
        handles = {f"k{i}": _Handle(f"k{i}") for i in range(rng.randint(1, 6))}
        batch = IssuedScatter()
        items = []  # (object id, key, owner, eager slots)
        for owner in range(rng.randint(1, 5)):
            keys = rng.sample(sorted(handles), rng.randint(1, len(handles)))
            req = _request(rng, f"r{owner}", keys)
            placed, row = [], 0
            for c in req.chunks:
                if c.places():
                    obj = torch.empty(1)
                    placed.append((obj, row, c.num_tokens, handles[c.key]))
                    eager = slot_mapping(req.block_ids, BS, c.start, c.num_tokens, c.placed())
                    items.append((id(obj), c.key, owner, eager))
                row += c.num_tokens
            batch.add(req, BS, placed, 0)
        repeats = batch.group_by_chunk()
        assert repeats == len(items) - len({t[1] for t in items})
        got = batch.slots.per_item()
        assert len(got) == len(batch.objs) == len(batch.placed) == len(batch.owner) == len(items)
        by_obj = {t[0]: t for t in items}
        for obj, h, owner, slots in zip(batch.objs, batch.placed, batch.owner, got, strict=True):
            _, key, want_owner, eager = by_obj[id(obj)]  # each item whole: its key, owner, slots
            assert (h.key, owner) == (key, want_owner)
            assert torch.equal(slots, eager)
        want_joined = [by_obj[id(o)][3] for o in batch.objs]
        assert torch.equal(batch.slots.joined(), joined_slots(want_joined))
        keys = [h.key for h in batch.placed]
        seen: list[str] = []
        for k in keys:  # each key's items form one run, runs in first-seen order
            if not seen or seen[-1] != k:
                assert k not in seen
                seen.append(k)
        assert seen == list(dict.fromkeys(t[1] for t in items))
        for key in seen:  # within a key, the original order (stable)
            want = [t[2] for t in items if t[1] == key]
            assert [o for h, o in zip(batch.placed, batch.owner, strict=True) if h.key == key] == want


def test_deferred_slots_are_made_once_per_request_and_lists_pass_through(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from maru.transfer import slot_plan

    calls: list[list[str]] = []

    def counting(requests, block_size):  # type: ignore[no-untyped-def]
        calls.append([chunks[0].key for _, chunks in requests])
        return many_chunk_slots(requests, block_size)

    monkeypatch.setattr(slot_plan, "many_chunk_slots", counting)
    rng = random.Random(9)
    deferred = DeferredSlots()
    reqs = [_request(rng, f"r{i}", [f"a{i}", f"b{i}", f"c{i}"]) for i in range(2)]
    for req in reqs:
        r = deferred.add_request(req, BS)
        for i in range(3):
            deferred.add_item(r, i * CHUNK, CHUNK)
    assert calls == []  # nothing made before it is asked for
    first = deferred.per_item()
    assert deferred.per_item() is first and calls == [["a0", "a1"]]  # once, both requests in one pass
    assert torch.equal(deferred.joined(), torch.cat([chunk_slots(q.block_ids, BS, q.chunks) for q in reqs]))
    plain = [torch.arange(3)]
    assert listed(plain) == plain and listed(deferred) is first


def test_blocks_needed_is_where_chunk_slots_stops() -> None:
    rng = random.Random(3)
    for _ in range(300):
        req = _request(rng, "r", [f"k{i}" for i in range(rng.randint(1, 4))])
        need = blocks_needed(BS, req.chunks)
        chunk_slots(req.block_ids[:need], BS, req.chunks)  # enough
        if need:
            with pytest.raises(ValueError, match="blocks"):
                chunk_slots(req.block_ids[: need - 1], BS, req.chunks)


def test_a_held_turns_placed_tokens_are_one_run_and_holes_split_it() -> None:
    """``_contiguous_plan``'s placed runs (``_planned`` copies one slice a run): a held turn placed
    from inside its first chunk to inside its last is one run; a chunk placing nothing or starting
    late splits it; adjacent ranges merge; the runs are exactly the placed tokens."""
    from maru.transfer.records import ChunkRef, _contiguous_plan

    c = 8
    held = [
        ChunkRef("a", 0, c, 3),
        ChunkRef("b", c, c),
        ChunkRef("c", 2 * c, c),
        ChunkRef("d", 3 * c, c, 0, 5),
    ]
    assert _contiguous_plan(list(range(9)), BS, held, False)[4] == ((3, 3 * c + 5),)
    assert _contiguous_plan(list(range(9)), BS, held, True)[4] == ((0, 4 * c),)
    holes = [
        ChunkRef("a", 0, c, 3),
        ChunkRef("b", c, c, 2, 2),
        ChunkRef("c", 2 * c, c, 1),
        ChunkRef("d", 3 * c, c),
    ]
    assert _contiguous_plan(list(range(9)), BS, holes, False)[4] == ((3, c), (2 * c + 1, 4 * c))
    rng = random.Random(5)
    for _ in range(300):
        chunks, start = [], rng.randint(0, BS)
        for i in range(rng.randint(1, 5)):
            n = rng.randint(1, 2 * BS + 1)
            pb = rng.choice([0, 0, rng.randint(0, n)])
            pe = rng.choice([n, rng.randint(pb, n)])
            chunks.append(ChunkRef(f"k{i}", start, n, pb, pe))
            start += n
        plan = _contiguous_plan(list(range(64)), BS, chunks, False)
        placed, o = [], 0
        for ch in chunks:
            a, b = ch.placed()
            placed += range(o + a, o + b)
            o += ch.num_tokens
        if not placed:
            continue
        runs = plan[4]
        assert [t for a, b in runs for t in range(a, b)] == placed
        assert all(b0 < a1 for (_, b0), (a1, _) in zip(runs, runs[1:], strict=False))  # disjoint, apart
