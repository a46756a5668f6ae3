"""Fixtures shared by the tests that move KV through a real server's pool (one place, not one copy
per test file).

``module_server(name)`` makes a module-scoped fixture running a ``maru server`` process;
``pool_client()`` makes a function-scoped fixture (on the module's ``server`` fixture) giving a
connected ``MaruHandler``;
``module_client(name)`` makes a module-scoped fixture owning both. Every handler releases its
pool's CUDA registration before it unmaps the pool (``release_pool``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from maru.client import MaruHandler
from tests.helpers import ServerProcess


def release_pool(h: Any) -> None:
    """Unregister ``h``'s pool mapping from CUDA (if an engine registered it) before ``h`` unmaps it:
    a registration outliving its mapping would let a later mapping at the same address copy to
    stale pages. A no-op on CPU and when nothing was registered."""
    mapping = getattr(h, "_mapping", None)
    if mapping is not None and torch.cuda.is_available():
        from maru.client import cuda_host

        cuda_host.unregister_host_mapping(mapping)


def stop_worker(w: Any) -> None:
    """``w.shutdown()``, after its engine released the pool registration (``KVTransferEngine.close``)."""
    if w.engine is not None:
        w.engine.close()
    w.shutdown()


def module_server(name: str, pool_size: str = "64M") -> Callable[..., Iterator[ServerProcess]]:
    """A module-scoped fixture: a ``maru server`` process with a ``pool_size`` pool."""

    @pytest.fixture(scope="module")
    def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
        srv = ServerProcess(tmp_path_factory.mktemp(name), pool_size=pool_size)
        srv.start()
        try:
            yield srv
        finally:
            srv.cleanup()

    return server


def pool_client() -> Callable[..., Iterator[MaruHandler]]:
    """A function-scoped fixture: a handler on the module's ``server`` fixture, closed (its pool
    registration released) after the test."""

    @pytest.fixture
    def client(server: ServerProcess) -> Iterator[MaruHandler]:
        h = MaruHandler(server.url, timeout_s=5)
        try:
            yield h
        finally:
            release_pool(h)
            h.close()

    return client


def module_client(
    name: str, pool_size: str = "64M", timeout_s: float = 10.0
) -> Callable[..., Iterator[MaruHandler]]:
    """A module-scoped fixture: a server of its own and one handler on it, for the whole module."""

    @pytest.fixture(scope="module")
    def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MaruHandler]:
        srv = ServerProcess(tmp_path_factory.mktemp(name), pool_size=pool_size)
        srv.start()
        h = MaruHandler(srv.url, timeout_s=timeout_s)
        try:
            yield h
        finally:
            release_pool(h)
            h.close()
            srv.cleanup()

    return client
