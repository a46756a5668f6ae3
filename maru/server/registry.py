"""The key registry: which key names which bytes of the pool, who is writing, who is reading.

Invariants (each is a promise the tests try to break):

1. **Write-once keys.** A key, once committed, names the same ``(offset, size)`` until it is
   deleted or evicted. A second commit of a visible key does not replace it: the duplicate's
   space is freed and the commit reports ``"present"``.
2. **Visible only after commit.** A reservation (RESERVE) is private to the client that made it;
   no LOOKUP or EXISTS sees its key until COMMIT. A visible key therefore means complete bytes.
3. **Pins are per client and counted.** Each PIN (or pinning LOOKUP) adds one to the client's count
   on that entry; UNPIN takes one away. An entry with any pin is never evicted and its space is
   never freed.
4. **LRU eviction of unpinned entries.** When a reservation does not fit, entries that are visible
   and unpinned are evicted from least to most recently used until it fits or none are left (then
   that reservation is None). LOOKUP, EXISTS and COMMIT count as use.
5. **DELETE hides at once, frees last.** A deleted key is invisible immediately; its space is freed
   when its last pin goes (at once when it has none).
6. **Leases own reservations and pins, not keys.** ``drop_client`` frees the client's
   reservations and releases its pins; the keys it committed stay.
7. **Quarantine: space a silent holder may still touch is never reused.** ``quarantine_client``
   (lease expiry) takes the client's reservations and pins away from it (it can no longer commit
   or unpin) but keeps their extents allocated and their entries pinned, under a
   ``QuarantineHolder``: nothing is evicted, freed or handed out there until
   ``release_quarantine`` (the server knows the holder is dead, fenced, or timed out).
8. **Checksums travel with entries.** An entry keeps the checksum its writer sent in COMMIT
   (None: the writer sent none) for as long as it lives; the journal persists it. So do its
   segment sums (``maru.segments``; None: none were sent), which the server accepted only if they
   add up to that checksum.

The registry is single-threaded by design (the server's event loop is its only caller). Every
change to the committed set is reported to a ``Journal`` so the server can persist it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from maru.pool.allocator import ExtentAllocator
from maru.protocol import CommitResult
from maru.segments import SegmentSums

ClientId = Hashable


class Journal(Protocol):
    """Where the registry reports changes to committed entries (the server persists them)."""

    def put(self, entry: Entry) -> None:
        """``entry`` was committed (its key, place, tick, checksum and segment sums)."""
        ...

    def remove(self, key: str) -> None: ...

    def discard_puts(self, keys: list[str]) -> None:
        """Forget puts of this request that were undone before they became durable."""
        ...


class NullJournal:
    """A journal that forgets (unit tests, or a server without persistence)."""

    def put(self, entry: Entry) -> None:
        pass

    def remove(self, key: str) -> None:
        pass

    def discard_puts(self, keys: list[str]) -> None:
        pass


@dataclass(eq=False)
class Entry:
    """A committed object. Identity (not the key) names it: a deleted entry can outlive its key."""

    key: str
    offset: int
    size: int
    tick: int = 0
    pins: dict[ClientId, int] = field(default_factory=dict)
    visible: bool = True
    checksum: int | None = None  # maru.checksum of the bytes, from the writer's COMMIT
    # The segment sums, from the writer's COMMIT, kept in their wire form ``[tokens, bytes]``: about
    # 550 bytes for 64 segments where a ``SegmentSums`` of Python ints takes about 3 KB, and LOOKUP
    # sends it as it is. Only ever set from a valid ``SegmentSums`` (``with_segments``).
    segments_wire: list[Any] | None = field(default=None, repr=False)

    @property
    def pinned(self) -> bool:
        return bool(self.pins)

    @property
    def segments(self) -> SegmentSums | None:
        """The committed segment sums (decoded on each call; LOOKUP uses ``segments_wire``)."""
        return None if self.segments_wire is None else SegmentSums.from_wire(self.segments_wire)

    def with_segments(self, segments: SegmentSums | None) -> Entry:
        """Keep ``segments`` (in their wire form) with this entry; returns the entry."""
        self.segments_wire = None if segments is None else segments.to_wire()
        return self


@dataclass(frozen=True)
class Reservation:
    alloc_id: int
    client: ClientId
    offset: int
    size: int


@dataclass(frozen=True)
class QuarantineHolder:
    """Holds the reservations and pins of a client whose lease expired (see invariant 7)."""

    client: ClientId


@dataclass(frozen=True)
class QuarantineSize:
    """What one quarantine holds: extents (reservations plus pinned entries) and their aligned bytes."""

    extents: int
    nbytes: int


@dataclass
class RegistryCounters:
    stores: int = 0
    duplicates: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    bytes_stored: int = 0


class KeyRegistry:
    """Keys, reservations and pins over one ``ExtentAllocator`` (see the module docstring)."""

    def __init__(
        self, allocator: ExtentAllocator, journal: Journal | None = None, first_alloc_id: int = 1
    ) -> None:
        self.alloc = allocator
        self.journal: Journal = journal or NullJournal()
        self.counters = RegistryCounters()
        self._entries: dict[str, Entry] = {}  # visible entries only
        self._lru: OrderedDict[str, Entry] = OrderedDict()  # visible AND unpinned, oldest first
        self._lru_bytes = 0  # aligned bytes of entries in _lru (what eviction could free)
        self._reservations: dict[int, Reservation] = {}
        self._client_allocs: dict[ClientId, set[int]] = {}
        self._client_pins: dict[ClientId, dict[str, list[Entry]]] = {}
        self._pinned_entries = 0
        self._reserved_bytes = 0
        self._tick = 0
        self._touched: dict[str, Entry] = {}  # used since the last take_touched (LRU persistence)
        self._next_alloc_id = first_alloc_id
        self._quarantine: dict[ClientId, QuarantineSize] = {}
        # Kept in step with _quarantine so gauges are plain int reads (the metrics thread reads them).
        self._quarantined_extents = 0
        self._quarantined_bytes = 0

    # -- loading (restart) --------------------------------------------------------------------

    def load(self, rows: Iterable[tuple[str, int, int, int, int | None, SegmentSums | None]]) -> None:
        """Install committed entries ``(key, offset, size, tick, checksum, segments)`` whose extents
        the allocator already marks used (``ExtentAllocator.from_used``). LRU order follows the ticks."""
        for key, offset, size, tick, checksum, segments in sorted(rows, key=lambda r: r[3]):
            e = Entry(key, offset, size, tick, checksum=checksum).with_segments(segments)
            self._entries[key] = e
            self._lru[key] = e
            self._lru_bytes += self.alloc.round_up(size)
            self._tick = max(self._tick, tick)

    # -- writers ------------------------------------------------------------------------------

    def reserve(self, client: ClientId, size: int) -> Reservation | None:
        """Reserve ``size`` bytes for ``client``, evicting LRU unpinned entries if needed."""
        offset = self.alloc.allocate(size)
        if offset is None and self.alloc.round_up(size) <= self.alloc.free_bytes + self._lru_bytes:
            # Only evict when eviction could possibly make room; otherwise we would empty the
            # cache and still fail.
            while offset is None and self._lru:
                self._evict_one()
                offset = self.alloc.allocate(size)
        if offset is None:
            return None
        r = Reservation(self._next_alloc_id, client, offset, size)
        self._next_alloc_id += 1
        self._reservations[r.alloc_id] = r
        self._client_allocs.setdefault(client, set()).add(r.alloc_id)
        self._reserved_bytes += self.alloc.round_up(size)
        return r

    def commit(
        self,
        client: ClientId,
        key: str,
        alloc_id: int,
        checksum: int | None = None,
        segments: SegmentSums | None = None,
    ) -> CommitResult:
        """Publish the reservation ``alloc_id`` under ``key`` (write-once; see invariant 1).

        ``checksum`` and ``segments`` go with the entry (invariant 8); the caller checked that the
        segments add up to the checksum (the registry keeps what it is given)."""
        r = self._reservations.get(alloc_id)
        if r is None or r.client != client:
            return CommitResult.UNKNOWN_ALLOC
        self._drop_reservation(r)
        existing = self._entries.get(key)
        if existing is not None:
            self.alloc.free(r.offset)
            self.counters.duplicates += 1
            self._touch(existing)
            return CommitResult.PRESENT
        self._tick += 1
        e = Entry(key, r.offset, r.size, self._tick, checksum=checksum).with_segments(segments)
        self._entries[key] = e
        self._lru[key] = e
        self._lru_bytes += self.alloc.round_up(e.size)
        self.counters.stores += 1
        self.counters.bytes_stored += r.size
        self.journal.put(e)
        return CommitResult.STORED

    def abort(self, client: ClientId, alloc_id: int) -> bool:
        """Free a reservation of ``client``; False if it has no such reservation."""
        r = self._reservations.get(alloc_id)
        if r is None or r.client != client:
            return False
        self._drop_reservation(r)
        self.alloc.free(r.offset)
        return True

    def uncommit(self, client: ClientId, key: str, alloc_id: int) -> None:
        """Undo ``commit(client, key, alloc_id)`` that returned STORED in the current request
        (its change could not be made durable): the entry goes and the reservation is back, same
        id, same extent. Precondition: nothing used the entry since (no pin, no eviction)."""
        e = self._entries.pop(key)
        del self._lru[key]
        self._lru_bytes -= self.alloc.round_up(e.size)
        self._touched.pop(key, None)
        e.visible = False
        self.counters.stores -= 1
        self.counters.bytes_stored -= e.size
        r = Reservation(alloc_id, client, e.offset, e.size)
        self._reservations[alloc_id] = r
        self._client_allocs.setdefault(client, set()).add(alloc_id)
        self._reserved_bytes += self.alloc.round_up(e.size)

    # -- readers ------------------------------------------------------------------------------

    def lookup(self, key: str) -> Entry | None:
        e = self._entries.get(key)
        if e is not None:
            self._touch(e)
        return e

    def exists(self, key: str) -> bool:
        return self.lookup(key) is not None

    def lookup_many(self, keys: list[str]) -> list[Entry | None]:
        """``lookup`` of each key (the hot path of EXISTS and LOOKUP: ``_touch`` inlined)."""
        get = self._entries.get
        found = [get(k) for k in keys]
        tick = self._tick
        move = self._lru.move_to_end
        touched = self._touched
        for e in found:
            if e is not None:
                tick += 1
                e.tick = tick
                if not e.pins:
                    move(e.key)
                touched[e.key] = e
        self._tick = tick
        return found

    def take_touched(self) -> list[tuple[str, int]]:
        """``(key, tick)`` of visible entries used since the last call (to persist the LRU order)."""
        touched, self._touched = self._touched, {}
        return [(k, e.tick) for k, e in touched.items() if e.visible]

    def peek(self, key: str) -> Entry | None:
        """The visible entry of ``key`` without counting as a use (no LRU change)."""
        return self._entries.get(key)

    def pin(self, client: ClientId, key: str) -> Entry | None:
        """Add one pin of ``client`` on the visible entry of ``key``; None if there is none."""
        e = self._entries.get(key)
        if e is None:
            return None
        self._touch(e)
        if not e.pins:
            self._lru.pop(key, None)
            self._lru_bytes -= self.alloc.round_up(e.size)
            self._pinned_entries += 1
        e.pins[client] = e.pins.get(client, 0) + 1
        held = self._client_pins.setdefault(client, {}).setdefault(key, [])
        if e not in held:
            held.append(e)
        return e

    def pin_count(self, client: ClientId) -> int:
        """How many pins ``client`` holds now, over every entry (a key pinned twice counts twice)."""
        return sum(e.pins.get(client, 0) for held in self._client_pins.get(client, {}).values() for e in held)

    def unpin(self, client: ClientId, key: str) -> bool:
        """Take one pin of ``client`` off ``key`` (the visible entry first, else a deleted one)."""
        held = self._client_pins.get(client, {}).get(key)
        if not held:
            return False
        visible = self._entries.get(key)
        e = visible if visible in held else held[-1]
        self._release_pin(client, e, 1)
        return True

    def delete(self, key: str) -> bool:
        """Hide ``key`` now; free its space now if unpinned, else when the last pin goes."""
        e = self._entries.pop(key, None)
        if e is None:
            return False
        e.visible = False
        self.journal.remove(key)
        if e.pins:
            return True
        self._lru.pop(key, None)
        self._lru_bytes -= self.alloc.round_up(e.size)
        self.alloc.free(e.offset)
        return True

    # -- leases -------------------------------------------------------------------------------

    def drop_client(self, client: ClientId) -> tuple[int, int]:
        """Free every reservation and release every pin of ``client`` (its lease expired).

        Returns ``(reservations_freed, pins_released)``; committed keys stay.
        """
        freed = 0
        for alloc_id in list(self._client_allocs.get(client, ())):
            if self.abort(client, alloc_id):
                freed += 1
        self._client_allocs.pop(client, None)
        released = 0
        for entries in list(self._client_pins.get(client, {}).values()):
            for e in list(entries):
                n = e.pins.get(client, 0)
                released += n
                self._release_pin(client, e, n)
        self._client_pins.pop(client, None)
        return freed, released

    def quarantine_client(self, client: ClientId) -> QuarantineSize:
        """Take every reservation and pin of ``client`` away from it, keeping their space (invariant 7).

        Afterwards ``client`` has no state here (its commits get ``unknown_alloc``, its unpins
        do nothing) and the extents stay allocated under ``QuarantineHolder(client)`` until
        ``release_quarantine(client)``. Returns what this call added to the quarantine.
        """
        holder = QuarantineHolder(client)
        extents = nbytes = 0
        for alloc_id in list(self._client_allocs.get(client, ())):
            r = self._reservations[alloc_id]
            self._drop_reservation(r)
            moved = Reservation(r.alloc_id, holder, r.offset, r.size)
            self._reservations[alloc_id] = moved
            self._client_allocs.setdefault(holder, set()).add(alloc_id)
            self._reserved_bytes += self.alloc.round_up(r.size)
            extents += 1
            nbytes += self.alloc.round_up(r.size)
        held = self._client_pins.pop(client, {})
        into = self._client_pins.setdefault(holder, {}) if held else None
        for key, entries in held.items():
            for e in entries:
                n = e.pins.pop(client, 0)
                if not n:
                    continue
                # The entry stays pinned (out of the LRU, never freed): only the holder changes.
                if holder not in e.pins:
                    extents += 1
                    nbytes += self.alloc.round_up(e.size)
                e.pins[holder] = e.pins.get(holder, 0) + n
                lst = into.setdefault(key, [])  # type: ignore[union-attr]
                if e not in lst:
                    lst.append(e)
        if extents:
            old = self._quarantine.get(client, QuarantineSize(0, 0))
            self._quarantine[client] = QuarantineSize(old.extents + extents, old.nbytes + nbytes)
            self._quarantined_extents += extents
            self._quarantined_bytes += nbytes
        return QuarantineSize(extents, nbytes)

    def release_quarantine(self, client: ClientId) -> tuple[QuarantineSize, int, int]:
        """Free what ``quarantine_client(client)`` kept. Returns ``(what it held,
        reservations_freed, pins_released)``."""
        size = self._quarantine.pop(client, None)
        if size is None:
            return QuarantineSize(0, 0), 0, 0
        freed, released = self.drop_client(QuarantineHolder(client))
        self._quarantined_extents -= size.extents
        self._quarantined_bytes -= size.nbytes
        return size, freed, released

    def quarantined_clients(self) -> list[ClientId]:
        """Clients whose space is in quarantine now."""
        return list(self._quarantine)

    def reservation(self, alloc_id: int) -> Reservation | None:
        """The live reservation ``alloc_id`` (whoever owns it), or None."""
        return self._reservations.get(alloc_id)

    def reserved_bytes_of(self, owns: Callable[[ClientId], bool]) -> int:
        """Pool bytes reserved by the clients for which ``owns(client)`` is true."""
        total = 0
        for client, ids in self._client_allocs.items():
            if owns(client):
                total += sum(self.alloc.round_up(self._reservations[a].size) for a in ids)
        return total

    def client_has_state(self, client: ClientId) -> bool:
        return bool(self._client_allocs.get(client)) or bool(self._client_pins.get(client))

    # -- gauges -------------------------------------------------------------------------------

    @property
    def entries(self) -> int:
        return len(self._entries)

    @property
    def pinned_entries(self) -> int:
        """Entries (visible or deleted) with at least one pin."""
        return self._pinned_entries

    @property
    def reservations(self) -> int:
        return len(self._reservations)

    @property
    def reserved_bytes(self) -> int:
        return self._reserved_bytes

    @property
    def committed_bytes(self) -> int:
        return self.alloc.used_bytes - self._reserved_bytes

    @property
    def quarantined_bytes(self) -> int:
        """Aligned bytes held for clients whose lease expired (invariant 7); never reused until released."""
        return self._quarantined_bytes

    @property
    def quarantined_extents(self) -> int:
        return self._quarantined_extents

    @property
    def evictable_bytes(self) -> int:
        return self._lru_bytes

    def lru_keys(self) -> list[str]:
        """Evictable keys, least recently used first (tests and debugging)."""
        return list(self._lru)

    # -- internals ----------------------------------------------------------------------------

    def _touch(self, e: Entry) -> None:
        self._tick = tick = self._tick + 1
        e.tick = tick
        if not e.pins:  # unpinned visible entries are exactly the ones in the LRU order
            self._lru.move_to_end(e.key)
        self._touched[e.key] = e

    def _evict_one(self) -> None:
        key, e = self._lru.popitem(last=False)
        self._lru_bytes -= self.alloc.round_up(e.size)
        del self._entries[key]
        e.visible = False
        self.counters.evictions += 1
        self.counters.evicted_bytes += e.size
        self.alloc.free(e.offset)
        self.journal.remove(key)

    def _drop_reservation(self, r: Reservation) -> None:
        del self._reservations[r.alloc_id]
        allocs = self._client_allocs.get(r.client)
        if allocs is not None:
            allocs.discard(r.alloc_id)
            if not allocs:
                del self._client_allocs[r.client]
        self._reserved_bytes -= self.alloc.round_up(r.size)

    def _release_pin(self, client: ClientId, e: Entry, n: int) -> None:
        left = e.pins.get(client, 0) - n
        if left > 0:
            e.pins[client] = left
            return
        e.pins.pop(client, None)
        held = self._client_pins.get(client)
        if held is not None:
            lst = held.get(e.key)
            if lst is not None and e in lst:
                lst.remove(e)
                if not lst:
                    del held[e.key]
            if not held:
                del self._client_pins[client]
        if e.pins:
            return
        self._pinned_entries -= 1
        if e.visible:
            # Back in the eviction order as most recently used: it was just read.
            self._lru[e.key] = e
            self._lru_bytes += self.alloc.round_up(e.size)
        else:
            self.alloc.free(e.offset)
