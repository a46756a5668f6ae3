"""The key registry's invariants (see maru/server/registry.py), tried one by one."""

from __future__ import annotations

from maru.pool.allocator import ExtentAllocator
from maru.protocol import CommitResult
from maru.segments import SegmentSums
from maru.server.registry import KeyRegistry

A = 4096


def make(units: int = 8) -> KeyRegistry:
    return KeyRegistry(ExtentAllocator(A, A + units * A, A))


def store(reg: KeyRegistry, key: str, size: int = A, client: str = "w") -> int:
    r = reg.reserve(client, size)
    assert r is not None, f"no room for {key}"
    assert reg.commit(client, key, r.alloc_id) is CommitResult.STORED
    return r.offset


def test_a_reserved_key_is_invisible_until_commit() -> None:
    reg = make()
    r = reg.reserve("w", 100)
    assert r is not None
    assert not reg.exists("k") and reg.lookup("k") is None and reg.pin("r", "k") is None
    assert reg.commit("w", "k", r.alloc_id) is CommitResult.STORED
    e = reg.lookup("k")
    assert e is not None and (e.offset, e.size) == (r.offset, 100)


def test_second_commit_of_a_key_reports_present_and_frees_the_duplicate() -> None:
    reg = make()
    first = store(reg, "k")
    used = reg.alloc.used_bytes
    r = reg.reserve("w2", A)
    assert reg.commit("w2", "k", r.alloc_id) is CommitResult.PRESENT
    assert reg.lookup("k").offset == first  # the original stays
    assert reg.alloc.used_bytes == used  # the duplicate's space went back
    assert reg.counters.duplicates == 1


def test_commit_of_another_clients_or_unknown_reservation_is_refused() -> None:
    reg = make()
    r = reg.reserve("a", A)
    assert reg.commit("b", "k", r.alloc_id) is CommitResult.UNKNOWN_ALLOC
    assert reg.commit("a", "k", r.alloc_id + 1) is CommitResult.UNKNOWN_ALLOC
    assert not reg.exists("k")
    assert reg.commit("a", "k", r.alloc_id) is CommitResult.STORED
    assert reg.commit("a", "k2", r.alloc_id) is CommitResult.UNKNOWN_ALLOC  # used up


def test_full_pool_evicts_least_recently_used_first() -> None:
    reg = make(4)
    for k in "abcd":
        store(reg, k)
    reg.lookup("a")  # a is now the most recently used; b is the oldest
    reg.exists("c")
    store(reg, "e")
    assert not reg.exists("b")
    assert all(reg.peek(k) for k in "acde")
    assert reg.lru_keys() == ["d", "a", "c", "e"]


def test_a_pinned_entry_is_never_evicted() -> None:
    reg = make(4)
    for k in "abcd":
        store(reg, k)
    reg.pin("reader", "a")  # oldest, but pinned
    for i in range(10):
        store(reg, f"x{i}")
    assert reg.peek("a") is not None
    assert reg.counters.evictions == 10


def test_reserve_fails_without_evicting_when_only_pinned_entries_fill_the_pool() -> None:
    reg = make(4)
    for k in "abcd":
        store(reg, k)
        reg.pin("r", k)
    assert reg.reserve("w", A) is None
    assert reg.counters.evictions == 0 and reg.entries == 4
    # A reservation that could never fit does not empty the cache either.
    reg.unpin("r", "a")
    assert reg.reserve("w", 3 * A) is None
    assert reg.peek("a") is not None


def test_pins_are_counted_per_client() -> None:
    reg = make(2)
    store(reg, "a")
    store(reg, "b")
    reg.pin("r1", "a")
    reg.pin("r1", "a")
    reg.pin("r2", "a")
    assert reg.unpin("r1", "a") and reg.unpin("r2", "a")
    assert not reg.unpin("r2", "a")  # r2 has no pin left
    store(reg, "c")  # must evict: only b is unpinned
    assert reg.peek("a") is not None and reg.peek("b") is None
    assert reg.unpin("r1", "a")
    assert reg.lru_keys() == ["c", "a"]  # a is evictable again, as the most recently used
    store(reg, "d")
    store(reg, "e")
    assert reg.peek("a") is None and reg.peek("c") is None


def test_delete_hides_a_pinned_key_at_once_and_frees_it_at_the_last_unpin() -> None:
    reg = make(4)
    off = store(reg, "k", 2 * A)
    reg.pin("r", "k")
    assert reg.delete("k")
    assert not reg.exists("k") and reg.lookup("k") is None
    assert reg.alloc.extent_size(off) == 2 * A  # the reader may still be reading
    assert not reg.delete("k")
    # A new commit of the same key is a new object; the reader's old pin stays on the old one.
    new = store(reg, "k", A)
    assert new != off
    assert reg.unpin("r", "k")
    assert reg.alloc.extent_size(off) is None  # freed with the last pin
    assert reg.lookup("k").offset == new


