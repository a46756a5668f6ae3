"""End-to-end behaviour of Maru's core with every part real and in its own process.

``maru server`` runs as a child process (tests.helpers.ServerProcess); clients run in separate
processes started with the ``spawn`` method, each mapping the same /dev/shm pool file. A worker
process obeys commands sent over a pipe, so one test can drive several long-lived clients.

Object contents are derivable from the key (``content(key)``), so any process can check any
object it reads without being told what was written.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import random
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest

from maru import MaruHandler
from maru.errors import MaruTimeoutError, NotConnectedError, StaleAllocationError
from tests.helpers import ServerProcess, wait_until

SPAWN = mp.get_context("spawn")


def content(key: str, size: int | None = None) -> bytes:
    """The bytes stored under ``key`` by the key-derived tests (size too, unless given)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")
    rng = random.Random(seed)
    if size is None:
        size = rng.choice([1, 333, 4096, 5000, 65536, 131072 + 17])
    return rng.randbytes(size)


def sha(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


# -- a client in its own process, driven over a pipe ----------------------------------------------


def _worker_main(url: str, conn: Connection) -> None:
    held: list[Any] = []
    with MaruHandler(url, timeout_s=5.0) as h:
        conn.send(("ready", os.getpid()))
        while True:
            cmd, arg = conn.recv()
            try:
                if cmd == "store_random":  # arg: {key: size}; random bytes; reply {key: sha256}
                    keys = list(arg)
                    objs = h.batch_alloc([arg[k] for k in keys])
                    digests = {}
                    for k, o in zip(keys, objs, strict=True):
                        data = os.urandom(o.size)
                        o.buf[:] = data
                        digests[k] = sha(data)
                    h.batch_store(keys, objs)
                    conn.send(("ok", digests))
                elif cmd == "store_derived":  # arg: [key]; content(key)
                    objs = h.batch_alloc([len(content(k)) for k in arg])
                    for k, o in zip(arg, objs, strict=True):
                        o.buf[:] = content(k)
                    conn.send(("ok", [r.value for r in h.batch_store(arg, objs)]))
                elif cmd == "read":  # arg: [key]; reply {key: sha256 | None}
                    rs = h.batch_retrieve(arg)
                    out = {k: (None if r is None else sha(r.view)) for k, r in zip(arg, rs, strict=True)}
                    h.batch_release(rs)
                    conn.send(("ok", out))
                elif cmd == "reserve_and_fill":  # arg: [size]; hold the reservations, never store
                    objs = h.batch_alloc(arg)
                    for o in objs:
                        o.buf[:] = b"\xab" * o.size
                    held.extend(objs)
                    conn.send(("ok", sum(o.size for o in objs)))
                elif cmd == "store_held":  # arg: [key]; store what reserve_and_fill holds
                    objs = [o for o in held if not hasattr(o, "view")]
                    held.clear()
                    conn.send(("ok", [r.value for r in h.batch_store(arg, objs)]))
                elif cmd == "pin":  # arg: key; keep it pinned until exit
                    r = h.retrieve(arg)
                    held.append(r)
                    conn.send(("ok", None if r is None else sha(r.view)))
                elif cmd == "exit":
                    conn.send(("ok", None))
                    return
                else:
                    conn.send(("error", f"unknown command {cmd}"))
            except Exception as e:  # report, so the test shows the worker's error
                conn.send(("error", f"{type(e).__name__}: {e}"))


class Worker:
    """A client process; ``call(cmd, arg)`` runs one command there and returns its result."""

    def __init__(self, url: str) -> None:
        self.conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=_worker_main, args=(url, child), daemon=True)
        self.proc.start()
        child.close()
        status, self.pid = self._recv(60.0)
        assert status == "ready"

    def _recv(self, timeout_s: float) -> Any:
        if not self.conn.poll(timeout_s):
            raise AssertionError(f"worker {self.proc.pid} did not answer within {timeout_s} s")
        return self.conn.recv()

    def call_raw(self, cmd: str, arg: Any = None, timeout_s: float = 60.0) -> tuple[str, Any]:
        self.conn.send((cmd, arg))
        return self._recv(timeout_s)

    def call(self, cmd: str, arg: Any = None, timeout_s: float = 60.0) -> Any:
        status, value = self.call_raw(cmd, arg, timeout_s)
        if status != "ok":
            raise AssertionError(f"worker command {cmd} failed: {value}")
        return value

    def kill(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout_s=10)
            except (AssertionError, OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


@pytest.fixture
def workers(request: pytest.FixtureRequest) -> Any:
    started: list[Worker] = []

    def start(url: str) -> Worker:
        w = Worker(url)
        started.append(w)
        return w

    yield start
    for w in started:
        w.close()


# -- tests -----------------------------------------------------------------------------------------

MIXED_SIZES = [1, 7, 100, 4095, 4096, 4097, 65536, 100_000, 300_001]


def test_objects_stored_by_one_process_are_read_back_identical_by_another_in_both_directions(
    maru_server: ServerProcess, workers: Any
) -> None:
    rng = random.Random(1)
    a, b = workers(maru_server.url), workers(maru_server.url)
    for writer, reader, prefix in ((a, b, "a->b"), (b, a, "b->a")):
        sizes = {f"{prefix}/{i}": rng.choice(MIXED_SIZES) for i in range(200)}
        written = writer.call("store_random", sizes)
        read = reader.call("read", list(sizes))
        assert len(written) == 200
        assert read == written  # every SHA-256 matches, no key missing


def test_writer_killed_between_alloc_and_store_leaves_no_key_and_its_space_is_reclaimed(
    tmp_path: Path, workers: Any
) -> None:
    with ServerProcess(tmp_path, pool_size="32M", lease_timeout=1.0) as server:
        with MaruHandler(server.url) as h:
            free_before = h.usage()["free"]
            w = workers(server.url)
            reserved = w.call("reserve_and_fill", [1 << 20] * 4 + [12345])
            u = h.usage()
            assert u["reservations"] == 5 and u["reserved"] >= reserved
            assert u["free"] <= free_before - reserved
            w.kill()
            # Nothing was published: the dead writer never committed.
            assert u["entries"] == 0 and h.usage()["entries"] == 0
            wait_until(lambda: h.usage()["reservations"] == 0, 20.0, "the dead writer's lease to expire")
            u = h.usage()
            assert u["reserved"] == 0
            assert u["free"] == free_before
            assert h.stats()["counters"]["reclaimed_reservations"] == 5


def test_full_pool_evicts_least_recently_used_unpinned_objects_and_never_a_pinned_one(
    tmp_path: Path, workers: Any
) -> None:
    mib = 1 << 20
    # 8 MiB pool minus one 4 KiB header page: seven 1 MiB objects fit, the eighth needs an eviction.
    with ServerProcess(tmp_path, pool_size="8M") as server, MaruHandler(server.url) as h:
        reader = workers(server.url)
        pinned = "pinned"
        keys = [pinned] + [f"k{i}" for i in range(6)]
        _store_sized(h, keys, mib)
        pinned_sha = reader.call("pin", pinned)  # pinned by another process, held until it exits
        assert pinned_sha == sha(content(pinned, mib))
        r = h.retrieve("k0")  # touch k0: now k1 is the least recently used unpinned entry
        assert r is not None
        r.release()
        _store_sized(h, ["k6"], mib)
        _store_sized(h, ["k7"], mib)
        assert h.exists([pinned, "k0", "k1", "k2", "k3", "k6", "k7"]) == [
            True,
            True,
            False,
            False,
            True,
            True,
            True,
        ]
        # Now overfill the pool several times: the pinned object survives all of it.
        _store_sized(h, [f"x{i}" for i in range(30)], mib)
        assert h.retrieve("k1") is None
        assert reader.call("read", [pinned]) == {pinned: sha(content(pinned, mib))}
        assert h.stats()["counters"]["evictions"] >= 2 + 30 - 2
        assert h.usage()["pinned"] == 1


def _store_sized(h: MaruHandler, keys: list[str], size: int) -> None:
    for k in keys:  # one at a time: each reserve may evict
        obj = h.alloc(size)
        obj.buf[:] = content(k, size)
        assert h.store(k, obj) == "stored"


def test_server_killed_and_restarted_serves_every_committed_key_and_connected_clients_recover(
    tmp_path: Path, workers: Any
) -> None:
    with ServerProcess(tmp_path, pool_size="64M") as server:
        h = MaruHandler(server.url, timeout_s=5.0, heartbeat_interval_s=0.2)
        try:
            w = workers(server.url)
            keys = [f"persist/{i}" for i in range(120)]
            w.call("store_derived", keys)
            pending = h.alloc(4096)  # reserved before the crash: cannot be stored after it
            pending.buf[:] = b"\x01" * 4096
            server.kill()
            server.start()
            # The same handler and the same worker process, neither restarted:
            rs = h.batch_retrieve(keys)
            assert [r is not None and r.view == content(k) for k, r in zip(keys, rs, strict=True)] == [
                True
            ] * 120
            h.batch_release(rs)
            assert w.call("read", keys) == {k: sha(content(k)) for k in keys}
            with pytest.raises(StaleAllocationError, match="alloc again"):
                h.store("written-before-crash", pending)
            assert h.exists(["written-before-crash"]) == [False]
            obj = h.alloc(10)
            obj.buf[:] = b"after-boot"
            assert h.store("after", obj) == "stored"
            r = h.retrieve("after")
            assert r is not None and r.tobytes() == b"after-boot"
            r.release()
        finally:
            h.close()


def test_a_client_paused_past_its_lease_recovers_and_cannot_store_its_lost_reservations(
    tmp_path: Path, workers: Any
) -> None:
    with ServerProcess(tmp_path, pool_size="16M", lease_timeout=1.0) as server, MaruHandler(server.url) as h:
        w = workers(server.url)
        w.call("reserve_and_fill", [4096, 8192])
        os.kill(w.pid, signal.SIGSTOP)  # silent: no heartbeats (like a long GC pause or a debugger)
        try:
            # Its reservations go to quarantine, not back to the pool: it may still write there.
            wait_until(lambda: h.usage()["quarantined"] > 0, 20.0, "the paused client's lease to expire")
        finally:
            os.kill(w.pid, signal.SIGCONT)
        status, err = w.call_raw("store_held", ["lost-1", "lost-2"])
        assert status == "error" and err.startswith("StaleAllocationError")
        assert h.exists(["lost-1", "lost-2"]) == [False, False]
        # The same process, not restarted, works on in a new session.
        assert w.call("store_derived", ["after-pause"]) == ["stored"]
        assert w.call("read", ["after-pause"]) == {"after-pause": sha(content("after-pause"))}
        # It fenced its old session and said so: the quarantine is released, the space reusable.
        wait_until(lambda: h.usage()["quarantined"] == 0, 20.0, "the fenced client's quarantine release")
        assert h.stats()["counters"]["quarantine_released_fenced"] == 1


def test_calls_to_a_dead_server_raise_a_clear_error_within_the_timeout(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, pool_size="16M")
    # Nothing listening at all: the constructor fails with the fix in the message.
    t0 = time.monotonic()
    with pytest.raises(NotConnectedError, match=r"maru server"):
        MaruHandler(server.url, timeout_s=1.0)
    assert time.monotonic() - t0 < 10  # a hang guard, not a speed test
    with server:
        h = MaruHandler(server.url, timeout_s=1.0)
        try:
            assert h.exists(["a"]) == [False]
            server.kill()
            for call in (lambda: h.exists(["a"]), lambda: h.retrieve("a"), lambda: h.alloc(100), h.stats):
                t0 = time.monotonic()
                with pytest.raises((NotConnectedError, MaruTimeoutError)) as ei:
                    call()
                assert time.monotonic() - t0 < 10
                assert server.url in str(ei.value) and "maru server" in str(ei.value)
            assert not h.connected
        finally:
            h.close()


# -- eight processes at once -----------------------------------------------------------------------

CONCURRENT_KEYS = 300


def _stress_main(url: str, seed: int, duration_s: float, out: Any) -> None:
    rng = random.Random(seed)
    counts = {"stores": 0, "present": 0, "hits": 0, "misses": 0, "wrong": 0, "full": 0}
    wrong_keys: list[str] = []
    with MaruHandler(url) as h:
        deadline = time.monotonic() + duration_s
        while time.monotonic() < deadline:
            keys = [f"c/{rng.randrange(CONCURRENT_KEYS)}" for _ in range(rng.choice([1, 4, 16]))]
            if rng.random() < 0.5:
                datas = [content(k) for k in keys]
                try:
                    objs = h.batch_alloc([len(d) for d in datas])
                except Exception as e:  # PoolFullError while everything is pinned: count it
                    if type(e).__name__ != "PoolFullError":
                        raise
                    counts["full"] += 1
                    continue
                for o, d in zip(objs, datas, strict=True):
                    o.buf[:] = d
                for r in h.batch_store(keys, objs):
                    counts["stores" if r == "stored" else "present"] += 1
            else:
                rs = h.batch_retrieve(keys)
                for k, r in zip(keys, rs, strict=True):
                    if r is None:
                        counts["misses"] += 1
                    elif r.view.tobytes() == content(k):
                        counts["hits"] += 1
                    else:
                        counts["wrong"] += 1
                        wrong_keys.append(k)
                h.batch_release(rs)
    out.put((counts, wrong_keys[:5]))


def test_eight_processes_storing_and_retrieving_concurrently_never_see_wrong_bytes(tmp_path: Path) -> None:
    # A 6 MiB pool for 300 keys of ~36 KiB (aligned) each is small enough to force evictions under load.
    with ServerProcess(tmp_path, pool_size="6M") as server:
        q = SPAWN.Queue()
        procs = [SPAWN.Process(target=_stress_main, args=(server.url, i, 20.0, q)) for i in range(8)]
        for p in procs:
            p.start()
        results = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        total: dict[str, int] = {}
        for counts, wrong_keys in results:
            assert counts["wrong"] == 0, f"wrong bytes for {wrong_keys}"
            for k, v in counts.items():
                total[k] = total.get(k, 0) + v
        assert all(p.exitcode == 0 for p in procs)
        print(f"8 processes, 20 s: {total}")  # shown with -s: how much the run exercised
        assert total["wrong"] == 0
        assert total["stores"] > 0 and total["hits"] > 0 and total["misses"] > 0
        with MaruHandler(server.url) as h:
            assert h.stats()["counters"]["evictions"] > 0  # the run did exercise eviction
            assert h.usage()["pinned"] == 0  # every reader released its pins
