"""The request handlers of ``MaruServer``, one method per op: validate every field first, then act.

A mixin of ``MaruServer`` (it uses the server's registry, leases, quarantine, access policy, state
and stats); kept apart so that the event loop and the server's lifecycle read on their own. Every
handler raises ``validate.Reject`` for an error reply and changes nothing before it has validated
the whole request.
"""

from __future__ import annotations

import logging
from typing import Any

from maru import protocol as P
from maru.protocol import ErrorCode
from maru.segments import SegmentSums
from maru.server import validate as V

log = logging.getLogger("maru.server")


class RequestHandlers:
    """Per-op handlers (``_handshake`` ... ``_report``); the dispatch table lives in ``MaruServer``."""

    def _handshake(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        host = body.get("host", "")
        pid = body.get("pid", 0)
        if type(host) is not str or len(host) > V.MAX_HOST_LEN:
            raise V.Reject(
                ErrorCode.BAD_REQUEST, f"host must be a string of at most {V.MAX_HOST_LEN} characters"
            )
        V.int_field(pid, "pid", 0, 1 << 32)
        where = {}
        for name in ("boot_id", "pid_ns"):
            value = body.get(name, "")
            if type(value) is not str or len(value) > V.MAX_HOST_LEN:
                raise V.Reject(
                    ErrorCode.BAD_REQUEST, f"{name} must be a string of at most {V.MAX_HOST_LEN} characters"
                )
            where[name] = value
        where["pid_start"] = V.int_field(body.get("pid_start", 0), "pid_start", 0, (1 << 63) - 1)
        fenced = body.get("fenced", False)
        if type(fenced) is not bool:
            raise V.Reject(ErrorCode.BAD_REQUEST, "fenced must be true or false")
        info = V.info_field(body) if "info" in body else None
        if client not in self.leases and len(self.leases) >= self.cfg.max_clients:
            raise V.Reject(
                ErrorCode.TOO_MANY_CLIENTS,
                f"the server holds {len(self.leases)} client leases, its --max-clients limit: wait for idle "
                "clients' leases to expire, or raise --max-clients",
            )
        self.leases.grant(client, host, pid, info, **where)
        if fenced and self.quarantine.release(client) is not None:
            self._release_quarantine(client, "fenced")
        p = self.pool
        return P.ok(
            server_id=self.server_id,
            pool_path=p.path,
            pool_uuid=p.uuid,
            pool_kind=p.kind,
            pool_size=p.pool_size,
            data_offset=p.data_offset,
            data_size=p.data_size,
            alignment=p.alignment,
            max_object_size=self.max_object_size,
            lease_timeout_s=self.leases.timeout_s,
            protocol_version=P.PROTOCOL_VERSION,
            max_batch=P.MAX_BATCH,
            max_key_bytes=P.MAX_KEY_BYTES,
            max_client_info_bytes=P.MAX_CLIENT_INFO_BYTES,
            **self.key_index.wire_for(self._access.readable(client)),
        )

    def _reserve(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        sizes = V.list_field(body, "sizes")
        for s in sizes:
            if type(s) is not int:
                raise V.Reject(ErrorCode.BAD_REQUEST, f"sizes must be integers, got {type(s).__name__}")
            if s <= 0:
                raise V.Reject(ErrorCode.BAD_REQUEST, f"size {s} must be positive")
            if s > self.max_object_size:
                raise V.Reject(
                    ErrorCode.TOO_LARGE,
                    f"object of {s} bytes is over the server's max object size {self.max_object_size}",
                )
        reg = self.registry
        before = reg.counters.evictions
        allocs: list[list[int] | None] = []
        for s in sizes:
            r = reg.reserve(client, s)
            allocs.append(None if r is None else [r.alloc_id, r.offset, r.size])
        try:
            self._flush()  # evictions must be durable before their space goes to a writer
        except V.Reject as e:
            # The evicted entries stay evicted in memory and their removal stays buffered; until it
            # is written no RESERVE is admitted, so no writer touches their bytes (a crash before
            # then brings them back intact).
            for a in allocs:
                if a is not None:
                    reg.abort(client, a[0])
            self._count_evictions(before)
            raise V.Reject(e.code, f"nothing was reserved: {e.message}") from None
        failures = allocs.count(None)
        self.stats.add("reserves", len(sizes) - failures)
        self.stats.add("reserve_failures", failures)
        self._count_evictions(before)
        if failures:
            return P.ok(allocs=allocs, quarantined=reg.quarantined_bytes)
        return P.ok(allocs=allocs)

    def _count_evictions(self, before: int) -> None:
        n = self.registry.counters.evictions - before
        if n:
            self.stats.add("evictions", n)

    def _commit(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        items = V.list_field(body, "items")
        for it in items:
            if type(it) is not list or len(it) != 2 or type(it[0]) is not str or type(it[1]) is not int:
                raise V.Reject(ErrorCode.BAD_REQUEST, "items must be [key: str, alloc_id: int] pairs")
            if len(it[0]) > V.MAX_FAST_KEY_CHARS:
                V.check_long_key(it[0])
        checksums = body.get("checksums")
        if checksums is None:
            checksums = [None] * len(items)
        elif type(checksums) is not list or len(checksums) != len(items):
            raise V.Reject(ErrorCode.BAD_REQUEST, "checksums must be a list of one checksum per item")
        for c in checksums:
            if c is not None and (type(c) is not int or not 0 <= c < 1 << 64):
                raise V.Reject(
                    ErrorCode.BAD_REQUEST, f"checksum {c!r:.40} must be an unsigned 64-bit int or nil"
                )
        segments = self._commit_segments(client, body, items, checksums)
        results = self._commit_durably(client, items, checksums, segments)
        add = self.stats.add
        for (key, _), r in zip(items, results, strict=True):
            if r is P.CommitResult.STORED:
                add("stores")
                add("bytes_stored", self.registry.peek(key).size)  # type: ignore[union-attr]
            elif r is P.CommitResult.PRESENT:
                add("duplicates")
            else:
                add("unknown_allocs")
        return P.ok(results=[r.value for r in results])

    def _commit_segments(
        self, client: Any, body: dict[str, Any], items: list[list[Any]], checksums: list[int | None]
    ) -> list[SegmentSums | None]:
        """The COMMIT's optional ``segments`` field, one ``SegmentSums`` or None per item; validated
        whole before anything is committed (a refusal changes nothing).

        Segments need the item's checksum and must add up to it for the size of the reservation
        they commit (``SegmentSums.consistent``): a reader trusts the committed sums of the segments
        it skips, so sums that disagree with the checksum would make every partial read of the
        object fail (or, worse, vouch for bytes nobody summed). Items whose alloc id is not a live
        reservation of this client are not checked: they commit as ``unknown_alloc`` anyway.
        """
        raw = body.get("segments")
        if raw is None:
            return [None] * len(items)
        if type(raw) is not list or len(raw) != len(items):
            raise V.Reject(
                ErrorCode.BAD_REQUEST,
                "segments must be a list of one entry per item: nil or [tokens: int, sums: bytes]",
            )
        out: list[SegmentSums | None] = []
        reg = self.registry
        for (key, alloc_id), checksum, wire in zip(items, checksums, raw, strict=True):
            if wire is None:
                out.append(None)
                continue
            try:
                seg = SegmentSums.from_wire(wire)
            except ValueError as e:
                raise V.Reject(ErrorCode.BAD_REQUEST, f"segments of key {key!r:.80}: {e}") from None
            if checksum is None:
                raise V.Reject(
                    ErrorCode.BAD_REQUEST,
                    f"segments of key {key!r:.80} come without a checksum: segment sums are only "
                    "committed with the checksum they add up to",
                )
            r = reg.reservation(alloc_id)
            if r is not None and r.client == client and not seg.consistent(checksum, r.size):
                raise V.Reject(
                    ErrorCode.BAD_REQUEST,
                    f"the segment sums of key {key!r:.80} do not add up to its checksum for its "
                    f"{r.size}-byte object: the writer's sums are wrong; nothing of this COMMIT was "
                    "stored and its reservations are still yours (commit them again with correct "
                    "sums or none, or abort them)",
                )
            out.append(seg)
        return out

    def _commit_durably(
        self,
        client: Any,
        items: list[list[Any]],
        checksums: list[int | None],
        segments: list[SegmentSums | None],
    ) -> list[P.CommitResult]:
        """Commit ``items`` all or nothing: either every STORED is durable, or nothing changed.

        Items that will store (key not visible) go first and are flushed; items that find their
        key present (or reuse an alloc id of such an item) free their space and write nothing, so
        they run only after the flush. If the flush fails, the stored ones are undone (entries
        gone, reservations back) and the request is refused: a refused COMMIT is never applied.
        Results are the same as committing the items one by one in order.
        """
        reg = self.registry
        results: list[P.CommitResult | None] = [None] * len(items)
        later: list[int] = []
        later_allocs: set[int] = set()
        stored: list[int] = []
        for i, (key, alloc_id) in enumerate(items):
            if alloc_id in later_allocs or reg.peek(key) is not None:
                later.append(i)
                later_allocs.add(alloc_id)
                continue
            r = results[i] = reg.commit(client, key, alloc_id, checksums[i], segments[i])
            if r is P.CommitResult.STORED:
                stored.append(i)
        try:
            self._flush()
        except V.Reject as e:
            for i in reversed(stored):
                reg.uncommit(client, items[i][0], items[i][1])
            reg.journal.discard_puts([items[i][0] for i in stored])  # through tenant usage, if any
            raise V.Reject(
                e.code,
                f"nothing of this COMMIT was stored and its reservations are still yours (commit them "
                f"again later, or abort them): {e.message}",
            ) from None
        for i in later:
            results[i] = reg.commit(client, items[i][0], items[i][1], checksums[i], segments[i])
        return results  # type: ignore[return-value]

    def _abort(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        ids = V.list_field(body, "alloc_ids")
        for a in ids:
            if type(a) is not int:
                raise V.Reject(ErrorCode.BAD_REQUEST, "alloc_ids must be integers")
        freed = sum(1 for a in ids if self.registry.abort(client, a))
        self.stats.add("aborts", freed)
        return P.ok(freed=freed)

    def _lookup(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        keys = V.keys_field(body)
        pin = body.get("pin", False)
        if type(pin) is not bool:
            raise V.Reject(ErrorCode.BAD_REQUEST, "pin must be true or false")
        want_segments = body.get("segments", False)
        if type(want_segments) is not bool:
            raise V.Reject(ErrorCode.BAD_REQUEST, "segments must be true or false")
        reg = self.registry
        found = [reg.pin(client, k) for k in keys] if pin else reg.lookup_many(keys)
        entries: list[list[int] | None] = []
        checksums: list[int | None] = []
        served = 0
        for e in found:
            if e is None:
                entries.append(None)
                checksums.append(None)
            else:
                entries.append([e.offset, e.size])
                checksums.append(e.checksum)
                served += e.size
        hits = len(keys) - entries.count(None)
        st = self.stats.counters
        st["hits"] += hits
        st["misses"] += len(keys) - hits
        st["bytes_served"] += served
        if pin:
            st["pins"] += hits
        if want_segments:
            return P.ok(entries=entries, checksums=checksums, segments=_segments_of(found))
        return P.ok(entries=entries, checksums=checksums)

    def _exists(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        keys = V.keys_field(body)
        present = [e is not None for e in self.registry.lookup_many(keys)]
        try:
            prefix = present.index(False)
        except ValueError:
            prefix = len(present)
        hits = sum(present)
        st = self.stats.counters
        st["exists_hits"] += hits
        st["exists_misses"] += len(keys) - hits
        return P.ok(present=present, prefix=prefix)

    def _pin(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        keys = V.keys_field(body)
        pinned = [self.registry.pin(client, k) is not None for k in keys]
        self.stats.add("pins", sum(pinned))
        return P.ok(pinned=pinned)

    def _unpin(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        keys = V.keys_field(body)
        unpinned = [self.registry.unpin(client, k) for k in keys]
        self.stats.add("unpins", sum(unpinned))
        return P.ok(unpinned=unpinned)

    def _delete(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        keys = V.keys_field(body)
        deleted = [self.registry.delete(k) for k in keys]
        self.stats.add("deletes", sum(deleted))
        try:
            self._flush()
        except V.Reject as e:
            raise V.Reject(
                e.code,
                f"the keys are hidden now, but their removal is not durable yet (it is written once the "
                f"state takes writes; a crash before then brings them back): {e.message}",
            ) from None
        return P.ok(deleted=deleted)

    def _heartbeat(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        # ``pins``: the session's pins now, which the client compares with the pins its handles
        # hold (a pinning request lost with its socket may have been applied: docs/client.md).
        if "info" in body:
            info = V.info_field(body)  # validated before the lease is touched: a bad request changes nothing
            known = self.leases.set_info(client, info)
        else:
            known = self.leases.renew(client)
        return P.ok(server_id=self.server_id, known=known, pins=self.registry.pin_count(client))

    def _stats(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        # ``clients`` is only in the STATS reply, not in ``snapshot`` (the Prometheus thread reads
        # that one, and must not walk the lease table while the event loop changes it).
        return P.ok(
            **self.snapshot(), **self.clients_view(viewer=client), **self.quarantine_view(viewer=client)
        )

    def _usage(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        return P.ok(**self.usage())

    def _report(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        items = V.list_field(body, "corrupt")
        for it in items:
            if type(it) is not list or len(it) != 2 or type(it[0]) is not str or type(it[1]) is not int:
                raise V.Reject(ErrorCode.BAD_REQUEST, "corrupt must list [key: str, offset: int] pairs")
            V.check_long_key(it[0])
        deleted = []
        for key, offset in items:
            e = self.registry.peek(key)
            # Only the entry the reader checked: a report that arrives after the key was stored
            # again (elsewhere) must not delete the new, good entry.
            hit = e is not None and e.offset == offset and self.registry.delete(key)
            deleted.append(bool(hit))
            log.warning(
                "client %r read key %r at offset %d and its bytes failed the checksum%s",
                client,
                key,
                offset,
                ": entry deleted so it can be stored again" if hit else " (entry already gone or moved)",
            )
        self.stats.add("integrity_failures", len(items))
        self.stats.add("integrity_deletes", sum(deleted))
        return P.ok(deleted=deleted)


def _segments_of(found: list[Any]) -> list[list[Any] | None]:
    """The LOOKUP reply's ``segments``: each hit's committed sums in wire form (None: a miss, none
    committed, or past ``P.SEGMENT_FRAME_BYTES`` in this reply, so the reply always fits in a frame
    whatever its writers committed; those readers verify whole objects)."""
    out: list[list[Any] | None] = []
    left = P.SEGMENT_FRAME_BYTES
    for e in found:
        wire = None if e is None else e.segments_wire
        if wire is not None:
            left -= len(wire[1])
            if left < 0:
                wire = None
        out.append(wire)
    return out
