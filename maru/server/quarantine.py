"""Who holds quarantined space, and when it may be reused.

When a lease expires the client may only be stalled (SIGSTOP, a long GC pause, a swapped-out
process): it still maps the pool and may write through a reservation or read through a pinned
view once it runs again. So its space is kept (``KeyRegistry.quarantine_client``) and a
``QuarantineBook`` entry says whose it is. The space is released when one of these holds:

- **dead**: the holder runs on the server's own kernel (same boot id and PID namespace, sent in
  its handshake) and ``/proc/<pid>`` is gone or belongs to another process (its start time
  changed). A dead process touches nothing.
- **fenced**: the holder handshakes again and says it fenced its old session (``MaruHandler``
  remaps the old reservations and pinned views to private memory first); the server calls
  ``release``.
- **timed out**: ``timeout_s`` (``--quarantine-timeout``; 0 = never) after the expiry, for
  holders on other hosts that never come back. Then the object checksums are the only defence
  against a late write (docs/reliability.md).
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass

from maru.procinfo import process_start_time, read_boot_id, read_pid_ns
from maru.server.leases import Lease


@dataclass
class Held:
    """One quarantined client: who it was (from its lease) and since when its space is held."""

    lease: Lease
    since: float
    local: bool  # runs on this kernel, in this PID namespace: its death is observable


class QuarantineBook:
    """The holders of quarantined space and the rules that release it (see the module docstring)."""

    def __init__(self, timeout_s: float, clock=time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._boot_id = read_boot_id()
        self._pid_ns = read_pid_ns()
        self._held: dict[Hashable, Held] = {}

    def is_local(self, lease: Lease) -> bool:
        return bool(
            self._boot_id
            and lease.boot_id == self._boot_id
            and self._pid_ns
            and lease.pid_ns == self._pid_ns
            and lease.pid > 0
        )

    def hold(self, lease: Lease) -> None:
        """Record that ``lease.client``'s space is quarantined (again: the first time counts)."""
        if lease.client not in self._held:
            self._held[lease.client] = Held(lease, self._clock(), self.is_local(lease))

    def release(self, client: Hashable) -> Held | None:
        return self._held.pop(client, None)

    def __contains__(self, client: Hashable) -> bool:
        return client in self._held

    def __len__(self) -> int:
        return len(self._held)

    def holders(self) -> list[tuple[Held, float]]:
        """Each holder with the seconds its space has been held, longest first."""
        now = self._clock()
        return sorted(((h, now - h.since) for h in self._held.values()), key=lambda x: -x[1])

    def due(self) -> list[tuple[Held, str]]:
        """Remove and return the holders whose space may be reused now, each with the reason."""
        now = self._clock()
        out: list[tuple[Held, str]] = []
        for h in list(self._held.values()):
            reason = None
            if h.local and not self._alive(h.lease):
                reason = "dead"
            elif self.timeout_s > 0 and now - h.since >= self.timeout_s:
                reason = "timed out"
            if reason is not None:
                del self._held[h.lease.client]
                out.append((h, reason))
        return out

    @staticmethod
    def _alive(lease: Lease) -> bool:
        start = process_start_time(lease.pid)
        if start is None:
            return False
        # A holder that sent no start time is judged by its pid alone (alive while the pid is).
        return lease.pid_start == 0 or start == lease.pid_start
