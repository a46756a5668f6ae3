"""Client info: a client describes its data paths; STATS lists live clients; stats/doctor show them.

Real server process, real ZeroMQ; raw frames (``RawClient``) for the protocol, ``MaruHandler`` for
the re-handshake after a restart, and the ``maru`` CLI as a subprocess.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest

from maru import MaruHandler
from maru import protocol as P
from maru.cli import doctor
from maru.protocol import Op
from tests.helpers import RawClient, ServerProcess, flat, maru

FAST = {"role": "vllm-connector", "paths": {"load": "pipelined-gpu", "pool": "cuda-registered"}, "slow": []}
SLOW_SENTENCE = (
    "pool not registered with CUDA (cudaHostRegister failed: ENOMEM): loads use the staged pageable "
    "path; fix: raise the memlock limit (ulimit -l unlimited)"
)
SLOW = {"role": "vllm-connector", "paths": {"load": "staged", "pool": "pageable"}, "slow": [SLOW_SENTENCE]}


def wait_for(what: str, predicate: Callable[[], Any], timeout_s: float = 10.0) -> Any:
    """Poll ``predicate`` until it returns something truthy (a deadline, not a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def clients_by_id(url: str) -> dict[str, dict[str, Any]]:
    with RawClient(url) as c:
        reply = c.call(Op.STATS)
    assert reply["ok"], reply
    assert reply["clients_total"] == len(reply["clients"]) and reply["clients_truncated"] is False
    return {e["client_id"]: e for e in reply["clients"]}


# -- protocol, raw frames --------------------------------------------------------------------------


def test_handshake_info_shows_in_stats_next_to_an_old_style_client_without_info(
    maru_server: ServerProcess,
) -> None:
    with RawClient(maru_server.url) as old, RawClient(maru_server.url) as new:
        hs = old.handshake()  # no info: what a client of an earlier version sends
        assert hs["max_client_info_bytes"] == P.MAX_CLIENT_INFO_BYTES
        reply = new.call(Op.HANDSHAKE, host="worker-7", pid=4242, info=SLOW)
        assert reply["ok"], reply
        # The old-style client keeps working: reserve and commit need its lease.
        alloc = old.call(Op.RESERVE, sizes=[4096])["allocs"][0]
        assert old.call(Op.COMMIT, items=[["old-style", alloc[0]]])["results"] == ["stored"]

        with RawClient(maru_server.url) as probe:
            stats = probe.call(Op.STATS)
    assert [c["client_id"] for c in stats["clients"]] == [new.client_id, old.client_id]  # info first
    by_id = {c["client_id"]: c for c in stats["clients"]}
    entry = by_id[new.client_id]
    assert entry["info"] == SLOW
    assert (entry["host"], entry["pid"]) == ("worker-7", 4242)
    assert entry["age_s"] >= 0 and entry["idle_s"] >= 0
    assert by_id[old.client_id]["info"] is None and by_id[old.client_id]["pid"] == os.getpid()
    assert stats["clients_total"] == stats["gauges"]["clients"] == 2


def test_heartbeat_with_info_replaces_it_and_a_plain_heartbeat_keeps_it(maru_server: ServerProcess) -> None:
    with RawClient(maru_server.url) as c:
        c.call(Op.HANDSHAKE, host="h", pid=1, info=SLOW)
        reply = c.call(Op.HEARTBEAT, info=FAST)
        assert reply["ok"] and reply["known"] is True
        assert clients_by_id(maru_server.url)[c.client_id]["info"] == FAST
        assert c.call(Op.HEARTBEAT)["known"] is True
        assert clients_by_id(maru_server.url)[c.client_id]["info"] == FAST
        assert c.call(Op.HEARTBEAT, info={})["known"] is True  # an empty map clears it
        assert clients_by_id(maru_server.url)[c.client_id]["info"] is None
        # A new handshake says everything: without info, the client reports nothing.
        c.call(Op.HEARTBEAT, info=FAST)
        c.handshake()
        assert clients_by_id(maru_server.url)[c.client_id]["info"] is None

    with RawClient(maru_server.url) as stranger:  # no lease: the info is not kept, and it is told so
        reply = stranger.call(Op.HEARTBEAT, info=FAST)
        assert reply["ok"] and reply["known"] is False
        assert stranger.client_id not in clients_by_id(maru_server.url)


BAD_INFOS: list[tuple[str, Any, str, str]] = [
    ("not a map", ["load", "staged"], "bad_request", "info must be a map"),
    ("bytes value", {"paths": {"load": b"\x00staged"}}, "bad_request", "of type bytes"),
    ("too deep", {"a": {"b": {"c": {"d": {"e": 1}}}}}, "bad_request", "nests deeper than 4"),
    ("NaN", {"ratio": float("nan")}, "bad_request", "finite"),
    ("long key", {"k" * 200: 1}, "bad_request", "key of 200 characters"),
    ("oversized", {"slow": ["x" * 1000] * 5}, "too_large", "over the 4096-byte limit"),
]


@pytest.mark.parametrize("info,code,words", [b[1:] for b in BAD_INFOS], ids=[b[0] for b in BAD_INFOS])
def test_bad_info_gets_a_clear_error_changes_nothing_and_the_server_keeps_serving(
    maru_server: ServerProcess, info: Any, code: str, words: str
) -> None:
    with RawClient(maru_server.url) as fresh, RawClient(maru_server.url) as known:
        reply = fresh.call(Op.HANDSHAKE, host="h", pid=1, info=info)
        assert reply["ok"] is False and reply["code"] == code and words in reply["message"], reply
        # The refused handshake granted no lease.
        assert fresh.call(Op.RESERVE, sizes=[4096])["code"] == "unknown_client"

        known.call(Op.HANDSHAKE, host="h", pid=2, info=FAST)
        reply = known.call(Op.HEARTBEAT, info=info)
        assert reply["ok"] is False and reply["code"] == code and words in reply["message"], reply

        clients = clients_by_id(maru_server.url)
        assert fresh.client_id not in clients
        assert clients[known.client_id]["info"] == FAST  # the refused update changed nothing
        stats = known.call(Op.STATS)
        assert stats["errors"]["internal"] == 0
        assert known.call(Op.EXISTS, keys=["still-serving"])["ok"]


def test_stats_lists_at_most_256_clients_those_reporting_info_first_and_says_it_truncated(
    maru_server: ServerProcess,
) -> None:
    from maru.cli.stats import render_clients

    n = P.MAX_STATS_CLIENTS + 44
    reporting = {f"client-{i:03d}" for i in (5, 150, 299)}
    with RawClient(maru_server.url) as c:
        for i in range(n):  # one socket, many client ids: each handshake is a lease
            cid = f"client-{i:03d}"
            fields: dict[str, Any] = {"info": {**FAST, "paths": {"n": i}}} if cid in reporting else {}
            assert c.call(Op.HANDSHAKE, client_id=cid, host="h", pid=i + 1, **fields)["ok"]
        stats = c.call(Op.STATS)
    assert stats["clients_total"] == n and stats["clients_truncated"] is True
    listed = [e["client_id"] for e in stats["clients"]]
    assert len(listed) == P.MAX_STATS_CLIENTS
    assert listed[:3] == sorted(reporting)  # reporting first, then oldest first
    assert listed[3:] == [f"client-{i:03d}" for i in range(n) if f"client-{i:03d}" not in reporting][:253]

    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(render_clients(stats))
    assert f"clients ({n} live), showing the first {P.MAX_STATS_CLIENTS}" in console.export_text()


def test_info_with_non_string_keys_is_refused_by_the_decoder(maru_server: ServerProcess) -> None:
    with RawClient(maru_server.url) as c:
        body = {"client_id": c.client_id, "host": "h", "pid": 1, "info": {"paths": {1: "x"}}}
        c.send_raw(P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, Op.HANDSHAKE, 77) + msgpack.packb(body))
        frame = c.recv_raw(timeout_s=10)
        assert frame is not None and P.decode_header(frame)[2] == 77
        reply = P.decode_body(frame)
        assert reply["ok"] is False and reply["code"] == "malformed" and reply["message"]
        assert c.client_id not in clients_by_id(maru_server.url)


