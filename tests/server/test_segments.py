"""Segment sums (``maru.segments``) through a real server: COMMIT validates and keeps them, LOOKUP
answers them when asked, SQLite keeps them across restarts, and older state databases open."""

from __future__ import annotations

import mmap
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from maru import protocol as P
from maru.checksum import checksum
from maru.protocol import Op
from maru.segments import MAX_SEGMENTS, SegmentSums, host_segment_sums
from tests.helpers import RawClient, ServerProcess, map_pool

SHAPE = (2, 2, 37, 32)  # [L, KV, T, ROW]: 37 tokens, not a multiple of the segment size
SEG_TOKENS = 8
STATE_FILE = "maru-state.sqlite"


def random_object(seed: int) -> tuple[bytes, int, SegmentSums]:
    """A random float16 ``SHAPE`` object's bytes, its checksum and its real segment sums."""
    arr = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float16)
    seg = host_segment_sums(arr, SHAPE, arr.itemsize, SEG_TOKENS)
    data = arr.tobytes()
    assert len(seg.raws) == 5 and seg.consistent(checksum(data), len(data))
    return data, checksum(data), seg


def reserve(c: RawClient, sizes: list[int]) -> list[list[int]]:
    r = c.call(Op.RESERVE, sizes=sizes)
    assert r["ok"] and None not in r["allocs"], r
    return r["allocs"]


def refused(reply: dict[str, Any], code: P.ErrorCode = P.ErrorCode.BAD_REQUEST) -> str:
    assert reply["ok"] is False and reply["code"] == code.value, reply
    return reply["message"]


def store_with_segments(
    c: RawClient, pool: mmap.mmap, objs: dict[str, tuple[bytes, int, SegmentSums]]
) -> None:
    allocs = reserve(c, [len(d) for d, _, _ in objs.values()])
    for (data, _, _), (_, off, size) in zip(objs.values(), allocs, strict=True):
        pool[off : off + size] = data
    res = c.call(
        Op.COMMIT,
        items=[[k, a[0]] for k, a in zip(objs, allocs, strict=True)],
        checksums=[ck for _, ck, _ in objs.values()],
        segments=[seg.to_wire() for _, _, seg in objs.values()],
    )
    assert res["results"] == ["stored"] * len(objs), res


def test_segment_sums_round_trip_through_commit_and_lookup(maru_server: ServerProcess) -> None:
    pool = map_pool(maru_server.pool_path)
    with RawClient(maru_server.url) as c:
        c.handshake()
        objs = {"a": random_object(1), "b": random_object(2)}
        store_with_segments(c, pool, objs)
        # One without segment sums in the same pool: its LOOKUP entry says None.
        ((alloc_id, _, _),) = reserve(c, [100])
        plain = c.call(Op.COMMIT, items=[["plain", alloc_id]], checksums=[123])
        assert plain["results"] == ["stored"]

        look = c.call(Op.LOOKUP, keys=["a", "nope", "plain", "b"], pin=False, segments=True)
        assert look["ok"] and look["checksums"] == [objs["a"][1], None, 123, objs["b"][1]]
        got = look["segments"]
        assert got[1] is None and got[2] is None
        assert SegmentSums.from_wire(got[0]) == objs["a"][2] and SegmentSums.from_wire(got[3]) == objs["b"][2]
        assert got[0] == objs["a"][2].to_wire()

        pinned = c.call(Op.LOOKUP, keys=["b"], pin=True, segments=True)
        assert SegmentSums.from_wire(pinned["segments"][0]) == objs["b"][2]
        # Without the flag (or with false) the reply is what it always was: no such field.
        for extra in ({}, {"segments": False}):
            look = c.call(Op.LOOKUP, keys=["a", "b"], pin=False, **extra)
            assert look["ok"] and "segments" not in look and look["entries"][0] is not None
    pool.close()


def test_lookup_refuses_a_segments_flag_that_is_not_a_bool(maru_server: ServerProcess) -> None:
    with RawClient(maru_server.url) as c:
        for bad in (1, "yes", None, [True]):
            msg = refused(c.call(Op.LOOKUP, keys=["a"], pin=False, segments=bad))
            assert "segments must be true or false" in msg
        assert c.call(Op.LOOKUP, keys=["a"], pin=False, segments=True)["segments"] == [None]


