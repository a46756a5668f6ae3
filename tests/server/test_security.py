"""Authentication, identity and tenants, against a real ``maru server`` process.

Promises: a CURVE server lets in only listed client keys; a non-loopback address without keys is
refused unless ``--insecure``; sessions belong to the connection, so a victim's client id or
allocation ids sent from another connection reach nothing; a tenant cannot read, delete, pin or
unpin another tenant's keys, and quotas hold.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import zmq

from maru import MaruHandler
from maru.errors import MaruError, NotConnectedError, ServerError
from maru.protocol import Op
from maru.server.auth import load_public_key, write_key_pair
from tests.helpers import RawClient, ServerProcess, flat, maru


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    """Key pairs: the server, two allowed clients (a, b), an admin, and a stranger not on the list."""
    out: dict[str, tuple[Path, Path]] = {}
    allowed = tmp_path / "allowed"
    for name in ("server", "a", "b", "admin", "stranger"):
        out[name] = write_key_pair(tmp_path / "keys", name)
        if name in ("a", "b", "admin"):
            allowed.mkdir(exist_ok=True)
            (allowed / f"{name}.key").write_bytes(out[name][0].read_bytes())
    return out


def pub(keys: dict[str, tuple[Path, Path]], name: str) -> str:
    return load_public_key(keys[name][0]).decode()


def curve_opts(keys: dict[str, tuple[Path, Path]], name: str) -> dict[int, bytes]:
    from zmq.auth import load_certificate

    public, secret = load_certificate(keys[name][1])
    return {
        zmq.CURVE_SERVERKEY: load_public_key(keys["server"][0]),
        zmq.CURVE_PUBLICKEY: public,
        zmq.CURVE_SECRETKEY: secret,
    }


def curve_server(tmp_path: Path, keys: dict[str, tuple[Path, Path]], *extra: str) -> ServerProcess:
    return ServerProcess(
        tmp_path,
        extra_args=[
            "--curve-secret-key",
            str(keys["server"][1]),
            "--allowed-clients",
            str(tmp_path / "allowed"),
            *extra,
        ],
    )


def test_keys_generate_writes_a_public_file_and_a_secret_file_only_the_owner_can_read(
    keys: dict[str, tuple[Path, Path]],
) -> None:
    public, secret = keys["a"]
    assert stat.S_IMODE(os.stat(secret).st_mode) == 0o600
    assert "secret-key" not in public.read_text() and "secret-key" in secret.read_text()
    assert load_public_key(public) == load_public_key(secret)  # one pair
    assert load_public_key(public) != load_public_key(keys["b"][0])


def test_curve_server_refuses_a_key_not_on_the_list_and_serves_a_listed_one(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    with curve_server(tmp_path, keys) as srv:
        # A listed key: the handler's whole path works (reserve, write, store, retrieve).
        with MaruHandler(
            srv.url, server_public_key=str(keys["server"][0]), client_key=str(keys["a"][1])
        ) as h:
            data = os.urandom(4096)
            obj = h.alloc(4096)
            obj.buf[:] = data
            h.store("ns/k", obj)
            r = h.retrieve("ns/k")
            assert r is not None and bytes(r.view) == data
            r.release()
        # A key not on the list, a plain (unencrypted) client, and the wrong server key get nothing.
        for opts in (
            curve_opts(keys, "stranger"),
            {},
            {**curve_opts(keys, "a"), zmq.CURVE_SERVERKEY: load_public_key(keys["b"][0])},
        ):
            with RawClient(srv.url, timeout_s=1.0, sockopts=opts) as c:
                with pytest.raises(TimeoutError):
                    c.call(Op.EXISTS, keys=["ns/k"])
        with pytest.raises(NotConnectedError, match="allowed-clients"):
            MaruHandler(
                srv.url,
                server_public_key=str(keys["server"][0]),
                client_key=str(keys["stranger"][1]),
                timeout_s=1.0,
            )
        with RawClient(srv.url, sockopts=curve_opts(keys, "b")) as c:
            assert c.call(Op.EXISTS, keys=["ns/k"])["present"] == [True]


def test_non_loopback_address_without_keys_is_refused_unless_insecure(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path, host="0.0.0.0")
    with pytest.raises(MaruError, match="refusing to listen on 0.0.0.0 without authentication"):
        srv.start()
    srv.cleanup()
    with ServerProcess(tmp_path, host="0.0.0.0", extra_args=["--insecure"]) as srv:
        assert "WITHOUT authentication" in srv.log()
        with RawClient(srv.url) as c:
            assert c.call(Op.EXISTS, keys=["k"])["ok"]


def test_a_victims_client_id_and_alloc_ids_from_another_connection_reach_nothing(
    maru_server: ServerProcess,
) -> None:
    with RawClient(maru_server.url) as victim, RawClient(maru_server.url, client_id="attacker") as attacker:
        victim.handshake()
        allocs = victim.call(Op.RESERVE, sizes=[4096, 4096])["allocs"]
        first = victim.call(Op.RESERVE, sizes=[4096])["allocs"][0]
        assert victim.call(Op.COMMIT, items=[["k/pinned", first[0]]])["results"] == ["stored"]
        assert victim.call(Op.PIN, keys=["k/pinned"])["pinned"] == [True]

        # The attacker learns the victim's client id from STATS and guesses alloc ids around it.
        ids = [c["client_id"] for c in attacker.call(Op.STATS)["clients"]]
        assert victim.client_id in ids
        guesses = [a[0] + d for a in allocs for d in (-1, 0, 1)]
        as_victim = {"client_id": victim.client_id}
        assert attacker.call(Op.UNPIN, keys=["k/pinned"], **as_victim)["code"] == "unknown_client"
        assert attacker.call(Op.ABORT, alloc_ids=guesses, **as_victim)["code"] == "unknown_client"
        # Even with a lease of its own under the victim's id, nothing of the victim's is reachable.
        assert attacker.call(Op.HANDSHAKE, host="evil", pid=1, **as_victim)["ok"]
        assert attacker.call(Op.UNPIN, keys=["k/pinned"], **as_victim)["unpinned"] == [False]
        assert attacker.call(Op.ABORT, alloc_ids=guesses, **as_victim)["freed"] == 0
        stolen = attacker.call(Op.COMMIT, items=[["k/stolen", allocs[0][0]]], **as_victim)
        assert stolen["results"] == ["unknown_alloc"]
        # Same through a connection that claims the victim's routing id? The server hands a routing
        # id over to its newest connection (so a reconnecting handler keeps its session), but a
        # handler's id is 17 random bytes it never shows, and its session also needs its CURVE user.

        usage = victim.call(Op.USAGE)
        assert usage["reservations"] == 2 and usage["pinned"] == 1
        # The victim's session is intact: it commits both reservations and unpins its key.
        got = victim.call(Op.COMMIT, items=[["k/a", allocs[0][0]], ["k/b", allocs[1][0]]])["results"]
        assert got == ["stored", "stored"]
        assert victim.call(Op.UNPIN, keys=["k/pinned"])["unpinned"] == [True]
        assert victim.call(Op.EXISTS, keys=["k/stolen"])["present"] == [False]


def test_a_handler_keeps_its_session_when_its_socket_is_replaced(maru_server: ServerProcess) -> None:
    # The routing id is the handler's, not the socket's: a reconnect keeps reservations valid.
    with MaruHandler(maru_server.url) as h:
        obj = h.alloc(4096)
        h._rpc._drop_socket()  # what a timed-out request does
        obj.buf[:] = b"x" * 4096
        h.store("after-reconnect", obj)
        assert h.exists(["after-reconnect"]) == [True]


def test_a_socket_replaced_at_once_loses_no_request(maru_server: ServerProcess) -> None:
    # A reconnect can reach the server before it has retired the old connection. Without routing
    # id handover, libzmq ignored the newcomer as a duplicate and swallowed its first request (a
    # timeout, about one reconnect in ten on this machine). Every request must now be answered.
    with MaruHandler(maru_server.url, timeout_s=2.0) as h:
        for i in range(200):
            h._rpc._drop_socket()
            assert h.exists([f"k/{i}"]) == [False], f"reconnect {i}"


# -- tenants -------------------------------------------------------------------------------------


def tenants_file(tmp_path: Path, keys: dict[str, tuple[Path, Path]]) -> Path:
    p = tmp_path / "tenants.json"
    p.write_text(
        json.dumps(
            {
                "admins": [pub(keys, "admin")],
                "clients": {
                    pub(keys, "a"): {"name": "tenant-a", "namespaces": {"team-a": "rwd", "shared": "r"}},
                    pub(keys, "b"): {"name": "tenant-b", "namespaces": {"team-b": "rwd", "shared": "rw"}},
                },
                "namespaces": {"team-a": {"max_bytes": "16K", "max_objects": 3}, "team-b": {}, "shared": {}},
            }
        )
    )
    return p


def test_a_tenant_cannot_read_delete_pin_or_unpin_another_tenants_keys(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    with (
        curve_server(tmp_path, keys, "--tenants", str(tenants_file(tmp_path, keys))) as srv,
        RawClient(srv.url, sockopts=curve_opts(keys, "a")) as a,
        RawClient(srv.url, sockopts=curve_opts(keys, "b")) as b,
        RawClient(srv.url, sockopts=curve_opts(keys, "admin")) as admin,
    ):
        a.handshake()
        b.handshake()
        alloc = b.call(Op.RESERVE, sizes=[4096])["allocs"][0]
        assert b.call(Op.COMMIT, items=[["team-b/x", alloc[0]]])["results"] == ["stored"]
        for op, fields in [
            (Op.EXISTS, {"keys": ["team-b/x"]}),
            (Op.LOOKUP, {"keys": ["team-b/x"], "pin": False}),
            (Op.LOOKUP, {"keys": ["team-b/x"], "pin": True}),
            (Op.PIN, {"keys": ["team-b/x"]}),
            (Op.DELETE, {"keys": ["team-b/x"]}),
            (Op.DELETE, {"keys": ["no-namespace"]}),
        ]:
            reply = a.call(op, **fields)
            assert reply["ok"] is False and reply["code"] == "denied", (op, reply)
            assert "team-b" in reply["message"] or "''" in reply["message"]
        # a may read "shared" but not write it; b may write it.
        alloc = a.call(Op.RESERVE, sizes=[4096])["allocs"][0]
        assert a.call(Op.COMMIT, items=[["shared/y", alloc[0]]])["code"] == "denied"
        assert a.call(Op.ABORT, alloc_ids=[alloc[0]])["freed"] == 1
        alloc = b.call(Op.RESERVE, sizes=[4096])["allocs"][0]
        assert b.call(Op.COMMIT, items=[["shared/y", alloc[0]]])["results"] == ["stored"]
        assert a.call(Op.EXISTS, keys=["shared/y"])["present"] == [True]
        assert b.call(Op.PIN, keys=["team-b/x"])["pinned"] == [True]
        # b's key is untouched and still pinned by b only; a's STATS shows only a's session.
        assert b.call(Op.EXISTS, keys=["team-b/x"])["present"] == [True]
        assert b.call(Op.USAGE)["pinned"] == 1
        assert [c["client_id"] for c in a.call(Op.STATS)["clients"]] == [a.client_id]
        assert {c["client_id"] for c in admin.call(Op.STATS)["clients"]} == {a.client_id, b.client_id}


def test_namespace_quotas_refuse_the_commit_that_would_pass_them_and_change_nothing(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    with (
        curve_server(tmp_path, keys, "--tenants", str(tenants_file(tmp_path, keys))) as srv,
        RawClient(srv.url, sockopts=curve_opts(keys, "a")) as a,
    ):
        a.handshake()
        # team-a: 16 KiB, 3 objects. RESERVE past the room left is refused up front.
        assert a.call(Op.RESERVE, sizes=[20 << 10])["code"] == "quota"
        ids = [x[0] for x in a.call(Op.RESERVE, sizes=[4096] * 4)["allocs"]]
        assert (
            a.call(Op.COMMIT, items=[[f"team-a/{i}", ids[i]] for i in range(3)])["results"] == ["stored"] * 3
        )
        reply = a.call(Op.COMMIT, items=[["team-a/3", ids[3]]])
        assert reply["code"] == "quota" and "max_objects" in reply["message"], reply
        assert a.call(Op.EXISTS, keys=["team-a/3"])["present"] == [False]
        # Deleting frees quota; the refused reservation is still the client's to commit.
        assert a.call(Op.DELETE, keys=["team-a/0"])["deleted"] == [True]
        assert a.call(Op.COMMIT, items=[["team-a/3", ids[3]]])["results"] == ["stored"]
        # Bytes: 3 x 4 KiB held, 4 KiB left: an 8 KiB reservation is refused until a delete makes room.
        reply = a.call(Op.RESERVE, sizes=[8192])
        assert reply["code"] == "quota" and "4.0 KiB left" in reply["message"], reply
        assert a.call(Op.DELETE, keys=["team-a/1"])["deleted"] == [True]
        big = a.call(Op.RESERVE, sizes=[8192])["allocs"][0]
        assert a.call(Op.COMMIT, items=[["team-a/big", big[0]]])["results"] == ["stored"]
        assert a.call(Op.RESERVE, sizes=[4096])["code"] == "quota"  # full: 16 KiB held


def test_tenants_file_errors_name_the_problem(tmp_path: Path, keys: dict[str, tuple[Path, Path]]) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"clients": {pub(keys, "a"): {"namespaces": {"nope": "r"}}}, "namespaces": {}}))
    srv = curve_server(tmp_path, keys, "--tenants", str(bad))
    with pytest.raises(MaruError, match="names namespace 'nope', which 'namespaces' does not declare"):
        srv.start()
    srv.cleanup()
    srv = ServerProcess(tmp_path, extra_args=["--tenants", str(bad)])
    with pytest.raises(MaruError, match="--tenants needs --curve-secret-key"):
        srv.start()
    srv.cleanup()


def test_server_errors_carry_the_denied_code_to_the_handler(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]]
) -> None:
    with curve_server(tmp_path, keys, "--tenants", str(tenants_file(tmp_path, keys))) as srv:
        with MaruHandler(srv.url, server_public_key=pub(keys, "server"), client_key=str(keys["a"][1])) as h:
            with pytest.raises(ServerError, match="no read right on namespace 'team-b'") as e:
                h.exists(["team-b/x"])
            assert e.value.code == "denied"


def test_under_tenants_the_key_index_answers_each_tenant_for_the_namespaces_it_may_read(
    tmp_path: Path, keys: dict[str, tuple[Path, Path]], monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        curve_server(tmp_path, keys, "--tenants", str(tenants_file(tmp_path, keys))) as srv,
        RawClient(srv.url, sockopts=curve_opts(keys, "admin")) as admin,
        MaruHandler(srv.url, server_public_key=pub(keys, "server"), client_key=str(keys["a"][1])) as a,
        MaruHandler(srv.url, server_public_key=pub(keys, "server"), client_key=str(keys["b"][1])) as b,
    ):
        # Each handshake carries the secrets of the namespaces its key may read, and no others.
        assert admin.handshake()["key_index_secrets"] == {}  # an admin sees sessions, not keys
        for who, readable in (("a", {"team-a", "shared"}), ("b", {"team-b", "shared"})):
            with RawClient(srv.url, sockopts=curve_opts(keys, who)) as raw:
                reply = raw.handshake()
            assert reply["key_index"]["keyed"] is True
            assert set(reply["key_index_secrets"]) == readable
        for h, key in ((a, "team-a/k"), (b, "team-b/x"), (b, "shared/y")):
            obj = h.alloc(4096)
            obj.buf[:4] = b"abcd"
            h.store(key, obj)
        before = srv_exists_count(admin)
        assert a.exists(["team-a/k", "team-a/gone", "shared/y", "shared/z"]) == [True, False, True, False]
        assert b.exists(["team-b/x", "shared/y", "team-b/k"]) == [True, True, False]
        assert srv_exists_count(admin) == before  # every answer came from the table
        assert a.local_exists.counts()["exists_local"] == 1
        # What a tenant may not read it cannot test in the table: the server answers, and refuses.
        with pytest.raises(ServerError, match="no read right on namespace 'team-b'"):
            a.exists(["team-b/x"])
        assert a.local_exists.counts()["exists_remote"] == 1
        assert srv_exists_count(admin) == before  # refused before it was counted
        # A restarted server draws new secrets; the handler's next handshake brings them.
        old = dict(a.local_exists._reader.fingerprints.secrets)  # type: ignore[union-attr]
        srv.stop()
        srv.start()
        obj = a.alloc(4096)  # a lease op: the handler handshakes with the new server
        obj.buf[:4] = b"efgh"
        a.store("team-a/k2", obj)
        assert a.exists(["team-a/k", "team-a/k2", "shared/y", "team-a/gone"]) == [True, True, True, False]
        new = a.local_exists._reader.fingerprints.secrets  # type: ignore[union-attr]
        assert set(new) == set(old) and all(new[ns] != old[ns] for ns in old)
        assert a.local_exists.counts()["exists_local"] == 2
        # `maru doctor`, as tenant a, says how its EXISTS are answered.
        monkeypatch.setenv("MARU_SERVER_PUBLIC_KEY", pub(keys, "server"))
        monkeypatch.setenv("MARU_CLIENT_KEY", str(keys["a"][1]))
        p = maru("doctor", "--url", srv.url, "--quick")
        out = flat(p.stdout)
        assert "key index (optional) ok 4 keys" in out, p.stdout + p.stderr
        assert "for the namespaces they may read (fingerprints keyed per namespace)" in out, out


def srv_exists_count(raw: RawClient) -> int:
    c = raw.call(Op.STATS)["counters"]
    return int(c["exists_hits"]) + int(c["exists_misses"])
