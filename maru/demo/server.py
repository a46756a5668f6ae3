"""A ``maru server`` child process: spawn it, wait for its ready line, stop it, clean up after it.

The one place that starts a server from Python (the demos, the benchmarks and the test suite's
``maru_server`` fixture all go through it):

* ``ServerProcess``: the server's output goes to a log file in a work dir; ``start()`` returns once
  the server printed its ready line and raises ``MaruError`` with that output if it exits or stays
  silent; ``stop()`` (SIGTERM), ``kill()`` (a crash), ``restart()`` on the same port, pool and state.
* ``EmbeddedServer``: the embedded default for demos and benchmarks: port 5555 when it is free, a
  pool under /dev/shm and a temporary work dir, all removed by ``cleanup()``.

The child imports the same ``maru`` package as the parent (its folder is put first on PYTHONPATH).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from maru.config import DEFAULT_HOST, DEFAULT_PORT
from maru.errors import MaruError
from maru.pool.key_index import SIDE_SUFFIX

READY_MARK = "maru server ready on "
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def port_is_free(port: int, host: str = DEFAULT_HOST) -> bool:
    """Whether nothing listens on ``host:port`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = DEFAULT_HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class ServerProcess:
    """One ``maru server`` child. Its state dir (unless given) and log live in ``workdir``.

    Attributes: ``url``, ``port``, ``pool_path``, ``state_dir``, ``proc`` (the Popen; None before
    the first start), ``pid``, ``ready_line``. The pool file is created by the server; ``cleanup()``
    removes it when this object chose its name. ``prefix`` runs the server under another command
    (``["ip", "netns", "exec", NS]``).
    """

    pool_prefix = "maru-"  # of the pool file's name under /dev/shm when none is given

    def __init__(
        self,
        workdir: Path | str,
        pool_size: str | int | None = "64M",
        lease_timeout: float = 30.0,
        port: int | None = None,
        extra_args: tuple[str, ...] | list[str] = (),
        pool_path: str | None = None,
        state_dir: Path | str | None = None,
        log_level: str = "INFO",
        host: str = DEFAULT_HOST,
        prefix: tuple[str, ...] | list[str] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.host = host
        self.prefix = list(prefix)
        self.pool_size = pool_size
        self.lease_timeout = lease_timeout
        self.port = port or free_port()
        self._auto_port = port is None
        self.extra_args = list(extra_args)
        self.pool_path = pool_path or f"/dev/shm/{self.pool_prefix}{uuid.uuid4().hex[:12]}"
        self._own_pool = pool_path is None
        self._auto_state = state_dir is None
        self.state_dir = Path(state_dir) if state_dir else self.workdir / f"state-{self.port}"
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready_line = ""
        self._log_path = self.workdir / f"server-{self.port}.log"
        self._starts = 0

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise MaruError("maru server is not running: start() it first")
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
        """Everything the server wrote (stdout and stderr, all starts)."""
        try:
            return self._log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def start(self, timeout: float = 30.0) -> ServerProcess:
        """Spawn the server and wait for its ready line; ``MaruError`` with its output if it fails.

        On the first start with an automatically picked port, a port that another process took in
        the meantime is replaced by a fresh one (up to three tries).
        """
        for attempt in range(3):
            try:
                return self._start_once(timeout)
            except MaruError as e:
                if not (self._auto_port and self._starts == 1 and "already in use" in str(e)) or attempt == 2:
                    raise
                self._starts = 0
                self.port = free_port()
                if self._auto_state:
                    self.state_dir = self.workdir / f"state-{self.port}"
                self._log_path = self.workdir / f"server-{self.port}.log"
        raise AssertionError("unreachable")

    def _start_once(self, timeout: float) -> ServerProcess:
        if self.proc is not None and self.proc.poll() is None:
            raise MaruError(f"maru server on {self.url} is already running (pid {self.proc.pid})")
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env["PYTHONPATH"] = str(_PACKAGE_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env["PYTHONUNBUFFERED"] = "1"
        # A file, not a pipe: nobody has to keep reading it, and it outlives the process.
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
                raise MaruError(
                    f"maru server exited with code {self.proc.returncode} before it was ready; "
                    f"argv={self.argv()}\n--- server output ---\n{self._log_since(start_offset)}"
                )
            time.sleep(0.02)
        self.kill()
        raise MaruError(
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
        """SIGKILL the server (a crash) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM and wait (SIGKILL after ``timeout``); returns the exit code (None: never started)."""
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
        raise MaruError(f"no VmRSS in /proc/{self.pid}/status")

    def cleanup(self) -> None:
        """Stop the server and remove the pool file if this object named it. Idempotent."""
        try:
            self.stop()
        finally:
            if self._own_pool:
                # The key index's side file goes with the server on a clean stop, not on a kill.
                for path in (self.pool_path, self.pool_path + SIDE_SUFFIX):
                    try:
                        os.unlink(path)
                    except FileNotFoundError:
                        pass

    def __enter__(self) -> ServerProcess:
        if self.proc is None or self.proc.poll() is not None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.cleanup()


class EmbeddedServer(ServerProcess):
    """The embedded default for demos and benchmarks: port 5555 when free (else any free port), an
    emulated pool under /dev/shm and a temporary work dir; ``cleanup()`` removes the pool and the dir."""

    def __init__(
        self,
        port: int | None = None,
        pool_size: str | int = "256M",
        lease_timeout_s: float = 10.0,
        log_level: str = "WARNING",
        extra_args: list[str] | None = None,
    ) -> None:
        if port is None:
            port = DEFAULT_PORT if port_is_free(DEFAULT_PORT) else free_port()
        super().__init__(
            tempfile.mkdtemp(prefix="maru-embedded-"),
            pool_size=pool_size,
            lease_timeout=lease_timeout_s,
            port=port,
            extra_args=extra_args or [],
            pool_path=f"/dev/shm/maru-embedded-{port}-{os.getpid()}",
            log_level=log_level,
        )
        self._own_pool = True

    def start(self, timeout: float = 30.0) -> EmbeddedServer:
        try:
            super().start(timeout)
        except MaruError:
            self.cleanup()
            raise
        return self

    def cleanup(self) -> None:
        """Stop the server, then remove its pool file and work dir. Idempotent."""
        try:
            super().cleanup()
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        return self.start()
