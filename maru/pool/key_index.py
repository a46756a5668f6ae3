"""The key index: which keys are committed, readable in shared memory without asking the server.

Why. vLLM asks the connector, one new request after another on its scheduling thread, how much
of each prompt is stored. Through the server that is an EXISTS round trip per request (0.5-1.5 ms
on loopback, measured on the H200 host and on the CI machine): a step that admits 16 requests
waited 16 such trips before its forward. The server already knows the answer; here it writes it
where every client can read it.

Layout (little-endian u64 words; ``HEADER_BYTES`` then ``slots`` slot words)::

    word 0  magic   "MARUKIX1" (fingerprints anyone can compute) or "MARUKIK1" (keyed per namespace)
    word 1  nonce   random per server start: a reader from another server's era sees a mismatch
    word 2  seq     even: stable; odd: the server is moving slots (a delete's shift, a rebuild)
    word 3  slots   a power of two
    word 4  state   0 usable, 1 full (too many keys for the table), 2 closed (server stopped)
    word 5  keys    keys in the table (informational)
    word 6  pid     the server's process id (a reader on the same host checks it is alive)
    word 7  beat    counts up every housekeeping turn of the server (a reader anywhere sees it move)

A slot holds 0 (empty) or a key's 64-bit fingerprint (blake2b of the key, never 0 or 1: 1 marked
a deleted key in the first version of this table); open addressing with
linear probing from ``fingerprint & (slots - 1)``, at most ``MAX_PROBE`` slots. A delete shifts
the keys after it back (Knuth's algorithm R), so there are no tombstones and no periodic
rebuild: the table never needs to stop answering to clean itself up.

Invariants:

1. **One writer.** Only the server's event loop writes (``KeyIndexWriter``), in the order its
   registry changes: a key committed is in the table before the COMMIT reply leaves, a key
   deleted or evicted is out of it before that reply leaves.
2. **Readers never block the writer and never get a wrong "absent" for a stable key**: a slot
   write is one aligned 8-byte store; an add changes one slot, and whatever a reader sees is the
   state before or after it. Moving slots (a delete's backward shift, a rebuild) happens only
   under an odd ``seq``; a reader that saw ``seq`` change or odd reads again (a shift is a few
   slot writes) and, after ``READ_TRIES``, answers None ("ask the server").
3. **The answer is advisory, like EXISTS.** A key can be evicted a microsecond after either
   says "present"; the load path (LOOKUP with pins) is the authority and handles a miss. A
   64-bit fingerprint collision (~n^2 / 2^65) can only make a key look present, never corrupt
   bytes: loads are by key, and the server's LOOKUP answers for the key itself.

Fingerprints: plain, or keyed per namespace under ``--tenants`` (``maru.pool.fingerprints``).

Memory order: x86-64 keeps stores in order and loads in order, which invariant 2 needs; on a
weaker memory model this table would need fences, and Maru targets x86 CXL hosts.
"""

from __future__ import annotations

import mmap
import os
import secrets
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from maru.pool.fingerprints import (
    EMPTY,
    Fingerprints,
    KeyedFingerprints,
    PlainFingerprints,
)

SIDE_SUFFIX = ".keyindex"  # an index beside a pool file: <pool path>.keyindex
HEADER_BYTES = 64
MAX_PROBE = 256
READ_TRIES = 8  # reads a reader makes while deletes move slots under it, before asking the server
SHIFT_WAIT_S = 0.0005  # how long a reader waits, in all, for shifts under way to end
STATE_OK, STATE_FULL, STATE_CLOSED = 0, 1, 2
MIN_SLOTS = 4096
MAX_SLOTS = 1 << 22  # 32 MiB of table
# Keep the table at most this full: linear probing stays short.
MAX_LOAD = 0.75

_MOVED = object()  # a read that slots moved under: read again

_W_MAGIC, _W_NONCE, _W_SEQ, _W_SLOTS, _W_STATE, _W_KEYS, _W_PID, _W_BEAT = range(8)


