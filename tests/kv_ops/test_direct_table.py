"""``kv_ops.direct_table``: the direct layer load's table, compiled (``maru.native``) or numpy.

The compiled table must be the numpy definition's, byte for byte, over whatever the buffer held
before (a row one writes and the other leaves would differ); a bad call is refused before anything
is written; and a process without the compiled table says so once and builds the same table.
"""

from __future__ import annotations

import ctypes
import logging

import numpy as np
import pytest
import torch

from maru import native
from maru.announce import forget
from maru.kv_ops import direct_table as dt

ROW, ESIZE = 24, 2

CASES = [
    [256, 256, 100],  # whole chunks and a tail: per-object addresses
    [256] * 64,
    [8, 3],
    [5],
    [16, 32, 16],  # per token
    [16, 16, 20],  # a last object longer than the first: per token
    [3, 0, 7],  # an empty object
    [1] * 17,
    [],
]


def _compiled_or_skip() -> None:
    if dt._compiled() is None:
        pytest.skip(f"no compiled table here: {dt.table_way()}")


def _inputs(lengths: list[int], seed: int) -> tuple[list[int], np.ndarray, np.ndarray, int]:
    rng = np.random.default_rng(seed)
    total = sum(lengths)
    ptrs = [int(p) for p in rng.integers(1 << 30, 1 << 46, len(lengths))]
    slots = rng.integers(-2, 1 << 22, total).astype(np.int64)
    prefill = rng.integers(0, 1 << 64, len(lengths), dtype=np.uint64)
    return ptrs, slots, prefill, total + int(rng.integers(0, 40))


@pytest.mark.parametrize("lengths", CASES, ids=lambda c: f"{len(c)}x{c[:2]}")
@pytest.mark.parametrize("with_prefill", [False, True])
def test_the_compiled_table_is_the_numpy_one_byte_for_byte(lengths: list[int], with_prefill: bool) -> None:
    _compiled_or_skip()
    ptrs, slots, prefill, width = _inputs(lengths, 11 + len(lengths))
    pf = prefill if with_prefill else None
    words = dt.DIRECT_ROWS * (width + 1) + 13  # a scratch buffer longer than the table
    garbage = torch.from_numpy(np.random.default_rng(5).integers(-(1 << 62), 1 << 62, words))
    want, got = garbage.clone(), garbage.clone()
    dt._table_numpy(ptrs, lengths, slots, ROW, ESIZE, width, out=want, prefill=pf)
    tab = dt.direct_table_spans(ptrs, lengths, slots, ROW, ESIZE, width, out=got, prefill=pf)
    assert torch.equal(got, want)
    assert tab.shape == (dt.DIRECT_ROWS, width + 1) and tab.data_ptr() == got.data_ptr()
    # The slots as a tensor (what a caller without direct_host_slots passes): the same table.
    again = garbage.clone()
    dt.direct_table_spans(ptrs, lengths, torch.from_numpy(slots), ROW, ESIZE, width, out=again, prefill=pf)
    assert torch.equal(again, want)
    fresh = dt.direct_table_spans(ptrs, lengths, slots, ROW, ESIZE, width, prefill=pf)  # a table of its own
    assert fresh.dtype == torch.int64 and torch.equal(fresh[2], tab[2])


def test_odd_slot_arrays_take_the_numpy_way_with_the_same_table() -> None:
    lengths = [256, 256, 100]
    ptrs, slots, prefill, width = _inputs(lengths, 3)
    strided = np.repeat(slots, 2)[::2]  # the same values, not contiguous
    assert not strided.flags.c_contiguous
    a = dt.direct_table_spans(ptrs, lengths, strided, ROW, ESIZE, width, prefill=prefill)
    b = dt._table_numpy(ptrs, lengths, slots, ROW, ESIZE, width, prefill=prefill)
    assert torch.equal(a[2], b[2]) and torch.equal(a[:2, :3], b[:2, :3]) and torch.equal(a[5, :3], b[5, :3])
    int32 = slots.astype(np.int32)  # another dtype: numpy's way too
    c = dt.direct_table_spans(ptrs, lengths, int32, ROW, ESIZE, width, prefill=prefill)
    assert torch.equal(c[2], b[2])


