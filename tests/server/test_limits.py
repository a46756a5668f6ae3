"""Limits: no frame, flood or handshake storm can stall the server or grow it without bound.

Promises: a request's decoding is bounded (elements, nesting), so a frame built to explode the
decoder is refused after bounded work; a flooding client cannot starve another (the ROUTER serves
connections in turn, one message each); live leases are capped (``--max-clients``); under 100,000
fuzzed frames every frame with a header gets exactly one reply and memory stays bounded.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import msgpack
import pytest

from maru import protocol as P
from maru.errors import ProtocolError
from maru.protocol import Op
from tests.helpers import RawClient, ServerProcess


def nested_empty_arrays_frame(req_id: int = 1) -> bytes:
    """~8 MB: a map whose ``keys`` holds arrays of 32,768 empty arrays (millions of lists if decoded)."""
    inner = b"\xdc" + (32768).to_bytes(2, "big") + b"\x90" * 32768
    n = P.MAX_FRAME_BYTES // len(inner) - 1
    body = b"\x81\xa4keys\xdc" + n.to_bytes(2, "big") + inner * n
    return P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION, Op.EXISTS, req_id) + body


def test_decoder_refuses_too_many_elements_and_too_deep_nesting_but_takes_full_batches() -> None:
    with pytest.raises(ProtocolError, match="more than .* array and map elements"):
        P.decode_request(nested_empty_arrays_frame())
    deep = P.HEADER.pack(P.MAGIC, 1, Op.EXISTS, 1) + b"\x81\xa4keys" + b"\x91" * 20 + b"\x90"
    with pytest.raises(ProtocolError, match="nests deeper than"):
        P.decode_request(deep)
    # What the protocol allows decodes: a full COMMIT batch, an info map nested to its limit.
    items = [[f"k{i}" * 20, i] for i in range(P.MAX_BATCH)]
    assert P.decode_request(P.encode(Op.COMMIT, 1, {"client_id": "c", "items": items}))["items"] == items
    info = {"a": {"b": {"c": {"d": [1, 2]}}}}
    assert P.decode_request(P.encode(Op.HANDSHAKE, 1, {"client_id": "c", "info": info}))["info"] == info
    # Replies may carry more (a full RESERVE reply) and still decode.
    allocs = [[1 << 40, 1 << 30, 4096]] * P.MAX_BATCH
    assert (
        P.decode_body(P.encode(Op.RESERVE | P.REPLY_BIT, 1, {"ok": True, "allocs": allocs}))["allocs"]
        == allocs
    )


def test_exploding_frames_are_refused_with_bounded_memory_while_another_client_is_served(
    tmp_path: Path,
) -> None:
    with (
        ServerProcess(tmp_path, log_level="WARNING") as srv,
        RawClient(srv.url) as flooder,
        RawClient(srv.url) as other,
    ):
        other.call(Op.STATS)
        rss_before = srv.rss_kib()
        frame = nested_empty_arrays_frame()
        for i in range(40):
            flooder.send_raw(frame[:8] + struct.pack("!Q", i) + frame[16:])
        # The other client's EXISTS is answered while the flood is queued.
        assert other.call(Op.EXISTS, keys=["k"])["present"] == [False]
        for i in range(40):
            reply = flooder.recv_raw(timeout_s=30)
            assert reply is not None and P.decode_header(reply)[2] == i
            body = P.decode_body(reply)
            assert body["code"] == "malformed" and "elements" in body["message"]
        grown_mib = (srv.rss_kib() - rss_before) / 1024
        assert grown_mib < 100, f"RSS grew {grown_mib:.0f} MiB decoding refused frames"


def test_a_flooding_client_does_not_starve_another(tmp_path: Path) -> None:
    """While one client has hundreds of heavy requests queued, another's are served in between."""
    with (
        ServerProcess(tmp_path, log_level="WARNING") as srv,
        RawClient(srv.url) as flooder,
        RawClient(srv.url) as other,
    ):
        keys = [f"flood/{i:05d}" for i in range(P.MAX_BATCH)]
        heavy = [P.encode(Op.LOOKUP, i, {"client_id": "f", "keys": keys, "pin": False}) for i in range(400)]
        for f in heavy:
            flooder.send_raw(f)
        served = []
        for _ in range(5):
            served.append(other.call(Op.STATS)["requests"].get("lookup", 0))
        # A server taking requests in arrival order answers the other's first request after all
        # 400 heavy ones; taking one request per client per turn, the other's five round trips end
        # while most of the flood still waits. (How many heavy ones fit between two of the other's
        # requests is its own turnaround time over the server's, so no tighter bound holds on a
        # loaded machine: a gap of 6 was seen on 2 busy cores.)
        assert served[-1] < len(heavy) // 2, served
        for _ in heavy:
            assert flooder.recv_raw(timeout_s=60) is not None


