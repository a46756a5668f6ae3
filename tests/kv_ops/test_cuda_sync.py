"""``RawSync`` against a stand-in libcudart (no GPU here): the flags its events are made with.

A done event the write-behind drain thread waits on must be ``cudaEventBlockingSync`` (the wait
sleeps; spinning would make the thread's CPU time the spin's), the forward thread's must not (a
sleeping waiter wakes later). The stand-in records each call's arguments as ctypes passes them.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pytest

from maru.kv_ops.cuda_sync import RawSync


class FakeCudart:
    """Every libcudart function RawSync binds; ``cudaEventCreateWithFlags`` writes a new handle."""

    def __init__(self) -> None:
        self.flags: list[int] = []
        self.synced: list[int] = []
        self._next = 0x1000

        def create(handle: Any, flags: int) -> int:
            self._next += 16
            ctypes.cast(handle, ctypes.POINTER(ctypes.c_void_p))[0] = self._next
            self.flags.append(flags)
            return 0

        def sync(event: int) -> int:
            self.synced.append(event)
            return 0

        self.cudaEventCreateWithFlags = create
        self.cudaEventSynchronize = sync

    def __getattr__(self, name: str) -> Any:
        if not name.startswith("cuda"):
            raise AttributeError(name)
        fn = lambda *args: 0  # noqa: E731 - a call that succeeds
        setattr(self, name, fn)
        return fn


def test_events_spin_by_default_and_sleep_when_asked() -> None:
    lib = FakeCudart()
    sync = RawSync(lib)  # type: ignore[arg-type]
    spin, sleep = sync.event(), sync.event(blocking=True)
    assert spin != sleep and spin and sleep
    disable_timing, blocking_sync = 2, 1  # cudaEventDisableTiming, cudaEventBlockingSync
    assert lib.flags == [disable_timing, disable_timing | blocking_sync]
    sync.synchronize(sleep)
    assert lib.synced == [sleep]


def test_a_failed_event_creation_raises_with_the_cuda_error() -> None:
    lib = FakeCudart()
    lib.cudaEventCreateWithFlags = lambda handle, flags: 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaEventCreateWithFlags failed: cudaError 2"):
        RawSync(lib).event(blocking=True)  # type: ignore[arg-type]


class _RecordingSync:
    """A sync with raw calls that records what each wait was queued on."""

    raw = True

    def __init__(self) -> None:
        self.raw_waits: list[tuple[int, int]] = []
        self.torch_waits: list[tuple[Any, int]] = []

    def wait_on(self, stream: int, event: int) -> None:
        self.raw_waits.append((stream, event))

    def wait(self, stream: Any, event: int) -> None:
        self.torch_waits.append((stream, event))


def test_a_layer_wait_on_the_current_stream_takes_its_raw_handle_not_a_torch_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``wait_for_layer`` runs once a layer inside the forward: with raw calls the current stream's
    handle comes from ``current_raw_stream`` (no torch Stream built); a stream given is used as is."""
    from maru.kv_ops import device_handles

    monkeypatch.setattr(device_handles, "current_raw_stream", lambda: 0xBEEF)
    sync = _RecordingSync()
    load = device_handles.LayerLoad(1 << 20, [101, 102, 103], sync, keepalive=None)
    load.wait_for_layer(1)
    load.wait_on()
    assert sync.raw_waits == [(0xBEEF, 102), (0xBEEF, 103)]  # layer 1's event; the done event (last)
    given = object()
    load.wait_for_layer(2, stream=given)
    assert sync.torch_waits == [(given, 103)]
    cpu = device_handles.LayerLoad(1 << 20, None, None, None)  # a CPU load: nothing to wait for
    cpu.wait_for_layer(0)
    cpu.wait_on()
    assert len(sync.raw_waits) == 2


