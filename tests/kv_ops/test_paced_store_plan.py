"""Which way a staged store is queued (``PacedStores._raw_plan``), decided on the host.

The libcudart way needs, for every chunk of the store, a slot whose graph placer has raw graph
executables for the chunk's size; this checks which slot and graphs each chunk gets (the paced
lane's one slot and its chunk graph, the ring's slots from its next one on with a gather and a
checksum graph each), and that every reason to go the torch way is named once. No CUDA here: slots, placers and the sync are stand-ins (the GPU tests queue real stores).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from maru.announce import forget
from maru.kv_ops.paced_store import PacedStores, StoreLane


class _Placer:
    def __init__(self, captured: set[int], full_after: int = 99) -> None:
        self.captured, self.full_after, self.asked = captured, full_after, []

    def raw_exec(self, key: tuple, *, capture: bool) -> int:
        op, t, _ = key
        if t not in self.captured and not capture:
            return 0
        if len(self.captured | {t}) > self.full_after:
            raise ValueError("full")
        self.asked.append(key)
        return {"gather": 1000, "checksum": 2000, "paced-chunk": 4000}[op] + t

    def staging(self, t: int) -> torch.Tensor:
        return torch.zeros(t)

    def warm_pause(self) -> None:
        self.asked.append(("pause", 0, None))  # the real placer captures it once, on the paced lane

    def sum_address(self, t: int) -> int:
        return 3000 + t


class _Slot:
    def __init__(self, name: str, placer: Any) -> None:
        self.name, self.placer = name, placer


class _Pipe(PacedStores):
    esize = 2

    def __init__(self, ring: list[_Slot], *, lazy: bool = False, raw: bool = True) -> None:
        self._sync = type("S", (), {"raw": raw})()
        self._ring, self.ring_slots, self._next_slot = ring, len(ring), 1
        self.lazy_capture = lazy


def _objs(*tokens: int) -> list[torch.Tensor]:
    return [torch.zeros(2, 2, t, 4) for t in tokens]


SLOTS = torch.zeros(10, dtype=torch.int64)


def test_the_ring_lane_takes_slots_from_the_next_one_on_and_the_paced_lane_its_one_slot() -> None:
    ring = [_Slot(f"r{i}", _Placer({64})) for i in range(3)]
    pipe = _Pipe(ring)
    plan = pipe._raw_plan(
        StoreLane(None, None, (), paced=False, path="pipelined"), _objs(64, 64, 64, 64), SLOTS, True
    )
    assert plan is not None
    assert [c.slot.name for c in plan] == ["r1", "r2", "r0", "r1"]
    first = plan[0]
    assert (first.gather, first.checksum, first.tokens, first.nbytes, first.sum_at) == (
        1064,
        2064,
        64,
        2048,
        3064,
    )
    own = (_Slot("p0", _Placer({64})),)
    lane = StoreLane(None, None, own, paced=True, path="paced")
    # The paced lane's one graph a chunk gathers and sums (checksum 0: no graph of its own), with
    # checksums asked for or not (the sums then stay on the device).
    for checksums in (False, True):
        plan = pipe._raw_plan(lane, _objs(64, 64, 64), SLOTS, checksums)
        assert plan is not None and [c.slot.name for c in plan] == ["p0", "p0", "p0"]
        assert [(c.gather, c.checksum) for c in plan] == [(4064, 0)] * 3


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("eager", "eager placement"),
        ("slots", "a non-contiguous slot mapping"),
    ],
)
def test_every_reason_for_the_torch_way_is_named_once(
    case: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    forget("kv_ops.store-torch-way")
    placer = None if case == "eager" else _Placer({64}, full_after=1 if case == "full" else 99)
    own = (_Slot("p0", placer),)
    pipe = _Pipe([], lazy=case == "full")  # not lazy: nothing is captured here
    slots = torch.zeros(20, dtype=torch.int64)[::2] if case == "slots" else SLOTS
    lane = StoreLane(None, None, own, paced=True, path="paced")
    with caplog.at_level(logging.INFO, logger="maru.kv_ops"):
        assert pipe._raw_plan(lane, _objs(64, 40), slots, True) is None
        assert pipe._raw_plan(lane, _objs(64, 40), slots, True) is None
    said = [r.getMessage() for r in caplog.records if "queued through torch" in r.getMessage()]
    assert len(said) == 1 and why in said[0]
    # The way is remembered once, without sizes: tails of other lengths add no new way.
    [way] = pipe.store_ways
    assert way.startswith("torch (") and why in way and "40" not in way
    assert pipe._raw_plan(lane, _objs(64, 16), slots, True) is None
    assert pipe.store_ways == {way}


@pytest.mark.parametrize(
    ("case", "why"),
    [
        ("not warmed", "no raw graph for a chunk size not warmed at start"),
        ("full", "no graph bucket left for a chunk size"),
    ],
)
def test_a_chunk_without_raw_graphs_alone_goes_the_torch_way_in_its_turn(
    case: str, why: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A prompt's partial tail (40 tokens here) in a store of full chunks: only it goes through
    torch; the full chunks keep libcudart, each in the lane's slot in turn."""
    forget("kv_ops.store-torch-way")
    placer = _Placer({64}, full_after=1 if case == "full" else 99)
    own = (_Slot("p0", placer),)
    pipe = _Pipe([], lazy=case == "full")
    lane = StoreLane(None, None, own, paced=True, path="paced")
    with caplog.at_level(logging.INFO, logger="maru.kv_ops"):
        plan = pipe._raw_plan(lane, _objs(64, 40, 64), SLOTS, True)
        assert plan is not None
        assert [(c.slot.name, c.tokens, c.gather != 0) for c in plan] == [
            ("p0", 64, True),
            ("p0", 40, False),
            ("p0", 64, True),
        ]
        assert plan[1].nbytes == 2 * 2 * 40 * 4 * 2  # its bytes still known (the torch copy's size)
        pipe._raw_plan(lane, _objs(64, 40), SLOTS, True)
    said = [r.getMessage() for r in caplog.records if "queued through torch" in r.getMessage()]
    assert len(said) == 1 and why in said[0]
    assert pipe.store_ways == {"libcudart", next(w for w in pipe.store_ways if w.startswith("torch ("))}
    # A store of tails only: nothing for libcudart, the whole store the torch way.
    assert pipe._raw_plan(lane, _objs(40, 16), SLOTS, True) is None


