"""The Maru metadata server: one ZeroMQ ROUTER socket, one thread, one dispatch table.

Everything that touches the registry, the leases and SQLite runs on the event loop's thread, so
none of it needs a lock. Per request: decode header, decode body, validate, act, flush SQL if the
committed set changed, reply. No request is answered before its changes are durable.

Robustness promises (tested by the fuzz test):
- every frame with a readable 16-byte header gets exactly one reply with its request id echoed;
  a shorter frame (or a broken envelope) is dropped and counted in ``malformed_frames``;
- a bad frame never raises out of the loop and never changes state: fields are validated before
  anything is mutated;
- nothing a client sends is kept beyond its request, except its lease, reservations, pins and
  info map, which are bounded (the pool; ``MAX_CLIENT_INFO_BYTES`` per lease) and reaped when the
  lease expires.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import zmq

from maru import protocol as P
from maru.config import MaruConfig, format_size
from maru.errors import ConfigError, MaruError, ProtocolError
from maru.pool.allocator import ExtentAllocator
from maru.pool.backing import PoolInfo, open_pool, remove_created_pool
from maru.pool.perms import FileAccess
from maru.protocol import ErrorCode, Op
from maru.server import validate as V
from maru.server.auth import Caller, auth_from_config
from maru.server.leases import LeaseTable
from maru.server.locks import FileLock
from maru.server.quarantine import QuarantineBook
from maru.server.registry import KeyRegistry
from maru.server.state import TICK_FLUSH_S, StateStore, StateWriteError
from maru.server.stats import ServerStats, start_metrics_server
from maru.server.tenants import OpenAccess, TenantAccess

log = logging.getLogger("maru.server")


class _StopServing(Exception):
    """Raised by the signal handler to break a blocked receive (see ``request_stop``)."""


# zmq closes a peer that sends a message larger than this (protects our memory). Frames between
# MAX_FRAME_BYTES and this still arrive and get a "too_large" reply.
ZMQ_MAXMSGSIZE = 2 * P.MAX_FRAME_BYTES


class MaruServer:
    """One pool, one registry, one ROUTER socket. ``start()`` binds; ``serve_forever()`` runs."""

    def __init__(self, cfg: MaruConfig, pool_size: int | None = None, alignment: int | None = None) -> None:
        """``pool_size``/``alignment`` None: take them from an existing pool (or the defaults)."""
        self.cfg = cfg
        self._requested_size = pool_size
        self._requested_alignment = alignment
        self.server_id = secrets.token_hex(8)
        self.stats = ServerStats()
        self.leases = LeaseTable(cfg.lease_timeout_s)
        self.quarantine = QuarantineBook(cfg.quarantine_timeout_s)
        self._stop = False
        self._in_recv = False
        self._ctx: zmq.Context | None = None
        self._sock: zmq.Socket | None = None
        self._locks: list[FileLock] = []
        self._metrics: Any = None
        self._auth: Any = None  # OpenAuth | CurveAuth, made in start() (it reads key files)
        self._access: OpenAccess | TenantAccess = OpenAccess()
        self.pool: PoolInfo
        self.state: StateStore
        self.registry: KeyRegistry
        self.max_object_size: int
        self._dispatch: dict[int, Callable[[Any, dict[str, Any]], dict[str, Any]]] = {
            Op.HANDSHAKE: self._handshake,
            Op.RESERVE: self._reserve,
            Op.COMMIT: self._commit,
            Op.ABORT: self._abort,
            Op.LOOKUP: self._lookup,
            Op.EXISTS: self._exists,
            Op.PIN: self._pin,
            Op.UNPIN: self._unpin,
            Op.DELETE: self._delete,
            Op.HEARTBEAT: self._heartbeat,
            Op.STATS: self._stats,
            Op.USAGE: self._usage,
            Op.REPORT: self._report,
        }
        # Ops that act on a client's reservations or pins need a live lease.
        self._needs_lease = {Op.RESERVE, Op.COMMIT, Op.ABORT, Op.PIN, Op.UNPIN}
        # Ops that may change the committed set: refused up front while the state is unwritable.
        # (RESERVE may evict; a reservation is volatile, but its COMMIT would be refused anyway.)
        self._writes = {Op.RESERVE, Op.COMMIT, Op.DELETE}

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        """Bind the socket, open the pool and the state, rebuild the registry. Raises MaruError."""
        try:
            self._auth = auth_from_config(
                self.cfg.host, self.cfg.curve_secret_key, self.cfg.allowed_clients, self.cfg.insecure
            )
            if self.cfg.tenants:
                if not self._auth.enabled:
                    raise ConfigError(
                        "--tenants needs --curve-secret-key: tenants are told apart by client keys"
                    )
                self._access = TenantAccess.from_file(self.cfg.tenants)
            self._bind()
            self._open_pool_and_state()
            self._access.attach(self.registry)
            if self.cfg.metrics_port:
                try:
                    self._metrics = start_metrics_server(self.cfg.metrics_port, self.snapshot)
                except OSError as e:
                    raise ConfigError(
                        f"cannot serve metrics on 127.0.0.1:{self.cfg.metrics_port}: {e.strerror}; "
                        "pick another --metrics-port"
                    ) from None
        except BaseException:
            # A failed start removes what it created (a new pool file, a new state dir), never
            # anything that existed before.
            pool, state = getattr(self, "pool", None), getattr(self, "state", None)
            self.close()
            if state is not None:
                state.remove_created()
            if pool is not None:
                remove_created_pool(pool)
            raise

    def _bind(self) -> None:
        ctx = self._ctx = zmq.Context()
        sock = self._sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a vanished client must not raise on reply
        # Per peer: a request/reply client has a few requests in flight, so 1000 queued messages
        # is plenty, and it bounds what one flooding peer can make us buffer.
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.SNDHWM, 10_000)  # replies are small; a slow reader must not lose them
        sock.setsockopt(zmq.MAXMSGSIZE, ZMQ_MAXMSGSIZE)
        self._auth.apply(ctx, sock)
        try:
            sock.bind(self.cfg.url)
        except zmq.ZMQError as e:
            if e.errno == zmq.EADDRINUSE:
                raise ConfigError(
                    f"cannot listen on {self.cfg.url}: the address is already in use (another maru server?); "
                    f"stop that process or pass another --port"
                ) from None
            raise ConfigError(f"cannot listen on {self.cfg.url}: {e}; check --host and --port") from None

    def _open_pool_and_state(self) -> None:
        cfg = self.cfg
        path = cfg.resolved_pool_path()
        access = FileAccess.for_group(cfg.group)
        self.pool = pool = open_pool(
            path, self._requested_size, self._requested_alignment, cfg.sysfs_root, access=access
        )
        self._locks.append(FileLock(pool.path, "pool"))
        self.state = StateStore(cfg.state_dir, access)  # takes the state dir's lock
        self.state.bind_pool(pool)
        max_obj = cfg.max_object_size or pool.data_size
        if max_obj <= 0 or max_obj > pool.data_size:
            raise ConfigError(
                f"--max-object-size {format_size(max_obj)} must be between 1 byte and the pool's data size "
                f"({format_size(pool.data_size)})"
            )
        self.max_object_size = max_obj
        rows = self.state.load_entries()
        alloc, rejected = ExtentAllocator.from_used(
            pool.data_offset, pool.pool_size, pool.alignment, [(r[1], r[2]) for r in rows]
        )
        if rejected:
            dropped = [rows[i][0] for i in rejected]
            log.error(
                "state %s had %d entries outside the pool or overlapping others; dropped them: %s",
                self.state.path,
                len(dropped),
                dropped[:10],
            )
            self.state.drop_entries(dropped)
            bad = set(rejected)
            rows = [r for i, r in enumerate(rows) if i not in bad]
        # Alloc ids never repeat across restarts, so a commit of a pre-restart reservation can
        # never hit a reservation made after the restart.
        self.registry = KeyRegistry(alloc, self.state, first_alloc_id=secrets.randbits(40) << 20)
        self.registry.load(rows)
        log.info(
            "loaded %d committed entries (%s) from %s",
            len(rows),
            format_size(alloc.used_bytes),
            self.state.path,
        )

    def ready_line(self) -> str:
        p = self.pool
        return (
            f"maru server ready on {self.cfg.url} pool={p.path} ({p.kind}) size={format_size(p.pool_size)} "
            f"uuid={p.uuid} entries={self.registry.entries} state={self.state.dir}"
        )

    def request_stop(self, *_: Any) -> None:
        self._stop = True
        # A signal that lands while the loop is blocked in recv() interrupts it at once (pyzmq
        # lets a handler's exception out of an interrupted recv), so SIGTERM does not wait for
        # the receive timeout. Never raised while a request is being handled.
        if self._in_recv:
            raise _StopServing

    def serve_forever(self, install_signals: bool = True) -> None:
        """Run the event loop until SIGTERM/SIGINT (or ``request_stop``), then close cleanly."""
        if install_signals:
            signal.signal(signal.SIGTERM, self.request_stop)
            signal.signal(signal.SIGINT, self.request_stop)
        sock = self._sock
        assert sock is not None
        housekeeping_s = max(0.05, min(1.0, self.cfg.lease_timeout_s / 4))
        poll_ms = int(housekeeping_s * 1000)
        next_reap = time.monotonic() + housekeeping_s
        next_ticks = time.monotonic() + TICK_FLUSH_S
        # A blocking receive with a timeout instead of poll()+recv: one wake-up per request, and
        # the timeout still gives housekeeping a turn when the socket is idle.
        sock.setsockopt(zmq.RCVTIMEO, poll_ms)
        # Under CURVE the frames come as zmq.Frame objects, which carry the connection's User-Id.
        recv = partial(sock.recv_multipart, copy=False) if self._auth.enabled else sock.recv_multipart
        on_message = self._on_message
        monotonic = time.monotonic
        try:
            while not self._stop:
                try:
                    self._in_recv = True
                    try:
                        frames = recv()
                    finally:
                        self._in_recv = False
                    on_message(frames)
                except _StopServing:
                    break
                except zmq.Again:
                    pass
                except zmq.ZMQError as e:
                    if e.errno != errno.EINTR:
                        raise
                except Exception:  # handle_frame catches everything; this is the last line of defence
                    log.exception("unexpected error in the event loop; the server keeps serving")
                now = monotonic()
                if now >= next_reap:
                    self.reap()
                    next_reap = now + housekeeping_s
                if now >= next_ticks:
                    self._flush_ticks()
                    next_ticks = now + TICK_FLUSH_S
        finally:
            self.close()

    def close(self) -> None:
        """Close the socket and checkpoint SQLite. Idempotent."""
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        if self._auth is not None:
            self._auth.close()  # the ZAP thread holds a socket of the context: stop it before term()
            self._auth = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
        state = getattr(self, "state", None)
        if state is not None:
            try:
                if hasattr(self, "registry"):
                    state.write_ticks(self.registry.take_touched())
                state.close()
            except Exception:
                log.exception("closing the state database failed")
            del self.state
        if self._metrics is not None:
            try:
                server, thread = self._metrics
                server.shutdown()
            except Exception:
                pass
            self._metrics = None
        for lock in self._locks:
            lock.close()
        self._locks.clear()

    # -- housekeeping -------------------------------------------------------------------------

    def reap(self) -> None:
        """Expire silent clients: their reservations and pins go to quarantine (``quarantine.py``);
        release the quarantine of holders now known dead, or held past ``--quarantine-timeout``."""
        gone = self.leases.expired()
        for lease in gone:
            held = self.registry.quarantine_client(lease.client)
            self.stats.add("leases_expired")
            if held.extents:
                self.quarantine.hold(lease)
                self.stats.add("quarantines")
            log.info(
                "lease of client %r (%s pid %s) expired after %.1f s of silence: %d reservations and pinned "
                "entries (%s) quarantined until it is known dead or fenced%s",
                lease.client,
                lease.host,
                lease.pid,
                self.leases.timeout_s,
                held.extents,
                format_size(held.nbytes),
                "" if not self.quarantine.timeout_s else f" (at most {self.quarantine.timeout_s:g} s)",
            )
        for h, reason in self.quarantine.due():
            self._release_quarantine(h.lease.client, reason)
        if gone and self.state.writable:
            try:
                self._flush()
            except V.Reject:
                pass  # buffered; ``state.recover`` writes it (writes are refused meanwhile)
        if not self.state.writable:
            self.state.recover()  # writes what waits, once space returns (logs when it does)

    def _release_quarantine(self, client: Any, reason: str) -> None:
        size, freed, released = self.registry.release_quarantine(client)
        self.stats.add(f"quarantine_released_{reason.replace(' ', '_')}")
        self.stats.add("reclaimed_reservations", freed)
        self.stats.add("released_pins", released)
        log.info(
            "quarantine of client %r released (%s): %d reservations freed, %d pins released (%s may be reused)",
            client,
            reason,
            freed,
            released,
            format_size(size.nbytes),
        )

    def _flush_ticks(self) -> None:
        if not self.state.writable:
            return  # kept in the registry until the state takes writes again
        try:
            self.state.write_ticks(self.registry.take_touched())
            self.state.maintain()
        except StateWriteError:
            self.stats.add("state_write_errors")
        except Exception:
            log.exception("writing LRU ticks to %s failed", self.state.path)

    def _flush(self) -> None:
        """Make this request's changes durable; a failed write refuses the request (the caller
        undoes what it can; what it cannot stays buffered and is written by ``state.recover``)."""
        if not self.state.dirty:
            return
        try:
            self.state.flush()
        except StateWriteError as e:
            self.stats.add("state_write_errors")
            raise V.Reject(ErrorCode.STATE_UNWRITABLE, str(e)) from None
        self.stats.add("sql_transactions")

    # -- one message --------------------------------------------------------------------------

    def _on_message(self, parts: list[Any]) -> None:
        # ROUTER gives [identity, frame] from a DEALER, [identity, b"", frame] from a REQ-style peer.
        if len(parts) < 2 or len(parts) > 3:
            self.stats.add("malformed_frames")
            return
        user = ""
        if type(parts[0]) is not bytes:  # zmq.Frame (CURVE): the key is the connection's, not the body's
            user = parts[-1].get("User-Id") or ""
            parts = [p.bytes for p in parts]
        if len(parts) == 3 and parts[1]:
            self.stats.add("malformed_frames")
            return
        reply = self.handle_frame(parts[-1], user, parts[0])
        if reply is None:
            return
        try:
            self._sock.send_multipart([*parts[:-1], reply], zmq.NOBLOCK)  # type: ignore[union-attr]
        except zmq.ZMQError:
            pass  # the client is gone or not reading; its lease will expire

    def handle_frame(self, frame: bytes, user: str = "", conn: bytes = b"") -> bytes | None:
        """Answer one frame from connection ``conn`` of ``user`` (its CURVE key, "" if anonymous);
        None for a frame too short to carry a header (no id to echo)."""
        if len(frame) < P.HEADER_SIZE:
            self.stats.add("malformed_frames")
            return None
        magic, version, op, req_id = P.HEADER.unpack_from(frame)
        reply_op = (op | P.REPLY_BIT) & 0xFFFF
        try:
            body = self._handle(magic, version, op, frame, user, conn)
        except V.Reject as r:
            self.stats.errors[r.code.value] += 1
            body = P.error(r.code, r.message)
        except Exception as e:  # a bug must cost one request, never the server
            log.exception("internal error handling op %s", op)
            self.stats.errors[ErrorCode.INTERNAL.value] += 1
            body = P.error(ErrorCode.INTERNAL, f"internal server error: {type(e).__name__}: {e}")
        try:
            return P.encode(reply_op, req_id, body)
        except ProtocolError as e:
            self.stats.errors[ErrorCode.TOO_LARGE.value] += 1
            return P.encode(reply_op, req_id, P.error(ErrorCode.TOO_LARGE, f"reply too large: {e}"))

    def _handle(
        self, magic: bytes, version: int, op: int, frame: bytes, user: str, conn: bytes
    ) -> dict[str, Any]:
        if magic != P.MAGIC:
            raise V.Reject(ErrorCode.MALFORMED, f"bad magic {magic!r}: not a Maru frame")
        if version != P.PROTOCOL_VERSION:
            raise V.Reject(
                ErrorCode.VERSION,
                f"protocol version {version} is not supported; this server speaks {P.PROTOCOL_VERSION}: "
                "upgrade the older of client and server",
            )
        handler = self._dispatch.get(op)
        if handler is None:
            self.stats.requests["unknown"] += 1
            raise V.Reject(ErrorCode.UNKNOWN_OP, f"unknown op {op}")
        self.stats.requests[Op(op).name.lower()] += 1
        if len(frame) > P.MAX_FRAME_BYTES:
            raise V.Reject(ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes is over {P.MAX_FRAME_BYTES}")
        try:
            body = P.decode_request(frame)
        except ProtocolError as e:
            raise V.Reject(ErrorCode.MALFORMED, str(e)) from None
        # Sessions belong to the connection (and its key), never to a client_id alone.
        client = Caller(user, conn, V.client_id(body))
        self._access.check(op, client, body, self.registry)
        if op in self._needs_lease or (op == Op.LOOKUP and body.get("pin") is True):
            if not self.leases.renew(client):
                raise V.Reject(
                    ErrorCode.UNKNOWN_CLIENT,
                    f"client {client.client_id!r} has no lease on this connection (no handshake, or silent past {self.leases.timeout_s:g} s, "
                    "or the server restarted): handshake again",
                )
        elif op != Op.HEARTBEAT:
            self.leases.renew(client)
        state = self.state
        if op in self._writes and not state.writable:
            raise V.Reject(ErrorCode.STATE_UNWRITABLE, state.unwritable_message())
        changes = state.changes
        reply = handler(client, body)
        if state.changes != changes:
            self._flush()  # durable before the client hears "stored"
        return reply

    # -- handlers (validate everything first, then act) ----------------------------------------

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
        results = self._commit_durably(client, items, checksums)
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

    def _commit_durably(
        self, client: Any, items: list[list[Any]], checksums: list[int | None]
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
            r = results[i] = reg.commit(client, key, alloc_id, checksums[i])
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
            results[i] = reg.commit(client, items[i][0], items[i][1], checksums[i])
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
        if "info" in body:
            info = V.info_field(body)  # validated before the lease is touched: a bad request changes nothing
            return P.ok(server_id=self.server_id, known=self.leases.set_info(client, info))
        return P.ok(server_id=self.server_id, known=self.leases.renew(client))

    def _stats(self, client: Any, body: dict[str, Any]) -> dict[str, Any]:
        # ``clients`` is only in the STATS reply, not in ``snapshot`` (the Prometheus thread reads
        # that one, and must not walk the lease table while the event loop changes it).
        return P.ok(**self.snapshot(), **self.clients_view(viewer=client))

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

    # -- views --------------------------------------------------------------------------------

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
            protocol_version=P.PROTOCOL_VERSION,
            pid=os.getpid(),
        )
        return snap


def run_server(cfg: MaruConfig, pool_size: int | None, alignment: int | None, ready_stream=sys.stderr) -> int:
    """Start, announce readiness on ``ready_stream``, serve until a signal. Returns an exit code."""
    server = MaruServer(cfg, pool_size, alignment)
    try:
        server.start()
    except MaruError as e:
        print(f"maru server: error: {e}", file=sys.stderr, flush=True)
        return 2
    print(server.ready_line(), file=ready_stream, flush=True)
    server.serve_forever()
    log.info("maru server on %s stopped", cfg.url)
    return 0