def test_inconsistent_sums_refuse_the_whole_commit_and_leave_the_reservations(
    maru_server: ServerProcess,
) -> None:
    pool = map_pool(maru_server.pool_path)
    with RawClient(maru_server.url) as c:
        c.handshake()
        good, bad = random_object(3), random_object(4)
        allocs = reserve(c, [len(good[0]), len(bad[0])])
        for (data, _, _), (_, off, size) in zip((good, bad), allocs, strict=True):
            pool[off : off + size] = data
        wrong = SegmentSums(bad[2].tokens, (bad[2].raws[0] ^ 1, *bad[2].raws[1:]))
        items = [["good", allocs[0][0]], ["bad", allocs[1][0]]]
        msg = refused(
            c.call(
                Op.COMMIT,
                items=items,
                checksums=[good[1], bad[1]],
                segments=[good[2].to_wire(), wrong.to_wire()],
            )
        )
        assert (
            "'bad'" in msg
            and "the writer's sums are wrong" in msg
            and "nothing of this COMMIT was stored" in msg
        )
        assert c.call(Op.EXISTS, keys=["good", "bad"])["present"] == [False, False]
        assert c.call(Op.USAGE)["reservations"] == 2
        # The same reservations commit without segment sums (or with correct ones).
        res = c.call(Op.COMMIT, items=items, checksums=[good[1], bad[1]], segments=[good[2].to_wire(), None])
        assert res["results"] == ["stored", "stored"], res
        look = c.call(Op.LOOKUP, keys=["good", "bad"], pin=False, segments=True)
        assert SegmentSums.from_wire(look["segments"][0]) == good[2] and look["segments"][1] is None
        assert c.call(Op.USAGE)["reservations"] == 0
    pool.close()


def test_sums_on_an_unknown_alloc_id_are_not_checked_and_commit_as_unknown_alloc(
    maru_server: ServerProcess,
) -> None:
    with RawClient(maru_server.url) as c:
        c.handshake()
        res = c.call(Op.COMMIT, items=[["k", 12345]], checksums=[7], segments=[[4, bytes(8)]])
        assert res["ok"] and res["results"] == ["unknown_alloc"], res


def _bad_segments(n_items: int) -> list[tuple[Any, str]]:
    """``segments`` fields that must be refused, with a piece of the message that says why."""
    ok = [4, bytes(8)]
    return [
        ("not a list", "segments must be a list of one entry per item"),
        ({"0": ok}, "segments must be a list of one entry per item"),
        (5, "segments must be a list of one entry per item"),
        ([ok] * (n_items + 1), "segments must be a list of one entry per item"),
        ([], "segments must be a list of one entry per item"),
        ([[4, b"1234567"], None], "multiple of 8"),
        ([[4, b""], None], "multiple of 8"),
        ([[4, bytes(8 * (MAX_SEGMENTS + 1))], None], f"at most {MAX_SEGMENTS}"),
        ([[0, bytes(8)], None], "segment tokens"),
        ([[-3, bytes(8)], None], "segment tokens"),
        ([[True, bytes(8)], None], "segment tokens"),
        ([[4, "not bytes"], None], "multiple of 8"),
        ([[4], None], "[tokens: int, sums: bytes]"),
        ([[4, bytes(8), 1], None], "[tokens: int, sums: bytes]"),
        ([None, ok], "without a checksum"),  # the second item has no checksum
    ]


def test_malformed_segments_are_bad_requests_and_the_server_keeps_serving(maru_server: ServerProcess) -> None:
    with RawClient(maru_server.url) as c:
        c.handshake()
        allocs = reserve(c, [4096, 4096])
        items = [["x", allocs[0][0]], ["y", allocs[1][0]]]
        checksums = [5, None]
        for bad, why in _bad_segments(len(items)):
            msg = refused(c.call(Op.COMMIT, items=items, checksums=checksums, segments=bad))
            assert why in msg, (bad if not isinstance(bad, list) else [repr(x)[:40] for x in bad], msg)
            assert c.call(Op.EXISTS, keys=["x", "y"])["present"] == [False, False]
        stats = c.call(Op.STATS)
        assert stats["errors"]["bad_request"] == len(_bad_segments(len(items)))
        # Consistent sums for the 4096-byte x: total ^ size == checksum.
        seg = SegmentSums(4, (5 ^ 4096,))
        res = c.call(Op.COMMIT, items=items, checksums=checksums, segments=[seg.to_wire(), None])
        assert res["results"] == ["stored", "stored"], res


def test_a_lookup_reply_carries_at_most_its_budget_of_sums(maru_server: ServerProcess) -> None:
    """Hits past ``SEGMENT_FRAME_BYTES`` of sums get None, so the reply always fits in a frame."""
    per = 8 * MAX_SEGMENTS  # the largest sums an object may have
    fit = P.SEGMENT_FRAME_BYTES // per
    n = fit + 2
    with RawClient(maru_server.url, timeout_s=30) as c:
        c.handshake()
        allocs = reserve(c, [4096] * n)
        segs = [SegmentSums(1, tuple(range(i, i + MAX_SEGMENTS))) for i in range(n)]
        res = c.call(
            Op.COMMIT,
            items=[[f"k{i}", a[0]] for i, a in enumerate(allocs)],
            checksums=[s.checksum(4096) for s in segs],
            segments=[s.to_wire() for s in segs],
        )
        assert res["results"] == ["stored"] * n
        got = c.call(Op.LOOKUP, keys=[f"k{i}" for i in range(n)], pin=False, segments=True)["segments"]
        assert [g is not None for g in got] == [True] * fit + [False] * 2
        assert SegmentSums.from_wire(got[fit - 1]) == segs[fit - 1]


