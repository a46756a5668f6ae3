"""The server's durable state: SQLite in WAL mode in the state directory.

What is stored: the pool identity (path, uuid, size, data offset, alignment) and every committed
entry (key, offset, size, LRU tick, checksum, segment sums). Schema 2 added the checksum: opening a
schema-1 database drops its entries (loudly): bytes nobody checksummed cannot be vouched for, and a
key kept without one would stay a miss for every verifying reader while writers, seeing it present,
never store it again. The cache refills. Schema 3 added the segment sums (``maru.segments``, a
nullable BLOB: 4-byte little-endian segment tokens, then one little-endian uint64 raw sum per
segment): a schema-2 database keeps its entries, with no segment sums (readers verify those whole).
A blob that does not decode is read as no segment sums (logged once at start). What is not: reservations and pins (volatile by design; a
restart drops them and clients handshake again) and the free map (derived from the entries).

Promise: ``flush`` commits every change buffered since the last flush in one transaction; the
server calls it before it sends the reply of a request that changed the committed set, so a
"stored" the client has seen survives SIGKILL of the server (WAL + synchronous=NORMAL is durable
against a process crash; against power loss the last transactions may be lost).
LRU ticks are buffered separately and written at most every ``TICK_FLUSH_S`` seconds, so reads
never pay for SQL; after a crash the LRU order may be up to that much stale.

A write that fails (disk full, I/O error) raises ``StateWriteError`` and is not durable: the
database is in exclusive locking mode, so its WAL index lives in this process's memory (no -shm
file) and a commit fails only before its commit frame is in the WAL, never after. The store then
reports ``writable`` False and keeps what it could not write buffered; ``recover`` retries (the
server calls it every housekeeping turn) and reports writable again once a write succeeds with
``RESUME_FREE_BYTES`` free on the state filesystem.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from maru.errors import MaruError, PoolError
from maru.pool.backing import PoolInfo
from maru.pool.perms import FileAccess
from maru.segments import SegmentSums
from maru.server.locks import FileLock

if TYPE_CHECKING:  # the registry's entries are what it journals; it never imports this module
    from maru.server.registry import Entry

log = logging.getLogger("maru.server.state")

SCHEMA_VERSION = 3
STATE_FILE = "maru-state.sqlite"
LOCK_FILE = "maru-state.lock"
TICK_FLUSH_S = 1.0
# Writes resume only with this much free space, so a state disk at its last pages does not flap
# between accepting and refusing every other request.
RESUME_FREE_BYTES = 256 << 10
# The WAL may use at most 1/WAL_SHARE of the free space: ``maintain`` lowers SQLite's automatic
# checkpoint (1000 pages by default) to that, and truncates a WAL that is already larger. Without
# it, a small state disk fills up with superseded WAL pages long before with entries.
WAL_SHARE = 4
WAL_TRIM_MIN_BYTES = 64 << 10


class StateWriteError(MaruError):
    """The state database refused a write (disk full or failing); nothing of that write is durable."""


class StateStore:
    """SQLite persistence of the committed entries of one pool (implements ``registry.Journal``).

    Invariant: while ``writable``, nothing is buffered between requests (each request's changes are
    flushed before its reply). After a failed write, ``writable`` is False until ``recover``
    succeeds, and the buffer holds only changes that are applied in memory but not yet durable.
    """

    def __init__(self, state_dir: Path | str, access: FileAccess | None = None) -> None:
        """Open (or create) the state in ``state_dir``; on failure, remove what this call created."""
        self.dir = Path(state_dir)
        self.path = self.dir / STATE_FILE
        self.access = access or FileAccess()
        self.created: list[Path] = []  # what this process created (``remove_created`` deletes it)
        self._puts: dict[str, tuple[int, int, int, int | None, bytes | None]] = {}
        self._removes: set[str] = set()
        self.transactions = 0
        self.changes = 0  # bumped by every put/remove: tells the server a request changed something
        self.writable = True
        self.error = ""  # why the last write failed (while not writable)
        self.lock: FileLock | None = None
        self.db: sqlite3.Connection | None = None  # type: ignore[assignment]
        try:
            self._open()
        except BaseException:
            if self.db is not None:
                self.db.close()
            if self.lock is not None:
                self.lock.close()
            self.remove_created()
            raise

    def _open(self) -> None:
        if not self.dir.exists():
            try:
                self._make_dirs(self.dir)
            except OSError as e:
                raise PoolError(
                    f"cannot create state directory {self.dir}: {e.strerror}; pass --state-dir"
                ) from None
            self.access.apply(str(self.dir), directory=True)
        elif not self.dir.is_dir():
            raise PoolError(f"state directory {self.dir} exists but is not a directory; pass --state-dir")
        # The lock comes before the database: a second server is told who holds the state dir.
        self.lock = FileLock(str(self.dir / LOCK_FILE), "state", create=self.access)
        if self.lock.created:
            self.created.append(self.dir / LOCK_FILE)
        if not self.path.exists():
            self._create_private(self.path)
        try:
            self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            # Exclusive before the first WAL access: the WAL index stays in memory (see the module
            # docstring); the server holds the state lock anyway, so no other process reads this file.
            self.db.execute("PRAGMA locking_mode=EXCLUSIVE")
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, offset INTEGER NOT NULL, "
                "size INTEGER NOT NULL, tick INTEGER NOT NULL, checksum INTEGER, segments BLOB) WITHOUT ROWID"
            )
            self.db.execute("SELECT COUNT(*) FROM meta").fetchone()  # takes the lock, opens the WAL
            self._migrate()
        except sqlite3.Error as e:
            raise PoolError(
                f"cannot open state database {self.path}: {e}; check the state directory and its free space"
            ) from None
        self.page_size = int(self.db.execute("PRAGMA page_size").fetchone()[0])
        self._autocheckpoint = 1000  # SQLite's default; ``maintain`` lowers it on a small disk
        self.maintain()
        # Every start: files an older server (or SQLite's default 0644) left more open get fixed.
        for f in (self.path, Path(f"{self.path}-wal"), Path(f"{self.path}-shm")):
            if f.exists():
                self.access.apply(str(f))

    def _make_dirs(self, d: Path) -> None:
        if not d.parent.exists():
            self._make_dirs(d.parent)
        d.mkdir(mode=0o700)
        self.created.append(d)

    def _create_private(self, path: Path) -> None:
        """Create ``path`` empty with the access mode before SQLite opens it (SQLite would make it
        0644, and gives the -wal file the database file's mode)."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise PoolError(f"cannot create state database {path}: {e.strerror}; check --state-dir") from None
        self.created.append(path)
        try:
            self.access.apply_fd(fd, str(path))
        finally:
            os.close(fd)

    # -- writing ------------------------------------------------------------------------------

    def _transaction(self, body: Callable[[sqlite3.Connection], object]) -> None:
        """Run ``body`` in one transaction; on any failure nothing of it is applied.

        SQLite rolls a transaction back by itself after some errors (disk full, I/O error), so an
        explicit ROLLBACK is issued only while one is still open.
        """
        db = self.db
        db.execute("BEGIN IMMEDIATE")
        try:
            body(db)
            db.execute("COMMIT")
        except BaseException:
            if db.in_transaction:
                try:
                    db.execute("ROLLBACK")
                except sqlite3.Error:
                    log.exception("rolling back a failed state transaction failed")
            raise

    def _write(self, body: Callable[[sqlite3.Connection], object]) -> None:
        """``_transaction``, turning a SQLite failure into ``StateWriteError`` (and not writable)."""
        try:
            self._transaction(body)
        except sqlite3.Error as e:
            if self.writable:
                log.error(
                    "the state database %s cannot take writes: %s; refusing writes until it can (%s free)",
                    self.path,
                    e,
                    self._free_text(),
                )
            self.writable = False
            self.error = str(e)
            raise StateWriteError(self.unwritable_message()) from None

    def unwritable_message(self) -> str:
        return (
            f"the state database {self.path} cannot take writes ({self.error}; {self._free_text()} free "
            f"on its filesystem): writes are refused until it can; free space in {self.dir} (the server "
            "retries by itself); reads and heartbeats keep working"
        )

    def free_bytes(self) -> int:
        try:
            vfs = os.statvfs(self.dir)
        except OSError:
            return 0
        return vfs.f_bavail * vfs.f_frsize

    def _free_text(self) -> str:
        n = self.free_bytes()
        return f"{n >> 10} KiB" if n < 10 << 20 else f"{n >> 20} MiB"

    def _migrate(self) -> None:
        """Bring an older database to ``SCHEMA_VERSION`` (see the module docstring), in one transaction.

        Schema 1 (no checksum column): entries dropped, both columns added. Schema 2 (no segments
        column): the column added, entries kept with NULL segments.
        """
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(entries)")}
        if "checksum" in columns and "segments" in columns:
            return
        n = self.db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        if "checksum" not in columns:
            log.warning(
                "state %s is from before object checksums (schema 1): dropping its %d entries, whose bytes "
                "cannot be verified; the cache refills as clients store again",
                self.path,
                n,
            )
        else:
            log.info(
                "state %s is from before segment sums (schema 2): keeping its %d entries without them "
                "(readers verify those objects whole)",
                self.path,
                n,
            )
        self.db.execute("BEGIN")
        if "checksum" not in columns:
            self.db.execute("DELETE FROM entries")
            self.db.execute("ALTER TABLE entries ADD COLUMN checksum INTEGER")
        self.db.execute("ALTER TABLE entries ADD COLUMN segments BLOB")
        self.db.execute(
            "INSERT OR REPLACE INTO meta (k, v) VALUES ('schema_version', ?)", (str(SCHEMA_VERSION),)
        )
        self.db.execute("COMMIT")

    # -- pool identity ------------------------------------------------------------------------

    def meta(self) -> dict[str, str]:
        return dict(self.db.execute("SELECT k, v FROM meta").fetchall())

    def bind_pool(self, pool: PoolInfo) -> None:
        """Check that this state belongs to ``pool`` (or record it for a fresh state dir).

        A state dir that names another pool is refused, except when the server just created a
        fresh pool file and the pool the state names no longer exists (its bytes are gone, so
        its entries are meaningless): then the stale entries are discarded, loudly.
        """
        meta = self.meta()
        old_uuid = meta.get("pool_uuid")
        if old_uuid is not None and old_uuid != pool.uuid:
            old_path = meta.get("pool_path", "?")
            n = self.db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
            gone = old_path == pool.path or not os.path.exists(old_path)
            if pool.created and gone:
                log.warning(
                    "state dir %s described pool %s (uuid %s), which no longer exists; the new pool %s has "
                    "uuid %s: discarding %d stale entries",
                    self.dir,
                    old_path,
                    old_uuid,
                    pool.path,
                    pool.uuid,
                    n,
                )
                self._start_write(
                    lambda db: (db.execute("DELETE FROM entries"), db.execute("DELETE FROM meta"))
                )
                meta = {}
            else:
                raise PoolError(
                    f"state dir {self.dir} belongs to pool uuid {old_uuid} ({old_path}, {n} entries), but "
                    f"{pool.path} has uuid {pool.uuid}; start with the pool that state belongs to, or use "
                    f"another --state-dir (or delete {self.path})"
                )
        elif old_uuid is not None and int(meta.get("pool_size", -1)) != pool.pool_size:
            raise PoolError(
                f"state dir {self.dir} recorded pool size {meta.get('pool_size')} for uuid {old_uuid}, "
                f"the pool now has {pool.pool_size}; use another --state-dir"
            )
        want = {
            "schema_version": SCHEMA_VERSION,
            "pool_path": pool.path,
            "pool_uuid": pool.uuid,
            "pool_size": pool.pool_size,
            "data_offset": pool.data_offset,
            "alignment": pool.alignment,
        }
        rows = [(k, str(v)) for k, v in want.items() if meta.get(k) != str(v)]
        if rows:  # a restart of the same pool writes nothing, so it works on a full disk
            self._start_write(
                lambda db: db.executemany("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", rows)
            )

    def load_entries(self) -> list[tuple[str, int, int, int, int | None, SegmentSums | None]]:
        """Every committed entry as ``(key, offset, size, tick, checksum, segments)``.

        A segments blob that does not decode (or sits on an entry without a checksum, or does not
        add up to its checksum) loads as None, the entry kept: its readers verify it whole. One
        warning for all of them: a damaged database must not stop the server, nor flood its log.
        """
        rows = self.db.execute("SELECT key, offset, size, tick, checksum, segments FROM entries").fetchall()
        out: list[tuple[str, int, int, int, int | None, SegmentSums | None]] = []
        bad: list[str] = []
        for k, o, s, t, c, blob in rows:
            checksum = _from_sql(c)
            segments = None
            if blob is not None:
                segments = _segments_from_sql(blob)
                if segments is None or checksum is None or not segments.consistent(checksum, s):
                    segments = None
                    bad.append(k)
            out.append((k, o, s, t, checksum, segments))
        if bad:
            log.warning(
                "state %s: the segment sums of %d entries (e.g. key %r) are unreadable or do not add up to "
                "their checksums; those entries are kept without them (readers verify them whole)",
                self.path,
                len(bad),
                bad[0],
            )
        return out

    def drop_entries(self, keys: list[str]) -> None:
        self._start_write(
            lambda db: db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in keys])
        )

    def _start_write(self, body: Callable[[sqlite3.Connection], object]) -> None:
        """A write at start: failure is a start error naming the state database."""
        try:
            self._transaction(body)
        except sqlite3.Error as e:
            raise PoolError(
                f"cannot write the state database {self.path}: {e} ({self._free_text()} free); "
                f"free space in {self.dir} or pass another --state-dir"
            ) from None

    # -- journal ------------------------------------------------------------------------------

    def put(self, entry: Entry) -> None:
        e = entry
        self._removes.discard(e.key)
        self._puts[e.key] = (e.offset, e.size, e.tick, _to_sql(e.checksum), _segments_to_sql(e.segments_wire))
        self.changes += 1

    def remove(self, key: str) -> None:
        self._puts.pop(key, None)
        self._removes.add(key)
        self.changes += 1

    def discard_puts(self, keys: list[str]) -> None:
        """Forget buffered puts of ``keys`` (their commits were undone in memory before any reply)."""
        for k in keys:
            self._puts.pop(k, None)

    @property
    def dirty(self) -> bool:
        return bool(self._puts or self._removes)

    def flush(self) -> None:
        """Write buffered puts and removes in one transaction (call before replying).

        Raises ``StateWriteError`` when the write fails; the changes then stay buffered (nothing of
        them is durable) and the store is not ``writable`` until ``recover`` succeeds.
        """
        if not (self._puts or self._removes):
            return
        puts, removes = self._puts, self._removes

        def write(db: sqlite3.Connection) -> None:
            # Removes first: a key evicted and committed again in one request ends up present.
            if removes:
                db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in removes])
            if puts:
                db.executemany(
                    "INSERT OR REPLACE INTO entries (key, offset, size, tick, checksum, segments) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    [(k, o, s, t, c, g) for k, (o, s, t, c, g) in puts.items()],
                )

        self._write(write)
        self._puts = {}
        self._removes = set()
        self.transactions += 1

    def maintain(self) -> bool:
        """Keep the WAL under 1/``WAL_SHARE`` of the free space (see ``WAL_SHARE``); True when it
        truncated the WAL. Cheap when there is nothing to do (one stat, one statvfs)."""
        free = self.free_bytes()
        pages = max(16, min(1000, free // WAL_SHARE // self.page_size))
        if pages != self._autocheckpoint:
            self.db.execute(f"PRAGMA wal_autocheckpoint={pages}")
            self._autocheckpoint = pages
        try:
            wal = os.stat(f"{self.path}-wal").st_size
        except OSError:
            return False
        if wal < WAL_TRIM_MIN_BYTES or wal * WAL_SHARE < free:
            return False
        try:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error as e:
            log.warning("could not checkpoint %s (%d KiB of WAL): %s", self.path, wal >> 10, e)
            return False
        return True

    def recover(self) -> bool:
        """Try to become writable again: write what is buffered, then a probe; True on success.

        Needs ``RESUME_FREE_BYTES`` free first. A TRUNCATE checkpoint gives the WAL's space back
        to the filesystem where the database file can take the WAL's pages.
        """
        if self.writable:
            return True
        try:
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        except sqlite3.Error:
            pass  # the checkpoint needs space too; the free-space check below decides
        if self.free_bytes() < RESUME_FREE_BYTES:
            return False
        try:
            self.flush()
            self._write(
                lambda db: db.execute(
                    "INSERT OR REPLACE INTO meta (k, v) VALUES ('last_write_probe', ?)", (str(time.time()),)
                )
            )
        except StateWriteError:
            return False
        log.warning(
            "the state database %s is writable again (%s free); writes resume", self.path, self._free_text()
        )
        self.writable = True
        self.error = ""
        return True

    def write_ticks(self, ticks: list[tuple[str, int]]) -> None:
        """Write LRU ticks ``(key, tick)`` (cheap to lose: only the eviction order depends on them).

        Raises ``StateWriteError`` like ``flush``; the ticks are then dropped.
        """
        if not ticks:
            return
        self._write(
            lambda db: db.executemany("UPDATE entries SET tick = ? WHERE key = ?", [(t, k) for k, t in ticks])
        )

    def close(self) -> None:
        """Write what is buffered (if it can), checkpoint, close. Never raises ``StateWriteError``."""
        try:
            try:
                self.flush()
            except StateWriteError:
                log.error(
                    "closing with %d changes not written to %s: %s",
                    len(self._puts) + len(self._removes),
                    self.path,
                    self.error,
                )
            try:
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            except sqlite3.Error as e:  # the WAL stays; the next start reads it
                log.warning("could not checkpoint %s at close: %s", self.path, e)
        finally:
            self.db.close()
            if self.lock is not None:
                self.lock.close()

    def remove_created(self) -> None:
        """Delete the files and directories this process created (after ``close``; a failed start)."""
        for p in reversed(self.created):
            try:
                if p.is_dir():
                    p.rmdir()
                else:
                    for extra in (Path(f"{p}-wal"), Path(f"{p}-shm"), Path(f"{p}-journal")):
                        extra.unlink(missing_ok=True)
                    p.unlink(missing_ok=True)
            except OSError as e:
                log.warning("could not remove %s after a failed start: %s", p, e.strerror)
        self.created.clear()


# SQLite integers are signed 64-bit; checksums are unsigned 64-bit: stored two's complement.
def _to_sql(checksum: int | None) -> int | None:
    return None if checksum is None else checksum - (1 << 64) if checksum >= 1 << 63 else checksum


def _from_sql(value: int | None) -> int | None:
    return None if value is None else value + (1 << 64) if value < 0 else value


# Segment sums in SQLite: 4-byte little-endian segment tokens, then the raw sums as little-endian
# uint64 (the wire form's bytes): 8 bytes a segment, 4 an entry.
_SEGMENT_TOKENS_BYTES = 4


def _segments_to_sql(wire: list[Any] | None) -> bytes | None:
    """An entry's segment sums in their wire form (``Entry.segments_wire``: valid, or None)."""
    if wire is None:
        return None
    tokens, raws = wire
    return int(tokens).to_bytes(_SEGMENT_TOKENS_BYTES, "little") + raws


def _segments_from_sql(blob: object) -> SegmentSums | None:
    """The segment sums a blob holds, or None when it is not a valid encoding (never raises)."""
    if not isinstance(blob, bytes) or len(blob) <= _SEGMENT_TOKENS_BYTES:
        return None
    tokens = int.from_bytes(blob[:_SEGMENT_TOKENS_BYTES], "little")
    try:
        return SegmentSums.from_wire([tokens, blob[_SEGMENT_TOKENS_BYTES:]])
    except ValueError:
        return None
