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

from maru.pool.fingerprints import TOMBSTONE, KeyedFingerprints, fingerprint
from maru.pool.key_index import (
    HEADER_BYTES,
    MAX_PROBE,
    MIN_SLOTS,
    STATE_FULL,
    IndexPlace,
    KeyIndexReader,
    KeyIndexWriter,
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


def runs_are_intact(t: Table) -> None:
    """Every key sits within MAX_PROBE slots of its home with no empty slot on the way (what a
    reader's probe needs), and nothing else is in the table."""
    slots = t.w.slots
    view = memoryview(t.mm)[t.r.place.offset + 64 : t.r.place.offset + table_bytes(slots)].cast("Q")
    table = list(view)
    view.release()
    held = [v for v in table if v != 0]
    assert TOMBSTONE not in held and len(held) == len(set(held)) == t.w.keys
    for j, v in enumerate(table):
        if v:
            home = v & (slots - 1)
            dist = (j - home) % slots
            assert dist < MAX_PROBE
            assert all(table[(home + d) % slots] != 0 for d in range(dist))


def churn(t: Table, pool: list[str], most: int, steps: int, seed: int, check_every: int) -> set[str]:
    """Random adds and deletes (never more than ``most`` keys), checked against a reference set."""
    rng = random.Random(seed)
    present: set[str] = set()
    for step in range(steps):
        k = rng.choice(pool)
        if k in present or len(present) >= most:
            gone = k if k in present else rng.choice(sorted(present))
            t.w.discard(gone)
            present.discard(gone)
        else:
            t.w.add(k)
            present.add(k)
        if step % check_every == 0:
            sample = rng.sample(pool, 300)
            assert t.r.contains_many(sample) == [s in present for s in sample]
    return present


def test_the_reader_agrees_with_a_reference_set_through_adds_and_shifting_deletes(tmp_path: Path) -> None:
    # Not at the start of the file (offsets are honoured), read through a whole-pool mapping.
    t = Table(tmp_path, MIN_SLOTS, offset=8192, through_pool_mapping=True)
    pool = keys(6000, 1)  # more keys than fit at once: deletes must make room
    present = churn(t, pool, most=2500, steps=12000, seed=7, check_every=500)
    assert t.w.shifts >= 100  # deletes moved later keys back while readers kept answering
    assert t.w.rebuilds == 0  # and the table never stopped to clean up
    assert t.r.contains_many(pool) == [k in present for k in pool]
    assert t.w.keys == len(present)
    runs_are_intact(t)


def test_churn_at_the_most_the_table_keeps_stays_exact_and_usable(tmp_path: Path) -> None:
    t = Table(tmp_path, MIN_SLOTS)
    pool = keys(4000, 4)
    most = int(0.75 * MIN_SLOTS)  # 3072 of 4096 slots: long runs, every delete shifts
    present = churn(t, pool, most=most, steps=20000, seed=5, check_every=1000)
    assert t.w.state != STATE_FULL and t.w.rebuilds == 0
    assert t.r.contains_many(pool) == [k in present for k in pool]
    runs_are_intact(t)


def test_runs_that_wrap_past_the_last_slot_survive_deletes_in_any_order(tmp_path: Path) -> None:
    t = Table(tmp_path, MIN_SLOTS)
    # Keys whose homes are the last 8 slots: their run wraps to slot 0 and on.
    near_end, i = [], 0
    while len(near_end) < 120:
        k = f"w{i}"
        if fingerprint(k) & (MIN_SLOTS - 1) >= MIN_SLOTS - 8:
            near_end.append(k)
        i += 1
    others = keys(200, 6)  # keys at home near slot 0 mixed into the wrapped run
    rng = random.Random(8)
    present: set[str] = set()
    for k in near_end + [k for k in others if fingerprint(k) & (MIN_SLOTS - 1) < 200]:
        t.w.add(k)
        present.add(k)
    runs_are_intact(t)
    order = sorted(present)
    rng.shuffle(order)
    for k in order:
        t.w.discard(k)
        present.discard(k)
        assert t.r.contains_many(order) == [x in present for x in order]
    runs_are_intact(t)
    assert t.w.keys == 0


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


class ShiftDuringFirstRead:
    """Slot words as a reader sees them, with a whole delete's shift (seq + 2) landing during the
    reader's first look at a slot."""

    def __init__(self, t: Table) -> None:
        self.t, self.slots, self.looks, self.shifted = t, t.r._s, 0, False

    def __getitem__(self, i: int) -> int:
        self.looks += 1
        if not self.shifted:
            self.shifted = True
            self.t.header(2, self.t.header(2) + 2)
        return int(self.slots[i])


def test_a_read_that_a_shift_overlapped_is_made_again(tmp_path: Path) -> None:
    t = Table(tmp_path, MIN_SLOTS)
    t.w.add("k")
    slots = ShiftDuringFirstRead(t)
    t.r._s = slots  # type: ignore[assignment]
    assert t.r.contains_many(["k", "x"]) == [True, False]  # not None: read again, not sent away
    assert slots.shifted and slots.looks >= 4  # two keys looked up twice


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


def test_a_keyed_table_answers_a_reader_only_for_the_namespaces_it_holds_secrets_for(tmp_path: Path) -> None:
    path = str(tmp_path / "index")
    size = table_bytes(MIN_SLOTS)
    with open(path, "wb") as f:
        f.truncate(size)
    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, size)
    os.close(fd)
    server = KeyedFingerprints.drawn(["team-a", "team-b"])
    w = KeyIndexWriter(memoryview(mm), MIN_SLOTS, fingerprints=server)
    ns_keys = {
        ns: [f"{ns}/{k}" for k in keys(200, hash(ns) & 0xFFFF)] for ns in ("team-a", "team-b", "other")
    }
    stored = {k for ks in ns_keys.values() for k in ks[:100]}  # half of each namespace's keys
    w.add_many(sorted(stored))
    place = IndexPlace(path, 0, size, MIN_SLOTS, w.nonce, keyed=True)
    # A tenant that may read team-a: exact there, no answer elsewhere (the server decides those).
    mine = KeyedFingerprints.from_wire(server.for_reader(["team-a"]))
    assert mine is not None and set(mine.secrets) == {"team-a"}
    r = KeyIndexReader(place, path=path, fingerprints=mine)
    a = ns_keys["team-a"]
    assert r.contains_many(a) == [k in stored for k in a]
    assert r.contains_many(ns_keys["team-b"][:3]) is None
    assert r.contains_many([a[0], "other/x"]) is None
    assert mine.missing([a[0], "team-b/x"]) == "team-b" and mine.missing(a) is None
    # Nothing in the table can be told from keys without a secret: no slot holds a key's plain
    # fingerprint, and team-a's secret fingerprints no team-b key that is there.
    view = mm[HEADER_BYTES:size]
    words = set(memoryview(view).cast("Q"))
    assert not words & {fingerprint(k) for k in stored}
    assert not words & {fingerprint(k, mine.secrets["team-a"]) for k in ns_keys["team-b"][:100]}
    # A reader must come with the secrets of a keyed table, and a plain reader of a keyed table
    # sees another server's magic.
    with pytest.raises(ValueError, match="no secrets came with it"):
        KeyIndexReader(place, path=path)
    plain = KeyIndexReader(IndexPlace(path, 0, size, MIN_SLOTS, w.nonce), path=path)
    assert plain.contains_many(a[:2]) is None and "not this server's" in (plain.why_unusable() or "")
    with pytest.raises(ValueError, match="every namespace"):
        KeyIndexWriter(memoryview(bytearray(size)), MIN_SLOTS, fingerprints=mine)
    for bad in ({"team-a": "zz"}, {"team-a": 3}, {"team-a": ""}, ["team-a"]):
        assert KeyedFingerprints.from_wire(bad) is None
    r.close()
    plain.close()
    w.release()


def test_remembered_fingerprints_equal_computed_ones_and_the_memo_stays_bounded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from maru.pool import fingerprints as F

    monkeypatch.setattr(F, "MEMO_KEYS", 8)
    plain = F.PlainFingerprints()
    keyed = KeyedFingerprints({"a": b"s" * 16})
    keys = [f"a/kv1/{i:032x}" for i in range(20)]
    for _ in range(2):  # computed, then remembered: the same values
        assert [plain.of(k) for k in keys] == [fingerprint(k) for k in keys]
        assert [keyed.of(k) for k in keys] == [fingerprint(k, b"s" * 16) for k in keys]
    assert len(plain._memo) <= 8 and len(keyed._memo) <= 8
    # A key of a namespace without a secret has no fingerprint, and none is remembered for it.
    assert keyed.of("b/kv1/00") is None and "b/kv1/00" not in keyed._memo
