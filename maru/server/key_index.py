"""The server's key index (``maru.pool.key_index``): where it lives, and the journal that feeds it.

Place. In the pool's header unit when that has room (a DAX pool's first 2 MiB hold a 64-byte
header: the index goes in the pages after it, so every host that maps the device reads it);
otherwise in a file next to the pool file (``<pool>.keyindex``, same owner and mode), which is
what a ``/dev/shm`` pool of 4 KiB alignment gets. The index is rebuilt at every start from the
registry: nothing in it is persistent.

It is off (clients ask the server, announced once) with ``--no-key-index``. Under ``--tenants``
its fingerprints are keyed per namespace (``KeyedFingerprints``), and a client's handshake carries
the secrets of the namespaces it may read, nothing else: what it cannot fingerprint it asks the
server, which checks its right.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

from maru.config import format_size
from maru.pool.backing import PoolInfo
from maru.pool.fingerprints import Fingerprints, KeyedFingerprints, PlainFingerprints
from maru.pool.header import HEADER_BYTES as POOL_HEADER_BYTES
from maru.pool.key_index import (
    MIN_SLOTS,
    SIDE_SUFFIX,
    STATE_FULL,
    IndexPlace,
    KeyIndexWriter,
    slots_for,
    table_bytes,
)
from maru.pool.perms import FileAccess
from maru.procinfo import read_boot_id, read_pid_ns
from maru.server.registry import Entry, Journal

log = logging.getLogger("maru.server")


class IndexedJournal:
    """A ``Journal`` that keeps the key index in step with the committed set, then persists."""

    def __init__(self, inner: Journal, index: KeyIndexWriter) -> None:
        self.inner = inner
        self.index = index

    def put(self, entry: Entry) -> None:
        self.inner.put(entry)
        self.index.add(entry.key)

    def remove(self, key: str) -> None:
        self.inner.remove(key)
        self.index.discard(key)

    def discard_puts(self, keys: list[str]) -> None:
        self.inner.discard_puts(keys)
        for k in keys:
            self.index.discard(k)


class ServerKeyIndex:
    """The index of one server run: its place, its writer, or why there is none."""

    def __init__(self, place: IndexPlace | None, writer: KeyIndexWriter | None, why_off: str) -> None:
        self.place = place
        self.writer = writer
        self.why_off = why_off
        self._mm: mmap.mmap | None = None
        self._side: str | None = None

    @classmethod
    def off(cls, why: str) -> ServerKeyIndex:
        log.warning("key index off: %s; every EXISTS is a round trip to this server", why)
        return cls(None, None, why)

    @classmethod
    def open(
        cls, pool: PoolInfo, access: FileAccess, beat_s: float, fingerprints: Fingerprints | None = None
    ) -> ServerKeyIndex:
        """Make the index for ``pool`` (in its header unit, else beside it); ``off`` if neither fits.
        ``beat_s``: the longest the server goes between two ``beat()`` calls; ``fingerprints``:
        the access policy's (plain by default)."""
        fps = fingerprints or PlainFingerprints()
        want = slots_for(pool.data_size, pool.alignment)
        start = -(-POOL_HEADER_BYTES // mmap.PAGESIZE) * mmap.PAGESIZE
        room = pool.data_offset - start
        if room >= table_bytes(MIN_SLOTS):
            slots = min(want, 1 << ((room - table_bytes(0)) // 8).bit_length() - 1)
            # Mapped as the whole header unit: a DAX device maps only whole alignment units.
            return cls._made(pool.path, None, start, slots, os.O_RDWR, None, beat_s, pool.data_offset, fps)
        if pool.kind != "file":
            return cls.off(
                f"the pool's header unit ({format_size(pool.data_offset)}) has no room for it and a "
                f"{pool.kind} pool has no place beside it"
            )
        side = pool.path + SIDE_SUFFIX
        # A new file every start: a reader still mapping the last run's file keeps that inode
        # (it reads "closed" or a stale nonce), never a file shrunk under it (SIGBUS).
        _unlink(side)
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL
        return cls._made(side, side, 0, want, flags, access, beat_s, table_bytes(want), fps)

    @classmethod
    def _made(
        cls,
        path: str,
        side: str | None,
        offset: int,
        slots: int,
        fd_flags: int,
        access: FileAccess | None,
        beat_s: float,
        map_len: int,
        fps: Fingerprints,
    ) -> ServerKeyIndex:
        size = table_bytes(slots)
        try:
            fd = os.open(path, fd_flags | os.O_CLOEXEC, 0o600)
        except OSError as e:
            return cls.off(f"cannot open {path}: {e.strerror}")
        try:
            if access is not None:
                access.apply_fd(fd, path)
                # Reserved, not just sized: a tmpfs without room for it would SIGBUS the server
                # on its first write to the table, as it would a pool (maru.pool.backing).
                try:
                    os.posix_fallocate(fd, 0, size)
                except OSError as e:
                    os.close(fd)
                    _unlink(path)
                    return cls.off(
                        f"no room for its {format_size(size)} beside the pool ({path}: {e.strerror}); free "
                        "memory in that filesystem or lower --pool-size"
                    )
            mm = mmap.mmap(fd, map_len, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except Exception as e:
            os.close(fd)
            if side is not None:
                _unlink(side)
            return cls.off(f"cannot map {format_size(size)} of {path}: {e}")
        os.close(fd)
        writer = KeyIndexWriter(memoryview(mm)[offset : offset + size], slots, fingerprints=fps)
        host = (read_boot_id(), read_pid_ns())
        keyed = isinstance(fps, KeyedFingerprints)
        place = IndexPlace(side, offset, size, slots, writer.nonce, beat_s, host, keyed)
        idx = cls(place, writer, "")
        idx._mm, idx._side = mm, side
        where = f"{path} at offset {offset}" if side is None else path
        log.info(
            "key index: %d slots (%s) in %s%s; clients answer EXISTS from it",
            slots,
            format_size(size),
            where,
            ", fingerprints keyed per namespace (--tenants)" if keyed else "",
        )
        return idx

    def wire_for(self, readable: list[str] | None) -> dict[str, Any]:
        """The handshake reply's part: where the index is and, keyed, the secrets of the
        namespaces in ``readable`` (the caller's read rights)."""
        if self.place is None or self.writer is None:
            return {}
        out: dict[str, Any] = {"key_index": self.place.to_wire()}
        fps = self.writer.fingerprints
        if isinstance(fps, KeyedFingerprints):
            out["key_index_secrets"] = fps.for_reader(readable or [])
        return out

    def beat(self) -> None:
        if self.writer is not None:
            self.writer.beat()

    def journal(self, inner: Journal) -> Journal:
        return inner if self.writer is None else IndexedJournal(inner, self.writer)

    def snapshot(self) -> dict[str, Any]:
        w = self.writer
        if w is None or self.place is None:
            return {"on": False, "why_off": self.why_off}
        return {
            "on": True,
            "full": w.state == STATE_FULL,
            "keyed": isinstance(w.fingerprints, KeyedFingerprints),
            "slots": w.slots,
            "keys": w.keys,
            "rebuilds": w.rebuilds,
            "shifts": w.shifts,
            "where": self.place.path or "pool header unit",
        }

    def close(self) -> None:
        """Tell readers to ask the server; unmap; remove a side file."""
        if self.writer is not None:
            self.writer.close()
            self.writer.release()
            self.writer = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:
                pass  # the writer's views go with it
            self._mm = None
        if self._side is not None:
            _unlink(self._side)
            self._side = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