@pytest.mark.parametrize("way", ["compiled", "numpy"])
def test_bad_calls_are_refused_and_write_nothing(way: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if way == "compiled":
        _compiled_or_skip()
    else:
        monkeypatch.setattr(dt, "_state", (None, "a test said so", "none"))
    lengths = [8, 8, 5]
    ptrs, slots, prefill, width = _inputs(lengths, 9)
    buf = torch.full((dt.DIRECT_ROWS * (width + 1),), 7, dtype=torch.int64)
    with pytest.raises(ValueError, match="width"):
        dt.direct_table_spans(ptrs, lengths, slots, ROW, ESIZE, len(slots) - 1, out=buf)
    with pytest.raises(ValueError, match="hold 22 tokens"):
        dt.direct_table_spans(ptrs, [8, 8, 6], slots, ROW, ESIZE, width, out=buf)
    with pytest.raises(ValueError, match="addresses for"):
        dt.direct_table_spans(ptrs[:-1], lengths, slots, ROW, ESIZE, width, out=buf)
    with pytest.raises(ValueError):  # lengths that add up, one negative: never a write past the table
        dt.direct_table_spans(ptrs, [8, 20, -7], slots, ROW, ESIZE, width, out=buf)
    assert (buf == 7).all()
    if way == "compiled":
        with pytest.raises(ValueError, match="int64"):  # an int32 buffer would be overrun
            dt.direct_table_spans(ptrs, lengths, slots, ROW, ESIZE, width, out=buf.to(torch.int32))
        with pytest.raises(RuntimeError):  # too short for the table: torch refuses the view
            dt.direct_table_spans(ptrs, lengths, slots, ROW, ESIZE, width, out=buf[:10])


def test_the_self_check_refuses_a_table_that_differs() -> None:
    _compiled_or_skip()
    good = native.load().direct_table
    assert good is not None and dt.self_check(good) is None

    def one_slot_off(out, width, slots, total, ptrs, lengths, n, row, esize, prefill):  # noqa: ANN001, ANN202
        rc = good(out, width, slots, total, ptrs, lengths, n, row, esize, prefill)
        if rc == 0 and total:
            ctypes.c_int64.from_address(out + 8 * 2 * (width + 1)).value += 1  # the first token's slot
        return rc

    assert dt.self_check(one_slot_off) is not None
    assert dt.self_check(lambda *args: 0) is not None  # says it wrote, wrote nothing
    assert dt.self_check(lambda *args: -1) is not None


def test_without_the_compiled_table_numpy_builds_it_and_says_why_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(native, "_loaded", native.Native(None, "a test said so"))
    monkeypatch.setattr(dt, "_state", None)
    forget("kv_ops.direct-table-numpy")
    lengths = [256, 256, 100]
    ptrs, slots, prefill, width = _inputs(lengths, 4)
    with caplog.at_level(logging.WARNING, logger="maru.kv_ops"):
        a = dt.direct_table_spans(ptrs, lengths, slots, ROW, ESIZE, width, prefill=prefill)
        b = dt.direct_table_spans(ptrs, lengths, slots, ROW, ESIZE, width, prefill=prefill)
    said = [r.getMessage() for r in caplog.records if "table is built with numpy" in r.getMessage()]
    assert len(said) == 1 and "a test said so" in said[0] and "Fix: " + native.FIX in said[0]
    assert dt.table_way() == "numpy (a test said so)"
    note = dt.table_note()
    assert note is not None and "a test said so" in note and native.FIX in note
    want = dt._table_numpy(ptrs, lengths, slots, ROW, ESIZE, width, prefill=prefill)
    assert torch.equal(a[2], want[2]) and torch.equal(b[:2, :3], want[:2, :3])


def test_a_process_with_the_compiled_table_reports_no_slower_way() -> None:
    _compiled_or_skip()
    assert dt.table_way() == "compiled" and dt.table_note() is None


def test_maru_doctor_says_which_way_the_table_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    from maru.cli.doctor import OK, WARN, DoctorContext, check_checksum

    ctx = DoctorContext(url="tcp://127.0.0.1:9")
    if native.load().words_sum is not None and dt._compiled() is not None:
        ok = check_checksum(ctx)
        assert ok.status == OK and "the direct layer table too" in ok.detail
    # The checksum compiled, the table refused (its self-check failed): said, with the fix.
    monkeypatch.setattr(native, "_loaded", native.Native(lambda a, b, e: 0, library="/x/lib.so"))
    monkeypatch.setattr(dt, "_state", (None, "the compiled table /x/lib.so disagrees", "report it"))
    warn = check_checksum(ctx)
    assert warn.status == WARN and "table is built with numpy" in warn.detail and "disagrees" in warn.detail
    assert warn.fix == "report it"
    # No library at all: the checksum's warning names the table too.
    monkeypatch.setattr(native, "_loaded", native.Native(None, "a test said so"))
    none = check_checksum(ctx)
    assert none.status == WARN and "table" in none.detail and "a test said so" in none.detail
