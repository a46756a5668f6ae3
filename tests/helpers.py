"""Test helpers shared by every test file: a real ``maru server`` in its own process.

``ServerProcess`` spawns ``python -m maru.server`` on a free loopback port with a pool file under
/dev/shm (unique name) and a state dir under the test's tmp_path, waits for the ready line, and
cleans up the pool file afterwards. Use it as a context manager or through the ``maru_server``
fixture in conftest.py.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
READY_MARK = "maru server ready on "


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A ``maru server`` child process for tests.

    Attributes: ``url`` (tcp://127.0.0.1:PORT), ``port``, ``pool_path`` (/dev/shm/...),
    ``state_dir``, ``proc`` (the Popen, None when stopped), ``pid``, ``ready_line``.
    ``restart()`` starts it again on the same port, pool and state dir.
    """

    def __init__(
        self,
        tmp_path: Path | str,
        pool_size: str | int | None = "64M",
        lease_timeout: float = 30.0,
        port: int | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        pool_path: str | None = None,
        state_dir: Path | str | None = None,
        log_level: str = "INFO",
        host: str = "127.0.0.1",
        prefix: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.tmp_path = Path(tmp_path)
        self.host = host
        self.prefix = list(prefix)  # e.g. ["ip", "netns", "exec", NS]: run the server elsewhere
        self.pool_size = pool_size
        self.lease_timeout = lease_timeout
        self.port = port or free_port()
        self._auto_port = port is None
        self.extra_args = list(extra_args)
        self.pool_path = pool_path or f"/dev/shm/maru-test-{uuid.uuid4().hex[:12]}"
        self._own_pool = pool_path is None
        self._auto_state = state_dir is None
        self.state_dir = Path(state_dir) if state_dir else self.tmp_path / f"state-{self.port}"
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_line = ""
        self._log_path = self.tmp_path / f"server-{self.port}.log"
        self._starts = 0

    # -- properties ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server is not running"
        return self.proc.pid

    def argv(self) -> list[str]:
        args = [
            *self.prefix,
            sys.executable,
            "-m",
            "maru.server",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--pool-path",
            self.pool_path,
            "--state-dir",
            str(self.state_dir),
            "--lease-timeout",
            str(self.lease_timeout),
            "--log-level",
            self.log_level,
        ]
        if self.pool_size is not None:
            args += ["--pool-size", str(self.pool_size)]
        return args + self.extra_args

    def log(self) -> str:
        """Everything the server wrote to stderr/stdout so far (all starts)."""
        try:
            return self._log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Spawn the server and wait for its ready line; raise RuntimeError with its stderr if it fails.

        On the first start with an automatically picked port, a port that got taken in the
        meantime (another test's process) is replaced by a fresh one, up to three times.
        """
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except RuntimeError as e:
                if not (self._auto_port and self._starts == 1 and "already in use" in str(e)) or attempt == 2:
                    raise
                self._starts = 0
                self.port = free_port()
                if self._auto_state:
                    self.state_dir = self.tmp_path / f"state-{self.port}"
                self._log_path = self.tmp_path / f"server-{self.port}.log"
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> ServerProcess:
        assert self.proc is None or self.proc.poll() is not None, "server already running"
        self.tmp_path.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        log_file = open(self._log_path, "ab")  # noqa: SIM115 (closed below; the child keeps its copy)
        start_offset = log_file.tell()
        try:
            self.proc = subprocess.Popen(
                self.argv(), stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            )
        finally:
            log_file.close()
        self._starts += 1
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self._log_since(start_offset)
            for line in text.splitlines():
                if line.startswith(READY_MARK):
                    self.ready_line = line
                    return self
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"maru server exited with code {self.proc.returncode} before it was ready; "
                    f"argv={self.argv()}\n--- server output ---\n{self._log_since(start_offset)}"
                )
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(
            f"maru server not ready within {timeout} s; argv={self.argv()}\n--- server output ---\n"
            f"{self._log_since(start_offset)}"
        )

    def _log_since(self, offset: int) -> str:
        try:
            with open(self._log_path, "rb") as f:
                f.seek(offset)
                return f.read().decode(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (simulates a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def restart(self, timeout: float = 30.0) -> ServerProcess:
        """Stop (if running) and start again on the same port, pool file and state dir."""
        self.stop()
        return self.start(timeout)

    def rss_kib(self) -> int:
        """The server's resident set size (VmRSS) in KiB."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
        raise RuntimeError("VmRSS not found")

    def cleanup(self) -> None:
        """Stop the server and remove the pool file this helper created."""
        try:
            self.stop()
        finally:
            if self._own_pool:
                try:
                    os.unlink(self.pool_path)
                except FileNotFoundError:
                    pass

    def __enter__(self) -> ServerProcess:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


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
        for opt, value in (sockopts or {}).items():
            self.sock.setsockopt(opt, value)
        self.sock.connect(url)
        self.client_id = client_id or uuid.uuid4().hex
        self.timeout_ms = int(timeout_s * 1000)
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
        self.sock.send(P.encode(op, self._req, fields))
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
