"""maru.segments: segment sums split the checksum exactly; partial reads vouch for what they place."""

from __future__ import annotations

import numpy as np
import pytest

from maru import segments as sg
from maru.checksum import MASK64, checksum, reference_checksum

SHAPE = (3, 2, 13, 12)  # L, KV, T (not a multiple of the segment), ROW (fp16: 24 bytes, 3 words)
TOKEN_BYTES = 3 * 2 * 12 * 2  # one token of every layer and plane


def _obj(seed: int, shape: tuple[int, ...] = SHAPE) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 16, size=shape, dtype=np.uint16)


@pytest.mark.parametrize("seg", [1, 3, 4, 13, 20])
def test_segment_sums_add_up_to_the_checksum(seg: int) -> None:
    obj = _obj(seg)
    sums = sg.host_segment_sums(obj, obj.shape, 2, seg)
    assert len(sums.raws) == -(-SHAPE[2] // seg)
    assert sums.fits(SHAPE[2]) and not sums.fits(SHAPE[2] + seg)
    assert sums.checksum(obj.nbytes) == checksum(obj) == reference_checksum(obj.tobytes())
    assert sums.consistent(checksum(obj), obj.nbytes)
    assert not sums.consistent(checksum(obj) ^ 1, obj.nbytes)


def test_a_segment_sum_covers_its_tokens_in_every_layer_and_plane() -> None:
    obj = _obj(1)
    before = sg.host_segment_sums(obj, obj.shape, 2, 4)
    obj[2, 1, 5, 7] ^= 1  # token 5: segment 1, last layer, V plane
    after = sg.host_segment_sums(obj, obj.shape, 2, 4)
    changed = [i for i, (a, b) in enumerate(zip(before.raws, after.raws, strict=True)) if a != b]
    assert changed == [1]


def test_wire_form_round_trips_and_bad_values_are_refused_with_what_is_wrong() -> None:
    sums = sg.host_segment_sums(_obj(2), SHAPE, 2, 4)
    assert sg.SegmentSums.from_wire(sums.to_wire()) == sums
    with pytest.raises(ValueError, match="tokens"):
        sg.SegmentSums.from_wire([0, b"\0" * 8])
    with pytest.raises(ValueError, match="multiple of 8"):
        sg.SegmentSums.from_wire([4, b"\0" * 7])
    with pytest.raises(ValueError, match="at most"):
        sg.SegmentSums.from_wire([4, b"\0" * 8 * (sg.MAX_SEGMENTS + 1)])
    with pytest.raises(ValueError, match="tokens: int"):
        sg.SegmentSums.from_wire({"tokens": 4})
    with pytest.raises(ValueError, match="unsigned 64-bit"):
        sg.SegmentSums(4, (1 << 64,))
    with pytest.raises(ValueError, match="tokens"):
        sg.SegmentSums.from_wire([True, b"\0" * 8])  # a bool is not a token count
    # Parsed without the per-sum check: the same value (and hash) as one built with it.
    top = sg.SegmentSums(16, ((1 << 64) - 1, 0, 12345))
    back = sg.SegmentSums.from_wire(top.to_wire())
    assert back == top and hash(back) == hash(top) and back.raws == top.raws
    assert all(type(r) is int for r in back.raws)


def test_segment_tokens_start_at_the_block_size_and_bound_the_count() -> None:
    assert sg.segment_tokens(16, 256) == 16
    assert sg.segment_tokens(16, 16384) == 16384 // sg.TARGET_SEGMENTS
    assert -(-1000 // sg.segment_tokens(3, 1000)) <= sg.TARGET_SEGMENTS


def test_mark_unread_leaves_whole_unwritten_segments_unread_and_prefills_their_sums() -> None:
    a, b = _obj(3), _obj(4, (3, 2, 7, 12))
    segs = [sg.host_segment_sums(a, a.shape, 2, 4), sg.host_segment_sums(b, b.shape, 2, 4)]
    slots = np.arange(20, dtype=np.int64)
    slots[:9] = -1  # object a: tokens 0..8 skipped: segments 0 and 1 unread, segment 2 read (token 8 too)
    prefill, unread = sg.mark_unread(slots, [13, 7], segs)
    assert unread == 8
    assert (slots[:8] == -2).all() and slots[8] == -1 and (slots[9:] >= 0).all()
    assert prefill is not None and int(prefill[0]) == (segs[0].raws[0] + segs[0].raws[1]) & MASK64
    assert int(prefill[1]) == 0
    # A gap at the end too (the general path): segments 0 and 3 unread, 1 and 2 read.
    tail = np.arange(13, dtype=np.int64)
    tail[:4] = -1
    tail[11:] = -1
    prefill, unread = sg.mark_unread(tail, [13], segs[:1])
    assert unread == 5 and (tail[:4] == -2).all() and (tail[12:] == -2).all() and tail[11] == -1
    assert prefill is not None and int(prefill[0]) == (segs[0].raws[0] + segs[0].raws[3]) & MASK64
    untouched = np.arange(20, dtype=np.int64)
    assert sg.mark_unread(untouched, [13, 7], segs) == (None, 0)
    # Sums of another segmentation (they do not fit the object) are not used.
    other = sg.host_segment_sums(a, a.shape, 2, 5)
    again = np.arange(13, dtype=np.int64)
    again[:9] = -1
    assert sg.mark_unread(again, [13], [other.__class__(5, other.raws + (0,))]) == (None, 0)


@pytest.mark.parametrize("seed", range(6))
def test_mark_unread_of_many_objects_equals_each_object_planned_alone(seed: int) -> None:
    """Many objects in one mapping plan as each object alone: every object's tokens found at
    its own offset. Random lengths (empty objects and tails included), skipped prefixes, gaps at
    the end, objects without sums."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(9, 40))
    lengths = [int(x) for x in rng.choice([0, 5, 13, 16, 16, 16], size=n)]
    segs = [
        None
        if not t or rng.random() < 0.2
        else sg.SegmentSums(4, tuple(int(v) for v in rng.integers(0, 1 << 62, -(-t // 4))))
        for t in lengths
    ]
    slots = np.arange(sum(lengths), dtype=np.int64)
    start = 0
    for t in lengths:
        if t and rng.random() < 0.4:
            slots[start : start + int(rng.integers(1, t + 1))] = -1  # a skipped prefix
        if t and rng.random() < 0.2:
            slots[start + int(rng.integers(0, t)) : start + t] = -1  # a gap at the end
        start += t
    want_slots, want_prefill, want_unread = slots.copy(), np.zeros(n, dtype=np.uint64), 0
    start = 0
    for k, t in enumerate(lengths):
        part = want_slots[start : start + t]  # a view: marked in place
        prefill, unread = sg.mark_unread(part, [t], [segs[k]])
        want_unread += unread
        if prefill is not None:
            want_prefill[k] = prefill[0]
        start += t
    prefill, unread = sg.mark_unread(slots, lengths, segs)
    assert unread == want_unread
    assert (slots == want_slots).all()
    got = np.zeros(n, dtype=np.uint64) if prefill is None else prefill
    assert (got == want_prefill).all()
    assert (unread > 0) == (prefill is not None)


def _segments_with_a_written_token(written: np.ndarray, seg: int) -> set[int]:
    return {j // seg for j in np.flatnonzero(written).tolist()}


@pytest.mark.parametrize("seed", range(8))
def test_mark_unread_against_a_brute_force_reference(seed: int) -> None:
    """One written run an object (the connector's shape: a skipped prefix, a hit ending inside the
    chunk): exactly the segments holding no written token are unread, at their committed sums.
    With holes inside the run: never a segment holding a written token, and those outside the
    run still. Tokens and segments of every size, the last segment shorter."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(40):
        tokens, seg = int(rng.integers(1, 70)), int(rng.integers(1, 12))
        segs = sg.SegmentSums(seg, tuple(int(v) for v in rng.integers(0, 1 << 62, -(-tokens // seg))))
        written = np.zeros(tokens, dtype=bool)
        a = int(rng.integers(0, tokens + 1))
        b = int(rng.integers(a, tokens + 1))
        written[a:b] = True
        holes = rng.random() < 0.3 and b - a > 2
        if holes:
            written[a + 1 : b - 1] &= rng.random(b - a - 2) < 0.5
        slots = np.where(written, np.arange(tokens) + 1000, -1).astype(np.int64)
        before = slots.copy()
        prefill, unread = sg.mark_unread(slots, [tokens], [segs])
        unread_segs = {j // seg for j in np.flatnonzero(slots == -2).tolist()}
        keep = _segments_with_a_written_token(written, seg)
        assert not unread_segs & keep  # a segment with a written token is always read
        assert (slots[written] == before[written]).all() and set(np.unique(slots[~written])) <= {-1, -2}
        outside = set(range(-(-tokens // seg))) - set(range((a if b > a else tokens) // seg, -(-b // seg)))
        if b == a:  # nothing written: every segment unread
            outside = set(range(-(-tokens // seg)))
        want = outside if holes else set(range(-(-tokens // seg))) - keep
        if not (written[0] and written[-1]):  # only partly written objects are looked at
            assert unread_segs == want
        else:
            assert unread_segs == set()
        # Whole segments only, counted right, at their committed sums.
        assert all((slots[j * seg : (j + 1) * seg] == -2).all() for j in unread_segs)
        assert unread == int((slots == -2).sum())
        if unread_segs:
            assert prefill is not None and int(prefill[0]) == segs.raw_of(sorted(unread_segs))
        else:
            assert prefill is None


def test_a_partial_host_read_vouches_for_the_bytes_it_places_only() -> None:
    obj = _obj(5)
    segs = sg.host_segment_sums(obj, obj.shape, 2, 4)
    written = np.ones(SHAPE[2], dtype=bool)
    written[:6] = False  # segment 0 unread; segment 1 read (tokens 6, 7 placed)
    assert sg.host_checksum(obj, obj.shape, 2, written, segs) == (checksum(obj), 4 * TOKEN_BYTES)
    unread_poke = obj.copy()
    unread_poke[1, 0, 2, 3] ^= 0x40  # token 2: a segment nobody places
    assert sg.host_checksum(unread_poke, obj.shape, 2, written, segs) == (checksum(obj), 4 * TOKEN_BYTES)
    read_poke = obj.copy()
    read_poke[0, 1, 5, 0] ^= 0x40  # token 5: not placed, but in segment 1, which is read
    assert sg.host_checksum(read_poke, obj.shape, 2, written, segs)[0] != checksum(obj)
    # Without segment sums: the whole object, so the unread poke is caught too.
    assert sg.host_checksum(unread_poke, obj.shape, 2, written, None) == (checksum(unread_poke), 0)


def test_pieces_refuse_rows_that_are_not_whole_words() -> None:
    with pytest.raises(ValueError, match="whole 8-byte words"):
        sg.pieces((1, 2, 4, 3), 2, 2)


def test_a_partial_read_large_enough_for_threads_reads_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces are read on the calling thread; from ``PARALLEL_BYTES`` a whole read is split over
    threads and faster, so it is taken (and vouches for everything, unread poke included)."""
    import maru.checksum as mc

    obj = _obj(6)
    segs = sg.host_segment_sums(obj, obj.shape, 2, 4)
    written = np.ones(SHAPE[2], dtype=bool)
    written[:6] = False
    poked = obj.copy()
    poked[1, 0, 2, 3] ^= 0x40  # unread by a partial read
    assert sg.host_checksum(poked, obj.shape, 2, written, segs) == (checksum(obj), 4 * TOKEN_BYTES)
    monkeypatch.setattr(mc, "PARALLEL_BYTES", 64)
    monkeypatch.setattr(mc, "_threads", lambda: 2)
    assert sg.host_checksum(poked, obj.shape, 2, written, segs) == (checksum(poked), 0)


@pytest.mark.parametrize("seed", range(4))
def test_the_objects_a_partial_read_can_apply_to_are_found_as_object_by_object(seed: int) -> None:
    """``_partly_written`` (array operations) against a loop over the objects: each non-empty object
    whose first or last token is not written, in order; empty objects anywhere, the last included."""
    rng = np.random.default_rng(100 + seed)
    for _ in range(200):
        lengths = [int(x) for x in rng.choice([0, 1, 4, 13, 16], size=int(rng.integers(1, 12)))]
        total = sum(lengths)
        slots = rng.integers(0, 1000, size=total).astype(np.int64)
        slots[rng.random(total) < 0.2] = -1
        want, start = [], 0
        for k, t in enumerate(lengths):
            if t and (slots[start] < 0 or slots[start + t - 1] < 0):
                want.append((k, start, start + t))
            start += t
        assert sg._partly_written(slots, lengths) == want


@pytest.mark.parametrize("seg", [1, 4, 5, 13, 20])
def test_the_compiled_segment_sums_equal_the_piecewise_ones(
    seg: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One compiled call for every segment (``native.segment_sums``) against the loop over the
    pieces (the path without it), whole and with only some segments read; a mask too short and an
    object too small for its shape are refused, not read past."""
    import dataclasses

    from maru import checksum as checksum_module
    from maru import native

    obj = _obj(30 + seg, (4, 2, 13, 12))
    n = -(-13 // seg)
    only = np.random.default_rng(seg).random(n) < 0.5
    compiled = [
        sg.host_segment_sums(obj, obj.shape, 2, seg),
        sg.host_segment_sums(obj, obj.shape, 2, seg, only),
    ]
    nat = native.load()
    assert nat.segment_sums is not None
    monkeypatch.setattr(checksum_module, "_native", lambda: dataclasses.replace(nat, segment_sums=None))
    pieces = [
        sg.host_segment_sums(obj, obj.shape, 2, seg),
        sg.host_segment_sums(obj, obj.shape, 2, seg, only),
    ]
    assert compiled == pieces
    assert all(r == 0 for r, keep in zip(compiled[1].raws, only, strict=True) if not keep)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="segment flags"):
        sg.host_segment_sums(obj, obj.shape, 2, seg, only[:-1] if n > 1 else np.zeros(0, dtype=bool))
    with pytest.raises(ValueError, match="needs more"):
        sg.host_segment_sums(obj[:3], obj.shape, 2, seg)
