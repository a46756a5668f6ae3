"""The key index: which keys are committed, readable in shared memory without asking the server.

Why. vLLM asks the connector, one new request after another on its scheduling thread, how much
of each prompt is stored. Through the server that is an EXISTS round trip per request (0.5-1.5 ms
on loopback, measured on the H200 host and on the CI machine): a step that admits 16 requests
waited 16 such trips before its forward. The server already knows the answer; here it writes it
where every client can read it.

Layout (little-endian u64 words; ``HEADER_BYTES`` then ``slots`` slot words)::

    word 0  magic   "MARUKIX1"
    word 1  nonce   random per server start: a reader from another server's era sees a mismatch
    word 2  seq     even: stable; odd: the server is rebuilding the table (readers ask the server)
    word 3  slots   a power of two
    word 4  state   0 usable, 1 full (too many keys for the table), 2 closed (server stopped)
    word 5  keys    keys in the table (informational)
    word 6  pid     the server's process id (a reader on the same host checks it is alive)
    word 7  beat    counts up every housekeeping turn of the server (a reader anywhere sees it move)

A slot holds 0 (empty), 1 (a deleted key's tombstone) or a key's 64-bit fingerprint (blake2b of
the key, never 0 or 1); open addressing with linear probing from ``fingerprint & (slots - 1)``,
at most ``MAX_PROBE`` slots.

Invariants:

1. **One writer.** Only the server's event loop writes (``KeyIndexWriter``), in the order its
   registry changes: a key committed is in the table before the COMMIT reply leaves, a key
   deleted or evicted is out of it before that reply leaves.
2. **Readers never block the writer and never get a wrong "absent" for a stable key**: a slot
   write is one aligned 8-byte store; a single add or delete changes one slot, and whatever a
   reader sees is the state before or after it. Moving slots (a rebuild) happens only under an
   odd ``seq``; a reader that saw ``seq`` change or odd answers None ("ask the server").
3. **The answer is advisory, like EXISTS.** A key can be evicted a microsecond after either
   says "present"; the load path (LOOKUP with pins) is the authority and handles a miss. A
   64-bit fingerprint collision (~n^2 / 2^65) can only make a key look present, never corrupt
   bytes: loads are by key, and the server's LOOKUP answers for the key itself.

Memory order: x86-64 keeps stores in order and loads in order, which invariant 2 needs; on a
weaker memory model this table would need fences, and Maru targets x86 CXL hosts.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import secrets
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAGIC = int.from_bytes(b"MARUKIX1", "little")
SIDE_SUFFIX = ".keyindex"  # an index beside a pool file: <pool path>.keyindex
HEADER_BYTES = 64
EMPTY, TOMBSTONE = 0, 1
MAX_PROBE = 256
STATE_OK, STATE_FULL, STATE_CLOSED = 0, 1, 2
MIN_SLOTS = 4096
MAX_SLOTS = 1 << 22  # 32 MiB of table
# Keep the table at most this full (keys plus tombstones): linear probing stays short.
MAX_LOAD = 0.75

_W_MAGIC, _W_NONCE, _W_SEQ, _W_SLOTS, _W_STATE, _W_KEYS, _W_PID, _W_BEAT = range(8)


def fingerprint(key: str) -> int:
    """The 64-bit fingerprint a key is stored under (never EMPTY or TOMBSTONE)."""
    v = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")
    return v if v > TOMBSTONE else v + 2


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

    def to_wire(self) -> dict[str, object]:
        return {
            "path": self.path,
            "offset": self.offset,
            "size": self.size,
            "slots": self.slots,
            "nonce": self.nonce,
            "beat_s": self.beat_s,
            "host": list(self.host),
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

    def __init__(self, buf: memoryview, slots: int, nonce: int | None = None) -> None:
        if slots < 1 or slots & (slots - 1):
            raise ValueError(f"slots must be a power of two, got {slots}")
        if len(buf) < table_bytes(slots):
            raise ValueError(f"the index needs {table_bytes(slots)} bytes, got {len(buf)}")
        self.nonce = secrets.randbits(63) | 1 if nonce is None else nonce
        self.slots = slots
        self._mask = slots - 1
        self._h = buf[:HEADER_BYTES].cast("Q")
        self._s = buf[HEADER_BYTES : table_bytes(slots)].cast("Q")
        self._fps: dict[int, int] = {}  # fingerprint -> keys with it (collisions are counted)
        self._tombstones = 0
        self._released = False
        self.rebuilds = 0
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
        self._h[_W_MAGIC] = MAGIC
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
        fp = fingerprint(key)
        n = self._fps.get(fp, 0)
        self._fps[fp] = n + 1
        if n == 0 and self.state == STATE_OK:
            self._place(fp)
            self._h[_W_KEYS] = len(self._fps)
            if len(self._fps) + self._tombstones > MAX_LOAD * self.slots:
                self._rebuild()

    def discard(self, key: str) -> None:
        if self._released:
            return
        fp = fingerprint(key)
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
                self._s[i] = TOMBSTONE
                self._tombstones += 1
            self._h[_W_KEYS] = len(self._fps)
        elif self.state == STATE_FULL and len(self._fps) < MAX_LOAD * self.slots / 2:
            self._rebuild()  # room again: usable once every key is placed

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
        spot = None
        for _ in range(MAX_PROBE):
            v = self._s[i]
            if v == EMPTY:
                if spot is None:
                    spot = i
                break
            if v == TOMBSTONE and spot is None:
                spot = i
            i = (i + 1) & self._mask
        if spot is None:  # a probe run as long as readers look: readers must ask the server
            self._h[_W_STATE] = STATE_FULL
            return
        if self._s[spot] == TOMBSTONE:
            self._tombstones -= 1
        self._s[spot] = fp

    def _rebuild(self) -> None:
        """Re-place every key without tombstones (invariant 2: under an odd ``seq``)."""
        self.rebuilds += 1
        seq = int(self._h[_W_SEQ])
        self._h[_W_SEQ] = seq + 1
        self._s[:] = memoryview(bytes(8 * self.slots)).cast("Q")
        self._tombstones = 0
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

    def __init__(self, place: IndexPlace, pool: mmap.mmap | None = None, path: str | None = None) -> None:
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
        if h[_W_MAGIC] != MAGIC or h[_W_NONCE] != self.nonce:
            return "the index at that place is not this server's (the server restarted)"
        state = h[_W_STATE]
        if state == STATE_FULL:
            return "the server's key index is full (more keys than its slots)"
        if state == STATE_CLOSED:
            return "the server closed its key index (it stopped)"
        return None

    def contains_many(self, keys: Sequence[str]) -> list[bool] | None:
        """Per key, whether it is committed; None when the table cannot answer (ask the server)."""
        h, s, mask = self._h, self._s, self._mask
        seq = h[_W_SEQ]
        if seq & 1 or h[_W_STATE] != STATE_OK or h[_W_NONCE] != self.nonce or h[_W_MAGIC] != MAGIC:
            return None
        out = []
        for k in keys:
            fp = fingerprint(k)
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
                return None
        if h[_W_SEQ] != seq:
            return None
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
