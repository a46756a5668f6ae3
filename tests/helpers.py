"""Test helpers shared by every test file: a real ``maru server`` in its own process, a raw client.

``ServerProcess`` is ``maru.demo.server.ServerProcess`` (spawn ``python -m maru.server`` on a free
loopback port, wait for the ready line, stop, restart, kill) with its state dir and log under the
test's tmp_path and its pool file named ``maru-test-*``, the prefix the session fixture in
conftest.py sweeps from /dev/shm when a killed server leaves one. Use it as a context manager or
through the ``maru_server`` fixture.
"""

from __future__ import annotations

import mmap
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from maru.demo import server as _server
from maru.demo.server import free_port

REPO_ROOT = Path(__file__).resolve().parent.parent

__all__ = [
    "REPO_ROOT",
    "RawClient",
    "ServerProcess",
    "flat",
    "free_port",
    "maru",
    "reported_slow",
    "wait_until",
]


def map_pool(path: str) -> mmap.mmap:
    """The whole pool file at ``path``, mapped read-write (what a client maps)."""
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def wait_until(pred: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll ``pred`` until true; fail the test naming ``what`` after ``timeout_s`` (a hang guard)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for: {what}")


def maru(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    """Run the ``maru`` command (this checkout's) as a child process; 200 columns, output captured."""
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "maru.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def flat(out: str) -> str:
    """Table output as one line of words (cells wrap at spaces; the other cells of a wrapped row are empty)."""
    return " ".join(re.sub(r"[│┃]", " ", out).split())


class ServerProcess(_server.ServerProcess):
    """A ``maru server`` child for tests (``tmp_path`` first: its state dir and log go there)."""

    pool_prefix = "maru-test-"


class RawClient:
    """A bare DEALER socket speaking ``maru.protocol`` (no MaruHandler): for server tests.

    ``call(op, **fields)`` sends one request (``client_id`` filled in) and returns the reply body;
    it checks that the reply echoes the request id and carries ``op | REPLY_BIT``.
    """

    def __init__(
        self,
        url: str,
        client_id: str | None = None,
        timeout_s: float = 10.0,
        sockopts: dict[int, Any] | None = None,
    ) -> None:
        """``sockopts``: extra ZeroMQ options set before connecting (CURVE keys, a routing id)."""
        import zmq

        self._zmq = zmq
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.timeout_ms = int(timeout_s * 1000)
        # A DEALER's send blocks while it has no peer (e.g. after a refused CURVE handshake dropped
        # the connection): bounded like the reply wait, so "no answer" is a TimeoutError either way.
        self.sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
        for opt, value in (sockopts or {}).items():
            self.sock.setsockopt(opt, value)
        self.sock.connect(url)
        self.client_id = client_id or uuid.uuid4().hex
        self._req = 0

    def send_raw(self, frame: bytes) -> None:
        self.sock.send(frame)

    def recv_raw(self, timeout_s: float | None = None) -> bytes | None:
        ms = self.timeout_ms if timeout_s is None else int(timeout_s * 1000)
        if not self.sock.poll(ms):
            return None
        return self.sock.recv()

    def call(self, op: int, **fields: Any) -> dict[str, Any]:
        from maru import protocol as P

        fields.setdefault("client_id", self.client_id)
        self._req += 1
        try:
            self.sock.send(P.encode(op, self._req, fields))
        except self._zmq.Again:
            raise TimeoutError(f"op {op} could not be sent within {self.timeout_ms} ms (no peer)") from None
        frame = self.recv_raw()
        if frame is None:
            raise TimeoutError(f"no reply to op {op} within {self.timeout_ms} ms")
        _, rop, rid = P.decode_header(frame)
        assert rid == self._req and rop == op | P.REPLY_BIT, (rid, rop, self._req, op)
        return P.decode_body(frame)

    def handshake(self) -> dict[str, Any]:
        from maru.protocol import Op

        reply = self.call(Op.HANDSHAKE, host="test", pid=os.getpid())
        assert reply["ok"], reply
        return reply

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def reported_slow(server: Any) -> dict[str, list[str]]:
    """Client id -> its ``slow`` list, for the clients that report info, as STATS lists them."""
    from maru.protocol import Op

    with RawClient(server.url) as c:
        reply = c.call(Op.STATS)
    return {e["client_id"]: e["info"].get("slow", []) for e in reply["clients"] if e.get("info")}
