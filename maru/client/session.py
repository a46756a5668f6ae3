"""The session half of ``MaruHandler``: handshake, fencing of a lost session, heartbeats,
the one connection lock and the request loop, and the client info it reports.

``SessionClient`` is a base class: ``MaruHandler.__init__`` sets the attributes it uses
(``_rpc``, ``_lock``, ``_session``, ``_token``, ``_mapping``, ``_reserved``, ``_pins``,
``_pinned_extents``, ...). Invariant: a lost session is fenced (``_fence_session``) before the
handshake that starts the next one, and that handshake tells the server so (``fenced``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from maru import protocol
from maru.client.mapping import PoolMapping
from maru.client.objects import AllocState, SessionToken
from maru.client.replies import (
    INFO_REFUSALS,
    ServerInfo,
    chunks,
    error_from_reply,
    plain_info,
)
from maru.client.rpc import never_poll_on_this_thread
from maru.errors import (
    HandlerClosedError,
    MaruError,
    MaruTimeoutError,
    NotConnectedError,
    PoolError,
    ProtocolError,
    ServerError,
    StaleAllocationError,
)
from maru.procinfo import process_start_time, read_boot_id, read_pid_ns
from maru.protocol import ErrorCode, Op

if TYPE_CHECKING:
    from maru.client.handler import MaruHandler

log = logging.getLogger("maru.client")

_BOOT_ID = read_boot_id()
# How long the keys of a lost pinning request are kept to give its pins back: after a socket is
# replaced, the server can apply a request of the old connection only until it has read what was
# already in that connection's pipe (well under a second); a minute is far beyond it.
LOST_PINS_KEPT_S = 60.0
_PID_NS = read_pid_ns()
_START: dict[int, int] = {}


def _own_start_time() -> int:
    """This process's start time in clock ticks (0 if unknown); per pid, so a fork reads its own."""
    pid = os.getpid()
    if pid not in _START:
        _START[pid] = process_start_time(pid) or 0
    return _START[pid]


