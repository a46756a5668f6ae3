"""``MaruHandler`` with segment sums (``maru.segments``), against a real ``maru server`` in its own
process: stores send them only when given, retrieves ask for them only when told, and what a
server sends back is parsed (or, unparsable, read as none)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from maru import MaruHandler
from maru.announce import forget
from maru.checksum import checksum
from maru.client import Allocation, CommitResult, frames
from maru.errors import ServerError
from maru.protocol import MAX_BATCH, MAX_SEGMENT_BATCH, SEGMENT_FRAME_BYTES, Op
from maru.segments import MAX_SEGMENTS, SegmentSums, host_segment_sums
from tests.helpers import ServerProcess

SHAPE = (3, 2, 45, 16)  # [L, KV, T, ROW]; 45 tokens: the last segment is short
SEG_TOKENS = 16


@pytest.fixture
def h(maru_server: ServerProcess) -> Iterator[MaruHandler]:
    with MaruHandler(maru_server.url) as handler:
        yield handler


class Recorder:
    """Wraps a handler's RPC channel: records each request, and lets a test rewrite a reply."""

    def __init__(self, h: MaruHandler) -> None:
        self.sent: list[tuple[int, dict[str, Any]]] = []
        self.rewrite: dict[int, Any] = {}  # op -> a function of the reply body
        inner = h._rpc.request

        def request(op: int, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
            self.sent.append((op, dict(body)))
            reply = inner(op, body, timeout_s)
            fix = self.rewrite.get(op)
            return fix(reply) if fix is not None else reply

        h._rpc.request = request  # type: ignore[method-assign]

    def bodies(self, op: int) -> list[dict[str, Any]]:
        return [b for o, b in self.sent if o == op]


def write_random(h: MaruHandler, seed: int) -> tuple[Allocation, int, SegmentSums]:
    """A reservation holding a random 2-byte-element ``SHAPE`` object, its checksum and segment sums."""
    arr = np.random.default_rng(seed).integers(0, 1 << 16, SHAPE, dtype=np.uint16)
    obj = h.alloc(arr.nbytes)
    obj.buf[:] = arr.tobytes()
    seg = host_segment_sums(arr, SHAPE, arr.itemsize, SEG_TOKENS)
    assert len(seg.raws) == 3 and seg.fits(45) and not seg.fits(49)
    return obj, checksum(arr), seg


def test_segment_sums_round_trip_through_store_and_retrieve(h: MaruHandler) -> None:
    rec = Recorder(h)
    (a, ca, sa), (b, cb, _) = write_random(h, 1), write_random(h, 2)
    assert (
        h.batch_store(["a", "b"], [a, b], checksums=[ca, cb], segments=[sa, None])
        == [CommitResult.STORED] * 2
    )
    (commit,) = rec.bodies(Op.COMMIT)
    assert commit["segments"] == [sa.to_wire(), None] and commit["checksums"] == [ca, cb]

    got = h.batch_retrieve(["a", "b", "missing"], segments=True)  # verified whole, as before
    assert got[2] is None and got[0] is not None and got[1] is not None
    assert got[0].segments == sa and got[0].checksum == ca and got[1].segments is None
    assert rec.bodies(Op.LOOKUP)[-1]["segments"] is True
    h.batch_release(got)

    plain = h.retrieve("a")
    assert plain is not None and plain.segments is None and plain.checksum == ca
    assert "segments" not in rec.bodies(Op.LOOKUP)[-1]  # the request other clients send
    plain.release()
    one = h.retrieve("a", pin=False, verify=False, segments=True)
    assert one is not None and one.segments == sa
    one.release()


def test_a_store_without_segment_sums_sends_no_segments_field(h: MaruHandler) -> None:
    rec = Recorder(h)
    obj, ck, _ = write_random(h, 3)
    other, _, _ = write_random(h, 4)
    h.store("one", obj, ck, None)
    h.batch_store(["two"], [other])
    assert [("segments" in b) for b in rec.bodies(Op.COMMIT)] == [False, False]


def test_bad_segment_sums_raise_before_anything_is_sent(h: MaruHandler) -> None:
    rec = Recorder(h)
    obj, ck, seg = write_random(h, 5)
    wrong = SegmentSums(seg.tokens, (seg.raws[0], seg.raws[1] ^ 8, seg.raws[2]))
    with pytest.raises(ValueError, match="without checksums"):
        h.batch_store(["k"], [obj], segments=[seg])
    with pytest.raises(ValueError, match="1 segment sums for 2 objects"):
        h.batch_store(["k", "k2"], [obj, obj], checksums=[ck, ck], segments=[seg])
    with pytest.raises(ValueError, match="do not add up to its checksum"):
        h.store("k", obj, ck, wrong)
    with pytest.raises(TypeError, match="SegmentSums or None"):
        h.batch_store(["k"], [obj], checksums=[ck], segments=[seg.to_wire()])  # type: ignore[list-item]
    assert rec.bodies(Op.COMMIT) == [] and obj.reserved
    assert h.store("k", obj, ck, seg) is CommitResult.STORED
    r = h.retrieve("k", segments=True)
    assert r is not None and r.segments == seg
    r.release()


def test_the_server_refuses_sums_the_client_did_not_check(h: MaruHandler) -> None:
    """The server's check holds whatever a client sends (here: past the handler's own check)."""
    obj, ck, seg = write_random(h, 6)
    wrong = SegmentSums(seg.tokens, (seg.raws[0] ^ 1, *seg.raws[1:]))
    with pytest.raises(ServerError, match="the writer's sums are wrong") as e:
        h._call(Op.COMMIT, {"items": [["k", obj.alloc_id]], "checksums": [ck], "segments": [wrong.to_wire()]})
    assert e.value.code == "bad_request" and h.exists(["k"]) == [False]
    assert h.store("k", obj, ck) is CommitResult.STORED


def test_sums_that_do_not_parse_read_as_none_warned_once(
    h: MaruHandler, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The process-wide record of it (a worker reports it to `maru doctor`) is this test's alone:
    # restored after, so later tests in this process do not inherit a slow path.
    monkeypatch.setattr(frames, "bad_segments_seen", None)
    rec = Recorder(h)
    obj, ck, seg = write_random(h, 7)
    h.store("k", obj, ck, seg)
    forget(frames.BAD_SEGMENTS_ANNOUNCEMENT)
    rec.rewrite[Op.LOOKUP] = lambda reply: {**reply, "segments": [[0, b"\0" * 8]]}
    with caplog.at_level(logging.WARNING, logger="maru.client"):
        for _ in range(2):
            r = h.retrieve("k", segments=True)
            assert r is not None and r.segments is None and r.checksum == ck  # still verified whole
            r.release()
    warned = [rec for rec in caplog.records if "segment sums that do not parse" in rec.getMessage()]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING
    assert frames.bad_segments_seen is not None  # what a worker of this process would report
    # An older server ignores the flag: no field, no segment sums, nothing to warn about.
    caplog.clear()
    forget(frames.BAD_SEGMENTS_ANNOUNCEMENT)
    rec.rewrite[Op.LOOKUP] = lambda reply: {k: v for k, v in reply.items() if k != "segments"}
    with caplog.at_level(logging.WARNING, logger="maru.client"):
        r = h.retrieve("k", segments=True)
    assert r is not None and r.segments is None and not caplog.records
    r.release()


def test_a_batch_with_large_sums_is_split_into_commits_the_server_takes(h: MaruHandler) -> None:
    """Sums of the largest size: a COMMIT carries at most SEGMENT_FRAME_BYTES of them."""
    rec = Recorder(h)
    per = 8 * MAX_SEGMENTS
    fit = SEGMENT_FRAME_BYTES // per
    n = fit + 3
    objs = h.batch_alloc([4096] * n)
    segs = [SegmentSums(1, tuple(range(i, i + MAX_SEGMENTS))) for i in range(n)]
    keys = [f"k{i}" for i in range(n)]
    results = h.batch_store(keys, objs, checksums=[s.checksum(4096) for s in segs], segments=segs)
    assert results == [CommitResult.STORED] * n
    assert [len(b["items"]) for b in rec.bodies(Op.COMMIT)] == [fit, 3]
    got = h.batch_retrieve(keys, pin=False, verify=False, segments=True)
    # The LOOKUP reply too carries at most SEGMENT_FRAME_BYTES of sums: the last hits get none.
    assert [r.segments for r in got] == segs[:fit] + [None] * 3  # type: ignore[union-attr]
    h.batch_release(got)


class _Obj:
    def __init__(self, alloc_id: int) -> None:
        self.alloc_id = alloc_id


def test_commit_bodies_split_by_items_and_bytes_and_omit_segments_where_none() -> None:
    def split(n: int, wires: list[Any] | None) -> list[dict[str, Any]]:
        keys = [f"k{i}" for i in range(n)]
        objs = [_Obj(i) for i in range(n)]
        out = list(frames.commit_bodies(keys, objs, [1] * n, wires))  # type: ignore[arg-type]
        assert [k for ks, _, _ in out for k in ks] == keys
        assert [it for _, _, b in out for it in b["items"]] == [[k, i] for i, k in enumerate(keys)]
        return [b for _, _, b in out]

    plain = split(MAX_BATCH + 1, None)
    assert [len(b["items"]) for b in plain] == [MAX_BATCH, 1] and not any("segments" in b for b in plain)
    small = [4, bytes(8)]
    many = split(MAX_SEGMENT_BATCH + 5, [small] * (MAX_SEGMENT_BATCH + 5))
    assert [len(b["segments"]) for b in many] == [MAX_SEGMENT_BATCH, 5]
    big = [1, bytes(SEGMENT_FRAME_BYTES // 2 + 8)]  # two do not fit in one body
    mixed = split(4, [big, big, None, None])
    assert [len(b["items"]) for b in mixed] == [1, 3]
    assert mixed[1]["segments"] == [big, None, None] and mixed[0]["checksums"] == [1]
    # A body whose objects have no sums sends no segments field.
    tail = split(MAX_SEGMENT_BATCH + 1, [small] * MAX_SEGMENT_BATCH + [None])
    assert "segments" in tail[0] and "segments" not in tail[1]