def slots_for(data_size: int, alignment: int) -> int:
    """Slots for a pool: room for twice the most objects it can hold, within [MIN, MAX]_SLOTS."""
    most_objects = max(1, data_size // max(1, alignment))
    want = 1 << (2 * most_objects - 1).bit_length()
    return max(MIN_SLOTS, min(MAX_SLOTS, want))


def table_bytes(slots: int) -> int:
    return HEADER_BYTES + 8 * slots


@dataclass(frozen=True)
class IndexPlace:
    """Where a server's index lives: ``size`` bytes at ``offset`` of ``path`` (None: the pool's own
    path, for an index in the header unit of the pool). Sent to clients in the handshake."""

    path: str | None
    offset: int
    size: int
    slots: int
    nonce: int
    beat_s: float = 1.0  # the server beats at least this often
    host: tuple[str, str] = ("", "")  # the server's (boot id, pid namespace): same host, same pids
    keyed: bool = False  # fingerprints keyed per namespace (the handshake carries the secrets)

    def to_wire(self) -> dict[str, object]:
        return {
            "path": self.path,
            "offset": self.offset,
            "size": self.size,
            "slots": self.slots,
            "nonce": self.nonce,
            "beat_s": self.beat_s,
            "host": list(self.host),
            "keyed": self.keyed,
        }

    @classmethod
    def from_wire(cls, d: object) -> IndexPlace | None:
        """None for anything that is not a well-formed place (an older server sends nothing)."""
        if not isinstance(d, dict):
            return None
        try:
            path = d.get("path")
            place = cls(
                path if path is None else str(path),
                int(d["offset"]),
                int(d["size"]),
                int(d["slots"]),
                int(d["nonce"]),
                float(d.get("beat_s", 1.0)),
                tuple(str(x) for x in d.get("host", ("", ""))),  # type: ignore[arg-type]
                d.get("keyed", False) is True,
            )
        except (KeyError, TypeError, ValueError):
            return None
        if len(place.host) != 2 or not 0 < place.beat_s < 3600:
            return None
        s = place.slots
        if s < 1 or s & (s - 1) or place.size < table_bytes(s) or place.offset < 0:
            return None
        return place


class KeyIndexWriter:
    """The server's side: adds and removes keys (invariant 1: called from the event loop only)."""

    def __init__(
        self, buf: memoryview, slots: int, nonce: int | None = None, fingerprints: Fingerprints | None = None
    ) -> None:
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        if len(buf) < table_bytes(slots):
            raise ValueError(f"the index needs {table_bytes(slots)} bytes, got {len(buf)}")
        self.nonce = secrets.randbits(63) | 1 if nonce is None else nonce
        self.fingerprints = fingerprints or PlainFingerprints()
        if not self.fingerprints.complete:
            raise ValueError("the writer's fingerprints must cover every namespace (a fallback secret)")
        self.slots = slots
        self._mask = slots - 1
        self._h = buf[:HEADER_BYTES].cast("Q")
        self._s = buf[HEADER_BYTES : table_bytes(slots)].cast("Q")
        self._fps: dict[int, int] = {}  # fingerprint -> keys with it (collisions are counted)
        self._released = False
        self.rebuilds = 0
        self.shifts = 0  # deletes that moved slots under an odd seq (readers may have read again)
        # Empty table, then the header: a reader that sees the magic sees a consistent table.
        self._h[_W_SEQ] = 1
        self._s[:] = memoryview(bytes(8 * slots)).cast("Q")
        for w, v in (
            (_W_NONCE, self.nonce),
            (_W_SLOTS, slots),
            (_W_STATE, STATE_OK),
            (_W_KEYS, 0),
            (_W_PID, os.getpid()),
        ):
            self._h[w] = v
        self._h[_W_MAGIC] = self.fingerprints.magic
        self._h[_W_SEQ] = 2

    @property
    def state(self) -> int:
        return int(self._h[_W_STATE])

    @property
    def keys(self) -> int:
        """Distinct fingerprints held (a collision counts once). ``len`` of a dict is one read,
        so the metrics thread may ask while the event loop changes the table."""
        return len(self._fps)

    def add_many(self, keys: Iterable[str]) -> None:
        for k in keys:
            self.add(k)

    def add(self, key: str) -> None:
        if self._released:
            return
        fp = self._fp(key)
        n = self._fps.get(fp, 0)
        self._fps[fp] = n + 1
        if n == 0 and self.state == STATE_OK:
            if len(self._fps) > MAX_LOAD * self.slots:
                self._h[_W_STATE] = STATE_FULL  # readers ask the server until deletes make room
            else:
                self._place(fp)
            self._h[_W_KEYS] = len(self._fps)

    def discard(self, key: str) -> None:
        if self._released:
            return
        fp = self._fp(key)
        n = self._fps.get(fp, 0)
        if n == 0:
            return
        if n > 1:
            self._fps[fp] = n - 1
            return
        del self._fps[fp]
        if self.state == STATE_OK:
            i = self._find(fp)
            if i is not None:
                self._delete_at(i)
            self._h[_W_KEYS] = len(self._fps)
        elif self.state == STATE_FULL and len(self._fps) < MAX_LOAD * self.slots / 2:
            self._rebuild()  # room again: usable once every key is placed

    def _fp(self, key: str) -> int:
        fp = self.fingerprints.of(key)
        assert fp is not None  # the writer's cover every namespace (checked at construction)
        return fp

    def beat(self) -> None:
        """The server is alive (its housekeeping turn): readers that see this move keep reading."""
        if not self._released:
            self._h[_W_BEAT] = (self._h[_W_BEAT] + 1) & 0xFFFFFFFFFFFFFFFF

    def close(self) -> None:
        """Readers ask the server from now on (the server stops)."""
        if not self._released:
            self._h[_W_STATE] = STATE_CLOSED

    def release(self) -> None:
        """Drop the views of the mapping (so it can be unmapped); later changes are ignored."""
        if not self._released:
            self._released = True
            self._h.release()
            self._s.release()

    def _find(self, fp: int) -> int | None:
        i = fp & self._mask
        for _ in range(MAX_PROBE):
            v = self._s[i]
            if v == fp:
                return i
            if v == EMPTY:
                return None
            i = (i + 1) & self._mask
        return None

    def _place(self, fp: int) -> None:
        i = fp & self._mask
        for _ in range(MAX_PROBE):
            if self._s[i] == EMPTY:
                self._s[i] = fp
                return
            i = (i + 1) & self._mask
        # A probe run as long as readers look: readers must ask the server.
        self._h[_W_STATE] = STATE_FULL

    def _delete_at(self, hole: int) -> None:
        """Empty slot ``hole`` and shift back every later key of its run whose home slot does not
        lie between the hole and where it sits, so that every key stays reachable from its home
        without crossing an empty slot (invariant 2: under an odd ``seq``)."""
        s, mask = self._s, self._mask
        if s[(hole + 1) & mask] == EMPTY:  # the end of its run: one slot write, nothing moves
            s[hole] = EMPTY
            return
        seq = int(self._h[_W_SEQ])
        self._h[_W_SEQ] = seq + 1
        self.shifts += 1
        j = hole
        while True:
            j = (j + 1) & mask
            v = s[j]
            if v == EMPTY:
                break
            home = v & mask
            # v may stay at j when its home lies cyclically in (hole, j]: its probe from there
            # reaches j without passing the hole.
            if (j - home) & mask < (j - hole) & mask:
                continue
            s[hole] = v
            hole = j
        s[hole] = EMPTY
        self._h[_W_SEQ] = seq + 2

    def _rebuild(self) -> None:
        """Re-place every key, once a full table has room again (invariant 2: under an odd
        ``seq``). The loop answers nothing meanwhile (0.7 s for 1M keys on the CI machine): it
        happens only after the table was full, never in steady churn."""
        self.rebuilds += 1
        seq = int(self._h[_W_SEQ])
        self._h[_W_SEQ] = seq + 1
        self._s[:] = memoryview(bytes(8 * self.slots)).cast("Q")
        self._h[_W_STATE] = STATE_OK
        if len(self._fps) > MAX_LOAD * self.slots:
            self._h[_W_STATE] = STATE_FULL
        else:
            for fp in self._fps:
                self._place(fp)
                if self.state != STATE_OK:
                    break
        self._h[_W_KEYS] = len(self._fps)
        self._h[_W_SEQ] = seq + 2


class KeyIndexReader:
    """A client's side: answers EXISTS from the server's index.

    ``pool`` is the client's own mapping of the whole pool, for an index in its header unit (a DAX
    device maps only in whole alignment units, which that mapping already is); an index in a side
    file is mapped here, read-only.
    """

    def __init__(
        self,
        place: IndexPlace,
        pool: mmap.mmap | None = None,
        path: str | None = None,
        fingerprints: Fingerprints | None = None,
    ) -> None:
        self.fingerprints = fingerprints or PlainFingerprints()
        if place.keyed != isinstance(self.fingerprints, KeyedFingerprints):
            raise ValueError(
                "the server's key index is keyed per namespace and no secrets came with it"
                if place.keyed
                else "keyed fingerprints for a plain key index"
            )
        self._mm: mmap.mmap | None = None
        if pool is not None:
            view = memoryview(pool)[place.offset :]
        else:
            if path is None:
                raise ValueError("a key index needs the pool's mapping or its side file's path")
            page = mmap.ALLOCATIONGRANULARITY
            start = place.offset - place.offset % page
            fd = os.open(path, os.O_RDONLY)
            try:
                self._mm = mmap.mmap(
                    fd, place.offset - start + place.size, mmap.MAP_SHARED, mmap.PROT_READ, offset=start
                )
            finally:
                os.close(fd)
            view = memoryview(self._mm)[place.offset - start :]
        if len(view) < table_bytes(place.slots):
            raise ValueError(
                f"the key index needs {table_bytes(place.slots)} bytes, the mapping has {len(view)}"
            )
        self.place = place
        self.nonce = place.nonce
        self._mask = place.slots - 1
        self._h = view[:HEADER_BYTES].cast("Q")
        self._s = view[HEADER_BYTES : table_bytes(place.slots)].cast("Q")

    @property
    def server_pid(self) -> int:
        return int(self._h[_W_PID])

    @property
    def beat(self) -> int:
        return int(self._h[_W_BEAT])

    def why_unusable(self) -> str | None:
        """None when the table can answer now; else why not (for the announcement)."""
        h = self._h
        if h[_W_MAGIC] != self.fingerprints.magic or h[_W_NONCE] != self.nonce:
            return "the index at that place is not this server's (the server restarted)"
        state = h[_W_STATE]
        if state == STATE_FULL:
            return "the server's key index is full (more keys than its slots)"
        if state == STATE_CLOSED:
            return "the server closed its key index (it stopped)"
        return None

    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        """Per key, whether it is committed; None when the table cannot answer (ask the server).

        A read that a delete's shift overlapped (``seq`` moved) is made again, up to
        ``READ_TRIES`` times in all."""
        of = self.fingerprints.of
        fps = [of(k) for k in keys]
        if None in fps:
            return None  # a namespace this client holds no secret for: the server checks the right
        deadline = None
        for _ in range(READ_TRIES):
            got = self._read(fps)
            if got is not _MOVED:
                return got  # type: ignore[return-value]
            # A shift is a few slot writes: wait for the writer to finish it (seq even again)
            # rather than spin through the tries while it is still under way.
            deadline = deadline or time.perf_counter() + SHIFT_WAIT_S
            while self._h[_W_SEQ] & 1:
                if time.perf_counter() > deadline:
                    return None  # the server is stuck mid-shift (descheduled): ask it
        return None

    def _read(self, fps: list[int]) -> list[bool] | None | object:
        h, s, mask = self._h, self._s, self._mask
        seq = h[_W_SEQ]
        if h[_W_STATE] != STATE_OK or h[_W_NONCE] != self.nonce or h[_W_MAGIC] != self.fingerprints.magic:
            return None
        if seq & 1:
            return _MOVED
        out = []
        for fp in fps:
            i = fp & mask
            for _ in range(MAX_PROBE):
                v = s[i]
                if v == fp:
                    out.append(True)
                    break
                if v == EMPTY:
                    out.append(False)
                    break
                i = (i + 1) & mask
            else:
                # The writer places a key within MAX_PROBE slots of its home or turns the table
                # off, and a shift only moves keys nearer home: not within them, not there.
                out.append(False)
        if h[_W_SEQ] != seq:
            return _MOVED
        return out

    def close(self) -> None:
        """Drop the views (the pool's mapping can then be unmapped) and a side file's mapping."""
        try:
            self._h.release()
            self._s.release()
            if self._mm is not None:
                self._mm.close()
        except (BufferError, ValueError):
            pass  # a view still in use: the mapping goes with the object
