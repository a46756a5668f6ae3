"""``MaruHandler.post_lookup``: a lookup-and-pin sent now and read later, against a real server.

Its handles must equal a ``batch_retrieve``'s (bytes, offsets, checksums, segment sums), its pins
must count as the handler's and go back when released; a lookup given up before or after its reply
must leave nothing pinned; a server that stops answering must make ``result`` raise in time, and a
reply read by another call on the way must not be lost.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from maru import MaruHandler
from maru.errors import MaruTimeoutError
from maru.protocol import MAX_BATCH, Op
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server

server = module_server("posted-lookups", pool_size="8M")


@pytest.fixture
def h(server: ServerProcess) -> Iterator[MaruHandler]:
    with MaruHandler(server.url, timeout_s=5, heartbeat_interval_s=0.2) as handler:
        yield handler


def _put(h: MaruHandler, keys: list[str], seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    out = {}
    for i, k in enumerate(keys):
        data = rng.integers(0, 256, 512 + 64 * i, dtype=np.uint8).tobytes()
        obj = h.alloc(len(data))
        obj.buf[:] = data
        h.store(k, obj)
        out[k] = data
    return out


def _pinned(h: MaruHandler) -> int:
    return int(h.usage()["pinned"])


def _session_pins(h: MaruHandler) -> int:
    """The pins the server holds for this handler's session (a heartbeat's ``pins``)."""
    with h._lock:
        return int(h._call(Op.HEARTBEAT, {}, retry=False)["pins"])


@contextlib.contextmanager
def _connection_held_elsewhere(h: MaruHandler) -> Iterator[None]:
    """Another thread holds the handler's connection (as an exchange with a stopped server does)
    for the duration of the block."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with h._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(5)
        yield
    finally:
        release.set()
        t.join()


def _slow_at_server(h: MaruHandler) -> list[str]:
    """This client's ``slow`` sentences as the server lists them (``maru stats``, ``maru doctor``)."""
    mine = [c for c in h.stats()["clients"] if c["client_id"] == h.client_id]
    info = mine[0]["info"] if mine else None
    return list((info or {}).get("slow", []))


def _until_unpinned(h: MaruHandler) -> None:
    deadline = time.monotonic() + 10
    while _pinned(h):
        assert time.monotonic() < deadline, "pins of a given-up lookup were never sent back"
        time.sleep(0.05)


def test_posted_lookups_in_flight_together_give_what_batch_retrieve_gives(h: MaruHandler) -> None:
    data = _put(h, [f"pl-a{i}" for i in range(6)], seed=1)
    asks = [["pl-a0", "pl-a1"], ["pl-a2", "pl-absent", "pl-a3"], ["pl-a4", "pl-a5", "pl-a0"]]
    posted = [h.post_lookup(keys, segments=True) for keys in asks]  # three in flight at once
    assert all(p is not None for p in posted)
    got = [p.result(5) for p in posted if p is not None]
    assert _pinned(h) == 6  # every entry found is pinned (pl-a0 by two handles)
    ref = h.batch_retrieve([k for keys in asks for k in keys], verify=False, segments=True)
    flat = [r for rs in got for r in rs]
    assert (
        [r is None for r in flat] == [r is None for r in ref] == [k == "pl-absent" for ks in asks for k in ks]
    )
    for r, want in zip(flat, ref, strict=True):
        if r is None or want is None:
            continue
        assert (r.key, r.offset, r.size, r.checksum) == (want.key, want.offset, want.size, want.checksum)
        assert bytes(r.view) == data[r.key]
        assert r.valid and r.pinned
    h.batch_release(ref)
    h.batch_release(flat)
    assert _pinned(h) == 0


def test_a_reply_read_by_another_call_on_the_way_is_kept_for_its_lookup(h: MaruHandler) -> None:
    data = _put(h, ["pl-b0"], seed=2)
    p = h.post_lookup(["pl-b0"])
    assert p is not None
    h.usage()  # any exchange reads the posted reply before its own
    assert p.done
    (r,) = p.result(0.0)  # no wait left
    assert r is not None and bytes(r.view) == data["pl-b0"]
    with pytest.raises(RuntimeError):
        p.result(1)  # taken once
    r.release()
    assert _pinned(h) == 0


@pytest.mark.parametrize("when", ["before its reply", "after its reply"])
def test_a_lookup_given_up_leaves_nothing_pinned(h: MaruHandler, when: str) -> None:
    _put(h, ["pl-c0", "pl-c1"], seed=3)
    p = h.post_lookup(["pl-c0", "pl-c1", "pl-c-absent"])
    assert p is not None
    if when == "after its reply":
        h.read_posted()
        deadline = time.monotonic() + 5
        while not p.done:
            assert time.monotonic() < deadline
            h.read_posted()
    p.abandon()
    p.abandon()  # idempotent
    with pytest.raises(RuntimeError):
        p.result(1)
    _until_unpinned(h)  # sent back at once, or with the next heartbeat's UNPIN
    (r,) = h.batch_retrieve(["pl-c0"])  # the entries themselves are untouched
    assert r is not None
    r.release()


