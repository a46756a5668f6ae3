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
from maru.server.handlers import RequestHandlers
from maru.server.key_index import ServerKeyIndex
from maru.server.leases import LeaseTable
from maru.server.locks import FileLock
from maru.server.quarantine import QuarantineBook
from maru.server.registry import KeyRegistry
from maru.server.state import TICK_FLUSH_S, StateStore, StateWriteError
from maru.server.stats import ServerStats, start_metrics_server
from maru.server.tenants import OpenAccess, TenantAccess
from maru.server.views import ServerViews

log = logging.getLogger("maru.server")


class _StopServing(Exception):
    """Raised by the signal handler to break a blocked receive (see ``request_stop``)."""


# zmq closes a peer that sends a message larger than this (protects our memory). Frames between
# MAX_FRAME_BYTES and this still arrive and get a "too_large" reply.
ZMQ_MAXMSGSIZE = 2 * P.MAX_FRAME_BYTES


class MaruServer(RequestHandlers, ServerViews):
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
        self.key_index: ServerKeyIndex
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
        # HANDOVER: a client that reconnects (after a timeout it drops its socket) keeps its routing
        # id, since its session is keyed by it. Without handover a reconnect that arrives before we
        # have retired the old connection is "ignored as a duplicate", and libzmq then swallows its
        # first request as a routing id: the request is lost and the client times out. With it the
        # newest connection takes the id. Routing ids are 17 random bytes a client never shows, and
        # reservations also belong to the CURVE user, so this hands nothing to another client.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
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
        if not cfg.key_index:
            self.key_index = ServerKeyIndex.off("--no-key-index")
        else:
            fps = self._access.index_fingerprints()
            self.key_index = ServerKeyIndex.open(pool, access, self.housekeeping_s, fps)
        if self.key_index.writer is not None:
            self.key_index.writer.add_many(r[0] for r in rows)
        self.registry.journal = self.key_index.journal(self.registry.journal)
        log.info(
            "loaded %d committed entries (%s) from %s",
            len(rows),
            format_size(alloc.used_bytes),
            self.state.path,
        )

    @property
    def housekeeping_s(self) -> float:
        """The longest the event loop goes between two housekeeping turns (reaping, index beats)."""
        return max(0.05, min(1.0, self.cfg.lease_timeout_s / 4))

    def ready_line(self) -> str:
        p = self.pool
        return (
            f"maru server ready on {self.cfg.url} pool={p.path} ({p.kind}) size={format_size(p.pool_size)} "
            f"uuid={p.uuid} entries={self.registry.entries} state={self.state.dir} "
            f"spin={self.cfg.resolved_spin_us()}us"
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
        housekeeping_s = self.housekeeping_s
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
        spin_s = self.cfg.resolved_spin_us() * 1e-6
        try:
            while not self._stop:
                try:
                    self._in_recv = True
                    try:
                        frames = recv()
                    finally:
                        self._in_recv = False
                    on_message(frames)
                    if spin_s:  # the next request of a burst is then answered without a wake-up
                        _poll_for_next(sock, spin_s)
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
                    self.key_index.beat()  # readers of the key index see the server alive
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
        key_index = getattr(self, "key_index", None)
        if key_index is not None:
            key_index.close()
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
        t0 = time.perf_counter()
        magic, version, op, req_id = P.HEADER.unpack_from(frame)
        try:
            return self._answer(magic, version, op, req_id, frame, user, conn)
        finally:
            self.stats.add_service(op, time.perf_counter() - t0)

    def _answer(
        self, magic: bytes, version: int, op: int, req_id: int, frame: bytes, user: str, conn: bytes
    ) -> bytes:
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


def _poll_for_next(sock: zmq.Socket, spin_s: float) -> None:
    """Poll up to ``spin_s`` for the next frame without sleeping (``--spin-us``), so that one
    following within that time is answered without a thread wake-up; the blocking receive after
    this returns at once then, or sleeps as before."""
    until = time.perf_counter() + spin_s
    events = zmq.EVENTS
    while not int(sock.getsockopt(events)) & 1:  # ZMQ_POLLIN; int(): the flag enum's & is slow
        if time.perf_counter() >= until:
            return