def test_dropping_a_client_frees_its_reservations_and_pins_but_keeps_its_keys() -> None:
    reg = make(8)
    store(reg, "mine", client="gone")
    store(reg, "theirs", client="other")
    reg.reserve("gone", A)
    reg.reserve("gone", A)
    reg.pin("gone", "theirs")
    reg.pin("gone", "theirs")
    reg.pin("gone", "mine")
    reg.pin("other", "mine")
    used = reg.alloc.used_bytes
    assert reg.drop_client("gone") == (2, 3)
    assert reg.alloc.used_bytes == used - 2 * A
    assert reg.peek("mine") and reg.peek("theirs")
    assert reg.peek("theirs").pins == {} and reg.peek("mine").pins == {"other": 1}
    assert not reg.client_has_state("gone")
    assert reg.lru_keys()[-1] == "theirs"  # evictable again


def test_quarantine_keeps_an_expired_clients_space_until_released() -> None:
    reg = make(4)
    store(reg, "theirs", client="other")
    r = reg.reserve("stalled", A)
    reg.pin("stalled", "theirs")
    held = reg.quarantine_client("stalled")
    assert (held.extents, held.nbytes) == (2, 2 * A)
    assert reg.quarantined_bytes == 2 * A and reg.quarantined_extents == 2
    assert not reg.client_has_state("stalled")
    assert reg.commit("stalled", "late", r.alloc_id) is CommitResult.UNKNOWN_ALLOC
    assert not reg.unpin("stalled", "theirs")
    # The pool has 4 units: 2 quarantined; the other 2 go, and nothing evicts or reuses the held ones.
    others = [reg.reserve("y", A) for _ in range(3)]
    assert others[2] is None and {o.offset for o in others[:2]}.isdisjoint(
        {r.offset, reg.peek("theirs").offset}
    )
    assert reg.delete("theirs")  # hidden at once, but its space stays held
    assert reg.reserve("y", A) is None
    size, freed, released = reg.release_quarantine("stalled")
    assert (size.extents, freed, released) == (2, 1, 1)
    assert reg.quarantined_bytes == 0 and reg.quarantined_extents == 0
    assert reg.reserve("y", A) is not None and reg.reserve("y", A) is not None
    reg.alloc.check()


def test_a_second_expiry_adds_to_the_same_quarantine_without_counting_twice() -> None:
    reg = make(4)
    store(reg, "k", client="w")
    reg.pin("c", "k")
    reg.quarantine_client("c")
    reg.pin("c", "k")
    reg.reserve("c", A)
    held = reg.quarantine_client("c")
    assert (held.extents, held.nbytes) == (1, A)  # the entry is held already: only the reservation
    assert reg.quarantined_extents == 2 and reg.peek("k").pinned
    assert reg.release_quarantine("c")[2] == 2
    assert not reg.peek("k").pinned and reg.lru_keys() == ["k"]


def test_committed_checksum_travels_with_the_entry() -> None:
    reg = make(4)
    r = reg.reserve("w", 10)
    reg.commit("w", "k", r.alloc_id, (1 << 64) - 5)
    assert reg.lookup("k").checksum == (1 << 64) - 5
    assert reg.peek("k").segments is None and reg.peek("k").segments_wire is None


class _Puts:
    """A journal that records its puts."""

    def __init__(self) -> None:
        self.puts: list[object] = []

    def put(self, entry: object) -> None:
        self.puts.append(entry)

    def remove(self, key: str) -> None:
        pass

    def discard_puts(self, keys: list[str]) -> None:
        pass


def test_committed_segment_sums_travel_with_the_entry_and_its_journal_put() -> None:
    journal = _Puts()
    reg = KeyRegistry(ExtentAllocator(A, 5 * A, A), journal)
    seg = SegmentSums(16, (1, (1 << 64) - 1, 3))
    r = reg.reserve("w", 10)
    reg.commit("w", "k", r.alloc_id, seg.checksum(10), seg)
    e = reg.peek("k")
    assert e.segments == seg and e.segments_wire == seg.to_wire()
    assert journal.puts == [e] and (e.key, e.size, e.checksum) == ("k", 10, seg.checksum(10))


def test_load_restores_entries_in_lru_order() -> None:
    alloc, rejected = ExtentAllocator.from_used(A, 5 * A, A, [(A, 10), (2 * A, 10), (3 * A, 10)])
    reg = KeyRegistry(alloc)
    seg = SegmentSums(4, (5, 6, 7))
    reg.load([("x", A, 10, 30, None, None), ("y", 2 * A, 10, 10, 7, seg), ("z", 3 * A, 10, 20, None, None)])
    assert reg.peek("y").checksum == 7 and reg.peek("y").segments == seg and reg.peek("x").segments is None
    assert reg.lru_keys() == ["y", "z", "x"]
    store(reg, "n")
    store(reg, "m")  # the pool has 4 units: evicts y
    assert reg.peek("y") is None and reg.peek("x") is not None


