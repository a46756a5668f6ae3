"""The request/reply channel between a client and ``maru server``.

One ZeroMQ DEALER socket, guarded by a lock: a request is sent and its reply awaited while
the lock is held, so threads take turns and never read each other's replies. Replies are
matched to requests by the request id in the frame header; a reply whose id does not match
(the late answer to a request that already timed out) is dropped.

Invariant: a request either gets its own reply or raises within ``timeout_s`` seconds
(``NotConnectedError`` when no connection to the server exists, ``MaruTimeoutError`` when
the request went out but no reply came back). After either failure the socket is replaced,
so a request queued while the server was away is never delivered later by surprise.

Posted requests (``post``): sent without waiting, for requests whose answer changes nothing for
the caller (UNPIN on the load path: one round trip less per load), or whose answer the caller wants
later (a lookup-and-pin posted when a request arrives, read when its offer is made: the round trips
of requests arriving together then overlap). The server answers requests of one connection in
order, so anything this channel sends later sees a posted request applied. Its reply is read by
whichever later exchange meets it (or by ``wait_posted``/``read_posted``) and handed to
``on_reply``; if the socket is replaced before that, ``on_lost`` gets the request back (it may or
may not have been applied).

Waiting for a reply (``reply_spin_s``). A blocking receive lets the thread go to sleep without
the GIL; when the reply comes, the thread needs the GIL back, and while another thread of the
process runs Python it gets it only when that thread lets go: up to the interpreter's switch
interval (5 ms by default). In vLLM's engine process, where the scheduling thread shares the GIL
with the model runner's and the I/O threads, a lookup-and-pin round trip of ~110 us on an H200
host took 580 us on average that way. A channel with ``reply_spin_s`` > 0 first polls for the
reply without blocking, for up to that long: the thread keeps the GIL between polls (each poll
lets go of it only for the moment of the call), so the reply is read as soon as it lands. Then it
blocks as usual. Only for a latency-critical caller whose round trips are short (vLLM's scheduling
thread): spinning burns that thread's core and keeps the process's other Python threads waiting
for the same time. A background thread that shares such a channel (the session's heartbeat) calls
``never_poll_on_this_thread`` once: its exchanges block at once whatever the channel's setting.

Sending and reading without giving the GIL up (``maru.client.gil_io``). pyzmq gives the GIL up
around every send and receive, non-blocking ones too, and each take-back beside a busy thread may
wait a switch interval. Where libzmq can be called directly with the GIL kept, every send and every
read of a frame already there goes that way; only a wait for a reply not there yet blocks in pyzmq.
Where it cannot, pyzmq is used as before, announced once with the reason.

Identity. The server owns sessions by connection (its routing id, and its CURVE key when the server
authenticates), not by the ``client_id`` in the body. A channel picks one random 16-byte routing id
and keeps it across socket replacements, so its session survives a reconnect: the server hands the
id over to the newest connection (``ROUTER_HANDOVER``); nobody else knows the id.
With ``curve`` (``CurveKeys``) the connection is encrypted and the server sees this client's key.
"""

from __future__ import annotations

import itertools
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from maru import protocol
from maru.client import gil_io as _gil_io
from maru.client.gil_io import GilKeepingIO, gil_io, why_not
from maru.errors import ConfigError, HandlerClosedError, MaruTimeoutError, NotConnectedError, ProtocolError

log = logging.getLogger("maru.client")


PostedCallback = Callable[[int, dict[str, Any]], None]

MAX_REPLY_SPIN_S = 0.01  # the longest a channel may poll for one reply (a local round trip: ~0.1-0.3 ms)

_thread_flags = threading.local()


def never_poll_on_this_thread() -> None:
    """Make every exchange the calling thread makes block for its reply at once, on any channel
    (a background thread whose round trips no caller waits on must not hold the GIL polling)."""
    _thread_flags.never_poll = True


def _run_callback(cb: PostedCallback, op: int, body: dict[str, Any]) -> None:
    try:
        cb(op, body)
    except Exception:  # a callback's bug must not break the exchange that happened to meet it
        log.exception("a posted %s request's callback failed", protocol.Op(op).name)


_announced_pyzmq_io = False


def _io_for_channels() -> GilKeepingIO | None:
    """``gil_io()``; its absence is logged once per process, with the reason and what to do."""
    global _announced_pyzmq_io
    io = gil_io()
    if io is None and not _announced_pyzmq_io:
        _announced_pyzmq_io = True
        log.warning(
            "maru: round trips to the server send and read through pyzmq, giving the GIL up at each "
            "(a busy thread of this process may then hold a caller up to 5 ms a call): %s. Fix: %s",
            why_not(),
            _gil_io.FIX,
        )
    return io