def test_lease_expiry_drops_the_client_and_its_info_from_stats(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, lease_timeout=0.5) as srv, RawClient(srv.url) as c:
        c.call(Op.HANDSHAKE, host="h", pid=1, info=SLOW)
        assert clients_by_id(srv.url)[c.client_id]["info"] == SLOW
        wait_for("the lease to expire", lambda: c.client_id not in clients_by_id(srv.url))
        with RawClient(srv.url) as probe:
            stats = probe.call(Op.STATS)
        assert stats["counters"]["leases_expired"] >= 1
        # Coming back with a plain heartbeat does not resurrect the old info.
        assert c.call(Op.HEARTBEAT)["known"] is False
        assert c.client_id not in clients_by_id(srv.url)


# -- MaruHandler.set_client_info -------------------------------------------------------------------


def test_set_client_info_is_sent_at_once_and_again_after_a_server_restart(tmp_path: Path) -> None:
    with ServerProcess(tmp_path) as srv:
        h = MaruHandler(srv.url, timeout_s=1.0, heartbeat_interval_s=0.1)
        try:
            h.set_client_info(SLOW)
            entry = clients_by_id(srv.url)[h.client_id]
            assert entry["info"] == SLOW and entry["pid"] == os.getpid()

            srv.restart()  # the new server knows no client: the re-handshake must carry the info
            wait_for(
                "the info after the restart",
                lambda: clients_by_id(srv.url).get(h.client_id, {}).get("info") == SLOW,
            )

            srv.stop()  # set while the server is away: kept, no exception, delivered on return
            h.set_client_info(FAST)
            assert h.client_info == FAST
            srv.start()
            wait_for(
                "the info set while the server was away",
                lambda: clients_by_id(srv.url).get(h.client_id, {}).get("info") == FAST,
            )
        finally:
            h.close()


