"""Sending and reading ZeroMQ frames without giving the GIL up: libzmq called through ``ctypes.PyDLL``.

Why: pyzmq gives the GIL up around every libzmq send and receive, non-blocking ones included. The
calling thread must then take it back, and beside another thread of the process that runs Python
it waits until that thread lets go: up to the interpreter's switch interval, 5 ms. vLLM's
scheduling thread makes the offer pins' round trips beside vLLM's other threads. A lookup-and-pin
round trip and its UNPIN post (three such calls) beside a busy Python thread took 11.2 ms (median)
through pyzmq and 0.28 ms this way (``bench/rpc_gil.py``, this project's 2-core machine). A
non-blocking send or receive of a small frame is a few microseconds inside libzmq (it queues to, or
takes from, the socket's pipe; libzmq's I/O thread does the network): keeping the GIL for it costs
the other threads nothing they would notice.

What: ``gil_io()`` finds the libzmq that pyzmq uses (the one mapped into this process; more than
one is refused), binds ``zmq_send``, ``zmq_msg_recv`` and the message functions through ``PyDLL``
(which keeps the GIL during the call), and checks them against pyzmq on an inproc socket pair
before any use: frames sent each way arrive byte for byte. Anything short of that leaves
``gil_io()`` None and ``why_not()`` the reason: channels then send and read through pyzmq as
before, which ``maru.client.rpc`` announces once, and the vLLM scheduler reports as a slow path
(``maru doctor``). ``MARU_GIL_IO=0`` turns it off on purpose (announced the same way).

Only calls that never wait go through here. A reply that is not there yet is still waited for
inside pyzmq, which gives the GIL up while the thread sleeps, as it must.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from pathlib import Path

import zmq

_DONTWAIT = 1  # ZMQ_DONTWAIT
ENV_SWITCH = "MARU_GIL_IO"
FIX = f"pyzmq from its PyPI wheel (it bundles libzmq), and {ENV_SWITCH} unset"  # where why_not() is set


class _Msg(ctypes.Structure):
    """libzmq's ``zmq_msg_t``: 64 opaque bytes, pointer-aligned."""

    _fields_ = [("_", ctypes.c_uint64 * 8)]


class GilKeepingIO:
    """Non-blocking send and receive on a pyzmq socket's libzmq handle, the GIL kept throughout.

    Invariant: used only on sockets of the libzmq it was bound to (``gil_io`` checks that the
    process has one), by the thread that owns the socket at the time (the channel's lock)."""

    def __init__(self, lib: ctypes.PyDLL) -> None:
        self._send = lib.zmq_send
        self._send.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int]
        self._send.restype = ctypes.c_int
        self._init = lib.zmq_msg_init
        self._init.argtypes = [ctypes.POINTER(_Msg)]
        self._recv = lib.zmq_msg_recv
        self._recv.argtypes = [ctypes.POINTER(_Msg), ctypes.c_void_p, ctypes.c_int]
        self._recv.restype = ctypes.c_int
        self._data = lib.zmq_msg_data
        self._data.argtypes = [ctypes.POINTER(_Msg)]
        self._data.restype = ctypes.c_void_p
        self._size = lib.zmq_msg_size
        self._size.argtypes = [ctypes.POINTER(_Msg)]
        self._size.restype = ctypes.c_size_t
        self._close = lib.zmq_msg_close
        self._close.argtypes = [ctypes.POINTER(_Msg)]
        self._errno = lib.zmq_errno
        self._errno.restype = ctypes.c_int

    def send(self, sock: zmq.Socket, frame: bytes) -> bool:
        """Queue ``frame`` on ``sock``; False when it cannot be queued now (no live connection, or
        the queue is full: the caller waits the usual way). Raises ``zmq.ZMQError`` otherwise."""
        if self._send(sock.underlying, frame, len(frame), _DONTWAIT) >= 0:
            return True
        err = self._errno()
        if err in (errno.EAGAIN, errno.EINTR):
            return False
        raise zmq.ZMQError(err)

    def recv(self, sock: zmq.Socket) -> bytes | None:
        """The next frame on ``sock`` if one is there, else None. Raises ``zmq.ZMQError``."""
        msg = _Msg()
        self._init(msg)
        try:
            if self._recv(msg, sock.underlying, _DONTWAIT) < 0:
                err = self._errno()
                if err in (errno.EAGAIN, errno.EINTR):
                    return None
                raise zmq.ZMQError(err)
            return ctypes.string_at(self._data(msg), self._size(msg))
        finally:
            self._close(msg)


def _mapped_libzmq() -> list[str]:
    """The distinct libzmq files mapped into this process (pyzmq loaded its own on import)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return []
    found = {ln.split()[-1] for ln in maps.splitlines() if "/libzmq" in ln and ".so" in ln}
    return sorted(p for p in found if os.path.basename(p).startswith("libzmq"))


def _check(io: GilKeepingIO) -> str | None:
    """Frames each way between ``io`` and pyzmq on an inproc pair: None when every byte arrives."""
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    try:
        addr = f"inproc://maru-gil-io-{os.urandom(8).hex()}"
        a.bind(addr)
        b.connect(addr)
        out, back = os.urandom(97), os.urandom(4099)
        if not io.send(a, out):
            return "a checking frame could not be sent on an inproc socket pair"
        if not b.poll(2000) or b.recv() != out:
            return "a frame sent through libzmq directly did not arrive intact through pyzmq"
        b.send(back)
        if not a.poll(2000) or io.recv(a) != back:
            return "a frame sent through pyzmq did not arrive intact through libzmq directly"
        return None
    finally:
        a.close(0)
        b.close(0)


@functools.cache
def _load() -> tuple[GilKeepingIO | None, str | None]:
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        return None, f"{ENV_SWITCH}=0 turns it off"
    libs = _mapped_libzmq()
    if len(libs) != 1:
        what = "no libzmq shared library is mapped into this process" if not libs else f"several are: {libs}"
        return None, f"cannot tell which libzmq pyzmq uses ({what})"
    try:
        lib = ctypes.PyDLL(libs[0])
        major, minor, patch = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
        lib.zmq_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(patch))
        if (major.value, minor.value, patch.value) != zmq.zmq_version_info():
            return (
                None,
                f"{libs[0]} is libzmq {major.value}.{minor.value}.{patch.value}, pyzmq's is {zmq.zmq_version()}",
            )
        io = GilKeepingIO(lib)
        why = _check(io)
    except (OSError, AttributeError, zmq.ZMQError) as e:
        return None, f"binding {libs[0]} failed: {e}"
    return (None, why) if why else (io, None)


def gil_io() -> GilKeepingIO | None:
    """The GIL-keeping calls for this process, or None (``why_not`` says why). Loaded once."""
    return _load()[0]


def why_not() -> str | None:
    """Why sends and reads go through pyzmq (giving the GIL up) in this process; None when they
    need not."""
    return _load()[1]


def slow_note(who: str) -> str | None:
    """The slow path ``who`` (e.g. "vLLM's scheduling thread") reports while it goes through pyzmq
    (``maru doctor``): what it costs, why, and the fix. None on the GIL-keeping calls."""
    why = why_not()
    if why is None:
        return None
    return (
        f"{who} gives the GIL up at each send and read of a server round trip (pyzmq) and may wait "
        f"up to a switch interval (5 ms) to get it back from the process's other threads: {why}. "
        f"Fix: {FIX}"
    )
