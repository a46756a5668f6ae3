"""``RpcChannel(reply_spin_s=...)``: a channel that polls for its replies before blocking gets the
same answers as a blocking one, in order, posted replies included, and still times out."""

from __future__ import annotations

import threading
import time

import pytest
import zmq

from maru import MaruHandler
from maru.client.rpc import RpcChannel
from maru.errors import MaruTimeoutError
from maru.protocol import REPLY_BIT, Op, decode_header, encode
from tests.helpers import ServerProcess


class _SlowEcho:
    """A ROUTER that answers each request ``delay_s`` later (None: never), with ``{"ok": True, "n": i}``."""

    def __init__(self, delay_s: float | None) -> None:
        self.delay_s = delay_s
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self.url = f"tcp://127.0.0.1:{port}"
        self.seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, frame = self._sock.recv_multipart()
            _, op, req_id = decode_header(frame)
            self.seen += 1
            if self.delay_s is None:
                continue
            time.sleep(self.delay_s)
            self._sock.send_multipart([ident, encode(op | REPLY_BIT, req_id, {"ok": True, "n": self.seen})])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._sock.close(0)


def test_a_spinning_handler_reads_back_its_own_bytes_and_its_posted_replies(
    maru_server: ServerProcess,
) -> None:
    with MaruHandler(maru_server.url, reply_spin_s=0.002) as h, MaruHandler(maru_server.url) as other:
        data = {f"spin{i}": bytes([i]) * (64 + i) for i in range(24)}
        for k, v in data.items():
            obj = h.alloc(len(v))
            obj.buf[:] = v
            h.store(k, obj)
        for _ in range(10):
            got = h.batch_retrieve(list(data))
            assert [bytes(r.view) for r in got] == list(data.values())
            assert other.usage()["pinned"] == len(data)
            h.batch_release(got, wait=False)  # posted: its reply arrives before the next one's
            assert h.usage()["pinned"] == 0  # our own reply, read after the posted one's
            assert not h._rpc._posted
        w = h.reply_waits
        assert w["spin_us"] == 2000 and w["replies_spun"] + w["spun_out"] >= 30  # every exchange counted
    with MaruHandler(maru_server.url) as blocking:
        blocking.usage()
        assert blocking.reply_waits == {
            "spin_us": 0,
            "gil_kept": 1,
            "replies_spun": 0,
            "spun_out": 0,
        }  # never polls


def test_a_reply_later_than_the_spin_is_still_read_by_the_blocking_wait() -> None:
    srv = _SlowEcho(delay_s=0.03)
    ch = RpcChannel(srv.url, reply_spin_s=0.0005)
    try:
        for i in range(1, 4):
            body = ch.request(Op.USAGE, {}, 5.0)
            assert body == {"ok": True, "n": i}  # each request its own reply, in order
        assert ch.spun_out == 3 and ch.replies_spun == 0  # each outlasted the 0.5 ms of polling
    finally:
        ch.close()
        srv.close()


def test_a_spinning_channel_still_times_out_and_replaces_its_socket() -> None:
    srv = _SlowEcho(delay_s=None)
    ch = RpcChannel(srv.url, reply_spin_s=0.001)
    try:
        with pytest.raises(MaruTimeoutError, match="no reply from maru server"):
            ch.request(Op.USAGE, {}, 0.3)
        assert srv.seen == 1 and ch._sock is None  # sent once; the socket went with the timeout
    finally:
        ch.close()
        srv.close()


@pytest.mark.parametrize("bad", [-0.001, 0.5])
def test_the_spin_is_bounded(bad: float) -> None:
    with pytest.raises(ValueError, match="reply_spin_s"):
        RpcChannel("tcp://127.0.0.1:9", reply_spin_s=bad)


def test_a_thread_that_never_polls_blocks_on_a_polling_channel() -> None:
    """The session's heartbeat shares the channel of a polling client; its own exchanges block."""
    from maru.client.rpc import never_poll_on_this_thread

    srv = _SlowEcho(delay_s=0.0)
    ch = RpcChannel(srv.url, reply_spin_s=0.005)
    got: list[dict] = []

    def background() -> None:
        never_poll_on_this_thread()
        got.append(ch.request(Op.USAGE, {}, 5.0))

    try:
        t = threading.Thread(target=background)
        t.start()
        t.join(10)
        assert got == [{"ok": True, "n": 1}]
        assert ch.replies_spun == 0 and ch.spun_out == 0  # that thread never polled
        assert ch.request(Op.USAGE, {}, 5.0) == {"ok": True, "n": 2}  # this thread still polls
        assert ch.replies_spun + ch.spun_out == 1
    finally:
        ch.close()
        srv.close()


def test_a_posted_wake_up_changes_no_answer_and_is_skipped_while_another_thread_talks(
    tmp_path,  # noqa: ANN001
) -> None:
    with (
        ServerProcess(tmp_path, pool_size="4M") as srv,
        MaruHandler(srv.url, timeout_s=5, reply_spin_s=0.002) as h,
    ):
        objs = h.batch_alloc([16])
        objs[0].buf[:] = b"w" * 16
        h.batch_store(["wake/a"], objs)
        for _ in range(5):
            assert h.wake()  # a heartbeat posted, its reply read by the next exchange
            assert h.exists(["wake/a", "wake/b"]) == [True, False]
            [r] = h.batch_retrieve(["wake/a"])
            assert r is not None and bytes(r.view) == b"w" * 16
            h.batch_release([r])
        assert not h._rpc._posted  # every posted reply was read
        held, done = threading.Event(), threading.Event()

        def talking() -> None:  # another thread in an exchange: the server is awake
            with h._lock:
                held.set()
                done.wait(10)

        t = threading.Thread(target=talking)
        t.start()
        assert held.wait(10)
        try:
            assert not h.wake()  # nothing posted, nothing waited for
        finally:
            done.set()
            t.join()
    assert not h.wake()  # closed: nothing is sent