def _start_hint() -> str:
    return "is `maru server` running? start it with `maru server` (check with `maru doctor`)"


ENV_SERVER_PUBLIC_KEY = "MARU_SERVER_PUBLIC_KEY"
ENV_CLIENT_KEY = "MARU_CLIENT_KEY"


@dataclass(frozen=True)
class CurveKeys:
    """What a client needs to reach a CURVE server: the server's public key, its own key pair (z85)."""

    server_public: bytes
    public: bytes
    secret: bytes

    @classmethod
    def resolve(cls, server_public_key: str | None, client_key: str | None) -> CurveKeys | None:
        """Keys from the arguments, else from $MARU_SERVER_PUBLIC_KEY / $MARU_CLIENT_KEY; None if neither.

        ``server_public_key``: a 40-character z85 key or a ``.key`` file; ``client_key``: this
        client's ``.key_secret`` file (``maru keys generate``). Raises ``ConfigError`` when only one
        is given or a file is unreadable.
        """
        server_public_key = server_public_key or os.environ.get(ENV_SERVER_PUBLIC_KEY) or None
        client_key = client_key or os.environ.get(ENV_CLIENT_KEY) or None
        if server_public_key is None and client_key is None:
            return None
        if server_public_key is None or client_key is None:
            raise ConfigError(
                "CURVE needs both the server's public key (maru_server_public_key / $MARU_SERVER_PUBLIC_KEY) "
                "and this client's .key_secret file (maru_client_key / $MARU_CLIENT_KEY); one was given"
            )
        from zmq.auth import load_certificate

        server_public = server_public_key.encode()
        if not (len(server_public_key) == 40 and not os.path.exists(server_public_key)):
            try:
                server_public = load_certificate(server_public_key)[0]
            except (OSError, ValueError) as e:
                raise ConfigError(
                    f"cannot read the server public key file {server_public_key}: {e}"
                ) from None
        try:
            public, secret = load_certificate(Path(client_key))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read the client key file {client_key}: {e}") from None
        if secret is None:
            raise ConfigError(f"{client_key} has no secret-key: pass this client's .key_secret file")
        return cls(server_public, public, secret)


