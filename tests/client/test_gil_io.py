"""``maru.client.gil_io``: libzmq's send and ready read with the GIL kept, checked against pyzmq;
a channel's round trips through it; and the pyzmq path, announced, where it is turned off."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import zmq

from maru.client import MaruHandler
from maru.client.gil_io import GilKeepingIO, gil_io, slow_note, why_not
from tests.gil_witness import GilWitness, quiet_interpreter  # noqa: F401 (a fixture)
from tests.pool_fixtures import module_server

server = module_server("gil-io", pool_size="16M")


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket, zmq.Socket]]:
    ctx = zmq.Context.instance()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    addr = f"inproc://test-gil-io-{os.urandom(8).hex()}"
    a.bind(addr)
    b.connect(addr)
    try:
        yield a, b
    finally:
        a.close(0)
        b.close(0)


@pytest.fixture
def io() -> GilKeepingIO:
    got = gil_io()
    assert got is not None, why_not()  # pyzmq's wheel bundles libzmq: available here
    return got


def test_frames_of_every_size_cross_both_ways_byte_for_byte(pair, io) -> None:
    a, b = pair
    for n in (0, 1, 29, 4096, 1 << 20):
        out = os.urandom(n)
        assert io.send(a, out)
        assert b.poll(2000) and b.recv() == out
        back = os.urandom(n)
        b.send(back)
        assert a.poll(2000) and io.recv(a) == back
    assert io.recv(a) is None  # nothing there: no wait, no error


def test_a_send_that_cannot_be_queued_says_so_and_a_closed_socket_raises(io) -> None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IMMEDIATE, 1)
    s.connect("tcp://127.0.0.1:9")  # nobody there: no live connection to queue on
    try:
        assert io.send(s, b"x") is False
    finally:
        s.close(0)


@pytest.mark.usefixtures("quiet_interpreter")
def test_send_and_ready_read_keep_the_gil_where_pyzmqs_give_it_up(pair, io) -> None:
    a, b = pair
    frame = os.urandom(256)
    # The control: pyzmq's copy of a large frame runs without the GIL, long enough (milliseconds)
    # for the witness to be scheduled even on a loaded machine.
    big = os.urandom(8 << 20)
    with GilWitness() as w:
        pyzmq_gave_up = sum(w.gave_up(lambda: a.send(big)) for _ in range(10))
        for _ in range(10):
            b.recv()
        mine = sum(w.gave_up(lambda: io.send(a, frame)) for _ in range(100))
        assert b.poll(2000)
        for _ in range(100):
            b.send(frame)
        assert a.poll(2000)
        read = 0
        for _ in range(100):
            got: list[bytes | None] = []
            read += w.gave_up(lambda got=got: got.append(io.recv(a)))
            assert got == [frame] or got == [None]
    assert pyzmq_gave_up > 0  # the check can fail: pyzmq's send gives the GIL up
    assert (mine, read) == (0, 0)


def test_a_polling_channels_round_trips_keep_the_gil_and_are_counted(server) -> None:
    with MaruHandler(server.url, timeout_s=5, reply_spin_s=0.01) as h:
        assert h.reply_waits["gil_kept"] == 1
        objs = h.batch_alloc([64])
        objs[0].buf[:] = b"\1" * 64
        h.batch_store(["gil-io-key"], objs)
        for _ in range(20):
            got = h.batch_retrieve(["gil-io-key"], pin=True, verify=False)
            assert got[0] is not None and bytes(got[0].view) == b"\1" * 64
            h.batch_release(got, wait=False)  # posted through the same send
        assert h.usage()["pinned"] == 0  # the posted releases were applied, in order
    assert slow_note("a test") is None


def test_turned_off_it_goes_through_pyzmq_announced_once_and_reported(server) -> None:
    code = (
        "import logging, sys; logging.basicConfig(level=logging.WARNING);"
        "from maru.client import MaruHandler; from maru.client.gil_io import slow_note;"
        "hs = [MaruHandler(sys.argv[1], timeout_s=5, reply_spin_s=0.001) for _ in range(2)];"
        "print('exists', hs[0].exists(['nothing-here']), hs[1].exists(['nothing-here']));"
        "print('kept', hs[0].reply_waits['gil_kept']); print('note', slow_note('the test'));"
        "[h.close() for h in hs]"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, server.url],
        env={**os.environ, "MARU_GIL_IO": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "exists [False] [False]" in out.stdout and "kept 0" in out.stdout
    assert "MARU_GIL_IO=0 turns it off" in out.stdout and "Fix: pyzmq from its PyPI wheel" in out.stdout
    # Announced once for the process, however many channels, with the reason and the fix.
    assert out.stderr.count("send and read through pyzmq") == 1, out.stderr
    assert "MARU_GIL_IO=0 turns it off" in out.stderr and "Fix:" in out.stderr


def test_maru_doctor_shows_which_zmq_calls_run() -> None:
    from maru.cli.doctor import OK, WARN, DoctorContext, check_zmq_calls

    r = check_zmq_calls(DoctorContext(url="tcp://127.0.0.1:9"))
    assert r.status == OK and "GIL kept" in r.detail
    code = (
        "from maru.cli.doctor import DoctorContext, check_zmq_calls;"
        "r = check_zmq_calls(DoctorContext(url='tcp://127.0.0.1:9'));"
        "print(r.status, '|', r.detail, '|', r.fix)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "MARU_GIL_IO": "0"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.startswith(WARN), out.stdout + out.stderr
    assert "MARU_GIL_IO=0 turns it off" in out.stdout and "MARU_GIL_IO unset" in out.stdout
