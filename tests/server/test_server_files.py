"""The files the server creates: their modes and group, and what a failed start leaves behind."""

from __future__ import annotations

import grp
import os
import socket
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from maru.pool import open_pool, read_pool_uuid
from maru.protocol import Op
from tests.helpers import REPO_ROOT, RawClient, ServerProcess, free_port


def run_server_cli(args: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT))
    return subprocess.run(
        [sys.executable, "-m", "maru.server", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture
def open_umask() -> Iterator[None]:
    """Spawn servers with umask 000, so a mode that comes from the umask (not the server) shows."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture
def shm_pool() -> Iterator[str]:
    path = f"/dev/shm/maru-test-{uuid.uuid4().hex[:12]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


def mode_and_gid(path: Path | str) -> tuple[int, int]:
    st = os.stat(path)
    return stat.S_IMODE(st.st_mode), st.st_gid


def server_files(srv: ServerProcess) -> list[Path]:
    """The pool file and every file in the state dir (database, -wal, -shm if any, lock)."""
    files = [Path(srv.pool_path), *sorted(p for p in srv.state_dir.iterdir())]
    names = {p.name for p in files}
    assert {"maru-state.sqlite", "maru-state.sqlite-wal", "maru-state.lock"} <= names, names
    return files


def other_group() -> grp.struct_group:
    for g in grp.getgrall():
        if g.gr_gid != os.getgid():
            return g
    pytest.skip("this host has no group other than the test's own")


def test_the_pool_file_and_state_files_are_private_to_the_owner(tmp_path: Path, open_umask: None) -> None:
    with ServerProcess(tmp_path) as srv, RawClient(srv.url) as c:
        c.handshake()
        c.call(Op.EXISTS, keys=["a"])
        for f in server_files(srv):
            assert mode_and_gid(f)[0] == 0o600, f
        assert mode_and_gid(srv.state_dir)[0] == 0o700
        srv.stop()
        # A database left more open (an older server, a copy) is made private again at start.
        os.chmod(srv.state_dir / "maru-state.sqlite", 0o644)
        srv.start()
        for f in server_files(srv):
            assert mode_and_gid(f)[0] == 0o600, f


def test_with_group_the_files_are_0660_and_owned_by_that_group(tmp_path: Path, open_umask: None) -> None:
    g = other_group()
    with ServerProcess(tmp_path, extra_args=["--group", g.gr_name]) as srv, RawClient(srv.url) as c:
        c.handshake()
        for f in server_files(srv):
            assert mode_and_gid(f) == (0o660, g.gr_gid), f
        assert mode_and_gid(srv.state_dir) == (0o770, g.gr_gid)


def test_an_unknown_group_is_refused_and_nothing_is_created(tmp_path: Path, shm_pool: str) -> None:
    res = run_server_cli(
        [
            "--port",
            str(free_port()),
            "--pool-path",
            shm_pool,
            "--state-dir",
            str(tmp_path / "s"),
            "--group",
            "no-such-grp",
        ]
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--group 'no-such-grp'" in res.stderr and "no such group" in res.stderr
    assert not os.path.exists(shm_pool) and not (tmp_path / "s").exists()


def test_a_failed_start_removes_the_pool_file_and_state_dir_it_created(tmp_path: Path, shm_pool: str) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        metrics_port = busy.getsockname()[1]
        state = tmp_path / "new" / "state"
        res = run_server_cli(
            [
                "--port",
                str(free_port()),
                "--pool-path",
                shm_pool,
                "--pool-size",
                "8M",
                "--state-dir",
                str(state),
                "--metrics-port",
                str(metrics_port),
            ]
        )
    assert res.returncode == 2 and "--metrics-port" in res.stderr and "Traceback" not in res.stderr
    assert not os.path.exists(shm_pool)
    assert not (tmp_path / "new").exists()


def test_a_bad_state_dir_removes_the_new_pool_file(tmp_path: Path, shm_pool: str) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    res = run_server_cli(
        [
            "--port",
            str(free_port()),
            "--pool-path",
            shm_pool,
            "--pool-size",
            "8M",
            "--state-dir",
            str(not_a_dir),
        ]
    )
    assert res.returncode == 2 and "not a directory" in res.stderr and "Traceback" not in res.stderr
    assert not os.path.exists(shm_pool)
    assert not_a_dir.read_text() == "x"


def test_a_failed_start_keeps_a_pool_file_that_existed_before(tmp_path: Path, shm_pool: str) -> None:
    info = open_pool(shm_pool, 8 << 20)
    fd = os.open(shm_pool, os.O_RDWR)
    try:
        payload = os.urandom(5000)
        os.pwrite(fd, payload, info.data_offset)
    finally:
        os.close(fd)
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    res = run_server_cli(["--port", str(free_port()), "--pool-path", shm_pool, "--state-dir", str(not_a_dir)])
    assert res.returncode == 2 and "not a directory" in res.stderr
    assert read_pool_uuid(shm_pool) == info.uuid
    with open(shm_pool, "rb") as f:
        f.seek(info.data_offset)
        assert f.read(5000) == payload


def test_a_second_server_on_the_same_state_dir_is_refused_and_leaves_the_state_alone(tmp_path: Path) -> None:
    with ServerProcess(tmp_path) as srv, RawClient(srv.url) as c:
        c.handshake()
        other_pool = f"/dev/shm/maru-test-{uuid.uuid4().hex[:12]}"
        res = run_server_cli(
            [
                "--port",
                str(free_port()),
                "--pool-path",
                other_pool,
                "--pool-size",
                "8M",
                "--state-dir",
                str(srv.state_dir),
            ]
        )
        assert res.returncode == 2 and "in use by another maru server" in res.stderr
        assert not os.path.exists(other_pool)
        assert c.call(Op.HEARTBEAT)["known"] is True
        assert (srv.state_dir / "maru-state.sqlite").exists() and (srv.state_dir / "maru-state.lock").exists()


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "0"])
def test_a_lease_timeout_that_is_not_a_finite_positive_number_is_refused(
    tmp_path: Path, shm_pool: str, value: str
) -> None:
    res = run_server_cli(
        [
            "--port",
            str(free_port()),
            "--pool-path",
            shm_pool,
            "--state-dir",
            str(tmp_path),
            f"--lease-timeout={value}",
        ]
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--lease-timeout" in res.stderr and "finite number of seconds above 0" in res.stderr
    assert not os.path.exists(shm_pool)


def test_a_second_server_on_the_same_pool_is_refused_and_the_first_keeps_serving(tmp_path: Path) -> None:
    with ServerProcess(tmp_path) as srv, RawClient(srv.url) as c:
        c.handshake()
        uuid_before = read_pool_uuid(srv.pool_path)
        res = run_server_cli(
            ["--port", str(free_port()), "--pool-path", srv.pool_path, "--state-dir", str(tmp_path / "other")]
        )
        assert res.returncode == 2 and "in use by another maru server" in res.stderr
        assert "Traceback" not in res.stderr
        assert os.path.exists(srv.pool_path) and read_pool_uuid(srv.pool_path) == uuid_before
        assert not (tmp_path / "other").exists()
        assert c.call(Op.RESERVE, sizes=[100])["ok"]


def test_a_pool_filling_its_tmpfs_leaves_the_key_index_off_with_the_reason_not_a_bus_error(
    tmp_path: Path, small_state_fs: Path
) -> None:
    # A 2 MiB tmpfs, a pool of all but 16 KiB of it: the index beside it (32 KiB) does not fit.
    # Sized without reserving, its first write killed the server at start (SIGBUS, rc 135).
    pool = str(small_state_fs / "pool")
    srv = ServerProcess(tmp_path, pool_size="2032K", pool_path=pool, log_level="INFO")
    with srv, RawClient(srv.url) as c:
        c.handshake()
        ki = c.call(Op.STATS)["key_index"]
        assert ki["on"] is False and "no room" in ki["why_off"] and "--pool-size" in ki["why_off"], ki
        assert "key_index" not in c.handshake()  # clients ask the server, and say why once
        alloc = c.call(Op.RESERVE, sizes=[4096])["allocs"][0]
        assert c.call(Op.COMMIT, items=[["k", alloc[0]]])["results"] == ["stored"]
        assert c.call(Op.EXISTS, keys=["k", "x"])["present"] == [True, False]
    assert not os.path.exists(pool + ".keyindex")
    assert "key index off: no room" in srv.log()