def test_with_the_census_on_the_gil_holding_calls_are_timed_by_thread(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``MARU_THREAD_CENSUS=1``: every call through the GIL-keeping handle adds its wall time to the
    calling thread's account (a launch that blocks 2 ms in the driver counts 2 ms and one long
    call); the calls that release the GIL (the blocking synchronize) are not timed. Off: the bound
    functions are the library's own, unwrapped."""
    import threading
    import time

    from maru import gil_calls

    lib = FakeCudart()
    monkeypatch.delenv(gil_calls.ENV, raising=False)
    plain = RawSync(lib, lib)  # type: ignore[arg-type]
    assert not plain.timed and plain._launch is lib.cudaGraphLaunch
    monkeypatch.setenv(gil_calls.ENV, "1")
    lib.cudaGraphLaunch = lambda graph, stream: (time.sleep(0.002), 0)[1]  # blocks in the "driver"
    timed = RawSync(lib, lib)  # type: ignore[arg-type]
    assert timed.timed and timed._sync is lib.cudaEventSynchronize  # releases the GIL: not timed
    assert not RawSync(lib).timed  # no GIL-keeping handle (the benchmarks' comparison): nothing to time
    me = threading.get_native_id()
    before = gil_calls.snapshot().get(me, (0, 0, 0))
    timed.launch_graph(0x10, 0x20)
    for _ in range(3):
        timed.record_on(0x30, 0x20)
    after = gil_calls.snapshot()[me]
    calls, held, long = (a - b for a, b in zip(after, before, strict=True))
    assert calls == 4 and long == 1
    assert 2_000_000 <= held < 2_000_000 + 200_000_000  # the sleep, plus a loaded machine's slack
    assert gil_calls.timed(lib.cudaGraphLaunch).__wrapped__ is lib.cudaGraphLaunch


def test_the_raw_calls_keep_the_gil_unless_an_ab_says_otherwise_and_then_doctor_says_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``RawSync.load()``: the quick calls through a GIL-keeping handle (``PyDLL``) by default; with
    ``MARU_RAW_CALLS_RELEASE_GIL=1`` every call through the GIL-releasing one (``CDLL``), and the
    pipelined path's report (``maru doctor``) names the setting and how to undo it."""
    from types import SimpleNamespace

    from maru.kv_ops import cuda_sync, launch
    from maru.transfer.device_path import PipelinedPath

    monkeypatch.setattr(launch, "_LAUNCHERS", [])  # no other test's kernel launches in the report
    releasing, keeping = FakeCudart(), FakeCudart()
    monkeypatch.setattr(cuda_sync, "find_cudart", lambda: "libcudart.so")
    monkeypatch.setattr(cuda_sync.ctypes, "CDLL", lambda path: releasing)
    monkeypatch.setattr(cuda_sync.ctypes, "PyDLL", lambda path: keeping)
    monkeypatch.delenv(cuda_sync.RELEASE_GIL_ENV, raising=False)
    monkeypatch.delenv("MARU_THREAD_CENSUS", raising=False)
    sync = cuda_sync.RawSync.load()
    assert (
        sync is not None
        and sync._launch is keeping.cudaGraphLaunch
        and sync._sync is releasing.cudaEventSynchronize
    )
    assert cuda_sync.gil_note() is None
    assert PipelinedPath.report(SimpleNamespace(pipeline=None), False)[1] == []  # type: ignore[arg-type]
    monkeypatch.setenv(cuda_sync.RELEASE_GIL_ENV, "1")
    sync = cuda_sync.RawSync.load()
    assert (
        sync is not None
        and sync._launch is releasing.cudaGraphLaunch
        and sync._record is releasing.cudaEventRecord
    )
    slow = PipelinedPath.report(SimpleNamespace(pipeline=None), False)[1]  # type: ignore[arg-type]
    assert len(slow) == 1 and cuda_sync.RELEASE_GIL_ENV in slow[0] and "Fix: unset" in slow[0]
    assert cuda_sync.RawSync.load(keep_gil=True)._launch is keeping.cudaGraphLaunch  # type: ignore[union-attr]