class SessionClient:
    """Session management shared by every ``MaruHandler`` call (see the module docstring)."""

    # ----------------------------------------------------------------- the server itself
    def ping(self) -> float:
        """One heartbeat round trip; returns its latency in seconds."""
        t0 = time.perf_counter()
        self._call(Op.HEARTBEAT, {}, retry=False)
        return time.perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        """The server's counters and gauges (hits, misses, stores, evictions, bytes...)."""
        reply = self._call(Op.STATS, {})
        reply.pop("ok", None)
        return reply

    def usage(self) -> dict[str, Any]:
        """Pool occupancy: pool_size, data_size, used, free, largest_free, reserved, committed, entries, pinned, clients."""
        reply = self._call(Op.USAGE, {})
        reply.pop("ok", None)
        return reply

    # ----------------------------------------------------------------- session
    def _pick_interval(self, wanted: float) -> float:
        assert self._info is not None
        # Three beats per lease: one lost beat must not cost the lease.
        limit = self._info.lease_timeout_s / 3
        if wanted > limit:
            log.warning(
                "heartbeat interval %.2f s is too long for the server's %.2f s lease; using %.2f s",
                wanted,
                self._info.lease_timeout_s,
                limit,
            )
            return limit
        return wanted

    def _fence_session(self) -> None:
        """Make the lost session's reservations and pinned views unable to touch the pool, and
        revoke their handles. Runs before the new handshake, so the server never reuses space
        this process could still write through. Call with ``_lock`` held."""
        self._token.alive = False
        ranges = [(o.offset, o.size) for o in self._reserved.values()]
        ranges += list(self._pinned_extents)
        fenced = 0
        if ranges and self._mapping is not None:
            try:
                fenced = self._mapping.fence(ranges)
            except MaruError as e:
                # Without a fence the server must keep the space quarantined until it times out.
                log.error(
                    "could not fence %d ranges of the lost session (%s); the server keeps them in quarantine",
                    len(ranges),
                    e,
                )
                fenced = -1
        if fenced >= 0:
            self.integrity_log.fenced(fenced)
            self._fence_pending = True
        # Reservations of the last session died with it: release their buffers now (a late
        # ``store`` raises StaleAllocationError, a late write lands in fenced private pages).
        for obj in self._reserved.values():
            obj._finish(AllocState.ABORTED)
        self._reserved.clear()
        self._pins.clear()  # the server dropped these pins with the lease
        self._pinned_extents.clear()
        self._pending_unpins.clear()

    def _handshake(self) -> None:
        """Start a new session: fence the old one, handshake, map the pool if it is a new one."""
        with self._lock:
            if self._info is not None and self._token.alive:
                self._fence_session()
            body: dict[str, Any] = {
                "client_id": self.client_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "boot_id": _BOOT_ID,
                "pid_ns": _PID_NS,
                "pid_start": _own_start_time(),
            }
            if self._fence_pending:
                body["fenced"] = True
            info_version, client_info = self._client_info_state()
            if info_version:
                body["info"] = client_info
            reply = self._rpc.request(Op.HANDSHAKE, body, self.timeout_s)
            if not reply.get("ok") and "info" in body and reply.get("code") in INFO_REFUSALS:
                # A server with other limits refused the info: connect without it, say so.
                self._info_refused(error_from_reply(Op.HANDSHAKE, reply, self.url))
                del body["info"]
                reply = self._rpc.request(Op.HANDSHAKE, body, self.timeout_s)
            if not reply.get("ok"):
                raise error_from_reply(Op.HANDSHAKE, reply, self.url)
            self._client_info_sent = info_version
            if info_version and "max_client_info_bytes" not in reply and not self._warned_info_unsupported:
                self._warned_info_unsupported = True
                log.warning(
                    "maru server at %s is older than this client and ignores client info: `maru doctor` "
                    "and `maru stats` will not show this process's data paths; upgrade the server",
                    self.url,
                )
            info = ServerInfo.from_reply(reply)
            if info.protocol_version != protocol.PROTOCOL_VERSION:
                raise ProtocolError(
                    f"maru server at {self.url} speaks protocol {info.protocol_version}, this client "
                    f"{protocol.PROTOCOL_VERSION}; install the same Maru version on both sides"
                )
            if not self._maps_pool:
                pass  # a client that only reports (map_pool=False): no mapping, no local index
            elif self._mapping is None or self._mapping.uuid != info.pool_uuid:
                new = self._map_pool(info)
                if self._mapping is not None:
                    log.warning("maru server now serves another pool (%s); remapped", info.pool_uuid)
                    self._old_mappings.append(self._mapping)
                self._mapping = new
            if self._maps_pool:
                self.local_exists.update(reply, self._mapping, info.pool_path)
            first = self._info is None
            self._info = info
            self._session += 1
            self._token = SessionToken(self._session)
            self._fence_pending = False
            self._connected = True
            if not first:
                log.info("maru client %s: new session with server %s", self.client_id[:8], info.server_id)

    def _map_pool(self, info: ServerInfo) -> PoolMapping:
        path = self._pool_path_override or info.pool_path
        try:
            return PoolMapping(path, info.pool_uuid, info.pool_size, info.data_offset)
        except PoolError:
            if self._pool_path_override is not None:
                raise
            # Another host may see the same device under another /dev/daxX.Y: find it by UUID.
            from maru.pool.backing import is_dax_path, scan_devices

            if not is_dax_path(path):
                raise
            found = scan_devices().get(info.pool_uuid)
            if found is None:
                raise
            log.info("pool %s is %s on this host", info.pool_uuid, found)
            return PoolMapping(found, info.pool_uuid, info.pool_size, info.data_offset)

    def _rehandshake(self, seen_session: int) -> None:
        with self._lock:
            if self._session == seen_session:  # nobody else did it meanwhile
                self._handshake()

    def _acquire(self, timeout: float) -> None:
        """Take the connection lock within ``timeout`` (no call waits longer than its timeout)."""
        if self._lock.acquire(timeout=timeout):
            return
        if not self._connected:  # the heartbeat thread holds the lock while it tries to reconnect
            raise NotConnectedError(
                f"cannot reach maru server at {self.url} (no reply for {timeout:g} s): is `maru server` "
                "running? start it with `maru server` (check with `maru doctor`)"
            )
        raise MaruTimeoutError(
            f"maru server at {self.url}: another thread held this handler's connection for {timeout:g} s "
            "(a slow or unreachable server); check `maru doctor`"
        )

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        """``with self._held():`` is ``with self._lock:`` bounded by ``timeout_s``."""
        self._acquire(self.timeout_s)
        try:
            yield
        finally:
            self._lock.release()

    def _call(
        self, op: int, body: dict[str, Any], *, retry: bool = True, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """One exchange; a forgotten client handshakes again and (if ``retry``) resends once."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        body["client_id"] = self.client_id
        self._acquire(timeout)
        try:
            if self._closed:
                raise HandlerClosedError("this MaruHandler was closed; create a new MaruHandler")
            if os.getpid() != self._pid:
                # A forked child shares the parent's socket: replies would go to either process.
                raise HandlerClosedError(
                    f"this MaruHandler was created in process {self._pid}, not in this forked child "
                    f"{os.getpid()}; create a new MaruHandler in the child (or use the 'spawn' start method)"
                )
            for attempt in (0, 1):
                session = self._session
                try:
                    reply = self._rpc.request(op, body, timeout)
                except (MaruTimeoutError, NotConnectedError):
                    self._connected = False
                    raise
                self._connected = True
                if reply.get("ok"):
                    return reply
                if reply.get("code") == ErrorCode.UNKNOWN_CLIENT.value and attempt == 0:
                    self._rehandshake(session)
                    if retry:
                        continue
                    raise StaleAllocationError(
                        f"maru server at {self.url} had forgotten this client (restart or expired "
                        f"lease) during {Op(op).name}; its reservations are gone: alloc again"
                    )
                raise error_from_reply(op, reply, self.url)
            raise AssertionError("unreachable")
        finally:
            self._lock.release()

    def _lost_pin(self, keys: list[str]) -> None:
        """Note the keys of a request whose fate is unknown, a pinning lookup (applied or not) or
        an UNPIN (not applied or applied): it went out and its reply was lost with its socket or
        could not be read. The heartbeat's pin count tells, and gives back what is stray. Call with
        ``_lock`` held."""
        self._lost_pins.update(keys)
        self._lost_at = time.monotonic()

    def _check_pins(self, server_pins: int) -> None:
        """Compare the session's pins on the server (the heartbeat's reply) with what this handler
        knows of: its handles' pins and the UNPINs it has yet to send. The server answers a
        connection's requests in order, so every earlier request is applied and every earlier
        posted reply was read (this heartbeat read it) when this reply was: the two are equal unless a
        request was lost with its socket, a pinning lookup the server applied after all or an UNPIN
        it never got (``_lost_pin``). Those stray pins are
        given back where their keys are known (``_give_back_stray``); any left are announced once a
        session, and ``stray_pins`` says how many there are. Call with ``_lock`` held."""
        known = sum(self._pins.values()) + len(self._pending_unpins)
        stray = max(0, server_pins - known)
        if stray and self._lost_pins:
            given = self._give_back_stray()
            if given:
                log.info(
                    "maru server at %s held %d pins of this client that none of its handles held "
                    "(requests lost with their connection: lookups applied after all, or UNPINs "
                    "not); %d given back",
                    self.url,
                    stray,
                    given,
                )
            stray = max(0, stray - given)
        elif self._lost_pins and time.monotonic() - self._lost_at > LOST_PINS_KEPT_S:
            self._lost_pins.clear()  # a request lost that long ago can no longer be applied
        self.stray_pins = stray
        self._note_integrity(_stray_note(stray) if stray else None)
        if stray and self._warned_stray_session != self._session:
            self._warned_stray_session = self._session
            log.warning(
                "maru server at %s holds %d pins of this client that none of its handles holds: a "
                "pinning lookup lost with its connection (the server was slow or stopped) was applied "
                "after all, or an UNPIN so lost was not. Those not given back yet (their keys "
                "unknown, or held by a handle too) keep their entries from eviction until they are, "
                "this handler closes or its lease ends; nothing reads through them (docs/client.md, "
                "Threading). integrity() reports stray_pins",
                self.url,
                stray,
            )

    def _give_back_stray(self) -> int:
        """UNPIN the keys of lost requests (``_lost_pin``) that no handle of this handler holds and
        no pending UNPIN names: any pin of this session on such a key is stray, so an UNPIN of it
        takes only those (one per lost request at most; one the server does not hold is a no-op).
        The pins given back. Call with ``_lock`` held."""
        pending = set(self._pending_unpins)
        keys = [
            k
            for k, n in self._lost_pins.items()
            if not self._pins.get(k) and k not in pending
            for _ in range(n)
        ]
        given = 0
        try:
            for chunk in chunks(keys):
                reply = self._call(Op.UNPIN, {"keys": chunk}, retry=False)
                for k, u in zip(chunk, reply.get("unpinned") or (), strict=False):
                    if u is True:  # that lost request's pin is back: it cannot be applied again
                        given += 1
                        self._lost_pins[k] -= 1
            self._lost_pins = +self._lost_pins  # the keys with nothing left to give back go
        except MaruError as e:  # the next heartbeat tries again
            log.info("giving back stray pins failed (%s); the next heartbeat tries again", e)
        return given

    def _post_unpin(self, keys: list[str]) -> bool:
        """Send UNPIN for ``keys`` without waiting (``RpcChannel.post``); False if not sent. Call
        with ``_lock`` held. A lost UNPIN goes to ``_pending_unpins`` (the heartbeat sends it)
        unless its session ended meanwhile (its pins ended with it)."""
        if self._closed or not self._connected or os.getpid() != self._pid:
            return False
        token = self._token

        def on_reply(op: int, reply: Mapping[str, Any]) -> None:
            if not reply.get("ok") and reply.get("code") != ErrorCode.UNKNOWN_CLIENT.value:
                # Only a bug or a protocol mismatch gets here: the lease frees the pins at the end.
                log.warning(
                    "maru server at %s refused an UNPIN of %d keys: %s",
                    self.url,
                    len(keys),
                    reply.get("error", reply.get("code")),
                )

        def on_lost(op: int, body: Mapping[str, Any]) -> None:
            if token is not self._token:
                return
            if self._server_counts_pins:
                # It may have been applied: sent again, it could take the pin of another handle
                # on the same key. The heartbeat's pin count says whether it was, and gives back
                # only pins no handle holds (``_give_back_stray``).
                self._lost_pin(keys)
            else:  # a server that does not count a session's pins: sent again by the heartbeat
                self._pending_unpins += keys

        return (
            self._rpc.post(Op.UNPIN, {"keys": keys, "client_id": self.client_id}, on_reply, on_lost)
            is not None
        )

    def wake(self) -> bool:
        """Post a heartbeat without waiting for it: a request the caller is about to make then
        finds the server awake (``maru server --spin-us`` keeps it polling a while after each
        request) rather than waiting for its thread to be woken. False (nothing sent) when not
        connected or when another thread is talking to the server right now (it is awake then)."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            if self._closed or not self._connected or os.getpid() != self._pid:
                return False
            return self._rpc.post(Op.HEARTBEAT, {"client_id": self.client_id}, _ignore, _ignore) is not None
        finally:
            self._lock.release()

    def _beat(self) -> None:
        """One heartbeat (from the heartbeat thread): renew the lease, notice a lost session."""
        if not self._lock.acquire(timeout=self._heartbeat_interval_s):
            return  # another thread is talking to the server right now (any request renews the lease)
        try:
            if self._closed:
                raise HandlerClosedError("closed")
            self._beat_locked()
        finally:
            self._lock.release()

    def _beat_locked(self) -> None:
        """Heartbeat (carrying the client info if the server lacks its latest version), handshake
        again if the server forgot this client, retry pending unpins. Call with ``_lock`` held."""
        assert self._info is not None
        session = self._session
        info_version, client_info = self._client_info_state()
        body: dict[str, Any] = {}
        if info_version != self._client_info_sent:
            body["info"] = client_info
        timeout = min(self.timeout_s, 2.0)
        try:
            reply = self._call(Op.HEARTBEAT, body, retry=False, timeout_s=timeout)
        except StaleAllocationError:
            return  # the server had forgotten us and _call has handshaken again
        except ServerError as e:
            if not body:
                raise
            # A server with other limits refused the info: the lease matters more than the report.
            self._info_refused(e)
            self._client_info_sent = info_version
            body = {}
            reply = self._call(Op.HEARTBEAT, body, retry=False, timeout_s=timeout)
        if not reply.get("known", True) or reply.get("server_id") != self._info.server_id:
            log.info("maru server at %s forgot this client (restart or expired lease)", self.url)
            self._rehandshake(session)  # the new handshake carries the latest info
        else:
            if body:
                self._client_info_sent = info_version
            if type(reply.get("pins")) is int:  # an older server does not say
                self._server_counts_pins = True
                self._check_pins(reply["pins"])
        self.settle_abandoned()  # type: ignore[attr-defined]  # PostedLookups (posted.py)
        if self._pending_unpins:
            for chunk in chunks(self._pending_unpins):
                self._call(Op.UNPIN, {"keys": chunk}, retry=False)
            self._pending_unpins = []  # only once sent: a failure leaves them for the next beat

    def _info_refused(self, e: MaruError) -> None:
        log.warning(
            "maru server at %s refused this client's info (%s); `maru doctor` and `maru stats` will not "
            "show it. Use the same Maru version for server and clients",
            self.url,
            e,
        )

    def _client_info_state(self) -> tuple[int, dict[str, Any] | None]:
        """(version, the info to send): the caller's info, with this handler's own integrity note
        (stray pins) added to its ``slow`` list while there is one (``maru doctor`` shows it)."""
        with self._client_info_lock:
            version, info, note = self._client_info_version, self._client_info, self._integrity_note
        if note is None:
            if info is None and version:  # only a note was ever sent, and it is gone: a map says so
                return version, {"role": "maru client", "slow": []}
            return version, info
        merged = dict(info) if info is not None else {"role": "maru client"}
        slow = merged.get("slow")
        merged["slow"] = [*(slow if isinstance(slow, list) else []), note]
        if protocol.client_info_problem(merged) is not None:  # no room left: the caller's info alone
            return version, info
        return version, merged

    def _note_integrity(self, note: str | None) -> None:
        """Set the handler's own ``slow`` sentence; a change goes with the next heartbeat."""
        with self._client_info_lock:
            if note != self._integrity_note:
                self._integrity_note = note
                self._client_info_version += 1

    def set_client_info(self, info: Mapping[str, Any]) -> None:
        """Describe this client to operators: ``maru stats`` lists it, ``maru doctor`` judges it.

        ``info`` is a small map (str keys; None, bool, int, float, str, lists and maps of those;
        at most ``protocol.MAX_CLIENT_INFO_BYTES`` encoded). Convention (see ``maru.protocol``):
        ``{"role": str, "paths": {name: value}, "slow": [sentence with reason and fix, ...]}``;
        ``maru doctor`` warns iff ``slow`` is non-empty. Each call replaces the previous info.

        It is kept here and sent at once when the server is reachable, else with the next
        heartbeat; every later handshake (a restarted server) carries it again. Raises
        ``ValueError`` for an info the protocol refuses (nothing is sent then); never raises for
        an unreachable server.
        """
        plain = plain_info(info)
        problem = protocol.client_info_problem(plain)
        if problem is not None:
            raise ValueError(f"set_client_info: {problem[1]}")
        if self._closed:
            raise HandlerClosedError("this MaruHandler was closed; create a new MaruHandler")
        with self._client_info_lock:
            self._client_info_version += 1
            self._client_info = plain
        try:
            with self._held():
                if self._closed:
                    return
                self._beat_locked()
        except (NotConnectedError, MaruTimeoutError) as e:
            log.info("client info kept; it goes to the server once it answers again (%s)", e)

    @property
    def client_info(self) -> dict[str, Any] | None:
        """The info last given to ``set_client_info`` (None before any)."""
        return self._client_info_state()[1]


