"""The key index table (``maru.pool.key_index``): writer and reader over one shared mapping.

The writer and the reader are given the same file, as the server and a client are; each test
compares the reader's answers with a reference set of keys kept beside it.
"""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import pytest

from maru.pool.key_index import (
    MAX_PROBE,
    MIN_SLOTS,
    STATE_FULL,
    TOMBSTONE,
    IndexPlace,
    KeyIndexReader,
    KeyIndexWriter,
    fingerprint,
    slots_for,
    table_bytes,
)


class Table:
    """A writer on a file and a reader of the same file (a second, read-only mapping)."""

    def __init__(self, tmp: Path, slots: int, offset: int = 0, through_pool_mapping: bool = False) -> None:
        self.path = str(tmp / "index")
        size = table_bytes(slots)
        with open(self.path, "wb") as f:
            f.truncate(offset + size)
        fd = os.open(self.path, os.O_RDWR)
        self.mm = mmap.mmap(fd, offset + size)
        os.close(fd)
        self.w = KeyIndexWriter(memoryview(self.mm)[offset:], slots)
        place = IndexPlace(None, offset, size, slots, self.w.nonce)
        if through_pool_mapping:  # an index in the pool's header unit: the client's pool mapping
            fd = os.open(self.path, os.O_RDWR)
            self.pool = mmap.mmap(fd, offset + size)
            os.close(fd)
            self.r = KeyIndexReader(place, pool=self.pool)
        else:
            self.r = KeyIndexReader(place, path=self.path)

    def header(self, word: int, value: int | None = None) -> int:
        view = memoryview(self.mm)[self.r.place.offset : self.r.place.offset + 64].cast("Q")
        if value is not None:
            view[word] = value
        return int(view[word])


def keys(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [f"ns/kv1/{rng.getrandbits(128):032x}" for _ in range(n)]


def test_the_reader_agrees_with_a_reference_set_through_adds_deletes_and_rebuilds(tmp_path: Path) -> None:
    # Not at the start of the file (offsets are honoured), read through a whole-pool mapping.
    t = Table(tmp_path, MIN_SLOTS, offset=8192, through_pool_mapping=True)
    rng = random.Random(7)
    pool = keys(6000, 1)  # more keys than fit at once: deletes must make room (tombstones, rebuilds)
    present: set[str] = set()
    for step in range(12000):
        k = rng.choice(pool)
        if k in present or len(present) >= 2500:
            if present:
                gone = k if k in present else rng.choice(sorted(present))
                t.w.discard(gone)
                present.discard(gone)
        else:
            t.w.add(k)
            present.add(k)
        if step % 500 == 0:
            sample = rng.sample(pool, 300)
            assert t.r.contains_many(sample) == [s in present for s in sample]
    assert t.w.rebuilds >= 1  # tombstones piled up and were cleared while readers kept answering
    assert t.r.contains_many(pool) == [k in present for k in pool]
    assert t.w.keys == len(present)


def test_a_key_present_twice_under_one_fingerprint_stays_until_both_go(tmp_path: Path) -> None:
    t = Table(tmp_path, MIN_SLOTS)
    t.w.add("a")
    t.w.add("a")  # the registry never commits a key twice; a fingerprint collision looks like this
    t.w.discard("a")
    assert t.r.contains_many(["a"]) == [True]
    t.w.discard("a")
    assert t.r.contains_many(["a"]) == [False]
    t.w.discard("never-added")  # harmless
    assert t.r.contains_many(["a", "never-added"]) == [False, False]


def test_the_reader_declines_while_a_rebuild_runs_or_the_table_belongs_to_another_run(tmp_path: Path) -> None:
    t = Table(tmp_path, MIN_SLOTS)
    t.w.add("k")
    assert t.r.contains_many(["k"]) == [True]
    seq = t.header(2)
    t.header(2, seq + 1)  # odd: the writer is moving slots
    assert t.r.contains_many(["k"]) is None
    t.header(2, seq + 2)
    assert t.r.contains_many(["k"]) == [True]
    nonce = t.header(1)
    t.header(1, nonce ^ 1)  # a restarted server wrote its own table here
    assert t.r.contains_many(["k"]) is None
    assert "restarted" in (t.r.why_unusable() or "")
    t.header(1, nonce)
    t.w.close()
    assert t.r.contains_many(["k"]) is None and "stopped" in (t.r.why_unusable() or "")


def test_more_keys_than_the_table_holds_turn_it_off_then_on_again(tmp_path: Path) -> None:
    t = Table(tmp_path, MIN_SLOTS)
    ks = keys(MIN_SLOTS, 2)  # 100% of the slots: past the 75% the table keeps
    for k in ks:
        t.w.add(k)
    assert t.w.state == STATE_FULL
    assert t.r.contains_many(ks[:3]) is None and "full" in (t.r.why_unusable() or "")
    for k in ks[MIN_SLOTS // 4 :]:
        t.w.discard(k)
    left = ks[: MIN_SLOTS // 4]
    assert t.w.state != STATE_FULL  # room again: every remaining key placed
    assert t.r.contains_many(ks[:50] + ks[-50:]) == [True] * 50 + [False] * 50
    assert t.r.contains_many(left) == [True] * len(left)


def test_a_probe_run_longer_than_readers_look_turns_the_table_off(tmp_path: Path) -> None:
    t = Table(tmp_path, MIN_SLOTS)
    # Keys whose fingerprints all start at one slot fill a run of MAX_PROBE slots.
    same = []
    i = 0
    while len(same) < MAX_PROBE + 1:
        k = f"k{i}"
        if fingerprint(k) & (MIN_SLOTS - 1) == 5:
            same.append(k)
        i += 1
    for k in same:
        t.w.add(k)
    assert t.w.state == STATE_FULL  # the last one found no slot a reader would reach
    assert t.r.contains_many(["anything"]) is None


def test_fingerprints_avoid_the_empty_and_tombstone_markers_and_sizes_follow_the_pool() -> None:
    assert all(fingerprint(k) > TOMBSTONE for k in keys(2000, 3))
    assert slots_for(16 << 20, 4096) == 8192  # 4096 objects at most: twice that
    assert slots_for(1 << 20, 4096) == MIN_SLOTS
    assert slots_for(1 << 40, 4096) == 1 << 22  # capped
    assert IndexPlace.from_wire({"path": None, "offset": 0, "size": 10, "slots": 4096, "nonce": 1}) is None
    assert IndexPlace.from_wire({"offset": 0}) is None and IndexPlace.from_wire("x") is None
    good = IndexPlace(None, 4096, table_bytes(4096), 4096, 3)
    assert IndexPlace.from_wire(good.to_wire()) == good


def test_a_reader_refuses_a_mapping_too_short_for_the_table(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs"):
        KeyIndexReader(IndexPlace(None, 0, table_bytes(4096), 4096, 1), pool=mmap.mmap(-1, 4096))
    with pytest.raises(ValueError, match="mapping or its side file"):
        KeyIndexReader(IndexPlace(None, 0, table_bytes(4096), 4096, 1))


def test_the_writer_refuses_a_table_that_does_not_fit() -> None:
    with pytest.raises(ValueError, match="power of two"):
        KeyIndexWriter(memoryview(bytearray(table_bytes(4096))), 3000)
    with pytest.raises(ValueError, match="needs"):
        KeyIndexWriter(memoryview(bytearray(100)), 4096)
