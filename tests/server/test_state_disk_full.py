"""A full state disk: the real server with its state dir on a 2 MiB tmpfs, real SQLite, kill -9.

Promises under test: a full state disk refuses writes with a clear error (``state_unwritable``),
keeps reads and heartbeats working, never reports a COMMIT as failed that was applied (nor as
stored one that was not), never lets a restart return bytes a key does not own, and recovers by
itself when space returns.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from maru.protocol import Op
from maru.server.state import STATE_FILE
from tests.helpers import RawClient, ServerProcess, flat, map_pool, maru


def fill(path: Path, leave: int) -> None:
    """Write a file that leaves about ``leave`` bytes free on its filesystem."""
    vfs = os.statvfs(path.parent)
    size = max(0, vfs.f_bavail * vfs.f_frsize - leave)
    with open(path, "wb") as f:
        f.write(b"\0" * size)


class Store:
    """Stores unique random objects one COMMIT at a time and records what the server answered."""

    def __init__(self, c: RawClient, pool: mmap.mmap, size: int = 3000) -> None:
        self.c, self.pool, self.size = c, pool, size
        self.data: dict[str, bytes] = {}
        self.acked: list[str] = []  # COMMIT answered "stored"
        self.refused: list[str] = []  # COMMIT (or its RESERVE) answered with an error
        self.errors: list[dict] = []
        self.n = 0

    def one(self) -> bool:
        key = f"obj-{self.n:06d}"
        self.n += 1
        r = self.c.call(Op.RESERVE, sizes=[self.size])
        if not r["ok"]:
            self.refused.append(key)
            self.errors.append(r)
            return False
        alloc_id, off, size = r["allocs"][0]
        value = os.urandom(size)
        self.data[key] = value
        self.pool[off : off + size] = value
        res = self.c.call(Op.COMMIT, items=[[key, alloc_id]])
        if res["ok"]:
            assert res["results"] == ["stored"], res
            self.acked.append(key)
            return True
        self.refused.append(key)
        self.errors.append(res)
        # Nothing was stored and the reservation is still ours: give it back.
        assert self.c.call(Op.ABORT, alloc_ids=[alloc_id])["freed"] == 1
        return False

    def until_refused(self, limit: int = 20_000) -> None:
        for _ in range(limit):
            if not self.one():
                return
        raise AssertionError(f"{limit} stores and the state disk never filled")


def present_bytes(c: RawClient, pool: mmap.mmap, keys: list[str]) -> dict[str, bytes]:
    out = {}
    for i in range(0, len(keys), 1000):
        chunk = keys[i : i + 1000]
        for k, e in zip(chunk, c.call(Op.LOOKUP, keys=chunk)["entries"], strict=True):
            if e is not None:
                out[k] = bytes(pool[e[0] : e[0] + e[1]])
    return out


def assert_refusal_is_clear(reply: dict) -> None:
    assert not reply["ok"] and reply["code"] == "state_unwritable", reply
    assert "state" in reply["message"] and "full" in reply["message"], reply


def test_a_full_state_disk_refuses_writes_keeps_reads_and_never_misreports_a_commit(
    tmp_path: Path, small_state_fs: Path
) -> None:
    srv = ServerProcess(tmp_path, pool_size="256M", state_dir=small_state_fs / "state")
    with srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        fill(small_state_fs / "filler", leave=400 << 10)
        s = Store(c, pool)
        s.until_refused()
        for _ in range(20):  # once full, further writes are refused up front
            assert not s.one()
        assert s.acked, "nothing was stored before the disk filled"
        for e in s.errors:
            assert_refusal_is_clear(e)
        assert c.call(Op.DELETE, keys=[s.acked[0]])["code"] == "state_unwritable"

        # Reads, pins and heartbeats keep working, and see exactly the acknowledged keys.
        assert c.call(Op.HEARTBEAT)["known"] is True
        ex = c.call(Op.EXISTS, keys=s.acked[-500:] + s.refused)
        assert ex["present"] == [True] * len(s.acked[-500:]) + [False] * len(s.refused)
        pinned = c.call(Op.LOOKUP, keys=s.acked[:3], pin=True)
        assert all(e is not None for e in pinned["entries"]), pinned
        assert c.call(Op.UNPIN, keys=s.acked[:3])["unpinned"] == [True] * 3
        got = present_bytes(c, pool, s.acked + s.refused)
        assert got == {k: s.data[k] for k in s.acked}
        st = c.call(Op.STATS)
        assert st["ok"] and st["state"]["writable"] is False and "full" in st["state"]["error"]

        # Crash on the full disk; restart on the full disk. Acknowledged: present with the right
        # bytes. Refused: absent (a refused COMMIT was not applied).
        pool.close()
        srv.kill()
        srv.start()
        pool = map_pool(srv.pool_path)
        got = present_bytes(c, pool, s.acked + s.refused)
        assert sorted(got) == sorted(s.acked)
        assert all(got[k] == s.data[k] for k in s.acked)
        pool.close()


def test_evictions_on_a_full_state_disk_never_hand_out_space_a_restart_gives_back(
    tmp_path: Path, small_state_fs: Path
) -> None:
    # A 20-object pool: every RESERVE past the first 20 evicts. An eviction that cannot be
    # written must not free space for a new writer, or a restart would bring the evicted key back
    # naming someone else's bytes.
    srv = ServerProcess(tmp_path, pool_size=(20 + 1) * 4096, state_dir=small_state_fs / "state")
    with srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        s = Store(c, pool)
        for _ in range(60):  # the pool is full after 20: 40 evictions so far
            assert s.one(), s.errors
        # Less room than the smallest WAL the server keeps: the next few writes fill the disk.
        fill(small_state_fs / "filler", leave=40 << 10)
        s.until_refused()
        for e in s.errors:
            assert_refusal_is_clear(e)
        assert c.call(Op.STATS)["counters"]["evictions"] >= 40
        before = present_bytes(c, pool, list(s.data))
        assert all(before[k] == s.data[k] for k in before)
        pool.close()
        srv.kill()
        srv.start()
        pool = map_pool(srv.pool_path)
        after = present_bytes(c, pool, list(s.data) + s.refused)
        # Every key a restart knows names its own bytes; refused commits are not there.
        assert after and all(after[k] == s.data[k] for k in after)
        assert not set(after) & set(s.refused)
        assert set(before) <= set(after)  # what was visible before the crash survived it
        pool.close()


def test_the_server_recovers_by_itself_when_space_returns(tmp_path: Path, small_state_fs: Path) -> None:
    srv = ServerProcess(tmp_path, pool_size="256M", state_dir=small_state_fs / "state")
    with srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        filler = small_state_fs / "filler"
        fill(filler, leave=300 << 10)
        s = Store(c, pool)
        s.until_refused()
        # maru doctor says so, with what to do; the server still serves reads, so it only warns.
        p = maru("doctor", "--url", srv.url, "--quick")
        out = flat(p.stdout)
        assert p.returncode == 0, p.stdout + p.stderr
        assert "server state disk (optional) warn" in out, out
        assert f"the state database {srv.state_dir / STATE_FILE} refuses writes" in out, out
        assert "state_unwritable" in out and f"fix: free space on the filesystem of {srv.state_dir}" in out, (
            out
        )
        filler.unlink()
        deadline = time.monotonic() + 20
        while not s.one():  # no restart: the server notices the space by itself
            assert time.monotonic() < deadline, f"still refused after space returned: {s.errors[-1]}"
            time.sleep(0.1)
        for _ in range(50):
            assert s.one(), s.errors[-1]
        assert c.call(Op.STATS)["state"]["writable"] is True
        assert "server state disk (optional) ok" in flat(maru("doctor", "--url", srv.url, "--quick").stdout)
        assert "writable again" in srv.log()
        pool.close()
        srv.kill()
        srv.start()
        pool = map_pool(srv.pool_path)
        got = present_bytes(c, pool, list(s.data) + s.refused)
        assert sorted(got) == sorted(s.acked)
        assert all(got[k] == s.data[k] for k in s.acked)
        pool.close()


def test_a_small_state_disk_fills_with_entries_not_with_wal(tmp_path: Path, small_state_fs: Path) -> None:
    # Each single-key COMMIT appends a page to the WAL: left to SQLite's default checkpoint (every
    # 1000 pages, 4 MiB), about 480 stores fill 2 MiB. The server keeps the WAL to a share of the
    # free space, so the disk holds what the entries need.
    srv = ServerProcess(tmp_path, pool_size="64M", state_dir=small_state_fs / "state")
    with srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        s = Store(c, pool, size=100)
        for _ in range(3000):
            assert s.one(), s.errors[-1]
        wal = os.stat(small_state_fs / "state" / "maru-state.sqlite-wal").st_size
        assert wal <= 1 << 20, wal
        pool.close()