def test_without_libcudart_nothing_is_planned_or_announced_here(caplog: pytest.LogCaptureFixture) -> None:
    forget("kv_ops.store-torch-way")
    pipe = _Pipe([_Slot("r0", _Placer({64}))], raw=False)
    with caplog.at_level(logging.INFO, logger="maru.kv_ops"):
        assert (
            pipe._raw_plan(StoreLane(None, None, (), paced=False, path="pipelined"), _objs(64), SLOTS, True)
            is None
        )
    assert not [r for r in caplog.records if "queued through torch" in r.getMessage()]


def test_tail_sizes_are_the_block_multiples_below_the_chunk_or_none() -> None:
    from maru.kv_ops.paced_store import MAX_TAIL_SIZES, tail_sizes

    assert tail_sizes(256, 16) == [16 * m for m in range(1, 16)]
    assert tail_sizes(64, 64) == []  # a chunk of one block has no partial tail
    assert tail_sizes(256, 24) == []  # the block does not divide the chunk: tails are not warmed
    assert tail_sizes(256, 0) == []
    # More sizes than MAX_TAIL_SIZES (a block of 1 token): none warmed (the torch way, said).
    assert tail_sizes(MAX_TAIL_SIZES + 1, 1) == list(range(1, MAX_TAIL_SIZES + 1))
    assert tail_sizes(MAX_TAIL_SIZES + 2, 1) == []