def test_too_many_keys_or_none_are_not_posted(h: MaruHandler) -> None:
    assert h.post_lookup([]) is None
    assert h.post_lookup([f"pl-many{i}" for i in range(MAX_BATCH + 1)]) is None


def test_a_server_that_stops_answering_makes_result_raise_in_time_and_nothing_stays_pinned(
    tmp_path: Path,
) -> None:
    srv = ServerProcess(tmp_path, pool_size="4M")
    srv.start()
    try:
        # A heartbeat that meets the stopped server waits min(timeout_s, 2 s) for its reply; a
        # stop longer than that (a loaded machine) would replace the socket (the lost lookup's pins
        # are then given back another way: test_a_pinning_lookup_lost_to_a_stopped_server_...).
        # This test is about the late reply read on the same socket.
        with MaruHandler(srv.url, timeout_s=10.0, heartbeat_interval_s=0.2) as h:
            _put(h, ["pl-d0"], seed=4)
            os.kill(srv.pid, signal.SIGSTOP)  # hung: the request goes out, no reply comes
            try:
                p = h.post_lookup(["pl-d0"])
                assert p is not None
                t0 = time.monotonic()
                with pytest.raises(MaruTimeoutError):
                    p.result(0.3)
                assert time.monotonic() - t0 < 5
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            # The late reply pinned pl-d0 on the server: given up, it is sent back.
            _until_unpinned(h)
    finally:
        srv.cleanup()


def test_result_keeps_its_timeout_while_another_thread_holds_the_connection(h: MaruHandler) -> None:
    """``result(t)`` counts the wait for the connection in ``t`` (a heartbeat stuck on a stopped
    server holds it up to 2 s): it raises in time, and the lookup it gave up leaves nothing pinned."""
    _put(h, ["pl-e0"], seed=5)
    p = h.post_lookup(["pl-e0"])
    assert p is not None
    with _connection_held_elsewhere(h):
        t0 = time.monotonic()
        with pytest.raises(MaruTimeoutError):
            p.result(0.2)
        assert time.monotonic() - t0 < 2.5  # not the handler's 5 s timeout
    _until_unpinned(h)  # the reply, read later, has its pin sent back


def test_a_lookup_given_up_while_the_connection_is_held_is_settled_by_the_heartbeat(h: MaruHandler) -> None:
    """Its reply already read (handles made, pinned), ``abandon`` while another thread holds the
    connection returns at once; the next heartbeat releases the handles: nothing stays pinned."""
    _put(h, ["pl-f0", "pl-f1"], seed=6)
    p = h.post_lookup(["pl-f0", "pl-f1"])
    assert p is not None
    deadline = time.monotonic() + 5
    while not p.done:  # the reply read by this thread (the heartbeat could read it too)
        h.read_posted()
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert _pinned(h) == 2
    with _connection_held_elsewhere(h):
        t0 = time.monotonic()
        p.abandon()
        assert time.monotonic() - t0 < 1.0  # deferred, not waited for
        assert p in h._abandoned_posts
    _until_unpinned(h)
    assert h._abandoned_posts == []
    with pytest.raises(RuntimeError):
        p.result(1)  # given up: no result any more


def test_pins_the_server_holds_beyond_the_handles_are_announced_as_stray(
    h: MaruHandler, caplog: pytest.LogCaptureFixture
) -> None:
    """A pinning lookup applied by the server but never turned into a handle (as one lost with its
    socket would be; here sent past the handler's bookkeeping) shows at the next heartbeat as
    ``stray_pins``, announced once; the handles' own pins are not counted, and once the stray pin
    is gone the count is back to 0."""
    _put(h, ["pl-g0", "pl-g1"], seed=7)
    legit = h.batch_retrieve(["pl-g0"], verify=False)  # a handle's pin: not stray
    assert legit[0] is not None and legit[0].pinned

    def beat_seen() -> None:
        with h._lock:  # one heartbeat now, as the heartbeat thread sends it
            h._beat_locked()

    beat_seen()
    assert h.integrity()["stray_pins"] == 0
    with caplog.at_level("WARNING", logger="maru.client"), h._lock:
        reply = h._rpc.request(
            Op.LOOKUP, {"keys": ["pl-g1", "pl-g0"], "pin": True, "client_id": h.client_id}, 5
        )
    assert reply["ok"] and all(reply["entries"])
    with caplog.at_level("WARNING", logger="maru.client"):
        beat_seen()
        beat_seen()
    assert h.integrity()["stray_pins"] == 2
    assert (
        sum("holds 2 pins of this client that none of its handles holds" in r.message for r in caplog.records)
        == 1
    )
    # The next heartbeat told the server: `maru stats` lists it among this client's slow paths,
    # `maru doctor` warns with it.
    assert any("holds 2 pins of this client's session" in s for s in _slow_at_server(h))
    with h._lock:  # the stray pins given back past the handler too
        assert h._rpc.request(Op.UNPIN, {"keys": ["pl-g1", "pl-g0"], "client_id": h.client_id}, 5)["ok"]
    beat_seen()
    assert h.integrity()["stray_pins"] == 0
    beat_seen()
    assert _slow_at_server(h) == []  # gone from the server's view too
    assert _pinned(h) == 1  # the handle's pin is still there
    h.batch_release(legit)


