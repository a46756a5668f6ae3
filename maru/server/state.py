"""The server's durable state: SQLite in WAL mode in the state directory.

What is stored: the pool identity (path, uuid, size, data offset, alignment) and every committed
entry (key, offset, size, LRU tick, checksum). Schema 2 added the checksum: opening a schema-1
database drops its entries (loudly): bytes nobody checksummed cannot be vouched for, and a key
kept without one would stay a miss for every verifying reader while writers, seeing it present,
never store it again. The cache refills. What is not: reservations and pins (volatile by design; a
restart drops them and clients handshake again) and the free map (derived from the entries).

Promise: ``flush`` commits every change buffered since the last flush in one transaction; the
server calls it before it sends the reply of a request that changed the committed set, so a
"stored" the client has seen survives SIGKILL of the server (WAL + synchronous=NORMAL is durable
against a process crash; against power loss the last transactions may be lost).
LRU ticks are buffered separately and written at most every ``TICK_FLUSH_S`` seconds, so reads
never pay for SQL; after a crash the LRU order may be up to that much stale.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

from maru.errors import PoolError
from maru.pool.backing import PoolInfo

log = logging.getLogger("maru.server.state")

SCHEMA_VERSION = 2
STATE_FILE = "maru-state.sqlite"
TICK_FLUSH_S = 1.0


class StateStore:
    """SQLite persistence of the committed entries of one pool (implements ``registry.Journal``)."""

    def __init__(self, state_dir: Path | str) -> None:
        self.dir = Path(state_dir)
        try:
            self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise PoolError(
                f"cannot create state directory {self.dir}: {e.strerror}; pass --state-dir"
            ) from None
        self.path = self.dir / STATE_FILE
        try:
            self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS entries (key TEXT PRIMARY KEY, offset INTEGER NOT NULL, "
                "size INTEGER NOT NULL, tick INTEGER NOT NULL, checksum INTEGER) WITHOUT ROWID"
            )
            self._migrate()
        except sqlite3.Error as e:
            raise PoolError(
                f"cannot open state database {self.path}: {e}; check the state directory"
            ) from None
        self._puts: dict[str, tuple[int, int, int, int | None]] = {}
        self._removes: set[str] = set()
        self.transactions = 0

    def _migrate(self) -> None:
        """Bring an older database to ``SCHEMA_VERSION`` (see the module docstring)."""
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(entries)")}
        if "checksum" in columns:
            return
        n = self.db.execute("SELECT COUNT(*) FROM entries").fetchone()[0]
        log.warning(
            "state %s is from before object checksums (schema 1): dropping its %d entries, whose bytes "
            "cannot be verified; the cache refills as clients store again",
            self.path,
            n,
        )
        self.db.execute("BEGIN")
        self.db.execute("DELETE FROM entries")
        self.db.execute("ALTER TABLE entries ADD COLUMN checksum INTEGER")
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
                self.db.execute("BEGIN")
                self.db.execute("DELETE FROM entries")
                self.db.execute("DELETE FROM meta")
                self.db.execute("COMMIT")
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
        self.db.execute("BEGIN")
        for k, v in (
            ("schema_version", SCHEMA_VERSION),
            ("pool_path", pool.path),
            ("pool_uuid", pool.uuid),
            ("pool_size", pool.pool_size),
            ("data_offset", pool.data_offset),
            ("alignment", pool.alignment),
        ):
            self.db.execute("INSERT OR REPLACE INTO meta (k, v) VALUES (?, ?)", (k, str(v)))
        self.db.execute("COMMIT")

    def load_entries(self) -> list[tuple[str, int, int, int, int | None]]:
        """Every committed entry as ``(key, offset, size, tick, checksum)``."""
        rows = self.db.execute("SELECT key, offset, size, tick, checksum FROM entries").fetchall()
        return [(k, o, s, t, _from_sql(c)) for k, o, s, t, c in rows]

    def drop_entries(self, keys: list[str]) -> None:
        self.db.execute("BEGIN")
        self.db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in keys])
        self.db.execute("COMMIT")

    # -- journal ------------------------------------------------------------------------------

    def put(self, key: str, offset: int, size: int, tick: int, checksum: int | None = None) -> None:
        self._removes.discard(key)
        self._puts[key] = (offset, size, tick, _to_sql(checksum))

    def remove(self, key: str) -> None:
        self._puts.pop(key, None)
        self._removes.add(key)

    @property
    def dirty(self) -> bool:
        return bool(self._puts or self._removes)

    def flush(self) -> None:
        """Write buffered puts and removes in one transaction (call before replying)."""
        if not (self._puts or self._removes):
            return
        db = self.db
        db.execute("BEGIN")
        try:
            # Removes first: a key evicted and committed again in one request ends up present.
            if self._removes:
                db.executemany("DELETE FROM entries WHERE key = ?", [(k,) for k in self._removes])
            if self._puts:
                db.executemany(
                    "INSERT OR REPLACE INTO entries (key, offset, size, tick, checksum) VALUES (?, ?, ?, ?, ?)",
                    [(k, o, s, t, c) for k, (o, s, t, c) in self._puts.items()],
                )
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
        self._puts.clear()
        self._removes.clear()
        self.transactions += 1

    def write_ticks(self, ticks: list[tuple[str, int]]) -> None:
        """Write LRU ticks ``(key, tick)`` (cheap to lose: only the eviction order depends on them)."""
        if not ticks:
            return
        self.db.execute("BEGIN")
        self.db.executemany("UPDATE entries SET tick = ? WHERE key = ?", [(t, k) for k, t in ticks])
        self.db.execute("COMMIT")

    def close(self) -> None:
        try:
            self.flush()
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        finally:
            self.db.close()


# SQLite integers are signed 64-bit; checksums are unsigned 64-bit: stored two's complement.
def _to_sql(checksum: int | None) -> int | None:
    return None if checksum is None else checksum - (1 << 64) if checksum >= 1 << 63 else checksum


def _from_sql(value: int | None) -> int | None:
    return None if value is None else value + (1 << 64) if value < 0 else value
