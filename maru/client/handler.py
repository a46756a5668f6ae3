"""``MaruHandler``: the client of one ``maru server``.

Data never goes through the server: ``alloc`` reserves space, the caller writes the bytes
straight into its own mapping of the pool, and ``store`` publishes the key (a visible key
means complete bytes). ``retrieve`` looks a key up (and pins it, so it cannot be evicted
while read) and returns a view of the same memory. Every batch call is one round trip per
``MAX_BATCH`` items.

Sessions. A handshake starts a *session* with the server; reservations and pins belong to
it. A background thread heartbeats; when the server forgets this client (it restarted, or
the lease expired) the handler first *fences* the old session (its reservations' and pinned
views' pages of the pool mapping become private memory, so a thread still writing or reading
through them no longer reaches the pool; their handles are revoked), then handshakes again,
telling the server it fenced (so the server may reuse that space), and carries on.
Reservations made in an earlier session cannot be stored any more: ``store`` raises
``StaleAllocationError`` and publishes nothing; retrieved handles of an earlier session are
no longer ``valid``.

Integrity. ``store`` sends the checksum (``maru.checksum``) of each object's bytes, and the segment
sums (``maru.segments``) a caller gives; ``retrieve`` recomputes the checksum over the pinned view
and returns None (a miss) when it differs, counts it (``integrity()``), warns once per key and
reports it to the server (``maru stats``). ``retrieve(..., segments=True)`` also hands the committed
segment sums to a caller that verifies partial reads itself.

Client info. ``set_client_info`` describes this client to operators (``maru stats``,
``maru doctor``): the map goes with every handshake and, when it changes, with the next
heartbeat (or at once), so the server shows the latest one even after it restarted.

Threading. A handler may be shared by threads: calls take turns on one socket (one lock);
no call waits longer than ``timeout_s`` for the lock, nor longer than ``timeout_s`` for its reply.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any

from maru.client import frames
from maru.client.integrity import IntegrityLog, check_hits
from maru.client.local_exists import LocalExists
from maru.client.mapping import PoolMapping
from maru.client.objects import Allocation, AllocState, Retrieved, SessionToken
from maru.client.posted import PostedLookups
from maru.client.replies import ServerInfo, check_keys, chunks, pool_full_error, reply_list
from maru.client.rpc import CurveKeys, RpcChannel
from maru.client.session import SessionClient, heartbeat_loop
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
    PoolError,
    ProtocolError,
    StaleAllocationError,
)
from maru.protocol import CommitResult, Op
from maru.segments import SegmentSums

log = logging.getLogger("maru.client")


class MaruHandler(PostedLookups, SessionClient):
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
        reply_spin_s: float = 0.0,
        map_pool: bool = True,
    ) -> None:
        """``server_public_key`` (z85 text or ``.key`` file) and ``client_key`` (this client's
        ``.key_secret`` file) connect to a CURVE server; both absent: $MARU_SERVER_PUBLIC_KEY and
        $MARU_CLIENT_KEY, else a plain connection (a loopback server). See docs/security.md.
        ``reply_spin_s``: poll for each reply this long before blocking (``maru.client.rpc``).
        ``map_pool=False``: a client that only reports and reads statistics (an off vLLM connector
        telling ``maru doctor`` why): it never maps the pool, and its data calls raise."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s}")
        self.url = url
        self.client_id = uuid.uuid4().hex
        self.timeout_s = float(timeout_s)
        self._pool_path_override = pool_path
        self._maps_pool = map_pool
        self._rpc = RpcChannel(url, CurveKeys.resolve(server_public_key, client_key), reply_spin_s)
        # One RLock orders every exchange with the server and every session change, so a
        # COMMIT can never race a re-handshake (which would invalidate its reservations).
        self._lock = threading.RLock()
        self._session = 0
        self._token = SessionToken(0)
        self._fence_pending = False  # an old session was fenced; the next handshake says so
        self.integrity_log = IntegrityLog()
        self._info: ServerInfo | None = None
        self._mapping: PoolMapping | None = None
        self._old_mappings: list[PoolMapping] = []
        self.local_exists = LocalExists()  # EXISTS from the server's key index, no round trip
        self._reserved: dict[int, Allocation] = {}
        self._pins: Counter[str] = Counter()
        self._pinned_extents: Counter[tuple[int, int]] = Counter()  # (offset, size) of held pins
        self._pending_unpins: list[str] = []
        self._abandoned_posts: list[Any] = []  # posted lookups given up without the lock (posted.py)
        self.stray_pins = 0  # the server's pins of this session no handle holds (last heartbeat)
        # Keys of pinning requests whose fate is unknown (lost with their socket, or no readable
        # reply): where the server holds stray pins, the heartbeat gives back theirs (session.py).
        self._lost_pins: Counter[str] = Counter()
        self._server_counts_pins = False  # its heartbeat replies say the session's pins
        self._lost_at = 0.0
        self._warned_stray_session = -1  # the session whose stray pins were announced
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
        self._integrity_note: str | None = None  # this handler's own slow sentence (stray pins)
        self._warned_info_unsupported = False
        try:
            self._handshake()
        except BaseException:
            self._rpc.close()
            raise
        self._heartbeat_interval_s = self._pick_interval(heartbeat_interval_s)
        self._stop = threading.Event()
        self._heartbeat = threading.Thread(
            target=heartbeat_loop,
            args=(weakref.ref(self), self._stop, self._heartbeat_interval_s),
            name=f"maru-heartbeat-{self.client_id[:8]}",
            daemon=True,
        )
        self._heartbeat.start()

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
    def reply_waits(self) -> dict[str, int]:
        """How replies were waited for (``RpcChannel.waits``)."""
        return self._rpc.waits()

    @property
    def pool_buffer(self) -> Any:
        """The ``mmap`` of the whole pool (e.g. to register it with CUDA once)."""
        return self._mapped().mmap

    @property
    def pool_address(self) -> int:
        """Virtual address of the first byte of the pool mapping in this process."""
        return self._mapped().address

    @property
    def pool_mapping(self) -> PoolMapping:
        """The pool mapping (address, size, path), e.g. to register it with CUDA once."""
        return self._mapped()

    def _mapped(self) -> PoolMapping:
        if not self._maps_pool:
            raise PoolError(
                "this MaruHandler was made with map_pool=False (it only reports and reads statistics): "
                "it has no pool mapping; make one without map_pool=False to store or load"
            )
        if self._mapping is None or self._closed:
            raise HandlerClosedError("this MaruHandler was closed; create a new MaruHandler")
        return self._mapping

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
                        raise pool_full_error(info, missing, len(sizes), reply)
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

    def store(
        self, key: str, obj: Allocation, checksum: int | None = None, segments: SegmentSums | None = None
    ) -> CommitResult:
        """Publish ``obj`` under ``key``: from now on everyone sees the key with these bytes.

        Returns ``CommitResult.STORED``, or ``CommitResult.PRESENT`` when the key existed already
        (keys are write-once: this object's space is freed). Either way ``obj.buf`` is released.
        ``checksum``, ``segments``: see ``batch_store``.
        """
        return self.batch_store(
            [key], [obj], None if checksum is None else [checksum], None if segments is None else [segments]
        )[0]

    def batch_store(
        self,
        keys: Sequence[str],
        objs: Sequence[Allocation],
        checksums: Sequence[int] | None = None,
        segments: Sequence[SegmentSums | None] | None = None,
    ) -> list[CommitResult]:
        """Publish many objects, one COMMIT round trip per MAX_BATCH. Per key: STORED or PRESENT.

        Each object goes with the checksum of its bytes (``maru.checksum``), which readers check:
        computed here over ``obj.buf`` (about 1 GB/s per core, bench/RESULTS.md), or given in
        ``checksums`` by a caller that computed it already (e.g. on the GPU from the source; it
        must be of exactly the bytes in the pool). ``segments``: per object its ``SegmentSums``
        or None, for readers that place only some tokens; only with given ``checksums``, which they
        must add up to (``ValueError`` otherwise, before anything is sent). Raises
        ``StaleAllocationError`` (publishing nothing) if an object was reserved before the server
        restarted or this client's lease expired.
        """
        keys = check_keys(keys)
        objs = list(objs)
        if len(keys) != len(objs):
            raise ValueError(f"batch_store got {len(keys)} keys but {len(objs)} objects")
        sums, wires = frames.commit_sums(keys, objs, checksums, segments)
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
            for kchunk, ochunk, body in frames.commit_bodies(keys, objs, sums, wires):
                try:
                    reply = self._call(Op.COMMIT, body, retry=False)
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
    def _exists_locally(self, keys: list[str]) -> list[bool] | None:
        """From the key index; None: ask the server (never from a forked child's inherited copy)."""
        return self.local_exists.answer(keys, self.connected and os.getpid() == self._pid)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Per key, whether it is committed now (from the server's key index when it has one)."""
        keys = check_keys(keys)
        out = self._exists_locally(keys)
        if out is not None:
            return out
        out = []
        for chunk in chunks(keys):
            out += map(bool, reply_list(self._call(Op.EXISTS, {"keys": chunk}), "present", len(chunk)))
        return out

    def exists_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are committed (stops at the first miss): a prefix match."""
        keys = check_keys(keys)
        if (local := self._exists_locally(keys)) is not None:
            return next((i for i, p in enumerate(local) if not p), len(local))
        total = 0
        for chunk in chunks(keys):
            n = int(self._call(Op.EXISTS, {"keys": chunk})["prefix"])
            total += n
            if n < len(chunk):
                break
        return total

    def retrieve(
        self, key: str, pin: bool = True, verify: bool = True, segments: bool = False
    ) -> Retrieved | None:
        """Look ``key`` up. None if absent (or, with ``verify``, if its bytes fail their
        checksum); else a handle whose ``view`` reads the pool. Release it."""
        return self.batch_retrieve([key], pin=pin, verify=verify, segments=segments)[0]

    def batch_retrieve(
        self, keys: Sequence[str], pin: bool = True, verify: bool = True, segments: bool = False
    ) -> list[Retrieved | None]:
        """Look many keys up, one LOOKUP round trip per MAX_BATCH; None for each absent key.

        With ``pin`` (default) every hit stays pinned until its handle is released. Without it the
        entry may be evicted and its space reused while you read: copy out at once, or pin.
        With ``verify`` (default) each hit's bytes are checked against the checksum its writer
        committed, after the pin is taken (``maru.checksum``, one read of the object on this CPU):
        a mismatch, or an entry committed without a checksum, is a miss (None; the pin is released),
        counted in ``integrity()``; a mismatch is also reported to the server. A caller that
        checks the bytes itself after copying them (e.g. on the GPU) passes ``verify=False`` and
        uses ``Retrieved.checksum``; with ``segments`` it also gets ``Retrieved.segments``, the
        committed segment sums (None: none committed, or an older server), to read only the
        segments it places.
        """
        keys = check_keys(keys)
        out: list[Retrieved | None] = []
        with self._held():
            try:
                for chunk in chunks(keys):
                    body: dict[str, Any] = {"keys": chunk, "pin": bool(pin)}
                    if segments:
                        body["segments"] = True  # absent otherwise: the request other clients send
                    try:
                        reply = self._call(Op.LOOKUP, body)
                        entries = reply_list(reply, "entries", len(chunk))
                        got = self._lookup_handles(chunk, reply, entries, pin, segments)
                    except (MaruTimeoutError, ProtocolError, PoolError):
                        # Went out with no reply, or a reply no handle could be made from: the
                        # server may hold its pins (given back by the heartbeat: _lost_pin). A
                        # refusal or a request never sent pinned nothing.
                        if pin:
                            self._lost_pin(chunk)
                        raise
                    out += got
            except BaseException:
                self.batch_release(out)  # the chunks before the one that failed: nothing is kept
                raise
            if verify:
                self._verify_hits(out)
        return out

    def _verify_hits(self, handles: list[Retrieved | None]) -> None:
        """Replace each handle whose bytes fail their checksum (or have none) by None; release
        those and report the corrupt ones to the server. Call with ``_lock`` held."""
        bad, corrupt = check_hits(handles, self.integrity_log, self.url)
        if not bad:
            return
        dropped = [handles[i] for i in bad]
        for i in bad:
            handles[i] = None
        self.batch_release(dropped)
        self._report(corrupt)

    def _report(self, corrupt: list[list[Any]]) -> None:
        """Send REPORT of ``[key, offset]`` pairs whose bytes failed; a failure is only logged."""
        if not corrupt:
            return
        try:
            for chunk in chunks(corrupt):
                self._call(Op.REPORT, {"corrupt": chunk}, retry=False)
        except MaruError as e:
            log.info("could not report %d corrupt objects to the server (%s)", len(corrupt), e)

    def report_corrupt(self, handles: Sequence[Retrieved], verified: int = 0) -> None:
        """Count and report objects whose bytes a caller checked itself and found not matching
        their ``Retrieved.checksum`` (it retrieved with ``verify=False``, e.g. to check what it
        copied to a GPU); ``verified``: how many it found good. Like a failed ``verify``: counted in
        ``integrity()``, warned once per key, sent to the server (which deletes the entry so the
        key can be stored again). The caller still releases the handles. Never raises a
        ``MaruError`` (a failed report is logged)."""
        self.integrity_log.verified(verified)
        for r in handles:
            self.integrity_log.failure(r.key, r.offset, self.url)
        self._report([[r.key, r.offset] for r in handles])

    def integrity(self) -> dict[str, int]:
        """This handler's integrity counters: verified, integrity_failures, unverifiable (entries
        without a checksum, served as misses), fenced_sessions, fenced_bytes, and stray_pins (at the
        last heartbeat, the pins the server held for this session beyond those of its handles:
        pinning requests lost with their socket, docs/client.md "Threading")."""
        return {**self.integrity_log.snapshot(), "stray_pins": self.stray_pins}

    def batch_release(self, handles: Iterable[Retrieved | None], wait: bool = True) -> None:
        """Release many retrieve handles with one UNPIN round trip (None entries are skipped).
        ``wait=False``: return without the reply (applied before this handler's next request; a
        refusal is logged, an UNPIN lost with its connection is resent by the heartbeat)."""
        held: list[Retrieved] = []
        for r in handles:
            if r is None or r.released:
                continue
            if r.pinned and r._on_release is not None:
                held.append(r)
                r._on_release = None
            r.release()
        self._unpin(held, wait)

    def _unpin_one(self, r: Retrieved) -> None:
        self._unpin([r])

    def _unpin(self, handles: list[Retrieved], wait: bool = True) -> None:
        if not handles:
            return
        with self._held():
            # Pins of a lost session died with its lease (and were fenced): nothing to give back.
            handles = [r for r in handles if r.session is self._token]
            keys = [r.key for r in handles]
            for r in handles:
                self._pins[r.key] -= 1
                if self._pins[r.key] <= 0:
                    del self._pins[r.key]
                ext = (r.offset, r.size)
                self._pinned_extents[ext] -= 1
                if self._pinned_extents[ext] <= 0:
                    del self._pinned_extents[ext]
            if self._closed or not keys:
                return
            try:
                for chunk in chunks(keys):
                    if wait or not self._post_unpin(chunk):
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
        self.local_exists.close()
        for m in [*self._old_mappings, *([self._mapping] if self._mapping else [])]:
            m.close()

    def __enter__(self) -> MaruHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._connected else "disconnected")
        return f"MaruHandler({self.url!r}, {state}, client_id={self.client_id[:8]})"