def test_segment_sums_survive_sigkill_and_restart(tmp_path: Path) -> None:
    with ServerProcess(tmp_path) as srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        objs = {"a": random_object(5), "b": random_object(6)}
        store_with_segments(c, pool, objs)
        pool.close()
        srv.kill()  # acknowledged means durable: no clean close to write anything more
        srv.start()
        look = c.call(Op.LOOKUP, keys=["a", "b"], pin=False, segments=True)
        assert [SegmentSums.from_wire(w) for w in look["segments"]] == [objs["a"][2], objs["b"][2]]
        assert look["checksums"] == [objs["a"][1], objs["b"][1]]
        srv.stop()
    db = sqlite3.connect(str(srv.state_dir / STATE_FILE))
    try:
        assert dict(db.execute("SELECT k, v FROM meta"))["schema_version"] == "3"
        blob = db.execute("SELECT segments FROM entries WHERE key = 'a'").fetchone()[0]
    finally:
        db.close()
    # Compact: 4 bytes of segment tokens, 8 a segment.
    assert blob == SEG_TOKENS.to_bytes(4, "little") + objs["a"][2].to_wire()[1]


# The schema-2 tables, as the server created them before segment sums.
SCHEMA_2 = (
    "CREATE TABLE meta (k TEXT PRIMARY KEY, v TEXT NOT NULL)",
    "CREATE TABLE entries (key TEXT PRIMARY KEY, offset INTEGER NOT NULL, "
    "size INTEGER NOT NULL, tick INTEGER NOT NULL, checksum INTEGER) WITHOUT ROWID",
)


def _rewrite_as_schema_2(state_file: Path) -> None:
    """Replace the (stopped) server's database by a schema-2 one holding the same meta and entries."""
    db = sqlite3.connect(str(state_file))
    meta = db.execute("SELECT k, v FROM meta").fetchall()
    rows = db.execute("SELECT key, offset, size, tick, checksum FROM entries").fetchall()
    db.close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{state_file}{suffix}").unlink(missing_ok=True)
    db = sqlite3.connect(str(state_file))
    for stmt in SCHEMA_2:
        db.execute(stmt)
    db.executemany(
        "INSERT INTO meta (k, v) VALUES (?, ?)", [(k, "2" if k == "schema_version" else v) for k, v in meta]
    )
    db.executemany("INSERT INTO entries VALUES (?, ?, ?, ?, ?)", rows)
    db.commit()
    db.close()


def test_a_schema_2_database_opens_with_its_entries_and_no_segment_sums(tmp_path: Path) -> None:
    with ServerProcess(tmp_path) as srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        old = random_object(7)
        store_with_segments(c, pool, {"old": old})
        srv.stop()
        _rewrite_as_schema_2(srv.state_dir / STATE_FILE)
        srv.start()
        look = c.call(Op.LOOKUP, keys=["old"], pin=False, segments=True)
        assert look["entries"][0] is not None and look["checksums"] == [old[1]]
        assert look["segments"] == [None]  # verified whole from now on
        assert "schema 2" in srv.log()
        # The migrated database takes new entries with sums, and keeps them.
        c.handshake()
        new = random_object(8)
        store_with_segments(c, pool, {"new": new})
        pool.close()
        srv.kill()
        srv.start()
        look = c.call(Op.LOOKUP, keys=["old", "new"], pin=False, segments=True)
        assert look["segments"][0] is None and SegmentSums.from_wire(look["segments"][1]) == new[2]


@pytest.mark.parametrize(
    "blob",
    [
        b"\x01",  # shorter than the tokens field
        bytes(4) + bytes(8),  # tokens 0
        (8).to_bytes(4, "little") + b"12345",  # not whole sums
        (8).to_bytes(4, "little") + bytes(16),  # decodes, but does not add up to the checksum
        "text, not a blob",
    ],
)
def test_an_unreadable_segments_blob_loads_as_none_and_the_server_starts(tmp_path: Path, blob: Any) -> None:
    with ServerProcess(tmp_path) as srv, RawClient(srv.url) as c:
        c.handshake()
        pool = map_pool(srv.pool_path)
        a, b = random_object(9), random_object(10)
        store_with_segments(c, pool, {"a": a, "b": b})
        pool.close()
        srv.stop()
        db = sqlite3.connect(str(srv.state_dir / STATE_FILE))
        db.execute("UPDATE entries SET segments = ? WHERE key = 'a'", (blob,))
        db.commit()
        db.close()
        srv.start()
        look = c.call(Op.LOOKUP, keys=["a", "b"], pin=False, segments=True)
        assert look["entries"][0] is not None and look["checksums"] == [a[1], b[1]]
        assert look["segments"][0] is None and SegmentSums.from_wire(look["segments"][1]) == b[2]
        assert srv.log().count("unreadable or do not add up") == 1
