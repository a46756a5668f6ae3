"""Maru's client: ``MaruHandler`` reserves, writes, publishes, looks up and reads objects in the
shared pool; only metadata goes to ``maru server``. See docs/client.md."""

from __future__ import annotations

from maru.client.handler import MaruHandler
from maru.client.mapping import PoolMapping
from maru.client.objects import Allocation, AllocState, Retrieved
from maru.client.replies import ServerInfo
from maru.protocol import CommitResult

__all__ = [
    "AllocState",
    "Allocation",
    "CommitResult",
    "MaruHandler",
    "PoolMapping",
    "Retrieved",
    "ServerInfo",
]
