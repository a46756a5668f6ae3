"""The staged store's chunks queued by one compiled call (``MARU_NATIVE_STORE_ISSUE``) make the same
libcudart calls, in the same order, as the Python loop (``PacedStores._queue_chunks_raw``).

No CUDA here: the Python loop runs against a sync that records each call, the compiled loop
against recording stand-ins for libcudart's functions (``maru.native.store_issue.Recorder``), both
over the same random plans: the paced lane's two slots and the ring's, with and without checksums,
with chunks that go the torch way in their turn between runs of raw ones. The GPU tests queue real
stores (tests/kv_ops/test_paced_store_gpu.py run with the switch on).
"""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from maru.announce import forget
from maru.kv_ops.cuda_sync import D2D, D2H
from maru.kv_ops.paced_store import PacedStores, RawChunk, StoreLane
from maru.native import store_issue as si
from tests.gil_witness import GilWitness, quiet_interpreter  # noqa: F401  (a fixture)

# Only a machine without a C compiler skips (the project's setup installs one); a build that
# disagrees with its definition fails these tests (``_native`` asserts it loaded).
pytestmark = pytest.mark.skipif("no C compiler" in si.load().reason, reason=si.load().reason)

G, C, YIELD_EXEC = 0x1000, 0x2000, 0x3000


class _Placer:
    def __init__(self, calls: list[Any], base: int) -> None:
        self.calls, self.base = calls, base

    def slots(self, t: int) -> Any:
        return SimpleNamespace(data_ptr=lambda: self.base + 16 * t)

    def slots_from(self, address: int, t: int, stream: int) -> None:  # as GraphedPlacer.slots_from
        self.calls.append(("copy", self.slots(t).data_ptr(), address, 8 * t, D2D, stream))


class _Sync:
    """The Python loop's calls, written as ``store_issue.reference_calls`` writes them."""

    raw = True

    def __init__(self, calls: list[Any]) -> None:
        self.calls = calls

    def wait_on(self, stream: int, event: int) -> None:
        self.calls.append(("wait", stream, event))

    def record_on(self, event: int, stream: int) -> None:
        self.calls.append(("record", event, stream))

    def launch_graph(self, exe: int, stream: int) -> None:
        self.calls.append(("launch", exe, stream))

    def copy(self, dst: int, src: int, n: int, stream: int, kind: int) -> None:
        self.calls.append(("copy", dst, src, n, kind, stream))


class _Pipe(PacedStores):
    def __init__(self, calls: list[Any], native: Any) -> None:
        self._sync, self._native = _Sync(calls), native
        self.calls = calls
        self._ring, self.ring_slots, self._next_slot = [], 0, 0
        self._yield_graph_exec = YIELD_EXEC

    def _native_issue(self) -> Any:
        return self._native

    def _queue_one_each(self, lane: Any, slot: Any, k: int, host: Any, chunk_slots: Any, acc: Any) -> None:
        self.calls.append(("torch way", k, slot.free, int(chunk_slots[0]), len(chunk_slots)))


_BUFFERS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _store(seed: int, calls: list[Any], native: Any, *, checksums: bool, paced: bool) -> _Pipe:
    """One store of a random plan on ``_Pipe``; the same plan and addresses for the same seed."""
    rng = random.Random(seed)
    pipe = _Pipe(calls, native)
    slots = tuple(
        SimpleNamespace(free=0x10 + 2 * i, ready=0x11 + 2 * i, used=rng.random() < 0.5, placer=_Placer(calls, 0x9000 * (i + 1)))
        for i in range(2)
    )  # fmt: skip
    n = rng.randrange(1, 9)
    tokens = [rng.choice([16, 48, 256]) for _ in range(n)]
    plan = [
        RawChunk(
            slots[k % 2],
            t,
            0 if rng.random() < 0.2 else 0x500 + k,
            0x600 + k if checksums else -1,
            0x700000 + k,
            t * 4096,
            0x800 + k,
        )  # fmt: skip
        for k, t in enumerate(tokens)
    ]
    if all(not ch.gather for ch in plan):  # at least one raw chunk (_raw_chunks: else no plan)
        plan[0] = RawChunk(
            plan[0].slot, tokens[0], 0x500, plan[0].checksum, 0x700000, tokens[0] * 4096, 0x800
        )
    objs = [SimpleNamespace(data_ptr=lambda k=k: 0x40000000 + (k << 20)) for k in range(n)]
    # Device addresses the calls carry: the same tensors for both loops of a seed.
    mapping, sums = _BUFFERS.setdefault(
        (seed, n), (torch.arange(sum(tokens), dtype=torch.int64) * 3, torch.zeros(n, dtype=torch.int64))
    )
    acc = sums if checksums else None
    lane = StoreLane(
        SimpleNamespace(cuda_stream=G), SimpleNamespace(cuda_stream=C), slots, paced=paced, path="paced"
    )
    pipe._queue_chunks_raw(lane, plan, objs, mapping, acc)
    pipe.slots_used = [s.used for s in slots]
    return pipe


