"""Client leases: who is alive, and who has been silent too long.

A client holds a lease from its HANDSHAKE on; every request it sends (HEARTBEAT included)
renews it. A client silent for more than ``timeout_s`` loses the lease: ``expired`` returns it
once and forgets it, and the server then frees its reservations and releases its pins
(``KeyRegistry.drop_client``). The clock is monotonic, so wall-clock jumps never expire anyone.

A lease also says where the client runs (host name; boot id, PID namespace and process start
time, so the server can tell when a client on its own kernel died: ``quarantine.py``) and
carries the client's self-description (``info``, validated by the server before it
gets here): in memory only, replaced by each handshake, gone with the lease.
"""

from __future__ import annotations

import time
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any


@dataclass
class Lease:
    client: Hashable
    host: str
    pid: int
    since: float
    last_seen: float
    info: dict[str, Any] | None = None
    boot_id: str = ""  # the client's kernel boot id ('' unknown)
    pid_ns: str = ""  # the client's PID namespace ('' unknown)
    pid_start: int = 0  # the client process's start time in clock ticks (0 unknown)


class LeaseTable:
    """Live clients and the time each was last heard from."""

    def __init__(self, timeout_s: float, clock=time.monotonic) -> None:
        self.timeout_s = timeout_s
        self._clock = clock
        self._leases: dict[Hashable, Lease] = {}

    def grant(
        self,
        client: Hashable,
        host: str = "",
        pid: int = 0,
        info: dict[str, Any] | None = None,
        *,
        boot_id: str = "",
        pid_ns: str = "",
        pid_start: int = 0,
    ) -> Lease:
        """Start (or refresh) the lease of ``client``; its info becomes ``info`` (a handshake says all)."""
        now = self._clock()
        lease = self._leases.get(client)
        if lease is None:
            lease = self._leases[client] = Lease(client, host, pid, now, now)
        else:
            lease.last_seen = now
            lease.host, lease.pid = host or lease.host, pid or lease.pid
        lease.info = info or None
        lease.boot_id, lease.pid_ns, lease.pid_start = boot_id, pid_ns, pid_start
        return lease

    def set_info(self, client: Hashable, info: dict[str, Any]) -> bool:
        """Replace the info of ``client`` (renewing its lease); False if it has no lease."""
        lease = self._leases.get(client)
        if lease is None:
            return False
        lease.last_seen = self._clock()
        lease.info = info or None
        return True

    def now(self) -> float:
        return self._clock()

    def renew(self, client: Hashable) -> bool:
        """Renew the lease of ``client``; False if it has none (never shook hands, or expired)."""
        lease = self._leases.get(client)
        if lease is None:
            return False
        lease.last_seen = self._clock()
        return True

    def __contains__(self, client: Hashable) -> bool:
        return client in self._leases

    def __len__(self) -> int:
        return len(self._leases)

    def expired(self) -> list[Lease]:
        """Remove and return every lease silent past the timeout."""
        deadline = self._clock() - self.timeout_s
        gone = [lease for lease in self._leases.values() if lease.last_seen < deadline]
        for lease in gone:
            del self._leases[lease.client]
        return gone

    def leases(self) -> list[Lease]:
        return list(self._leases.values())
