"""EXISTS answered in this process from the server's key index (``maru.pool.key_index``).

A ``MaruHandler`` owns one ``LocalExists``. Each handshake tells it where the server's index
is (or that there is none); ``answer`` then reads the table, or returns None and the handler
asks the server. That slower path is announced once per reason, with the fix, and counted
(``counts()``: ``exists_local`` / ``exists_remote``, shown by ``maru stats`` through the
connector's stats).

Never used while the server is not known alive: a dead server's table would keep saying
"present" for keys nobody can load any more. So the table is read only while the session is up,
the server's process exists (a client on the server's host checks its pid, a microsecond), and
the table's beat moved within the last ``4 x beat_s`` (at least 2 s; any host): a killed server
reads as unreachable at once on its own host, and within seconds on another.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from maru.pool.fingerprints import Fingerprints, KeyedFingerprints
from maru.pool.key_index import SIDE_SUFFIX, IndexPlace, KeyIndexReader
from maru.procinfo import read_boot_id, read_pid_ns
from maru.protocol import MAX_KEY_BYTES

log = logging.getLogger("maru.client")

_SHORT = MAX_KEY_BYTES // 4  # a str this short is under the byte limit in any encoding


def _plain(keys: Sequence[str]) -> bool:
    """Keys the server would accept without question: strings, short enough (checks run in C)."""
    return set(map(type, keys)) == {str} and max(map(len, keys)) <= _SHORT


_HOST = (read_boot_id(), read_pid_ns())


def _same(new: Fingerprints | None, old: Fingerprints) -> bool:
    """Whether a handshake's fingerprints are those the open reader already has."""
    if isinstance(old, KeyedFingerprints):
        return isinstance(new, KeyedFingerprints) and new.secrets == old.secrets
    return new is None


class ServerWatch:
    """Whether the server that writes a key index is alive, without asking it (see the module doc)."""

    def __init__(self, reader: KeyIndexReader) -> None:
        self.reader = reader
        host = reader.place.host
        # Same boot and PID namespace: the server's pid names the server's process here too.
        self.pid = reader.server_pid if host[0] and host == _HOST else None
        self.stale_s = max(2.0, 4 * reader.place.beat_s)
        self._beat = reader.beat
        self._moved = time.monotonic()

    def why_dead(self) -> str | None:
        if self.pid is not None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return f"the server process {self.pid} is gone"
            except PermissionError:
                pass  # alive, another user's
        beat, now = self.reader.beat, time.monotonic()
        if beat != self._beat:
            self._beat, self._moved = beat, now
        elif now - self._moved > self.stale_s:
            return f"the server has not refreshed its key index for {now - self._moved:.0f} s"
        return None


class LocalExists:
    """The reader of the current session's key index, and why it is not used when it is not."""

    def __init__(self) -> None:
        self._reader: KeyIndexReader | None = None
        self._watch: ServerWatch | None = None
        self.why_remote: str | None = "not connected yet"
        self._announced: set[str] = set()
        self.local = 0
        self.remote = 0

    def update(self, reply: dict[str, Any], pool: Any, server_pool_path: str) -> None:
        """After a handshake: open the index the server announced (keep it if unchanged).
        ``pool``: this client's ``PoolMapping`` of the server's pool."""
        place = IndexPlace.from_wire(reply.get("key_index"))
        fps: Fingerprints | None = None
        if place is not None and place.keyed:
            # --tenants: the secrets of the namespaces this client may read (maybe none).
            fps = KeyedFingerprints.from_wire(reply.get("key_index_secrets"))
        old = self._reader
        if old is not None and place == old.place and _same(fps, old.fingerprints):
            return
        self._reader = self._watch = None
        if old is not None:
            old.close()
        if place is None:
            self.why_remote = (
                "the server publishes no key index (started with --no-key-index, or an "
                "older server); `maru doctor` says which"
            )
            return
        if place.keyed and fps is None:
            self.why_remote = (
                "the server's key index is keyed per namespace and its handshake gave no secrets"
            )
            return
        path = pool.path
        try:
            if place.path is None:  # in the pool's header unit: read through the pool's own mapping
                self._reader = KeyIndexReader(place, pool=pool.mmap, fingerprints=fps)
            else:
                # A side file sits beside the pool: beside this process's path of it when it differs.
                side = server_pool_path + SIDE_SUFFIX
                path = pool.path + SIDE_SUFFIX if place.path == side else place.path
                self._reader = KeyIndexReader(place, path=path, fingerprints=fps)
            self._watch = ServerWatch(self._reader)
            self.why_remote = None
        except (OSError, ValueError) as e:
            self.why_remote = f"cannot map the server's key index {path}: {getattr(e, 'strerror', None) or e}"

    def answer(self, keys: Sequence[str], connected: bool) -> list[bool] | None:
        """Per key, whether it is committed; None: ask the server (counted, announced once)."""
        r = self._reader
        if keys and not _plain(keys):
            return None  # the server names what is wrong with them (type, length), as ever
        dead = self._watch.why_dead() if self._watch is not None and connected else None
        ns = r.fingerprints.missing(keys) if r is not None else None
        if ns is not None:
            why = f"this client holds no key-index secret for namespace {ns!r} (no read right on it)"
        elif r is not None and connected and dead is None:
            got = r.contains_many(keys)
            if got is not None:
                self.local += 1
                return got
            why = r.why_unusable()  # None: slots kept moving under the reads, nothing to announce
        elif dead is not None:
            why = dead
        else:
            why = self.why_remote if r is None else "the server is not reachable"
        self.remote += 1
        if why is not None and why not in self._announced:
            self._announced.add(why)
            log.warning("maru: EXISTS goes to the server (a round trip each): %s", why)
        return None

    @property
    def indexed(self) -> bool:
        """Whether EXISTS reads the server's key index now (``path`` says it in words)."""
        return self._reader is not None

    @property
    def path(self) -> str:
        """How EXISTS is answered now (``maru doctor``, the connector's data paths)."""
        return "key index" if self._reader is not None else f"server round trip ({self.why_remote})"

    def slow(self) -> list[str]:
        """What a client reports as a slow path (``set_client_info``) while EXISTS cannot use the
        index: the reason and where the fix is. Empty on the key index."""
        if self._reader is not None:
            return []
        return [
            f"EXISTS are server round trips, one per prefix probe ({self.why_remote}). Fix: `maru doctor` "
            "(key index) on this host names it; docs/server.md#the-key-index"
        ]

    def counts(self) -> dict[str, int]:
        return {"exists_local": self.local, "exists_remote": self.remote}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = self._watch = None
        self.why_remote = "closed"