def _native(rec: si.Recorder) -> tuple[si.StoreIssue, Any]:
    loaded = si.load()
    assert loaded.issue is not None, loaded.reason
    return loaded.issue, rec.fns


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("checksums", [True, False])
@pytest.mark.parametrize("paced", [True, False], ids=["paced", "ring"])
def test_the_compiled_loop_makes_the_python_loop_s_calls(seed: int, checksums: bool, paced: bool) -> None:
    py_calls: list[Any] = []
    py = _store(seed, py_calls, None, checksums=checksums, paced=paced)
    rec = si.Recorder()
    nat = _store(seed, rec.calls, _native(rec), checksums=checksums, paced=paced)
    assert rec.calls == py_calls
    assert nat.slots_used == py.slots_used
    assert "libcudart, one native call a run of chunks" in nat.store_ways
    assert any(c[0] == "copy" and c[4] == D2H for c in py_calls)  # a store, not an empty plan


def test_a_failing_call_stops_the_loop_there_and_is_raised_with_what_it_was() -> None:
    want: list[Any] = []
    _store(3, want, None, checksums=True, paced=True)
    raw = [i for i, c in enumerate(want) if c[0] != "torch way"]
    stop = raw[len(raw) // 2]
    rec = si.Recorder(fail_at=stop)  # its list holds the torch way's chunks too, as ``want`` does
    with pytest.raises(si.IssueFailed, match="cudaError 700") as e:
        _store(3, rec.calls, _native(rec), checksums=True, paced=True)
    assert rec.calls == want[: stop + 1]  # nothing queued after the failed call
    assert e.value.step in range(len(si.STEPS)) and e.value.err == 700


def test_the_switch_is_off_by_default_and_an_unavailable_loop_is_said(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    sync = SimpleNamespace(raw=True, function_table=lambda: "fns")
    pipe = PacedStores()
    pipe._sync = sync  # type: ignore[attr-defined]
    monkeypatch.delenv("MARU_NATIVE_STORE_ISSUE", raising=False)
    assert pipe._native_issue() is None
    monkeypatch.setenv("MARU_NATIVE_STORE_ISSUE", "1")
    pipe = PacedStores()
    pipe._sync = sync  # type: ignore[attr-defined]
    native = pipe._native_issue()
    assert native is not None and native[1] == "fns" and native[0] is si.load().issue
    monkeypatch.setattr(si, "_loaded", si.Loaded(None, "no C compiler found"))
    forget("kv_ops.native-issue")
    pipe = PacedStores()
    pipe._sync = sync  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="maru.kv_ops"):
        assert pipe._native_issue() is None
    assert any(
        "no C compiler found" in r.getMessage() and "MARU_NATIVE_STORE_ISSUE" in r.getMessage()
        for r in caplog.records
    )


@pytest.mark.usefixtures("quiet_interpreter")
def test_the_paced_lane_s_call_lets_the_gil_go_and_the_ring_s_keeps_it() -> None:
    """The drain thread's call (paced lane) lets vLLM's threads run while it queues; the ring's,
    whose caller may be vLLM's forward thread, never waits to take the GIL back. libcudart's calls
    need no GIL; libc's ``usleep`` stands in for each of them here (every first argument, which it
    reads as microseconds, is 300), as the recording stand-ins, Python callbacks, would take it."""
    import ctypes

    issue = si.load().issue
    assert issue is not None
    usleep = ctypes.cast(ctypes.CDLL(None).usleep, ctypes.c_void_p).value or 0
    fns = si.function_table([usleep] * 4)
    rows = [[si.WAIT_FREE | si.CHECKSUM | si.YIELD] + [300] * (si.ROW - 1)] * 3
    with GilWitness() as w:
        for release in (False, True):
            table = si.row_table(rows)
            gave_up = w.gave_up(
                lambda t=table, g=release: issue.queue(
                    fns, t, len(rows), 300, 300, 300, D2D, D2H, release_gil=g
                )
            )
            assert gave_up is release


def test_an_unloadable_loop_s_fix_follows_its_reason() -> None:
    off = si.Loaded(None, "MARU_NATIVE=0 turns the compiled code off")
    assert off.fix.startswith("unset MARU_NATIVE ")
    assert "C compiler" in si.Loaded(None, "no C compiler found").fix
