"""EXISTS from the server's key index: a real ``maru server`` process writes it, this process reads it.

Every answer read from the table is checked against the server's own EXISTS (a bare protocol
client, which always asks the server), through commits, deletes, evictions and a restart.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from maru import MaruHandler
from maru.errors import MaruError
from maru.protocol import Op
from tests.helpers import RawClient, ServerProcess


def put(h: MaruHandler, keys: list[str], size: int = 4096) -> None:
    objs = h.batch_alloc([size] * len(keys))
    for o in objs:
        o.buf[:8] = b"12345678"
    h.batch_store(keys, objs)


def server_says(url: str, keys: list[str]) -> list[bool]:
    raw = RawClient(url)
    try:
        return [bool(x) for x in raw.call(Op.EXISTS, keys=keys)["present"]]
    finally:
        raw.close()


def server_exists_keys(h: MaruHandler) -> int:
    c = h.stats()["counters"]
    return int(c["exists_hits"]) + int(c["exists_misses"])


def test_exists_is_answered_from_the_index_and_agrees_with_the_server(tmp_path: Path) -> None:
    # 1 MiB of pool in 4 KiB objects: the later stores evict the earlier ones.
    with ServerProcess(tmp_path, pool_size="1M") as srv, MaruHandler(srv.url) as h:
        assert os.path.exists(srv.pool_path + ".keyindex")  # beside a /dev/shm pool of 4 KiB alignment
        assert h.local_exists.path == "key index"
        rng = random.Random(3)
        names = [f"t/{i}" for i in range(600)]
        stored: list[str] = []
        before = server_exists_keys(h)
        for rnd in range(12):
            batch = names[rnd * 50 : (rnd + 1) * 50]
            put(h, batch)
            stored += batch
            h.delete(rng.sample(stored, 5))  # (some of them may be evicted or deleted already)
            probe = rng.sample(names, 120)
            assert h.exists(probe) == server_says(srv.url, probe)
        assert h.local_exists.counts()["exists_local"] == 12
        assert h.local_exists.counts()["exists_remote"] == 0
        assert server_exists_keys(h) == before + 12 * 120  # only server_says asked the server
        everything = server_says(srv.url, names)
        assert 0 < sum(everything) < 600 - 60  # evictions happened, and some keys are still there
        assert h.exists(names) == everything
        tail = server_says(srv.url, names[-50:])
        assert h.exists_prefix(names[-50:]) == (tail.index(False) if False in tail else 50)
    assert not os.path.exists(srv.pool_path + ".keyindex")  # a clean stop removes the side file


def test_a_restarted_server_publishes_a_new_index_with_the_keys_it_kept(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, pool_size="4M", lease_timeout=2.0)
    srv.start()
    try:
        with MaruHandler(srv.url, timeout_s=5) as h:
            put(h, ["kept/a", "kept/b"])
            old_nonce = h.local_exists._reader.nonce  # type: ignore[union-attr]
            srv.stop()
            srv.start()
            # The first call after the restart finds the new server, handshakes, and reads its index.
            assert h.exists(["kept/a", "kept/b", "kept/c"]) == [True, True, False]
            put(h, ["kept/c"])
            assert h.exists(["kept/c"]) == [True]
            assert h.local_exists._reader.nonce != old_nonce  # type: ignore[union-attr]
            assert h.local_exists.path == "key index"
    finally:
        srv.cleanup()


def test_the_index_sits_in_the_header_unit_of_a_pool_with_room_there(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, pool_size="8M", extra_args=["--alignment", "1M"]) as srv:
        with MaruHandler(srv.url) as h:
            assert not os.path.exists(srv.pool_path + ".keyindex")
            assert h.local_exists._reader.place.path is None  # type: ignore[union-attr]
            put(h, ["hdr/a"], size=100)
            assert h.exists(["hdr/a", "hdr/b"]) == [True, False]
            assert h.local_exists.counts()["exists_local"] == 1
            snap = h.stats()["key_index"]
            assert snap["on"] and snap["where"] == "pool header unit" and snap["keys"] == 1


def test_without_the_index_exists_goes_to_the_server_and_says_so_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        ServerProcess(tmp_path, pool_size="4M", extra_args=["--no-key-index"]) as srv,
        MaruHandler(srv.url) as h,
    ):
        assert "key index off: --no-key-index" in srv.log()
        assert h.stats()["key_index"] == {"on": False, "why_off": "--no-key-index"}
        put(h, ["x"])
        with caplog.at_level(logging.WARNING, logger="maru.client"):
            assert h.exists(["x", "y"]) == [True, False]
            assert h.exists(["x"]) == [True]
        notes = [r.message for r in caplog.records if "EXISTS goes to the server" in r.message]
        assert len(notes) == 1 and "--no-key-index" in notes[0]
        assert h.local_exists.counts() == {"exists_local": 0, "exists_remote": 2}
        assert h.local_exists.path.startswith("server round trip")


def test_a_killed_server_is_never_answered_for_from_its_table(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, pool_size="4M")
    srv.start()
    try:
        with MaruHandler(srv.url, timeout_s=1.0) as h:
            put(h, ["k"])
            assert h.exists(["k"]) == [True]
            srv.kill()  # its table still says "present"; this host sees the pid gone at once
            with pytest.raises(MaruError):
                h.exists(["k"])
            assert h.local_exists.counts()["exists_remote"] == 1
    finally:
        srv.cleanup()


def test_from_another_host_a_server_whose_beat_stopped_is_not_answered_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another host cannot see the server's pid: only the table's beat tells it the server lives.
    monkeypatch.setattr("maru.client.local_exists._HOST", ("another-boot", "another-ns"))
    srv = ServerProcess(tmp_path, pool_size="4M", lease_timeout=1.0)  # a beat every 0.25 s
    srv.start()
    try:
        with MaruHandler(srv.url, timeout_s=1.0, heartbeat_interval_s=30) as h:
            watch = h.local_exists._watch
            assert watch is not None and watch.pid is None and watch.stale_s == 2.0
            put(h, ["k"])
            time.sleep(0.6)  # beats move: still alive
            assert h.exists(["k"]) == [True] and watch.why_dead() is None
            os.kill(srv.pid, signal.SIGSTOP)  # hung: no beats, no replies
            try:
                deadline = time.monotonic() + 10
                while watch.why_dead() is None:
                    assert time.monotonic() < deadline, "the stopped beat was never noticed"
                    time.sleep(0.1)
                assert "has not refreshed its key index" in (watch.why_dead() or "")
                with pytest.raises(MaruError):
                    h.exists(["k"])  # to the server, which does not answer
            finally:
                os.kill(srv.pid, signal.SIGCONT)
    finally:
        srv.cleanup()


def _reader(url: str, stable: list[str], never: list[str], ready: Any, stop: Any, out: Any) -> None:
    """Another process: EXISTS in a loop while the server churns; every answer must be exact."""
    wrong, answers = 0, 0
    with MaruHandler(url, timeout_s=10) as h:
        want = [True] * len(stable) + [False] * len(never)
        while not stop.is_set():
            wrong += h.exists(stable + never) != want
            answers += 1
            ready.set()
        out.put((answers, wrong, h.local_exists.counts()))


def test_readers_in_another_process_stay_exact_while_deletes_shift_slots(tmp_path: Path) -> None:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with ServerProcess(tmp_path, pool_size="4M") as srv, MaruHandler(srv.url) as h:
        stable, never = [f"stable/{i}" for i in range(40)], [f"never/{i}" for i in range(40)]
        put(h, stable)
        ready, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        p = ctx.Process(target=_reader, args=(srv.url, stable, never, ready, stop, out))
        p.start()
        try:
            assert ready.wait(60), "the reader process never answered"
            deadline = time.monotonic() + 60
            batch = 0
            while h.stats()["key_index"]["shifts"] < 200:  # deletes moved slots under the reader
                assert time.monotonic() < deadline, h.stats()["key_index"]
                keys = [f"churn/{batch}/{i}" for i in range(400)]
                put(h, keys)
                h.delete(keys)
                batch += 1
        finally:
            stop.set()
            answers, wrong, counts = out.get(timeout=30)
            p.join(30)
    assert wrong == 0 and answers > 10
    assert counts["exists_local"] > 0  # most answers came from the table (a read that a shift
    # overlapped is read again, and asks the server only after several tries)
