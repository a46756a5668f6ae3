"""``MaruHandler``: the client of one ``maru server``.

Data never goes through the server: ``alloc`` reserves space, the caller writes the bytes
straight into its own mapping of the pool, and ``store`` publishes the key (a visible key
means complete bytes). ``retrieve`` looks a key up (and pins it, so it cannot be evicted
while read) and returns a view of the same memory. Every batch call is one round trip per
``MAX_BATCH`` items.

Sessions. A handshake starts a *session* with the server; reservations and pins belong to
it. A background thread heartbeats; when the server forgets this client (it restarted, or
the lease expired) the handler handshakes again on its own, re-pins what the caller still
holds, and carries on. Reservations made in an earlier session cannot be stored any more:
``store`` raises ``StaleAllocationError`` and publishes nothing.

Client info. ``set_client_info`` describes this client to operators (``maru stats``,
``maru doctor``): the map goes with every handshake and, when it changes, with the next
heartbeat (or at once), so the server shows the latest one even after it restarted.

Threading. A handler may be shared by threads: calls take turns on one socket (one lock);
no call waits longer than ``timeout_s`` for the lock, nor longer than ``timeout_s`` for its reply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
import weakref
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from maru import protocol
from maru.client.mapping import PoolMapping
from maru.client.objects import Allocation, AllocState, Retrieved
from maru.client.replies import (
    INFO_REFUSALS,
    ServerInfo,
    check_keys,
    chunks,
    error_from_reply,
    plain_info,
    reply_list,
)
from maru.client.rpc import CurveKeys, RpcChannel
from maru.config import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_REQUEST_TIMEOUT_S,
    DEFAULT_SERVER_URL,
    format_size,
)
from maru.errors import (
    HandlerClosedError,
    MaruError,
    MaruTimeoutError,
    NotConnectedError,
    PoolError,
    PoolFullError,
    ProtocolError,
    ServerError,
    StaleAllocationError,
)
from maru.protocol import CommitResult, ErrorCode, Op

log = logging.getLogger("maru.client")


class MaruHandler:
    """Client of one ``maru server``: reserve, write, publish, look up, read. See module docs."""

    def __init__(
        self,
        url: str = DEFAULT_SERVER_URL,
        *,
        timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        pool_path: str | None = None,
        server_public_key: str | None = None,
        client_key: str | None = None,
    ) -> None:
        """``server_public_key`` (z85 text or ``.key`` file) and ``client_key`` (this client's
        ``.key_secret`` file) connect to a CURVE server; both absent: $MARU_SERVER_PUBLIC_KEY and
        $MARU_CLIENT_KEY, else a plain connection (a loopback server). See docs/security.md."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        self.url = url
        self.client_id = uuid.uuid4().hex
        self.timeout_s = float(timeout_s)
        self._pool_path_override = pool_path
        self._rpc = RpcChannel(url, CurveKeys.resolve(server_public_key, client_key))
        # One RLock orders every exchange with the server and every session change, so a
        # COMMIT can never race a re-handshake (which would invalidate its reservations).
        self._lock = threading.RLock()
        self._session = 0
        self._info: ServerInfo | None = None
        self._mapping: PoolMapping | None = None
        self._old_mappings: list[PoolMapping] = []
        self._reserved: dict[int, Allocation] = {}
        self._pins: Counter[str] = Counter()
        self._pending_unpins: list[str] = []
        self._closed = False
        self._connected = False
        self._pid = os.getpid()
        # Client info: ``_client_info_version`` counts set_client_info calls (under its own lock, so
        # setting never waits on the connection); ``_client_info_sent`` is the version the server
        # holds now (changed under ``_lock``, with the exchange that delivered it).
        self._client_info_lock = threading.Lock()
        self._client_info: dict[str, Any] | None = None
        self._client_info_version = 0
        self._client_info_sent = 0
        self._warned_info_unsupported = False
        try:
            self._handshake()
        except BaseException:
            self._rpc.close()
            raise
        self._heartbeat_interval_s = self._pick_interval(heartbeat_interval_s)
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=_heartbeat_loop,
            args=(weakref.ref(self), self._stop, self._heartbeat_interval_s),
            name=f"maru-heartbeat-{self.client_id[:8]}",
            daemon=True,
        )
        self._heartbeat.start()

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

    def _handshake(self) -> None:
        """Start a new session: handshake, map the pool if it is a new one, re-pin held entries."""
        with self._lock:
            body: dict[str, Any] = {
                "client_id": self.client_id,
                "host": socket.gethostname(),
                "pid": os.getpid(),
            }
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
            if self._mapping is None or self._mapping.uuid != info.pool_uuid:
                new = self._map_pool(info)
                if self._mapping is not None:
                    log.warning("maru server now serves another pool (%s); remapped", info.pool_uuid)
                    self._old_mappings.append(self._mapping)
                self._mapping = new
            first = self._info is None
            self._info = info
            self._session += 1
            self._connected = True
            # Reservations of the last session died with it: the new session may hand their space
            # to someone else, so release their buffers now (a late write then raises, not corrupts).
            for obj in self._reserved.values():
                obj._finish(AllocState.ABORTED)
            self._reserved.clear()
            self._pending_unpins.clear()
            if not first:
                log.info("maru client %s: new session with server %s", self.client_id[:8], info.server_id)
                self._repin()

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

    def _repin(self) -> None:
        """Pins died with the old session; pin again what the caller still holds."""
        keys = list(self._pins.elements())
        if not keys:
            return
        lost: list[str] = []
        for chunk in chunks(keys):
            reply = self._call(Op.PIN, {"keys": chunk}, retry=False)
            lost += [
                k for k, ok in zip(chunk, reply_list(reply, "pinned", len(chunk)), strict=True) if not ok
            ]
        if lost:
            log.warning(
                "%d retrieved entries vanished while the server was away (e.g. %r); their views are "
                "no longer protected: release them",
                len(lost),
                lost[0],
            )

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
        elif body:
            self._client_info_sent = info_version
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
        with self._client_info_lock:
            return self._client_info_version, self._client_info

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

    # ----------------------------------------------------------------- info
    @property
    def server_info(self) -> ServerInfo:
        """The handshake of the current session (pool path, UUID, sizes, lease)."""
        assert self._info is not None
        return self._info

    @property
    def connected(self) -> bool:
        """False since the last exchange with the server failed (until one succeeds again)."""
        return self._connected and not self._closed

    @property
    def pool_buffer(self) -> Any:
        """The ``mmap`` of the whole pool (e.g. to register it with CUDA once)."""
        return self._mapped().mmap

    @property
    def pool_address(self) -> int:
        """Virtual address of the first byte of the pool mapping in this process."""
        return self._mapped().address

    def _mapped(self) -> PoolMapping:
        if self._mapping is None or self._closed:
            raise HandlerClosedError("this MaruHandler was closed; create a new MaruHandler")
        return self._mapping

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

    # ----------------------------------------------------------------- write path
    def alloc(self, size: int) -> Allocation:
        """Reserve ``size`` bytes; write them into ``obj.buf``, then ``store`` (or ``abort``)."""
        return self.batch_alloc([size])[0]

    def batch_alloc(self, sizes: Sequence[int]) -> list[Allocation]:
        """Reserve one object per size (one round trip per MAX_BATCH). All or nothing:
        if any does not fit even after eviction, the others are given back and PoolFullError is raised.
        """
        sizes = list(sizes)
        info = self.server_info
        for s in sizes:
            if isinstance(s, bool) or not isinstance(s, int) or s <= 0:
                raise ValueError(f"object sizes are positive ints, got {s!r}")
            if s > info.max_object_size:
                raise ValueError(
                    f"object of {s} bytes is over the server's max object size "
                    f"{info.max_object_size} ({format_size(info.max_object_size)}); split it"
                )
        out: list[Allocation] = []
        with self._held():
            try:
                for chunk in chunks(sizes):
                    reply = self._call(Op.RESERVE, {"sizes": chunk})
                    mapping = self._mapped()
                    missing = 0
                    for want, a in zip(chunk, reply_list(reply, "allocs", len(chunk)), strict=True):
                        if a is None:
                            missing += 1
                            continue
                        alloc_id, offset, size = int(a[0]), int(a[1]), int(a[2])
                        if size < want:
                            raise ProtocolError(f"server reserved {size} bytes for a {want}-byte object")
                        obj = Allocation(
                            alloc_id,
                            offset,
                            want,
                            self._session,
                            mapping.view(offset, want),
                            owner=self.client_id,
                        )
                        self._reserved[alloc_id] = obj
                        out.append(obj)
                    if missing:
                        raise PoolFullError(
                            f"pool {info.pool_path} ({format_size(info.data_size)}) is full: {missing} of "
                            f"{len(sizes)} objects do not fit even after evicting every unpinned entry; "
                            "raise `maru server --pool-size`, store smaller objects, or release retrieved "
                            "handles sooner (pinned entries cannot be evicted)"
                        )
                if any(o.session != self._session for o in out):
                    # A new session began between two chunks: the earlier chunks' reservations died.
                    raise StaleAllocationError(
                        f"maru server at {self.url} restarted (or this client's lease expired) during "
                        f"batch_alloc of {len(sizes)} objects; nothing is reserved: call it again"
                    )
            except BaseException:
                self._abort_quietly(out)
                raise
        return out

    def _abort_quietly(self, objs: list[Allocation]) -> None:
        try:
            self.abort(objs)
        except MaruError as e:
            log.warning(
                "could not give back %d reservations (%s); the server reclaims them with the lease",
                len(objs),
                e,
            )

    def abort(self, objs: Allocation | Sequence[Allocation]) -> int:
        """Give back reservations that will not be stored. Returns how many the server freed."""
        items = [objs] if isinstance(objs, Allocation) else list(objs)
        live: list[Allocation] = []
        with self._held():
            for obj in items:
                if obj.owner != self.client_id:
                    raise ValueError(f"{obj!r} was reserved by another MaruHandler; abort it with that one")
            for obj in items:
                if not obj.reserved:
                    continue
                if obj.session == self._session and self._reserved.get(obj.alloc_id) is obj:
                    live.append(obj)
                    del self._reserved[obj.alloc_id]
                obj._finish(AllocState.ABORTED)
            freed = 0
            for chunk in chunks(live):
                reply = self._call(Op.ABORT, {"alloc_ids": [o.alloc_id for o in chunk]}, retry=False)
                freed += int(reply.get("freed", 0))
        return freed

    def store(self, key: str, obj: Allocation) -> CommitResult:
        """Publish ``obj`` under ``key``: from now on everyone sees the key with these bytes.

        Returns ``CommitResult.STORED``, or ``CommitResult.PRESENT`` when the key existed already
        (keys are write-once: this object's space is freed). Either way ``obj.buf`` is released.
        """
        return self.batch_store([key], [obj])[0]

    def batch_store(self, keys: Sequence[str], objs: Sequence[Allocation]) -> list[CommitResult]:
        """Publish many objects, one COMMIT round trip per MAX_BATCH. Per key: STORED or PRESENT.

        Raises ``StaleAllocationError`` (publishing nothing) if an object was reserved before the
        server restarted or this client's lease expired.
        """
        keys = check_keys(keys)
        objs = list(objs)
        if len(keys) != len(objs):
            raise ValueError(f"batch_store got {len(keys)} keys but {len(objs)} objects")
        results: list[CommitResult] = []
        with self._held():
            stale = []
            for k, obj in zip(keys, objs, strict=True):
                if not isinstance(obj, Allocation):
                    raise TypeError(f"store takes an Allocation from alloc(), got {type(obj).__name__}")
                if obj.owner != self.client_id:
                    raise ValueError(
                        f"object for key {k!r} was reserved by another MaruHandler; store it with that one"
                    )
                if obj.state is not AllocState.RESERVED and obj.session == self._session:
                    raise ValueError(f"object for key {k!r} is already {obj.state.value}; alloc a new one")
                if obj.session != self._session or self._reserved.get(obj.alloc_id) is not obj:
                    stale.append(k)
            if stale:
                raise StaleAllocationError(
                    f"{len(stale)} objects (e.g. for key {stale[0]!r}) were reserved before maru server at "
                    f"{self.url} restarted or this client's lease expired; nothing was stored: alloc again"
                )
            for kchunk, ochunk in zip(chunks(keys), chunks(objs), strict=True):
                try:
                    reply = self._call(
                        Op.COMMIT,
                        {"items": [[k, o.alloc_id] for k, o in zip(kchunk, ochunk, strict=True)]},
                        retry=False,
                    )
                except StaleAllocationError as e:
                    # The server forgot us before this chunk; earlier chunks (in ``results``) are stored.
                    e.results = results  # type: ignore[attr-defined]
                    raise
                for k, o, r in zip(kchunk, ochunk, reply_list(reply, "results", len(kchunk)), strict=True):
                    self._reserved.pop(o.alloc_id, None)
                    res = CommitResult(r)
                    if res is CommitResult.UNKNOWN_ALLOC:
                        stale.append(k)
                        o._finish(AllocState.ABORTED)
                    else:
                        o._finish(AllocState.STORED if res is CommitResult.STORED else AllocState.PRESENT)
                    results.append(res)
        if stale:
            err = StaleAllocationError(
                f"maru server at {self.url} no longer knew the reservations of {len(stale)} keys (e.g. "
                f"{stale[0]!r}): the lease expired or the server restarted; those keys were not stored"
            )
            err.results = results  # type: ignore[attr-defined]
            raise err
        return results

    def delete(self, keys: Sequence[str]) -> list[bool]:
        """Remove keys; per key True if it was removed (False: absent).

        A removed key is invisible at once; if readers still hold it pinned, its space is freed
        when the last of them releases it (their views stay valid until then).
        """
        keys = check_keys(keys)
        out: list[bool] = []
        for chunk in chunks(keys):
            out += [
                bool(x) for x in reply_list(self._call(Op.DELETE, {"keys": chunk}), "deleted", len(chunk))
            ]
        return out

    # ----------------------------------------------------------------- read path
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is committed now."""
        keys = check_keys(keys)
        out: list[bool] = []
        for chunk in chunks(keys):
            out += map(bool, reply_list(self._call(Op.EXISTS, {"keys": chunk}), "present", len(chunk)))
        return out

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are committed (stops at the first miss): a prefix match."""
        keys = check_keys(keys)
        total = 0
        for chunk in chunks(keys):
            n = int(self._call(Op.EXISTS, {"keys": chunk})["prefix"])
            total += n
            if n < len(chunk):
                break
        return total

    def retrieve(self, key: str, pin: bool = True) -> Retrieved | None:
        """Look ``key`` up. None if absent; else a handle whose ``view`` reads the pool. Release it."""
        return self.batch_retrieve([key], pin=pin)[0]

    def batch_retrieve(self, keys: Sequence[str], pin: bool = True) -> list[Retrieved | None]:
        """Look many keys up, one LOOKUP round trip per MAX_BATCH; None for each absent key.

        With ``pin`` (default) every hit stays pinned until its handle is released. Without it the
        entry may be evicted and its space reused while you read: copy out at once, or pin.
        """
        keys = check_keys(keys)
        out: list[Retrieved | None] = []
        with self._held():
            for chunk in chunks(keys):
                reply = self._call(Op.LOOKUP, {"keys": chunk, "pin": bool(pin)})
                entries = reply_list(reply, "entries", len(chunk))
                views = self._mapped().read_views(entries)
                on_release = self._unpin_one if pin else None
                pins = self._pins
                for k, e, view in zip(chunk, entries, views, strict=True):
                    if view is None:
                        out.append(None)
                        continue
                    if pin:
                        pins[k] += 1
                    out.append(Retrieved(k, e[0], view, pin, on_release))
        return out

    def batch_release(self, handles: Iterable[Retrieved | None]) -> None:
        """Release many retrieve handles with one UNPIN round trip (None entries are skipped)."""
        keys: list[str] = []
        for r in handles:
            if r is None or r.released:
                continue
            if r.pinned:
                keys.append(r.key)
                r._on_release = None
            r.release()
        self._unpin(keys)

    def _unpin_one(self, r: Retrieved) -> None:
        self._unpin([r.key])

    def _unpin(self, keys: list[str]) -> None:
        if not keys:
            return
        with self._held():
            for k in keys:
                self._pins[k] -= 1
                if self._pins[k] <= 0:
                    del self._pins[k]
            if self._closed:
                return
            try:
                for chunk in chunks(keys):
                    self._call(Op.UNPIN, {"keys": chunk}, retry=False)
            except StaleAllocationError:
                pass  # a new session: the old pins are gone already
            except MaruError as e:
                # The heartbeat thread retries, so the entries do not stay pinned for ever.
                log.warning("unpin of %d keys failed (%s); will retry", len(keys), e)
                self._pending_unpins += keys

    # ----------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Give back open reservations and pins (best effort), stop heartbeats, unmap. Idempotent."""
        if os.getpid() != self._pid:
            self._closed = True  # a forked child: the socket and thread are the parent's; leave them be
            return
        # Bounded like every call: if another thread holds the connection that long, skip the courtesy.
        got = self._lock.acquire(timeout=self.timeout_s)
        try:
            if self._closed:
                return
            if got and self._connected:
                quick = min(self.timeout_s, 1.0)
                try:
                    ids = list(self._reserved)
                    for chunk in chunks(ids):
                        self._call(Op.ABORT, {"alloc_ids": chunk}, retry=False, timeout_s=quick)
                    pins = list(self._pins.elements()) + self._pending_unpins
                    for chunk in chunks(pins):
                        self._call(Op.UNPIN, {"keys": chunk}, retry=False, timeout_s=quick)
                except MaruError as e:
                    log.info(
                        "close: server did not take back reservations/pins (%s); the lease reclaims them", e
                    )
            for obj in self._reserved.values():
                obj._finish(AllocState.ABORTED)
            self._reserved.clear()
            self._closed = True
        finally:
            if got:
                self._lock.release()
        self._stop.set()
        if self._heartbeat is not threading.current_thread():
            self._heartbeat.join(timeout=self.timeout_s)
        self._rpc.close()
        for m in [*self._old_mappings, *([self._mapping] if self._mapping else [])]:
            m.close()

    def __enter__(self) -> MaruHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._connected else "disconnected")
        return f"MaruHandler({self.url!r}, {state}, client_id={self.client_id[:8]})"


def _heartbeat_loop(ref: weakref.ReferenceType[MaruHandler], stop: threading.Event, interval: float) -> None:
    """Beat every ``interval`` seconds; after a failure retry sooner, backing off up to ``interval``."""
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
