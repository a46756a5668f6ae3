"""The metadata server as a real process over real ZeroMQ (raw DEALER + maru.protocol)."""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from maru import protocol as P
from maru.pool import open_pool
from maru.protocol import Op
from tests.helpers import REPO_ROOT, RawClient, ServerProcess, free_port, map_pool


def put(c: RawClient, pool: mmap.mmap, items: dict[str, bytes]) -> dict[str, list[int]]:
    """Reserve, write through the mapping, commit; returns key -> [offset, size]."""
    keys = list(items)
    r = c.call(Op.RESERVE, sizes=[len(items[k]) for k in keys])
    assert r["ok"], r
    placed = {}
    for k, (alloc_id, off, size) in zip(keys, r["allocs"], strict=True):
        pool[off : off + size] = items[k]
        placed[k] = [alloc_id, off, size]
    res = c.call(Op.COMMIT, items=[[k, placed[k][0]] for k in keys])
    assert res["results"] == ["stored"] * len(keys), res
    return {k: v[1:] for k, v in placed.items()}


def run_server_cli(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "maru.server", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_a_committed_key_names_the_bytes_written_through_the_pool(maru_server: ServerProcess) -> None:
    pool = map_pool(maru_server.pool_path)
    with RawClient(maru_server.url) as c:
        hs = c.handshake()
        assert hs["pool_path"] == maru_server.pool_path and hs["protocol_version"] == P.PROTOCOL_VERSION
        assert hs["data_offset"] == hs["alignment"] == 4096 and hs["pool_size"] == 64 << 20
        data = {f"k{i}": os.urandom(1000 + 777 * i) for i in range(5)}
        placed = put(c, pool, data)
        assert all(off % hs["alignment"] == 0 and off >= hs["data_offset"] for off, _ in placed.values())
        look = c.call(Op.LOOKUP, keys=["k0", "nope", "k4"], pin=False)
        assert look["entries"] == [placed["k0"], None, placed["k4"]]
        off, size = look["entries"][2]
        assert pool[off : off + size] == data["k4"]
        ex = c.call(Op.EXISTS, keys=["k0", "k1", "nope", "k3"])
        assert ex["present"] == [True, True, False, True] and ex["prefix"] == 2
        assert c.call(Op.DELETE, keys=["k1", "k1x"])["deleted"] == [True, False]
        assert c.call(Op.EXISTS, keys=["k1"])["present"] == [False]
        u = c.call(Op.USAGE)
        assert u["entries"] == 4 and u["reservations"] == 0 and u["clients"] == 1
        s = c.call(Op.STATS)
        assert s["counters"]["stores"] == 5 and s["counters"]["hits"] == 2 and s["counters"]["misses"] == 1
        assert s["requests"]["commit"] == 1 and s["gauges"]["entries"] == 4
    pool.close()


def test_stateful_ops_without_a_handshake_get_unknown_client(maru_server: ServerProcess) -> None:
    with RawClient(maru_server.url) as c:
        r = c.call(Op.RESERVE, sizes=[10])
        assert not r["ok"] and r["code"] == "unknown_client" and "handshake" in r["message"]
        assert c.call(Op.HEARTBEAT)["known"] is False
        assert c.call(Op.EXISTS, keys=["a"])["ok"]  # read-only ops need no lease
        c.handshake()
        assert c.call(Op.HEARTBEAT)["known"] is True
        assert c.call(Op.RESERVE, sizes=[10])["ok"]


def test_committed_keys_survive_sigkill_and_restart_with_the_same_offsets_and_bytes(tmp_path: Path) -> None:
    with ServerProcess(tmp_path) as srv:
        pool = map_pool(srv.pool_path)
        with RawClient(srv.url) as c:
            c.handshake()
            data = {f"obj-{i}": os.urandom(int.from_bytes(os.urandom(2), "little") + 1) for i in range(60)}
            placed = put(c, pool, data)
            c.call(Op.DELETE, keys=["obj-0"])
            pending = c.call(Op.RESERVE, sizes=[4096])["allocs"][0]  # reserved, never committed
            uuid_before = c.call(Op.STATS)["pool_uuid"]
        pool.close()
        srv.kill()
        srv.start()
        pool = map_pool(srv.pool_path)
        with RawClient(srv.url) as c:
            assert c.call(Op.STATS)["pool_uuid"] == uuid_before
            look = c.call(Op.LOOKUP, keys=list(data))["entries"]
            assert look[0] is None  # the delete was durable too
            for (k, want), got in list(zip(data.items(), look, strict=True))[1:]:
                assert got == placed[k]
                off, size = got
                assert hashlib.sha256(pool[off : off + size]).digest() == hashlib.sha256(want).digest()
            # Reservations are volatile: the old one is gone and its space is free again.
            c.handshake()
            assert c.call(Op.COMMIT, items=[["late", pending[0]]])["results"] == ["unknown_alloc"]
            u = c.call(Op.USAGE)
            assert u["entries"] == 59 and u["reservations"] == 0
            assert u["used"] == sum(-(-len(v) // 4096) * 4096 for k, v in data.items() if k != "obj-0")
        pool.close()


def test_a_silent_clients_space_is_quarantined_then_reclaimed_after_the_quarantine_timeout(
    tmp_path: Path,
) -> None:
    args = ["--quarantine-timeout", "2"]
    with ServerProcess(tmp_path, lease_timeout=1.0, extra_args=args) as srv, RawClient(srv.url) as silent:
        with RawClient(srv.url) as alive:
            silent.handshake()  # a RawClient sends no boot id: the server cannot watch its pid
            alive.handshake()
            r = silent.call(Op.RESERVE, sizes=[4096, 8192, 100])
            ids = [a[0] for a in r["allocs"]]
            assert silent.call(Op.COMMIT, items=[["kept", ids[0]]])["results"] == ["stored"]
            assert silent.call(Op.LOOKUP, keys=["kept"], pin=True)["entries"][0] is not None
            kept_alive = alive.call(Op.RESERVE, sizes=[4096])["allocs"][0]
            u = alive.call(Op.USAGE)
            assert (u["reservations"], u["pinned"], u["clients"]) == (3, 1, 2)
            u = _wait_usage(alive, lambda u: u["clients"] == 1)
            # Lease gone; its two reservations and its pin are held in quarantine, not reused.
            assert (u["reservations"], u["pinned"], u["quarantined_extents"]) == (3, 1, 3), u
            assert u["quarantined"] == 4096 + 8192 + 4096
            assert alive.call(Op.STATS)["counters"]["quarantines"] == 1
            u = _wait_usage(alive, lambda u: u["quarantined"] == 0)
            # After the quarantine timeout: the silent client's space is back; the alive one's stays.
            assert (u["reservations"], u["pinned"], u["clients"]) == (1, 0, 1), u
            assert u["used"] == 4096 + 4096  # "kept" + the alive client's reservation
            assert alive.call(Op.EXISTS, keys=["kept"])["present"] == [True]
            assert alive.call(Op.COMMIT, items=[["mine", kept_alive[0]]])["results"] == ["stored"]
            c = alive.call(Op.STATS)["counters"]
            assert (c["leases_expired"], c["quarantine_released_timed_out"], c["released_pins"]) == (1, 1, 1)
        # The silent client comes back: told to handshake again, its old reservation is gone.
        assert silent.call(Op.HEARTBEAT)["known"] is False
        assert silent.call(Op.COMMIT, items=[["late", ids[1]]])["code"] == "unknown_client"
        silent.handshake()
        assert silent.call(Op.COMMIT, items=[["late", ids[1]]])["results"] == ["unknown_alloc"]


def _wait_usage(c: RawClient, done, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.2)
        u = c.call(Op.HEARTBEAT) and c.call(Op.USAGE)
        if done(u):
            return u
    raise AssertionError(f"usage never reached the expected state: {u}")


def test_pool_full_evicts_lru_but_never_a_pinned_entry(tmp_path: Path) -> None:
    # 17 pages: one for the header, 16 of data.
    with ServerProcess(tmp_path, pool_size=17 * 4096) as srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        put(c, pool, {f"k{i}": bytes([i]) * 4096 for i in range(16)})
        assert c.call(Op.PIN, keys=["k0"])["pinned"] == [True]
        c.call(Op.EXISTS, keys=["k1"])  # k1 becomes recently used; k2 is the LRU unpinned entry
        put(c, pool, {"new": b"n" * 4096})
        present = c.call(Op.EXISTS, keys=["k0", "k1", "k2", "k3", "new"])["present"]
        assert present == [True, True, False, True, True]
        assert c.call(Op.LOOKUP, keys=["k2"])["entries"] == [None]
        off, size = c.call(Op.LOOKUP, keys=["k0"])["entries"][0]
        assert pool[off : off + size] == bytes([0]) * 4096
        assert c.call(Op.STATS)["counters"]["evictions"] == 1
        # Nothing can make room for more than the pool: None, and nothing is evicted for it.
        with_room = c.call(Op.RESERVE, sizes=[16 * 4096])
        assert with_room["allocs"] == [None] and c.call(Op.USAGE)["entries"] == 16
        pool.close()


def test_errors_name_the_problem_and_the_server_keeps_serving(maru_server: ServerProcess) -> None:
    with RawClient(maru_server.url) as c:
        c.handshake()
        cases = [
            (Op.RESERVE, {"sizes": [0]}, "bad_request"),
            (Op.RESERVE, {"sizes": ["x"]}, "bad_request"),
            (Op.RESERVE, {"sizes": [1 << 40]}, "too_large"),
            (Op.RESERVE, {}, "bad_request"),
            (Op.EXISTS, {"keys": ["k"] * (P.MAX_BATCH + 1)}, "too_large"),
            (Op.EXISTS, {"keys": ["x" * (P.MAX_KEY_BYTES + 1)]}, "too_large"),
            (Op.EXISTS, {"keys": "abc"}, "bad_request"),
            (Op.LOOKUP, {"keys": [b"bytes"]}, "bad_request"),
            (Op.LOOKUP, {"keys": ["a"], "pin": 1}, "bad_request"),
            (Op.COMMIT, {"items": [["k"]]}, "bad_request"),
            (Op.COMMIT, {"items": [[1, 2]]}, "bad_request"),
            (Op.ABORT, {"alloc_ids": [None]}, "bad_request"),
            (Op.HANDSHAKE, {"host": 5}, "bad_request"),
            (99, {}, "unknown_op"),
        ]
        for op, body, code in cases:
            reply = c.call(op, **body)
            assert not reply["ok"] and reply["code"] == code, (op, body, reply)
            assert reply["message"]
        c.sock.send(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION + 1, Op.EXISTS, 77) + b"\x80")
        frame = c.recv_raw()
        assert P.decode_header(frame)[2] == 77 and P.decode_body(frame)["code"] == "version"
        c.sock.send(b"short")  # no header: dropped, counted
        assert c.recv_raw(timeout_s=0.3) is None
        s = c.call(Op.STATS)
        assert s["counters"]["malformed_frames"] == 1 and s["errors"]["bad_request"] >= 10
        assert c.call(Op.RESERVE, sizes=[10])["ok"]


def test_the_server_stops_cleanly_on_sigterm(maru_server: ServerProcess) -> None:
    assert maru_server.stop() == 0
    assert "stopped" in maru_server.log()


def test_a_port_in_use_is_a_clear_error_with_exit_code_2(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        res = run_server_cli(
            ["--port", str(port), "--pool-path", str(tmp_path / "pool"), "--state-dir", str(tmp_path)]
        )
    assert res.returncode == 2
    assert "already in use" in res.stderr and "--port" in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "pool").exists()  # it never touched a pool


def test_a_pool_larger_than_shm_free_space_is_refused_at_start(tmp_path: Path) -> None:
    path = f"/dev/shm/maru-test-huge-{os.getpid()}"
    res = run_server_cli(
        ["--port", str(free_port()), "--pool-path", path, "--pool-size", "10T", "--state-dir", str(tmp_path)]
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "10.0 TiB" in res.stderr and "--pool-size" in res.stderr
    assert not os.path.exists(path)


def test_the_server_serves_a_dax_device_found_through_sysfs(tmp_path: Path) -> None:
    sysfs = tmp_path / "sys" / "bus" / "dax" / "devices" / "dax0.0"
    sysfs.mkdir(parents=True)
    (sysfs / "size").write_text(str(16 << 20))
    (sysfs / "align").write_text(str(2 << 20))
    dev = tmp_path / "dev" / "dax0.0"
    dev.parent.mkdir()
    with open(dev, "wb") as f:
        f.truncate(16 << 20)
    srv = ServerProcess(
        tmp_path, pool_size=None, pool_path=str(dev), extra_args=["--sysfs-root", str(tmp_path / "sys")]
    )
    with srv, RawClient(srv.url) as c:
        hs = c.handshake()
        assert hs["pool_kind"] == "dax" and hs["pool_size"] == 16 << 20
        assert hs["data_offset"] == 2 << 20 and hs["data_size"] == 14 << 20
        alloc = c.call(Op.RESERVE, sizes=[100])["allocs"][0]
        assert alloc[1] == 2 << 20 and alloc[1] % hs["alignment"] == 0


def test_a_state_dir_of_another_pool_is_refused(tmp_path: Path) -> None:
    other = f"/dev/shm/maru-test-other-{os.getpid()}"
    try:
        with ServerProcess(tmp_path) as srv:
            state = srv.state_dir
        open_pool(other, 1 << 20)  # exists, with its own uuid
        res = run_server_cli(["--port", str(free_port()), "--pool-path", other, "--state-dir", str(state)])
        assert res.returncode == 2 and "belongs to pool uuid" in res.stderr and "--state-dir" in res.stderr
    finally:
        os.unlink(other)


def test_prometheus_metrics_are_served_on_the_metrics_port(tmp_path: Path) -> None:
    mport = free_port()
    with ServerProcess(tmp_path, extra_args=["--metrics-port", str(mport)]) as srv, RawClient(srv.url) as c:
        c.handshake()
        c.call(Op.EXISTS, keys=["a", "b"])
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
    assert "maru_exists_misses_total 2.0" in text
    assert 'maru_requests_total{op="handshake"} 1.0' in text
    # The server's own time on each op: some for those answered, none for the rest.
    spent = dict(re.findall(r'maru_request_seconds_total\{op="(\w+)"\} (\S+)', text))
    assert float(spent["exists"]) > 0 and float(spent["handshake"]) > 0
    assert float(spent["commit"]) == 0.0
    assert "maru_pool_size_bytes 6.7108864e+07" in text


@pytest.mark.parametrize("size", ["10K", "abc"])
def test_bad_flags_are_refused_with_exit_code_2(tmp_path: Path, size: str) -> None:
    res = run_server_cli(
        [
            "--port",
            str(free_port()),
            "--pool-path",
            str(tmp_path / "p"),
            "--pool-size",
            size,
            "--state-dir",
            str(tmp_path),
        ]
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr and "error" in res.stderr


def test_the_lru_order_survives_a_restart(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, pool_size=5 * 4096) as srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        put(c, pool, {k: k.encode() * 4096 for k in "abcd"})
        c.call(Op.LOOKUP, keys=["a"])  # a becomes the most recently used
        pool.close()
        assert srv.stop() == 0
        srv.start()
        c.handshake()
        r = c.call(Op.RESERVE, sizes=[4096])
        assert r["allocs"][0] is not None
        assert c.call(Op.EXISTS, keys=list("abcd"))["present"] == [True, False, True, True]


def test_req_style_envelopes_are_answered_and_broken_envelopes_are_dropped(
    maru_server: ServerProcess,
) -> None:
    with RawClient(maru_server.url) as c:
        frame = P.encode(Op.EXISTS, 5, {"client_id": "x", "keys": ["a"]})
        c.sock.send_multipart([b"", frame])  # what a REQ socket sends: empty delimiter first
        assert c.sock.poll(10_000)
        parts = c.sock.recv_multipart()
        assert len(parts) == 2 and parts[0] == b"" and P.decode_body(parts[1])["present"] == [False]
        c.sock.send_multipart([b"not-empty", frame])  # not an envelope the server understands
        c.sock.send_multipart([b"", b"", b"", frame])
        assert c.recv_raw(timeout_s=0.3) is None
        assert c.call(Op.STATS)["counters"]["malformed_frames"] == 2


def test_state_rows_that_overlap_or_leave_the_pool_are_dropped_loudly_on_restart(tmp_path: Path) -> None:
    import sqlite3

    with ServerProcess(tmp_path) as srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        placed = put(c, pool, {"good": b"g" * 5000})
        pool.close()
        srv.stop()
        db = sqlite3.connect(str(srv.state_dir / "maru-state.sqlite"))
        off = placed["good"][0]
        db.executemany(
            "INSERT INTO entries (key, offset, size, tick) VALUES (?, ?, ?, ?)",
            [("overlap", off + 4096, 100, 9), ("outside", 1 << 40, 100, 9)],
        )
        db.commit()
        db.close()
        srv.start()
        assert c.call(Op.LOOKUP, keys=["good", "overlap", "outside"])["entries"] == [
            placed["good"],
            None,
            None,
        ]
        assert "dropped them" in srv.log() and "'overlap'" in srv.log()


def test_an_evicted_key_stays_gone_after_sigkill_and_restart(tmp_path: Path) -> None:
    # If an eviction were not durable, the old key would come back naming bytes that now belong
    # to the object stored in its place.
    with ServerProcess(tmp_path, pool_size=5 * 4096) as srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        put(c, pool, {k: k.encode() * 4096 for k in "abcd"})
        placed = put(c, pool, {"new": b"n" * 4096})  # evicts a
        pool.close()
        srv.kill()
        srv.start()
        look = c.call(Op.LOOKUP, keys=["a", "b", "new"])["entries"]
        assert look[0] is None and look[1] is not None and look[2] == placed["new"]
        pool = map_pool(srv.pool_path)
        assert pool[look[2][0] : look[2][0] + 4096] == b"n" * 4096
        pool.close()


def test_stats_say_how_long_the_server_spent_on_each_op(tmp_path: Path) -> None:
    from maru.server.stats import service_us

    with ServerProcess(tmp_path) as srv, RawClient(srv.url) as c:
        c.handshake()
        for _ in range(7):
            c.call(Op.EXISTS, keys=["a", "b", "c"])
        snap = c.call(Op.STATS)
    svc = service_us(snap)
    assert svc["exists"][0] == 7 == snap["requests"]["exists"]
    assert svc["handshake"][0] == 1
    assert 0 < svc["exists"][1] < 1e6  # a mean of microseconds, not seconds
    assert "commit" not in svc and snap["service_s"]["commit"] == 0.0
