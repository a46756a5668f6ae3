"""Fixtures the scheduler-side test modules share; each module brings its own ``server``
(``tests.pool_fixtures.module_server``), which these resolve against."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

from maru.vllm.keys import ChunkKeyer, KeySpace
from tests.helpers import ServerProcess
from tests.vllm.helpers import C, CountingClient

_spaces = itertools.count(1)


@pytest.fixture
def keyer() -> ChunkKeyer:
    """A fresh key space per test, so tests never see each other's keys on a module's server."""
    return ChunkKeyer(KeySpace(f"model-{next(_spaces)}", "", "float32", 2, 2, 32, C))


@pytest.fixture
def client(server: ServerProcess) -> Iterator[CountingClient]:
    """A ``CountingClient`` of the module's server."""
    c = CountingClient(server.url)
    try:
        yield c
    finally:
        c.close()