class RpcChannel:
    """A thread-safe request/reply channel to one server URL."""

    def __init__(self, url: str, curve: CurveKeys | None = None, reply_spin_s: float = 0.0) -> None:
        """``curve`` None: keys from $MARU_SERVER_PUBLIC_KEY / $MARU_CLIENT_KEY if set (so ``maru doctor``
        and ``maru stats`` reach a CURVE server too), else a plain connection. ``reply_spin_s``:
        poll for each reply this long before blocking (see the module docs; 0: block at once)."""
        if not 0.0 <= reply_spin_s <= MAX_REPLY_SPIN_S:
            raise ValueError(f"reply_spin_s must be within [0, {MAX_REPLY_SPIN_S}] s, got {reply_spin_s}")
        self.url = url
        self.reply_spin_s = float(reply_spin_s)
        # With reply_spin_s: replies read while polling, and waits that outlasted the polling
        # (then blocked): many of the latter mean the spin is shorter than the round trips.
        self.replies_spun = 0
        self.spun_out = 0
        self._curve = curve if curve is not None else CurveKeys.resolve(None, None)
        self._io = _io_for_channels()  # None: pyzmq's send and recv (each gives the GIL up)
        self._routing_id = b"\x01" + secrets.token_bytes(16)  # a leading zero byte is libzmq's
        self._ctx = zmq.Context.instance()
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._rcvtimeo_ms = -1
        self._closed = False
        # Posted requests whose reply has not been read: req id -> (op, body, on_reply, on_lost).
        self._posted: dict[int, tuple[int, dict[str, Any], PostedCallback, PostedCallback]] = {}

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            # LINGER 0: closing never blocks on unsent requests.
            sock.setsockopt(zmq.LINGER, 0)
            # IMMEDIATE: queue only on a live connection, so "server absent" shows up as
            # "not writable" (NotConnectedError) instead of requests piling up for later.
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.RECONNECT_IVL, 50)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
            sock.setsockopt(zmq.ROUTING_ID, self._routing_id)
            if self._curve is not None:
                sock.setsockopt(zmq.CURVE_SERVERKEY, self._curve.server_public)
                sock.setsockopt(zmq.CURVE_PUBLICKEY, self._curve.public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, self._curve.secret)
            try:
                sock.connect(self.url)
            except zmq.ZMQError as e:
                sock.close(0)
                raise NotConnectedError(
                    f"cannot connect to maru server at {self.url!r}: {e}; use a URL like tcp://127.0.0.1:5555"
                ) from None
            self._sock = sock
            self._rcvtimeo_ms = -1
        return self._sock

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        # Their replies can no longer arrive: the owners decide (e.g. send again later).
        posted, self._posted = self._posted, {}
        for op, body, _, on_lost in posted.values():
            _run_callback(on_lost, op, body)

    def post(
        self, op: int, body: dict[str, Any], on_reply: PostedCallback, on_lost: PostedCallback
    ) -> int | None:
        """Send one request without waiting for its reply: its request id (>= 1), or None (nothing
        sent) when not connected.

        ``on_reply(op, reply_body)`` runs when a later exchange reads the reply; ``on_lost(op,
        body)`` when the socket is replaced first. Both run in the thread that holds this channel,
        under its lock, and must not call it.
        """
        with self._lock:
            if self._closed:
                raise HandlerClosedError("this MaruHandler was closed; create a new MaruHandler")
            sock = self._socket()
            req_id = next(self._ids)
            try:
                self._send(sock, protocol.encode(op, req_id, body))
            except zmq.Again:
                return None  # IMMEDIATE: no live connection; the caller sends it the usual way
            self._posted[req_id] = (op, body, on_reply, on_lost)
            return req_id

    def wait_posted(self, req_id: int, timeout_s: float) -> bool:
        """Read replies until the posted request ``req_id``'s callback ran (or it was lost): True;
        False if no such reply came within ``timeout_s`` (the socket is kept: a slow server's late
        reply still reaches the callback at a later read). Polls first as ``request`` does."""
        with self._lock:
            if req_id not in self._posted or self._sock is None:
                return req_id not in self._posted
            sock = self._sock
            deadline = time.monotonic() + timeout_s
            spin_until = self._spin_until()
            while req_id in self._posted:
                reply = self._spin(sock, spin_until) if spin_until else None
                if reply is None:
                    spin_until = 0.0
                    try:
                        reply = self._recv_within(sock, int((deadline - time.monotonic()) * 1000))
                    except zmq.Again:
                        return False
                self._take_reply(reply, None)  # a posted request's reply goes to its callback
            return True

    def read_posted(self) -> int:
        """Hand every reply already here to its posted request's callback, without waiting: how
        many frames were read."""
        with self._lock:
            if self._sock is None or not self._posted:
                return 0
            n = 0
            while self._posted:
                reply = self._spin(self._sock, 0.0)
                if reply is None:
                    return n
                n += 1
                self._take_reply(reply, None)
            return n

    def _take_reply(self, reply: bytes, req_id: int | None) -> tuple[int, int] | None:
        """(op, id) of ``reply`` when it answers ``req_id``; a posted request's reply goes to its
        callback, anything else (unreadable, the late reply of a timed-out request) is dropped."""
        try:
            _version, reply_op, reply_id = protocol.decode_header(reply)
        except ProtocolError as e:
            log.warning("dropping an unreadable frame from %s: %s", self.url, e)
            return None
        if reply_id == req_id:
            return reply_op, reply_id
        posted = self._posted.pop(reply_id, None)
        if posted is not None:
            try:
                body = protocol.decode_body(reply)
            except ProtocolError as e:
                body = {"ok": False, "error": f"unreadable reply: {e}"}
            _run_callback(posted[2], posted[0], body)
        return None

    def request(self, op: int, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one request and return its reply body (``ok`` may be False: the caller decides)."""
        with self._lock:
            if self._closed:
                raise HandlerClosedError("this MaruHandler was closed; create a new MaruHandler")
            sock = self._socket()
            req_id = next(self._ids)
            frame = protocol.encode(op, req_id, body)
            deadline = time.monotonic() + timeout_s
            try:
                return self._exchange(sock, op, req_id, frame, deadline, timeout_s)
            except (NotConnectedError, MaruTimeoutError):
                self._drop_socket()
                raise

    def _exchange(
        self, sock: zmq.Socket, op: int, req_id: int, frame: bytes, deadline: float, timeout_s: float
    ) -> dict[str, Any]:
        # The first wait is the whole timeout (the same value every call, so RCVTIMEO is set
        # once); only after a connect wait or a stale reply is the remaining time recomputed.
        wait_ms = int(timeout_s * 1000)
        try:
            self._send(sock, frame)
        except zmq.Again:
            wait_ms = -1
            # Not connected yet (or any more): wait for the connection up to the deadline.
            if not sock.poll(max(0.0, deadline - time.monotonic()) * 1000, zmq.POLLOUT):
                raise NotConnectedError(
                    f"cannot reach maru server at {self.url} within {timeout_s:g} s: {self._hint()}"
                ) from None
            sock.send(frame, zmq.NOBLOCK)
        spin_until = self._spin_until()
        while True:
            reply = self._spin(sock, spin_until) if spin_until else None
            if reply is not None:
                got = self._take_reply(reply, req_id)
                if got is None:
                    continue  # a posted request's reply: keep polling for ours
                self.replies_spun += 1
                return self._body(reply, got[0], op, req_id)
            if spin_until:  # spun out: block for what is left of the timeout
                spin_until, wait_ms = 0.0, -1
                self.spun_out += 1
            remaining_ms = wait_ms if wait_ms >= 0 else int((deadline - time.monotonic()) * 1000)
            wait_ms = -1
            try:
                reply = self._recv_within(sock, remaining_ms)
            except zmq.Again:
                raise MaruTimeoutError(
                    f"no reply from maru server at {self.url} within {timeout_s:g} s "
                    f"(op {protocol.Op(op).name}): {_start_hint()}"
                ) from None
            got = self._take_reply(reply, req_id)
            if got is None:
                continue  # a posted request's reply, or the late reply of a timed-out request
            return self._body(reply, got[0], op, req_id)

    def waits(self) -> dict[str, int]:
        """The polling budget (us), the replies read while polling, the waits that blocked past it."""
        return {
            "spin_us": round(self.reply_spin_s * 1e6),
            "gil_kept": int(self._io is not None),  # sends and ready reads keep the GIL (gil_io)
            "replies_spun": self.replies_spun,
            "spun_out": self.spun_out,
        }

    def _send(self, sock: zmq.Socket, frame: bytes) -> None:
        """Queue ``frame`` without waiting (the GIL kept where ``gil_io`` can); ``zmq.Again`` when
        it cannot be queued now."""
        if self._io is None or not self._io.send(sock, frame):
            sock.send(frame, zmq.NOBLOCK)  # raises zmq.Again where the direct send could not

    def _spin_until(self) -> float:
        """When polling for a reply should stop (perf_counter); 0.0: block at once."""
        spin = self.reply_spin_s if not getattr(_thread_flags, "never_poll", False) else 0.0
        return time.perf_counter() + spin if spin else 0.0

    def _recv_within(self, sock: zmq.Socket, remaining_ms: int) -> bytes:
        """The next frame, blocking up to ``remaining_ms``; ``zmq.Again`` when none came (or none
        is left). A blocking recv with a timeout is measurably faster than poll() then recv()."""
        if remaining_ms <= 0:
            raise zmq.Again()
        if remaining_ms != self._rcvtimeo_ms:
            sock.setsockopt(zmq.RCVTIMEO, remaining_ms)
            self._rcvtimeo_ms = remaining_ms
        return sock.recv()

    def _spin(self, sock: zmq.Socket, until: float) -> bytes | None:
        """The next frame, polled for without blocking until ``until`` (perf_counter); None if none came.

        With ``gil_io`` each try is one non-blocking recv that keeps the GIL: a frame costs one
        call into libzmq, not an EVENTS read and then the recv (5.3 -> 2.7 us a frame read on the
        CI machine; an offer reads its posted reply this way). Without it,
        polled through the socket's EVENTS option, which pyzmq reads without letting go of the
        GIL (pyzmq's non-blocking recv lets go of it at every try: a busy thread may take it at
        any of them, and then keeps it up to the switch interval); the frame is then read through
        pyzmq, which lets go of it once."""
        io = self._io
        if io is not None:
            while (frame := io.recv(sock)) is None:
                if time.perf_counter() >= until:
                    return None
            return frame
        while not int(sock.getsockopt(zmq.EVENTS)) & 1:  # ZMQ_POLLIN; int(): the enum's & is slow
            if time.perf_counter() >= until:
                return None
        try:
            return sock.recv(zmq.NOBLOCK)
        except zmq.Again:  # EVENTS said a frame was there; no other reader exists (the lock)
            return None

    def _body(self, reply: bytes, reply_op: int, op: int, req_id: int) -> dict[str, Any]:
        if reply_op != (op | protocol.REPLY_BIT):
            raise ProtocolError(
                f"server at {self.url} answered request {req_id} ({protocol.Op(op).name}) "
                f"with op {reply_op:#x}; client and server disagree on the protocol"
            )
        return protocol.decode_body(reply)

    def _hint(self) -> str:
        if self._curve is None:
            return _start_hint()
        return (
            f"{_start_hint()}; with CURVE, also check that this client's public key "
            f"{self._curve.public.decode()} is in the server's --allowed-clients and that the server "
            "public key given here is the server's"
        )

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._drop_socket()
