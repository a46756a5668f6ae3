"""The one server launcher (``maru.demo.server``): ready means serving, failure means an error with
the server's own output, and the embedded default leaves nothing behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from maru.client import MaruHandler
from maru.demo.server import EmbeddedServer, ServerProcess, free_port
from maru.errors import MaruError


def test_an_embedded_server_serves_once_started_and_cleanup_removes_its_pool_and_work_dir() -> None:
    server = EmbeddedServer(port=free_port(), pool_size="16M")
    try:
        server.start()
        assert server.ready_line.startswith("maru server ready on ")
        with MaruHandler(server.url) as h:
            obj = h.alloc(4096)
            obj.buf[:5] = b"hello"
            h.store("k", obj)
            with h.retrieve("k") as r:
                assert bytes(r.view[:5]) == b"hello"
        assert os.path.exists(server.pool_path) and server.workdir.is_dir()
    finally:
        server.cleanup()
    assert server.proc is not None and server.proc.poll() is not None
    assert not os.path.exists(server.pool_path)
    assert not server.workdir.exists()
    server.cleanup()  # idempotent


def test_a_server_that_exits_before_its_ready_line_raises_with_its_output(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, pool_size="64T")  # more than /dev/shm can reserve
    try:
        with pytest.raises(MaruError, match="exited with code") as err:
            server.start(timeout=30)
        assert "--- server output ---" in str(err.value)
        assert "64.0 TiB" in str(err.value)  # the server's own error line
    finally:
        server.cleanup()