def test_a_refused_tail_capture_keeps_the_smaller_tails_and_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A slot's warm-up (``_warm_slot``): one shared staging, the chunk size, then each tail size
    (the gather that sums on the paced lane; scatter, gather, checksum and the fused scatter
    where asked for on the ring). CUDA refusing one tail size's capture: the sizes before
    it stay, the rest go the old way, said once at warning with the size and the reason, and
    named for ``maru doctor`` (``tails_unwarmed``); the warm-up goes on."""

    class Placer:
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def share_staging(self, t: int) -> None:
            self.calls.append(("share", t))

        def warm(self, t: int, *, checksum: bool, fused: bool = False) -> None:
            if t == 48:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.calls.append(("warm", t, checksum, fused))

        def warm_gather(self, t: int) -> None:
            if t == 48:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.calls.append(("gather", t))

    class Sync:
        cleared = 0

        def clear_error(self) -> None:
            Sync.cleared += 1

    stores = PacedStores()
    stores._sync = Sync()
    stores.fuse_checksums = True  # type: ignore[attr-defined]
    lane, ring = Placer(), Placer()
    forget("kv_ops.tail-graphs")
    with caplog.at_level(logging.WARNING, logger="maru.kv_ops"):
        stores._warm_slot(lane, 64, [16, 32, 48], loads=False)
        stores._warm_slot(ring, 64, [16, 32, 48], loads=True)
    assert lane.calls == [("share", 64), ("gather", 64), ("gather", 16), ("gather", 32)]
    assert ring.calls == [
        ("share", 64),
        ("warm", 64, True, True),
        ("warm", 16, True, True),
        ("warm", 32, True, True),
    ]
    assert Sync.cleared == 2
    msgs = [r.getMessage() for r in caplog.records if "partial tail" in r.getMessage()]
    assert len(msgs) == 1 and "48-token" in msgs[0] and "stream is capturing" in msgs[0]
    assert (
        stores.tails_unwarmed is not None
        and "48-token" in stores.tails_unwarmed
        and "Fix:" in stores.tails_unwarmed
    )


class _LaneSync:
    """A raw sync stand-in: logs the paced lane's graph launches and copies into ``calls``, in
    order; any other call fails the test (the lane makes no other per-chunk call)."""

    raw = True

    def __init__(self, calls: list[tuple]) -> None:
        self.calls = calls

    def launch_graph(self, exe: int, stream: int) -> None:
        self.calls.append(("graph", exe, stream))

    def copy(self, dst: int, src: int, n: int, stream: int, kind: int) -> None:
        self.calls.append(("copy", dst, src, n, stream, kind))

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the paced lane called sync.{name}")


def test_the_paced_lane_queues_two_calls_a_chunk_on_its_one_stream_in_stream_order() -> None:
    """``_queue_chunks_serial`` on stand-ins: the store's start (its whole slot mapping into the
    lane's state, the state and its sums zeroed), then per raw chunk its graph and its copy to the
    pool, all on the lane's one stream, no event. A chunk without a graph goes the torch way in
    its turn, with its own stretch of the mapping and its index, and moves the state past it."""
    from types import SimpleNamespace

    from maru.kv_ops.cuda_sync import D2H
    from maru.kv_ops.paced_store import RawChunk

    calls: list[tuple] = []
    S = 0x5000

    class Batch:
        acc = torch.zeros(8, dtype=torch.int64)
        pause = 0  # not warmed: whole copies

        def start(self, sync: Any, slots: Any, chunks: int, stream: int) -> Any:
            calls.append(("start", slots.data_ptr(), int(slots.numel()), chunks, stream))
            return self.acc[:chunks]

        def advance(self, t: int) -> None:
            calls.append(("advance", t))

    class Pipe(PacedStores):
        def _queue_one_each(
            self, lane: Any, slot: Any, k: int, host: Any, chunk_slots: Any, acc: Any
        ) -> None:
            assert acc.data_ptr() == Batch.acc.data_ptr()  # its sum into the store's, at k
            calls.append(("torch", k, int(chunk_slots[0]), int(chunk_slots.numel())))

    pipe = Pipe()
    pipe._sync = _LaneSync(calls)
    slot = SimpleNamespace(placer=None, used=False)
    stream = SimpleNamespace(cuda_stream=S)
    lane = StoreLane(stream, stream, (slot,), True, "paced", Batch())
    plan = [
        RawChunk(slot, 64, 0x100, 0, 0x7000, 640, 0),
        RawChunk(slot, 48, 0, 0, 0, 480, 0),  # no graph for its size: the torch way
        RawChunk(slot, 64, 0x100, 0, 0x7000, 640, 0),
    ]
    objs = [SimpleNamespace(data_ptr=lambda k=k: 0x40000 * (k + 1)) for k in range(3)]
    mapping = torch.arange(176, dtype=torch.int64) * 5
    acc = pipe._queue_chunks_serial(lane, plan, objs, mapping)
    assert acc.data_ptr() == Batch.acc.data_ptr() and acc.numel() == 3
    assert calls == [
        ("start", mapping.data_ptr(), 176, 3, S),
        ("graph", 0x100, S),
        ("copy", 0x40000, 0x7000, 640, S, D2H),
        ("torch", 1, 64 * 5, 48),
        ("advance", 48),
        ("graph", 0x100, S),
        ("copy", 0xC0000, 0x7000, 640, S, D2H),
    ]
    assert slot.used  # a later warm-up leaves its static buffers alone


def test_a_store_larger_than_the_paced_lane_s_state_goes_the_torch_way_and_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from maru.kv_ops import paced_batch

    forget("kv_ops.store-torch-way")
    pipe = _Pipe([])
    lane = StoreLane(None, None, (_Slot("p0", _Placer({1})),), paced=True, path="paced")
    n = paced_batch.MAX_CHUNKS + 1
    with caplog.at_level(logging.INFO, logger="maru.kv_ops"):
        assert pipe._raw_plan(lane, _objs(*[1] * n), torch.zeros(n, dtype=torch.int64), True) is None
        assert pipe._raw_plan(lane, _objs(*[1] * (n - 1)), torch.zeros(n - 1, dtype=torch.int64), True)
    said = [r.getMessage() for r in caplog.records if "queued through torch" in r.getMessage()]
    assert len(said) == 1 and "larger than the paced lane's state" in said[0]


@pytest.mark.parametrize(
    "nbytes", [1, 640, 8 << 20, (8 << 20) + 1, 18 << 20, 32 << 20, 33_554_433, 100_000_007]
)
def test_pieces_cover_the_copy_exactly_in_order_none_over_the_limit(nbytes: int) -> None:
    from maru.kv_ops.paced_store import PIECE_ALIGN, PIECE_BYTES, pieces

    got = pieces(nbytes)
    assert got[0][0] == 0 and sum(n for _, n in got) == nbytes
    assert all(a + n == b for (a, n), (b, _) in zip(got, got[1:], strict=False))  # no gap, no overlap
    assert all(0 < n <= PIECE_BYTES for _, n in got)
    assert all(a % PIECE_ALIGN == 0 for a, _ in got)
    assert len(got) == -(-nbytes // PIECE_BYTES)  # as few as the limit allows
    if len(got) > 1:  # even: no sliver at the end
        assert got[-1][1] > PIECE_BYTES // 2 - PIECE_ALIGN


def test_small_limits_still_give_whole_aligned_pieces() -> None:
    from maru.kv_ops.paced_store import pieces

    assert pieces(640, 256, 64) == [(0, 256), (256, 256), (512, 128)]
    assert pieces(1000, 100, 256) == [(0, 256), (256, 256), (512, 256), (768, 232)]  # limit < align
    assert pieces(100, 256, 64) == [(0, 100)]


def test_a_chunk_s_copy_goes_in_pieces_with_the_pause_graph_between_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the lane's pause graph warmed, each raw chunk's copy is split (``pieces``) and the pause
    graph is the stream's next item between two of its pieces; the destinations and sources move
    together, on the lane's one stream."""
    from types import SimpleNamespace

    from maru.kv_ops import paced_store
    from maru.kv_ops.cuda_sync import D2H
    from maru.kv_ops.paced_store import RawChunk

    monkeypatch.setattr(paced_store, "PIECE_BYTES", 256)
    monkeypatch.setattr(paced_store, "PIECE_ALIGN", 64)
    calls: list[tuple] = []
    S, PAUSE = 0x5000, 0x900

    class Batch:
        acc = torch.zeros(4, dtype=torch.int64)
        pause = PAUSE

        def start(self, sync: Any, slots: Any, chunks: int, stream: int) -> Any:
            return self.acc[:chunks]

    pipe = PacedStores()
    pipe._sync = _LaneSync(calls)
    slot = SimpleNamespace(placer=None, used=False)
    stream = SimpleNamespace(cuda_stream=S)
    lane = StoreLane(stream, stream, (slot,), True, "paced", Batch())
    plan = [RawChunk(slot, 64, 0x100, 0, 0x7000, 640, 0), RawChunk(slot, 16, 0x200, 0, 0x7000, 160, 0)]
    objs = [SimpleNamespace(data_ptr=lambda: 0x40000), SimpleNamespace(data_ptr=lambda: 0x80000)]
    pipe._queue_chunks_serial(lane, plan, objs, torch.arange(80, dtype=torch.int64))
    assert calls == [
        ("graph", 0x100, S),
        ("copy", 0x40000, 0x7000, 256, S, D2H),
        ("graph", PAUSE, S),
        ("copy", 0x40100, 0x7100, 256, S, D2H),
        ("graph", PAUSE, S),
        ("copy", 0x40200, 0x7200, 128, S, D2H),
        ("graph", 0x200, S),  # the next chunk's graph is its own pause
        ("copy", 0x80000, 0x7000, 160, S, D2H),  # under the limit: whole
    ]