def test_stray_pins_of_lost_lookups_are_given_back_where_no_handle_holds_the_key(h: MaruHandler) -> None:
    """Pins applied for requests the handler noted lost (``_lost_pin``, as a lost socket does) go
    back at the next heartbeat, except on a key a handle also holds: that one waits until the
    handle is released. The handle's own pin is never touched."""
    _put(h, ["pl-h0", "pl-h1"], seed=8)
    legit = h.batch_retrieve(["pl-h0"], verify=False)
    with h._lock:
        reply = h._rpc.request(
            Op.LOOKUP, {"keys": ["pl-h0", "pl-h1", "pl-h1"], "pin": True, "client_id": h.client_id}, 5
        )
        assert reply["ok"] and all(reply["entries"])
        h._lost_pin(["pl-h0", "pl-h1", "pl-h1"])
    assert _session_pins(h) == 4
    with h._lock:
        h._beat_locked()
    assert h.integrity()["stray_pins"] == 1  # pl-h0's: a handle holds that key
    assert h._lost_pins == {"pl-h0": 1}  # pl-h1's lost requests are settled: not asked again
    assert _session_pins(h) == 2  # pl-h1's two given back; the handle's and one stray on pl-h0 left
    assert legit[0] is not None and legit[0].pinned
    h.batch_release(legit)
    with h._lock:
        h._beat_locked()
    assert h.integrity()["stray_pins"] == 0 and not h._lost_pins
    assert _session_pins(h) == 0


def test_a_pinning_lookup_lost_to_a_stopped_server_leaves_nothing_pinned(tmp_path: Path) -> None:
    """The server stops; a pinning lookup times out and its socket is replaced; the server resumes
    and may apply it after all. Whichever happened, nothing stays pinned."""
    srv = ServerProcess(tmp_path, pool_size="4M")
    srv.start()
    try:
        with MaruHandler(srv.url, timeout_s=0.5, heartbeat_interval_s=0.2) as h:
            _put(h, ["pl-i0", "pl-i1"], seed=9)
            os.kill(srv.pid, signal.SIGSTOP)
            try:
                with pytest.raises(MaruTimeoutError):
                    h.batch_retrieve(["pl-i0", "pl-i1"], verify=False)
            finally:
                os.kill(srv.pid, signal.SIGCONT)
            assert set(h._lost_pins) == {"pl-i0", "pl-i1"}
            deadline = time.monotonic() + 10
            while True:
                try:
                    if _pinned(h) == 0:
                        break
                except MaruTimeoutError:
                    pass  # reconnecting
                assert time.monotonic() < deadline, "a lost lookup's pins stayed"
                time.sleep(0.05)
            assert h.integrity()["stray_pins"] == 0
    finally:
        srv.cleanup()


@pytest.mark.parametrize("applied", [True, False], ids=["applied", "never-arrived"])
def test_an_unpin_lost_with_its_socket_never_takes_another_handles_pin(h: MaruHandler, applied: bool) -> None:
    """Two handles on one key; the UNPIN of the first is posted and lost with its socket, applied
    by the server or not. Sending it again could take the second handle's pin; instead the heartbeat's
    pin count tells: applied, nothing is stray; not applied, the stray pin waits while the second
    handle holds the key and goes back once it is released. The second handle stays pinned throughout."""
    _put(h, ["pl-j0"], seed=10)
    with h._lock:
        h._beat_locked()  # the server says it counts pins
    assert h._server_counts_pins
    first = h.batch_retrieve(["pl-j0"], verify=False)
    second = h.batch_retrieve(["pl-j0"], verify=False)
    assert _session_pins(h) == 2
    real_post = h._rpc.post

    def lost_post(op: int, body: dict, on_reply, on_lost):  # type: ignore[no-untyped-def]
        if op != Op.UNPIN:
            return real_post(op, body, on_reply, on_lost)
        req = real_post(op, body, lambda *a: None, lambda *a: None) if applied else 7
        on_lost(op, body)  # the socket replaced before its reply was read
        return req

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(h._rpc, "post", lost_post)
        h.batch_release(first, wait=False)
    assert h._pending_unpins == [] and h._lost_pins["pl-j0"] == 1
    with h._lock:
        h._beat_locked()
    assert _session_pins(h) == (1 if applied else 2)  # the second handle's pin is there
    assert h.integrity()["stray_pins"] == (0 if applied else 1)
    assert second[0] is not None and second[0].pinned
    h.batch_release(second)
    with h._lock:
        h._beat_locked()
    assert _session_pins(h) == 0 and h.integrity()["stray_pins"] == 0
