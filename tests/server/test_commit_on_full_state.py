"""A mixed COMMIT batch on a really full state disk: refused whole, then the same as one by one.

The server runs in this process (``handle_frame``) so the test can fill the disk at the exact
moment it wants; the pool, SQLite and the tmpfs are real.
"""

from __future__ import annotations

import os
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from maru import protocol as P
from maru.config import MaruConfig
from maru.pool.allocator import ExtentAllocator
from maru.protocol import Op
from maru.server.registry import KeyRegistry
from maru.server.server import MaruServer
from tests.helpers import free_port

A = 4096


class InProcess:
    def __init__(self, server: MaruServer) -> None:
        self.server, self.req = server, 0

    def call(self, op: int, **fields: Any) -> dict[str, Any]:
        self.req += 1
        fields.setdefault("client_id", "w")
        frame = self.server.handle_frame(P.encode(op, self.req, fields))
        assert frame is not None
        return P.decode_body(frame)


@pytest.fixture
def server(small_state_fs: Path) -> Iterator[MaruServer]:
    pool = f"/dev/shm/maru-test-{uuid.uuid4().hex[:12]}"
    cfg = MaruConfig(port=free_port(), pool_path=pool, state_dir=small_state_fs / "state")
    srv = MaruServer(cfg, pool_size=(64 + 1) * A)
    srv.start()
    try:
        yield srv
    finally:
        srv.close()
        os.unlink(pool)


def fill_completely(path: Path) -> None:
    with open(path, "wb", buffering=0) as f:
        try:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        except OSError:
            pass


def snapshot(srv: MaruServer) -> tuple[Any, ...]:
    reg = srv.registry
    return (reg.entries, reg.reservations, reg.reserved_bytes, reg.alloc.used_bytes, reg.evictable_bytes)


def test_a_refused_batch_changes_nothing_and_the_retry_matches_one_by_one_commits(
    server: MaruServer, small_state_fs: Path
) -> None:
    rng = random.Random(7)
    c = InProcess(server)
    assert c.call(Op.HANDSHAKE, host="t", pid=1)["ok"]
    ref = KeyRegistry(ExtentAllocator(A, (64 + 1) * A, A))  # the oracle: plain one-by-one commits
    allocs = c.call(Op.RESERVE, sizes=[A] * 12)["allocs"]
    ref_ids = {a[0]: ref.reserve("w", A).alloc_id for a in allocs}
    # Some keys are present already (duplicates), one alloc is used twice, one is unknown.
    assert c.call(Op.COMMIT, items=[["old-0", allocs[0][0]], ["old-1", allocs[1][0]]])["ok"]
    ref.commit("w", "old-0", ref_ids[allocs[0][0]])
    ref.commit("w", "old-1", ref_ids[allocs[1][0]])
    batch = [
        ["old-0", allocs[2][0]],  # present: frees its space
        ["new-a", allocs[2][0]],  # same alloc again: unknown_alloc
        ["new-b", allocs[3][0]],
        ["new-b", allocs[4][0]],  # present (stored just before in this batch)
        ["new-c", 999_999_999],  # unknown
        ["old-1", allocs[5][0]],
        ["new-c", allocs[6][0]],
        ["new-d", allocs[7][0]],
    ]
    rng.shuffle(batch)
    before = snapshot(server)
    filler = small_state_fs / "filler"
    fill_completely(filler)
    refused = c.call(Op.COMMIT, items=batch)
    assert not refused["ok"] and refused["code"] == "state_unwritable"
    assert "reservations are still yours" in refused["message"]
    assert snapshot(server) == before  # nothing applied, nothing freed
    assert c.call(Op.EXISTS, keys=["new-b", "new-c", "new-d"])["present"] == [False] * 3
    assert c.call(Op.RESERVE, sizes=[A])["code"] == "state_unwritable"
    assert c.call(Op.HEARTBEAT)["known"] is True
    server.reap()
    assert not server.state.writable  # still full: no recovery
    filler.unlink()
    server.reap()
    assert server.state.writable
    got = c.call(Op.COMMIT, items=batch)["results"]
    want = [ref.commit("w", k, ref_ids.get(a, a)).value for k, a in batch]
    assert got == want
    assert (server.registry.entries, server.registry.alloc.used_bytes) == (ref.entries, ref.alloc.used_bytes)
