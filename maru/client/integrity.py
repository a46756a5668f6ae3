"""What a handler learned about the integrity of what it read, and the one place that says so.

``IntegrityLog`` counts, per handler: objects verified, objects whose bytes failed their
committed checksum (``integrity_failures``: each is a miss, reported to the server so
``maru stats`` shows it), objects that carried no checksum (``unverifiable``: a miss for a
verifying reader), and sessions fenced. A failure is logged as a warning once per key (a
bounded set, so a flood of bad keys cannot grow memory), then at debug level. ``check_hits`` is
the verifying read of retrieved hits that feeds it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maru.checksum import checksum
from maru.client.objects import Retrieved

log = logging.getLogger("maru.client")

_WARNED_KEYS_MAX = 4096


@dataclass
class IntegrityCounts:
    verified: int = 0
    integrity_failures: int = 0
    unverifiable: int = 0
    fenced_sessions: int = 0
    fenced_bytes: int = 0


class IntegrityLog:
    """Counters and warn-once logging of integrity events (thread-safe)."""

    def __init__(self) -> None:
        self.counts = IntegrityCounts()
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    def verified(self, n: int) -> None:
        with self._lock:
            self.counts.verified += n

    def failure(self, key: str, offset: int, url: str) -> None:
        with self._lock:
            self.counts.integrity_failures += 1
            first = key not in self._warned and len(self._warned) < _WARNED_KEYS_MAX
            if first:
                self._warned.add(key)
        (log.warning if first else log.debug)(
            "maru: bytes of key %r at pool offset %d do not match the checksum its writer committed "
            "(another process wrote into its space: a stalled client, or a bug); served as a miss and "
            "reported to the server at %s (see `maru stats` integrity_failures)",
            key,
            offset,
            url,
        )

    def unverifiable(self, key: str) -> None:
        with self._lock:
            self.counts.unverifiable += 1
            first = key not in self._warned and len(self._warned) < _WARNED_KEYS_MAX
            if first:
                self._warned.add(key)
        (log.warning if first else log.debug)(
            "maru: key %r was committed without a checksum (an older client wrote it): it cannot be "
            "verified and is served as a miss; retrieve(..., verify=False) reads it unchecked",
            key,
        )

    def fenced(self, nbytes: int) -> None:
        with self._lock:
            self.counts.fenced_sessions += 1
            self.counts.fenced_bytes += nbytes

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            c = self.counts
            return {
                "verified": c.verified,
                "integrity_failures": c.integrity_failures,
                "unverifiable": c.unverifiable,
                "fenced_sessions": c.fenced_sessions,
                "fenced_bytes": c.fenced_bytes,
            }


def check_hits(
    handles: Sequence[Retrieved | None], integrity: IntegrityLog, url: str
) -> tuple[list[int], list[list[Any]]]:
    """Check each hit's bytes against its committed checksum (one read of each object), counting
    in ``integrity``. Returns the indices of the hits that must be misses (no checksum, or bytes
    that fail it) and ``[key, offset]`` of the failing ones (to REPORT to the server at ``url``)."""
    bad: list[int] = []
    corrupt: list[list[Any]] = []
    for i, r in enumerate(handles):
        if r is None:
            continue
        if r.checksum is None:
            integrity.unverifiable(r.key)
            bad.append(i)
        elif checksum(r.view) != r.checksum:
            integrity.failure(r.key, r.offset, url)
            corrupt.append([r.key, r.offset])
            bad.append(i)
    integrity.verified(len(handles) - handles.count(None) - len(bad))
    return bad, corrupt
