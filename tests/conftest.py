"""Shared pytest fixtures."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ServerProcess


@pytest.fixture
def maru_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A started ``maru server`` (64 MiB pool under /dev/shm, own port and state dir)."""
    server = ServerProcess(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()
