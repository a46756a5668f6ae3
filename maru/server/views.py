"""Read-only views of a running ``MaruServer``: pool usage, live clients, the stats snapshot.

A mixin of ``MaruServer``; the Prometheus thread reads ``snapshot()`` while the loop runs, so the
views build plain values and never mutate anything.
"""

from __future__ import annotations

import os
from typing import Any

from maru import protocol as P
from maru.server import validate as V
from maru.server.auth import Caller


class ServerViews:
    """``usage``, ``clients_view`` and ``snapshot`` of the server they are mixed into."""

    def usage(self) -> dict[str, Any]:
        reg, alloc, p = self.registry, self.registry.alloc, self.pool
        return {
            "pool_size": p.pool_size,
            "data_size": p.data_size,
            "used": alloc.used_bytes,
            "free": alloc.free_bytes,
            "largest_free": alloc.largest_free,
            "reserved": reg.reserved_bytes,
            "committed": reg.committed_bytes,
            "evictable": reg.evictable_bytes,
            "entries": reg.entries,
            "pinned": reg.pinned_entries,
            "reservations": reg.reservations,
            "clients": len(self.leases),
            "quarantined": reg.quarantined_bytes,
            "quarantined_extents": reg.quarantined_extents,
        }

    def clients_view(self, limit: int = P.MAX_STATS_CLIENTS, viewer: Caller | None = None) -> dict[str, Any]:
        """Live clients for STATS: those reporting info first, then oldest first; at most ``limit``.
        With tenants, a ``viewer`` that is not an admin sees only its own key's sessions."""
        now = self.leases.now()
        live = self.leases.leases()
        if viewer is not None:
            live = [lease for lease in live if self._access.may_see(viewer, lease.client)]
        leases = sorted(live, key=lambda lease: (lease.info is None, lease.since))
        clients = [
            {
                "client_id": V.client_id_text(lease.client),
                "host": lease.host,
                "pid": lease.pid,
                "age_s": round(now - lease.since, 3),
                "idle_s": round(now - lease.last_seen, 3),
                "info": lease.info,
            }
            for lease in leases[:limit]
        ]
        return {"clients": clients, "clients_total": len(leases), "clients_truncated": len(leases) > limit}

    def quarantine_view(
        self, limit: int = P.MAX_STATS_CLIENTS, viewer: Caller | None = None
    ) -> dict[str, Any]:
        """Who holds quarantined space (for STATS; like ``clients_view``, on the loop thread only)."""
        held = self.quarantine.holders()
        if viewer is not None:
            held = [(h, s) for h, s in held if self._access.may_see(viewer, h.lease.client)]
        holders = [
            {
                "client_id": V.client_id_text(h.lease.client),
                "host": h.lease.host,
                "pid": h.lease.pid,
                "held_s": round(held_s, 3),
                "local": h.local,  # its death is observable: the space returns once it exits
            }
            for h, held_s in held[:limit]
        ]
        return {"quarantine": {"timeout_s": self.quarantine.timeout_s, "holders": holders}}

    def snapshot(self) -> dict[str, Any]:
        """The STATS reply less ``clients`` (also what the Prometheus collector reads)."""
        snap = self.stats.snapshot()
        u = self.usage()
        snap["gauges"] = {
            "pool_size_bytes": u["pool_size"],
            "pool_data_bytes": u["data_size"],
            "pool_used_bytes": u["used"],
            "pool_free_bytes": u["free"],
            "pool_largest_free_bytes": u["largest_free"],
            "pool_reserved_bytes": u["reserved"],
            "pool_committed_bytes": u["committed"],
            "entries": u["entries"],
            "pinned_entries": u["pinned"],
            "reservations": u["reservations"],
            "clients": u["clients"],
            "quarantined_bytes": u["quarantined"],
            "quarantined_extents": u["quarantined_extents"],
            "quarantined_clients": len(self.quarantine),
            "state_writable": int(self.state.writable),
        }
        snap["state"] = {  # (the Prometheus thread may read this while the loop runs: plain values)
            "path": str(self.state.path),
            "writable": self.state.writable,
            "error": self.state.error,
        }
        snap["key_index"] = self.key_index.snapshot()
        p = self.pool
        snap.update(
            server_id=self.server_id,
            url=self.cfg.url,
            pool_path=p.path,
            pool_kind=p.kind,
            pool_uuid=p.uuid,
            pool_size=p.pool_size,
            max_object_size=self.max_object_size,
            lease_timeout_s=self.leases.timeout_s,
            spin_us=self.cfg.resolved_spin_us(),  # polls this long for the next request (--spin-us)
            protocol_version=P.PROTOCOL_VERSION,
            pid=os.getpid(),
        )
        return snap