def test_set_client_info_refuses_bad_info_locally_and_copies_what_it_keeps(
    maru_server: ServerProcess,
) -> None:
    with MaruHandler(maru_server.url) as h:
        h.set_client_info(FAST)
        for bad, words in [
            ({"paths": {"load": object()}}, "of type object"),
            ({"slow": ["x" * 5000]}, "4096-byte limit"),
            ("staged", "must be a map"),
        ]:
            with pytest.raises(ValueError, match=words):
                h.set_client_info(bad)  # type: ignore[arg-type]
        assert clients_by_id(maru_server.url)[h.client_id]["info"] == FAST  # nothing was sent

        mine = {"role": "r", "paths": {"load": ("a", "b")}, "slow": []}
        h.set_client_info(mine)
        mine["paths"]["load"] = "changed later"  # type: ignore[index]
        expected = {"role": "r", "paths": {"load": ["a", "b"]}, "slow": []}
        assert h.client_info == expected
        assert clients_by_id(maru_server.url)[h.client_id]["info"] == expected


def test_set_client_info_from_many_threads_while_others_call_leaves_the_last_value(
    maru_server: ServerProcess,
) -> None:
    with MaruHandler(maru_server.url, heartbeat_interval_s=0.05) as h:
        errors: list[BaseException] = []

        def setter(t: int) -> None:
            try:
                for i in range(20):
                    h.set_client_info({"role": "t", "paths": {"thread": t, "i": i}})
            except BaseException as e:  # noqa: BLE001 (reported below)
                errors.append(e)

        def reader() -> None:
            try:
                for _ in range(40):
                    assert h.exists(["k"]) == [False]
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        threads = [threading.Thread(target=setter, args=(t,)) for t in range(4)]
        threads.append(threading.Thread(target=reader))
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert not errors, errors
        final = {"role": "vllm-connector", "paths": {"load": "final"}, "slow": []}
        h.set_client_info(final)
        assert clients_by_id(maru_server.url)[h.client_id]["info"] == final


# -- maru stats / maru doctor ----------------------------------------------------------------------


def test_stats_and_doctor_show_client_paths_and_the_doctor_warns_on_a_slow_one(
    maru_server: ServerProcess,
) -> None:
    with MaruHandler(maru_server.url) as fast, MaruHandler(maru_server.url) as slow:
        fast.set_client_info(FAST)
        slow.set_client_info({**SLOW, "paths": {**SLOW["paths"], "extra": "maru[gpu]"}})

        p = maru("stats", "--url", maru_server.url, "--once")
        assert p.returncode == 0, p.stdout + p.stderr
        out = flat(p.stdout)
        assert "load=pipelined-gpu" in out and "load=staged" in out and "pool=pageable" in out
        assert "extra=maru[gpu]" in out  # reported text is not taken for markup
        assert "ulimit -l unlimited" in out and "vllm-connector" in out

        p = maru("stats", "--url", maru_server.url, "--json")
        assert p.returncode == 0, p.stdout + p.stderr
        snap = json.loads(p.stdout)
        infos = {c["client_id"]: c["info"] for c in snap["clients"]}
        assert infos[fast.client_id] == FAST and infos[slow.client_id]["slow"] == [SLOW_SENTENCE]

        p = maru("doctor", "--url", maru_server.url, "--quick")
        assert p.returncode == 0, p.stdout + p.stderr  # optional: a warning, not a failure
        out = flat(p.stdout)
        row = out[out.index("serving clients' data paths") :]
        assert row.split()[5] == "warn", out
        assert "load=staged, pool=pageable" in row and "load=pipelined-gpu" in row
        assert "fix: vllm-connector" in row and "ulimit -l unlimited" in row

        slow.set_client_info({**SLOW, "slow": []})
        ctx = doctor.DoctorContext(url=maru_server.url)
        assert doctor.check_server(ctx).status == doctor.OK
        r = doctor.check_client_paths(ctx)
        assert r.status == doctor.OK and "every reported data path is the fast one" in r.detail


def test_doctor_skips_the_client_paths_check_when_no_client_reports(maru_server: ServerProcess) -> None:
    ctx = doctor.DoctorContext(url=maru_server.url)
    assert doctor.check_client_paths(ctx).status == doctor.SKIP  # before the server check
    with MaruHandler(maru_server.url):
        assert doctor.check_server(ctx).status == doctor.OK
        r = doctor.check_client_paths(ctx)
    assert r.status == doctor.SKIP and "reports its data paths" in r.detail
