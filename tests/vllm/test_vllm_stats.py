"""The connector's counters in vLLM's stats pipeline (maru.vllm.stats)."""

from __future__ import annotations

import pickle

import pytest

pytest.importorskip("vllm")

from maru.vllm.stats import COUNTERS, MaruKVConnectorStats, counters, interval_stats  # noqa: E402
from maru.vllm.worker_stats import WorkerStats  # noqa: E402


def test_interval_stats_report_only_what_changed_since_the_last_report() -> None:
    assert interval_stats({"tokens_loaded": 5}, {"tokens_loaded": 5}) is None
    s = interval_stats({"tokens_loaded": 96, "chunks_loaded": 3}, {"tokens_loaded": 32, "chunks_loaded": 1})
    assert s is not None and s.data["tokens_loaded"] == 64 and s.data["chunks_loaded"] == 2


def test_counters_read_the_worker_stats_fields_as_the_full_dict_has_them() -> None:
    """``counters`` (what vLLM's per-step ``get_kv_connector_stats`` reads) is ``as_dict``'s subset:
    a renamed field fails here, not silently in the engine (where the hook swallows errors)."""
    st = WorkerStats()
    for i, k in enumerate(COUNTERS):
        setattr(st, k, getattr(st, k) + i + 1)
    full = st.as_dict()
    assert counters(st) == {k: full[k] for k in COUNTERS}
    s = interval_stats(counters(st), {})
    assert s is not None and s.data["load_errors"] == COUNTERS.index("load_errors") + 1


def test_aggregate_sums_workers_and_steps_and_reduce_summarizes() -> None:
    a = MaruKVConnectorStats(
        data={"tokens_loaded": 64, "bytes_loaded": 2e9, "load_seconds": 1.0, "chunks_stored": 1}
    )
    b = MaruKVConnectorStats(
        data={"tokens_loaded": 32, "bytes_loaded": 1e9, "load_seconds": 0.5, "store_failures": 2}
    )
    r = a.aggregate(b).reduce()
    assert r["tokens_loaded"] == 96 and r["chunks_stored"] == 1 and r["store_failures"] == 2
    assert r["load_GBps"] == pytest.approx(2.0)
    assert not a.is_empty()
    a.reset()
    assert a.is_empty()


def test_stats_survive_pickling_between_processes() -> None:
    s = MaruKVConnectorStats(data={"chunks_stored": 3})
    assert pickle.loads(pickle.dumps(s)).data == {"chunks_stored": 3}


def test_layer_loads_count_their_bytes_but_not_toward_the_load_rate() -> None:
    """A layer load runs under the forward: its host time is no transfer time, so a rate over it
    would exceed the bus. The rate is that of the loads the steps waited for."""
    waited = MaruKVConnectorStats(data={"bytes_loaded": 3e9, "load_seconds": 0.06})
    layered = MaruKVConnectorStats(data={"bytes_loaded": 5e9, "bytes_loaded_under_forward": 5e9})
    r = waited.aggregate(layered).reduce()
    assert r["load_GBps"] == pytest.approx(50.0)
    only = MaruKVConnectorStats(data={"bytes_loaded": 5e9, "bytes_loaded_under_forward": 5e9}).reduce()
    assert "load_GBps" not in only


def test_worker_stats_count_a_layer_loads_bytes_but_not_its_host_time() -> None:
    from maru.transfer.records import LoadReport
    from maru.vllm.worker_stats import WorkerStats

    st = WorkerStats()
    st.add_load(
        LoadReport(loaded_req_ids=["a"], chunks=4, tokens=64, bytes=4096, seconds=0.5, copies_shared=2)
    )
    st.add_load(LoadReport(loaded_req_ids=["b", "c"], chunks=2, tokens=32, bytes=1024, seconds=9.0), True)
    assert (st.loads, st.chunks_loaded, st.tokens_loaded, st.bytes_loaded) == (3, 6, 96, 5120)
    assert (st.load_seconds, st.bytes_loaded_under_forward, st.load_copies_shared) == (0.5, 1024, 2)
