"""Integrity against stalled and slow clients, with real processes (SIGSTOP/SIGCONT, kill -9).

Each test stops a real client process past its lease while others keep working, resumes it,
and checks the promise: no client changes the bytes another reads as a committed object
without it being detected (a miss), and space an expired holder may still touch is not reused
until it is known dead or fenced (docs/reliability.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from maru.client import MaruHandler
from maru.errors import PoolFullError
from tests.helpers import REPO_ROOT, ServerProcess

LEASE_S = 2.0
SIZE = 600 * 1024


class Child:
    """A ``tests.client.stall_child`` process: JSON lines out, cue lines in."""

    def __init__(self, *args: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.client.stall_child", *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
        )

    def read(self) -> dict[str, Any]:
        line = self.proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            raise AssertionError(f"child said nothing; stderr:\n{self.proc.stderr.read().decode()}")  # type: ignore[union-attr]
        return json.loads(line)

    def cue(self) -> None:
        self.proc.stdin.write(b"go\n")  # type: ignore[union-attr]
        self.proc.stdin.flush()  # type: ignore[union-attr]

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=10)


def wait_for(h: MaruHandler, done, what: str, timeout_s: float = 15.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        u = h.usage()
        s = h.stats()
        if done(u, s):
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen: usage={u} counters={s['counters']}")
        time.sleep(0.1)


def expired(count: int = 1):
    return lambda u, s: s["counters"]["leases_expired"] >= count


def put(h: MaruHandler, key: str, data: bytes) -> int:
    obj = h.alloc(len(data))
    obj.buf[:] = data
    offset = obj.offset
    h.store(key, obj)
    return offset


@pytest.mark.parametrize("mode", ["buf", "numpy"])
def test_a_stalled_writer_never_lands_in_another_clients_committed_object(tmp_path: Path, mode: str) -> None:
    with ServerProcess(tmp_path, pool_size="16M", lease_timeout=LEASE_S) as srv, MaruHandler(srv.url) as y:
        x = Child("writer", srv.url, str(SIZE), mode)
        try:
            x_offset = x.read()["offset"]
            x.stop()
            x.cue()  # queued: the writer thread writes the moment the process runs again
            wait_for(y, lambda u, s: s["counters"]["quarantines"] == 1, "X's lease expiring into quarantine")
            rng = np.random.default_rng(1)
            mine = {f"y{i}": rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes() for i in range(4)}
            offsets = {put(y, k, v) for k, v in mine.items()}
            assert x_offset not in offsets  # quarantined: not handed out while X may write there
            assert y.usage()["quarantined"] >= SIZE
            x.resume()
            # X fences itself and tells the server; then X's space is free again, while X keeps writing.
            wait_for(y, lambda u, s: s["counters"]["quarantine_released_fenced"] == 1, "X fencing")
            later = {}
            for i in range(8):  # best fit hands out X's old extent to one of these
                later[f"z{i}"] = rng.integers(0, 256, SIZE, dtype=np.uint8).tobytes()
                offsets.add(put(y, f"z{i}", later[f"z{i}"]))
            assert x_offset in offsets
            done = x.read()
            assert done["outcome"] == "stale" and done["writes"] > 10
            assert done["integrity"]["fenced_sessions"] == 1
            for k, v in {**mine, **later}.items():
                r = y.retrieve(k)
                assert r is not None and r.tobytes() == v, k
                r.release()
            assert y.stats()["counters"]["integrity_failures"] == 0
        finally:
            x.close()


def test_the_checksum_catches_a_stalled_writer_once_its_quarantine_timed_out(tmp_path: Path) -> None:
    args = ["--quarantine-timeout", "0.5"]
    with ServerProcess(tmp_path, pool_size="16M", lease_timeout=LEASE_S, extra_args=args) as srv:
        with MaruHandler(srv.url) as y:
            x = Child("writer", srv.url, str(SIZE), "buf")
            try:
                x_offset = x.read()["offset"]
                x.stop()
                x.cue()
                wait_for(
                    y, lambda u, s: s["counters"]["quarantine_released_timed_out"] == 1, "quarantine timeout"
                )
                data = os.urandom(SIZE)
                assert put(y, "victim", data) == x_offset  # the space was reused: X writes into it
                x.resume()
                assert x.read()["outcome"] == "stale"
                r = y.retrieve("victim")
                if r is not None:  # X was fenced before its first write landed: the bytes are intact
                    assert r.tobytes() == data
                    pytest.skip("the stalled writer was fenced before it wrote (race not hit this time)")
                assert y.integrity()["integrity_failures"] == 1
                c = y.stats()["counters"]
                assert (c["integrity_failures"], c["integrity_deletes"]) == (1, 1)
                assert y.exists(["victim"]) == [False]  # deleted: it can be stored again
                put(y, "victim", data)
                r = y.retrieve("victim")
                assert r is not None and r.tobytes() == data
            finally:
                x.close()


@pytest.mark.parametrize("quarantine_timeout", ["600", "0.5"])
def test_a_stalled_reader_learns_its_view_was_revoked_before_trusting_it(
    tmp_path: Path, quarantine_timeout: str
) -> None:
    args = ["--quarantine-timeout", quarantine_timeout]
    with ServerProcess(tmp_path, pool_size="8M", lease_timeout=LEASE_S, extra_args=args) as srv:
        with MaruHandler(srv.url) as w:
            original = os.urandom(SIZE)
            put(w, "read-me", original)
            reader = Child("reader", srv.url, "read-me")
            try:
                assert reader.read()["ready"]
                reader.stop()
                reader.cue()
                wait_for(w, expired(), "the reader's lease expiring")
                if quarantine_timeout != "600":
                    wait_for(w, lambda u, s: u["quarantined"] == 0, "the quarantine timing out")
                w.delete(["read-me"])
                for i in range(16):  # more than the pool holds: every reusable byte gets other bytes
                    put(w, f"other{i}", os.urandom(SIZE))
                reader.resume()
                seen = reader.read()
                good = hashlib.sha256(original).hexdigest()
                for trusted, sha in seen["samples"]:
                    assert sha == good or not trusted, seen  # other bytes are never vouched for
                assert not seen["valid"] and seen["integrity"]["fenced_sessions"] == 1
            finally:
                reader.close()


def test_a_killed_holders_quarantine_is_released_and_a_full_pool_says_why(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, pool_size="4M", lease_timeout=LEASE_S) as srv, MaruHandler(srv.url) as y:
        x = Child("writer", srv.url, str(3 << 20), "numpy")
        try:
            x.read()
            x.stop()
            wait_for(y, lambda u, s: s["counters"]["quarantines"] == 1, "X's lease expiring into quarantine")
            with pytest.raises(PoolFullError, match="quarantine"):
                y.alloc(2 << 20)
            x.proc.kill()  # SIGKILL: the server sees the pid gone and releases at once
            x.proc.wait(timeout=10)
            wait_for(
                y, lambda u, s: s["counters"]["quarantine_released_dead"] == 1, "release of a dead holder"
            )
            obj = y.alloc(2 << 20)
            y.abort(obj)
        finally:
            x.close()


def test_bytes_changed_behind_a_committed_object_are_a_counted_reported_miss(tmp_path: Path) -> None:
    """The deterministic half of the checksum test: another process (here, this one through its
    own mapping of the pool file) changes 8 bytes of a committed object."""
    import mmap

    with ServerProcess(tmp_path, pool_size="16M") as srv, MaruHandler(srv.url) as y:
        data = os.urandom(SIZE)
        offset = put(y, "victim", data)
        put(y, "bystander", data)
        with open(srv.pool_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
            m[offset + 4096 : offset + 4104] = bytes(8)
        got = y.batch_retrieve(["victim", "bystander"])
        assert got[0] is None and got[1] is not None and got[1].tobytes() == data
        got[1].release()
        assert y.integrity()["integrity_failures"] == 1
        c = y.stats()["counters"]
        assert (c["integrity_failures"], c["integrity_deletes"]) == (1, 1)
        assert y.usage()["pinned"] == 0  # the failed read's pin was given back
        from rich.console import Console

        from maru.cli.stats import render

        console = Console(record=True, width=160, file=open(os.devnull, "w"))  # noqa: SIM115
        console.print(render(y.stats(), None, None))
        shown = console.export_text()
        assert "integrity failures (checksum mismatch)" in shown and "quarantined (expired holders)" in shown
        r = y.retrieve("bystander", verify=False)
        assert r is not None and r.verify() and r.valid
        r.release()
