"""A throw-away ``maru server`` for demos and benchmarks: the embedded default, self-cleaning.

``EmbeddedServer`` starts ``python -m maru.server`` with an emulated pool under /dev/shm and a
temporary state dir, on port 5555 when it is free (else any free port), waits for its ready
line, and on ``stop()`` shuts it down and removes the pool file and the state dir.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

from maru.config import DEFAULT_HOST, DEFAULT_PORT
from maru.errors import MaruError

READY_MARK = "maru server ready on "


def port_is_free(port: int, host: str = DEFAULT_HOST) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = DEFAULT_HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class EmbeddedServer:
    """A ``maru server`` child process with its own pool file and state dir (both removed on stop)."""

    def __init__(
        self,
        port: int | None = None,
        pool_size: str = "256M",
        lease_timeout_s: float = 10.0,
        log_level: str = "WARNING",
        extra_args: list[str] | None = None,
    ) -> None:
        if port is None:
            port = DEFAULT_PORT if port_is_free(DEFAULT_PORT) else free_port()
        self.port = port
        self.url = f"tcp://{DEFAULT_HOST}:{port}"
        self.pool_path = f"/dev/shm/maru-embedded-{port}-{os.getpid()}"
        self.state_dir = tempfile.mkdtemp(prefix="maru-embedded-")
        self.argv = [
            sys.executable,
            "-m",
            "maru.server",
            "--host",
            DEFAULT_HOST,
            "--port",
            str(port),
            "--pool-path",
            self.pool_path,
            "--pool-size",
            pool_size,
            "--state-dir",
            self.state_dir,
            "--lease-timeout",
            str(lease_timeout_s),
            "--log-level",
            log_level,
            *(extra_args or []),
        ]
        self.proc: subprocess.Popen[str] | None = None
        self.output: list[str] = []
        self.ready_line = ""

    def start(self, timeout_s: float = 30.0) -> EmbeddedServer:
        """Start and wait for the ready line; raises MaruError with the server's output if it fails."""
        self.proc = subprocess.Popen(
            self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True
        )
        ready = threading.Event()

        def drain() -> None:  # keep reading, or a chatty server would block on a full pipe
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.output.append(line.rstrip("\n"))
                if line.startswith(READY_MARK):
                    self.ready_line = line.strip()
                    ready.set()

        threading.Thread(target=drain, name="maru-embedded-server-output", daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                why = (
                    f"exited with code {self.proc.returncode}"
                    if self.proc.returncode is not None
                    else "not ready"
                )
                raise MaruError(
                    f"embedded maru server {why} (argv: {' '.join(self.argv)}):\n"
                    + "\n".join(self.output[-20:])
                )
        return self

    def stop(self) -> None:
        """SIGTERM (SIGKILL after 10 s), then remove the pool file and the state dir. Idempotent."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        try:
            os.unlink(self.pool_path)
        except FileNotFoundError:
            pass
        shutil.rmtree(self.state_dir, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