def test_random_operations_keep_every_invariant() -> None:
    """A random mix of every operation, checked against a simple model after each step."""
    import random

    rng = random.Random(11)
    reg = make(24)  # smaller than 40 keys need: reservations must evict
    clients = ["c0", "c1", "c2"]
    reservations: dict[int, tuple[str, int]] = {}  # alloc_id -> (client, size)
    pins: dict[tuple[str, str], int] = {}  # (client, key) -> count, on the visible entry only
    deleted_pinned = 0
    for step in range(5000):
        op = rng.choice(["reserve", "commit", "abort", "pin", "unpin", "delete", "lookup", "drop"])
        c = rng.choice(clients)
        key = f"k{rng.randrange(40)}"
        if op == "reserve":
            r = reg.reserve(c, rng.choice([100, 4096, 3 * 4096, 9000]))
            if r is not None:
                reservations[r.alloc_id] = (c, r.size)
        elif op == "commit" and reservations:
            alloc_id = rng.choice(list(reservations))
            owner, _ = reservations[alloc_id]
            result = reg.commit(c, key, alloc_id)
            if owner != c:
                assert result is CommitResult.UNKNOWN_ALLOC
                continue
            del reservations[alloc_id]
            assert result in (CommitResult.STORED, CommitResult.PRESENT)
        elif op == "abort" and reservations:
            alloc_id = rng.choice(list(reservations))
            if reg.abort(c, alloc_id):
                assert reservations.pop(alloc_id)[0] == c
        elif op == "pin":
            if reg.pin(c, key) is not None:
                pins[(c, key)] = pins.get((c, key), 0) + 1
        elif op == "unpin":
            had = pins.get((c, key), 0)  # pins of c on the visible entry (unpin takes those first)
            assert reg.unpin(c, key) or not had
            if had > 1:
                pins[(c, key)] = had - 1
            elif had == 1:
                del pins[(c, key)]
        elif op == "delete":
            e = reg.peek(key)
            assert reg.delete(key) == (e is not None)
            if e is not None and e.pins:
                deleted_pinned += 1
            for ck in [ck for ck in pins if ck[1] == key]:
                del pins[ck]
        elif op == "lookup":
            reg.lookup(key)
        elif op == "drop":
            reg.drop_client(c)
            reservations = {a: v for a, v in reservations.items() if v[0] != c}
            pins = {ck: n for ck, n in pins.items() if ck[0] != c}
        # Invariants after every step.
        reg.alloc.check()
        for (pc, pk), n in pins.items():
            e = reg.peek(pk)
            assert e is not None, f"step {step}: pinned key {pk} vanished"
            assert e.pins.get(pc) == n
        assert reg.reservations == len(reservations)
        assert reg.reserved_bytes == sum(reg.alloc.round_up(s) for _, s in reservations.values())
        visible = [reg.peek(f"k{i}") for i in range(40)]
        visible_bytes = sum(reg.alloc.round_up(e.size) for e in visible if e is not None)
        assert reg.committed_bytes >= visible_bytes  # the rest: deleted entries still pinned
        assert set(reg.lru_keys()) == {e.key for e in visible if e is not None and not e.pins}
    for c in clients:
        reg.drop_client(c)
    for i in range(40):
        reg.delete(f"k{i}")
    reg.alloc.check()
    assert reg.alloc.used_bytes == 0 and reg.alloc.largest_free == reg.alloc.capacity
    assert deleted_pinned > 0 and reg.counters.evictions > 0  # it exercised delete-while-pinned and eviction


def test_uncommit_gives_the_reservation_back_and_hides_the_key() -> None:
    reg = make()
    r = reg.reserve("w", 100)
    used, reserved = reg.alloc.used_bytes, reg.reserved_bytes
    assert reg.commit("w", "k", r.alloc_id) is CommitResult.STORED
    reg.uncommit("w", "k", r.alloc_id)
    assert not reg.exists("k") and reg.entries == 0 and reg.evictable_bytes == 0 and reg.counters.stores == 0
    assert (reg.alloc.used_bytes, reg.reserved_bytes, reg.reservations) == (used, reserved, 1)
    assert reg.commit("x", "k", r.alloc_id) is CommitResult.UNKNOWN_ALLOC  # still w's, not anyone's
    assert reg.commit("w", "k", r.alloc_id) is CommitResult.STORED  # the same reservation commits again
    assert reg.lookup("k").offset == r.offset
