"""Protocol fuzzing: thousands of malformed frames, then a normal client still works, the server
never hit an internal error, and its memory did not grow without bound."""

from __future__ import annotations

import os
import random
import struct
from pathlib import Path
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from maru import protocol as P
from maru.protocol import Op
from tests.helpers import RawClient, ServerProcess

FIELDS = ["client_id", "sizes", "items", "alloc_ids", "keys", "pin", "host", "pid", "info"]

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=40)
    | st.binary(max_size=40)
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
# Bodies that look like requests: the right field names with values of any type and shape.
bodies = st.tuples(st.dictionaries(st.sampled_from(FIELDS), values, max_size=5), st.booleans()).map(
    lambda t: {**t[0], "client_id": "fuzz"} if t[1] else t[0]
)
ops = st.sampled_from([int(o) for o in Op]) | st.integers(min_value=0, max_value=0xFFFF)


def header(op: int, req_id: int, magic: bytes = P.MAGIC, version: int = P.PROTOCOL_VERSION) -> bytes:
    return P.HEADER.pack(magic, version, op, req_id)


@st.composite
def frames(draw: Any) -> tuple[bytes, bool]:
    """A frame and whether the server must reply (it must, whenever a header can be read)."""
    kind = draw(st.integers(min_value=0, max_value=7))
    req_id = draw(st.integers(min_value=0, max_value=2**64 - 1))
    op = draw(ops)
    if kind == 0:  # random bytes of any length
        raw = draw(st.binary(max_size=64))
        return raw, len(raw) >= P.HEADER_SIZE
    if kind == 1:  # a truncated header
        return header(op, req_id)[: draw(st.integers(min_value=0, max_value=P.HEADER_SIZE - 1))], False
    if kind == 2:  # wrong magic
        return header(op, req_id, magic=draw(st.binary(min_size=4, max_size=4))) + draw(
            st.binary(max_size=32)
        ), True
    if kind == 3:  # wrong version
        return header(op, req_id, version=draw(st.integers(min_value=0, max_value=0xFFFF))), True
    if kind == 4:  # valid header, garbage body
        return header(op, req_id) + draw(st.binary(max_size=64)), True
    if kind == 5:  # valid header, valid MessagePack that is not a request map
        return header(op, req_id) + msgpack.packb(draw(values), use_bin_type=True), True
    if kind == 6:  # valid header and request-shaped map with fields of the wrong types
        return header(op, req_id) + msgpack.packb(draw(bodies), use_bin_type=True), True
    # a huge batch: more items than MAX_BATCH, or an array beyond the decoder's limits
    n = draw(st.sampled_from([P.MAX_BATCH + 1, P.MAX_BATCH * 4 + 1]))
    field = draw(st.sampled_from(["keys", "sizes", "items", "alloc_ids"]))
    body = {"client_id": "fuzz", field: [1] * n}
    return header(draw(st.sampled_from([int(o) for o in Op])), req_id) + msgpack.packb(body), True


def sync(c: RawClient, expected: list[int]) -> None:
    """Read one reply per expected request id, in order, then check nothing else arrives."""
    for rid in expected:
        frame = c.recv_raw(timeout_s=10)
        assert frame is not None, f"no reply for request id {rid}"
        _, _, got = P.decode_header(frame)
        assert got == rid
        body = P.decode_body(frame)
        assert body["ok"] is True or (body["code"] in {c.value for c in P.ErrorCode} and body["message"]), (
            body
        )


def test_thousands_of_malformed_frames_leave_the_server_serving_with_bounded_memory(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, log_level="WARNING") as srv, RawClient(srv.url, client_id="fuzz") as c:
        c.handshake()
        c.call(Op.STATS)
        rss_before = srv.rss_kib()
        sent = 0

        @settings(max_examples=250, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(st.lists(frames(), min_size=1, max_size=16))
        def blast(batch: list[tuple[bytes, bool]]) -> None:
            nonlocal sent
            expected = []
            for raw, replies in batch:
                c.send_raw(raw)
                sent += 1
                if replies:
                    expected.append(P.HEADER.unpack_from(raw)[3])
            sync(c, expected)
            # And a valid request right behind the garbage still gets its own answer.
            assert c.call(Op.EXISTS, keys=["after-garbage"])["ok"]

        blast()

        # Plain random bytes, a lot of them, without waiting for each reply.
        rng = random.Random(7)
        expected = []
        for i in range(5000):
            raw = rng.randbytes(rng.randint(0, 200))
            if i % 3 == 0:
                raw = header(rng.choice(list(Op)), i) + raw
            c.send_raw(raw)
            if len(raw) >= P.HEADER_SIZE:
                expected.append(struct.unpack_from("!Q", raw, 8)[0])
        sent += 5000
        sync(c, expected)

        # Frames over the size limit: one the server still reads (answered "too_large"), one so
        # large that ZeroMQ drops the connection (the client reconnects by itself).
        c.send_raw(header(Op.EXISTS, 4242) + os.urandom(P.MAX_FRAME_BYTES))
        frame = c.recv_raw(timeout_s=10)
        assert frame is not None and P.decode_body(frame)["code"] == "too_large"
        c.send_raw(header(Op.EXISTS, 4343) + bytes(3 * P.MAX_FRAME_BYTES))
        assert c.recv_raw(timeout_s=1) is None

        assert sent > 3000
        with RawClient(srv.url) as fresh:
            fresh.handshake()
            assert fresh.call(Op.RESERVE, sizes=[4096])["allocs"][0] is not None
            stats = fresh.call(Op.STATS)
        assert stats["errors"]["internal"] == 0, "a malformed frame reached an unhandled exception"
        assert stats["errors"]["malformed"] > 100 and stats["counters"]["malformed_frames"] > 100
        assert srv.proc is not None and srv.proc.poll() is None
        grown_mib = (srv.rss_kib() - rss_before) / 1024
        assert grown_mib < 50, f"server RSS grew by {grown_mib:.1f} MiB"