def _stray_note(stray: int) -> str:
    """The ``slow`` sentence of a client whose session holds ``stray`` pins no handle holds."""
    return (
        f"the server holds {stray} pins of this client's session that none of its handles holds "
        "(requests lost with a replaced connection, applied after all): they keep those entries "
        "from eviction until given back (at a heartbeat, where their keys are known), the client "
        "closes or its lease ends. Fix: find why requests timed out (a stalled or overloaded "
        "server, `maru stats`), or restart this client to release them"
    )


def _ignore(op: int, body: Mapping[str, Any]) -> None:
    """A posted wake-up's reply (or its loss) changes nothing."""


def heartbeat_loop(ref: weakref.ReferenceType[MaruHandler], stop: threading.Event, interval: float) -> None:
    """Beat every ``interval`` seconds; after a failure retry sooner, backing off up to ``interval``."""
    never_poll_on_this_thread()  # nobody waits on a beat: never hold the GIL polling for its reply
    failures = 0
    while True:
        delay = interval if failures == 0 else min(interval, 0.05 * 2**failures)
        if stop.wait(delay):
            return
        h = ref()
        if h is None:
            return
        try:
            h._beat()
            if failures:
                log.info("maru server at %s is reachable again", h.url)
            failures = 0
        except HandlerClosedError:
            return
        except MaruError as e:
            if failures == 0:
                log.warning("lost maru server at %s (%s); retrying in the background", h.url, e)
            failures += 1
        except Exception:  # never let the heartbeat thread die silently
            log.exception("maru heartbeat failed unexpectedly; retrying")
            failures += 1
        finally:
            del h
