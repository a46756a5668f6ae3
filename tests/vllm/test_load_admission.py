"""``maru.vllm.load_admission``: the async-load window and the chunk keys in flight, alone (the
scheduler's use of it, with a real server, is in test_vllm_scheduler.py)."""

from __future__ import annotations

from maru.vllm.load_admission import LoadAdmission


def test_load_admission_counts_each_key_once_per_load_in_flight() -> None:
    a = LoadAdmission(max_loads=8, max_chunks=100, chunk_tokens=64)
    a.admit("r1", 128, ("k0", "k1"))
    a.admit("r2", 64, ("k1", "k1"))  # a key listed twice counts once
    assert a.in_flight("k0") and a.in_flight("k1") and not a.in_flight("k2")
    assert a.finish("r2") and a.in_flight("k1")  # r1 still places it
    a.admit("r1", 64, ("k2",))  # admitted again: the old load's keys go (landing until settled)
    a.settle()
    assert not a.in_flight("k0") and not a.in_flight("k1") and a.in_flight("k2")
    assert a.finish("r1") and not a.finish("r1") and a.ids() == set()
    assert a.in_flight("k2")  # landing: vLLM caches it in its next scheduling pass
    a.settle()
    assert not a.in_flight("k2") and not a.in_flight("k0")
    off = LoadAdmission(max_loads=8, max_chunks=100, chunk_tokens=64, share=False)
    off.admit("r", 64, ("k",))
    assert not off.in_flight("k") and off.ids() == {"r"}


def test_the_window_counts_chunks_and_always_admits_into_an_empty_one() -> None:
    a = LoadAdmission(max_loads=2, max_chunks=5, chunk_tokens=64)
    assert a.chunks_of(64) == 2 and a.chunks_of(65) == 3  # a load may start inside a chunk
    assert not a.window_full(10_000)  # empty: even a load larger than the window is admitted
    a.admit("r1", 128, ("k0",))  # 3 chunks
    assert not a.window_full(64) and a.window_full(65)  # 3 + 2 <= 5 < 3 + 3
    a.admit("r2", 1, ("k1",))
    assert a.window_full(1)  # two loads: the load count is full
    assert a.finish("r1") and not a.window_full(64)


def test_a_shared_wait_runs_out_once_and_ends_with_its_request(monkeypatch) -> None:
    from types import SimpleNamespace

    from maru.vllm import load_admission

    now = [0.0]
    monkeypatch.setattr(load_admission, "time", SimpleNamespace(monotonic=lambda: now[0]))
    w = load_admission.SharedWaits(bound_s=1.0)
    assert w.may_wait("r") and w.waited("r") == 0.0
    now[0] = 1.5
    assert not w.may_wait("r") and not w.may_wait("r") and w.timeouts == 1  # counted once
    assert w.waited("r") == 1.5
    w.end("r")
    assert w.waited("r") == 0.0 and w.may_wait("r")  # a new wait: a new clock