def test_handshake_flood_is_bounded_by_the_lease_cap(tmp_path: Path) -> None:
    info = {"slow": ["x" * 400] * 9}  # ~3.7 KB, just under the info limit
    with (
        ServerProcess(tmp_path, log_level="WARNING", extra_args=["--max-clients", "500"]) as srv,
        RawClient(srv.url) as c,
    ):
        codes = []
        for i in range(600):
            reply = c.call(Op.HANDSHAKE, client_id=f"c{i}", host="h", pid=1, info=info)
            codes.append(reply.get("code", "ok"))
        assert codes[:500] == ["ok"] * 500
        assert set(codes[500:]) == {"too_many_clients"}
        stats = c.call(Op.STATS)
        assert stats["clients_total"] == 500
        # A known client's handshake (a reconnect) is still accepted at the cap.
        assert c.call(Op.HANDSHAKE, client_id="c7", host="h", pid=1)["ok"]


def _fuzz_frame(rng: random.Random, i: int) -> tuple[bytes, bool]:
    kind = rng.randrange(8)
    op = rng.choice([int(o) for o in Op]) if rng.random() < 0.9 else rng.randrange(0x10000)
    if kind == 0:
        raw = rng.randbytes(rng.randrange(0, 64))
        return raw, len(raw) >= P.HEADER_SIZE
    if kind == 1:
        return P.HEADER.pack(P.MAGIC, 1, op, i)[: rng.randrange(P.HEADER_SIZE)], False
    head = P.HEADER.pack(P.MAGIC, P.PROTOCOL_VERSION if kind != 2 else rng.randrange(0x10000), op, i)
    if kind <= 3:
        return head + rng.randbytes(rng.randrange(0, 48)), True
    fields = ["client_id", "sizes", "items", "alloc_ids", "keys", "pin", "host", "pid", "info"]
    pool = [
        None,
        True,
        0,
        -1,
        2**63,
        1.5,
        "k",
        "ns/key",
        b"\x00",
        [],
        {},
        ["a", 1],
        [["k", 1]],
        [4096],
        {"a": [1]},
    ]
    body = {rng.choice(fields): rng.choice(pool) for _ in range(rng.randrange(5))}
    if rng.random() < 0.7:
        body["client_id"] = f"fuzz{rng.randrange(50)}"
    if kind == 7:  # an over-budget container: many small arrays
        body["keys"] = [[]] * rng.choice([10, P.MAX_BATCH + 1, P.MAX_FRAME_ELEMENTS])
    return head + msgpack.packb(body, use_bin_type=True), True


@pytest.mark.slow
def test_a_hundred_thousand_fuzzed_frames_each_with_a_header_get_exactly_one_reply(tmp_path: Path) -> None:
    rng = random.Random(11)
    with ServerProcess(tmp_path, log_level="ERROR") as srv, RawClient(srv.url) as c:
        c.call(Op.STATS)
        rss_before = srv.rss_kib()
        total, replies_expected = 100_000, 0
        for start in range(0, total, 500):  # windows of 500 in flight: bounded client-side queues
            expected = []
            for i in range(start, start + 500):
                raw, replies = _fuzz_frame(rng, i)
                c.send_raw(raw)
                if replies:
                    expected.append(struct.unpack_from("!Q", raw, 8)[0])
            for rid in expected:
                frame = c.recv_raw(timeout_s=30)
                assert frame is not None, f"no reply to request {rid}"
                assert P.decode_header(frame)[2] == rid
            replies_expected += len(expected)
        assert c.recv_raw(timeout_s=0.5) is None  # no extra replies
        stats = c.call(Op.STATS)
        assert stats["errors"]["internal"] == 0
        assert replies_expected > 80_000
        grown_mib = (srv.rss_kib() - rss_before) / 1024
        assert grown_mib < 64, f"RSS grew {grown_mib:.0f} MiB under fuzzing"
