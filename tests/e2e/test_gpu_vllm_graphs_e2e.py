"""MaruKVConnector with vLLM's CUDA graphs and torch.compile (vLLM's default), on a GPU.

The other GPU end-to-end tests run their engines eager (start-up is minutes shorter); a user who
changes nothing runs vLLM's graphs. Two engines here, each in its own process, vLLM 0.26's
default V2 model runner, the model of Llama-3-8B's KV geometry (``bench/vllm_harness.py``), one
real ``maru server``:

- G, the default configuration (offers pinned at each offer, the layer-overlap load issued when
  vLLM plans the step, the write-behind store). vLLM keeps its full graphs: a step with prefill
  runs piecewise graphs, the per-layer wait between the pieces, and loads layer by layer under the
  forward; a step replayed as one full graph skips that wait, so the worker waits for its load
  before the forward. G computes a batch
  XG of four prompts and a batch ZG of four prompts a token past a block boundary, settles (every
  store published, its prefix cache reset), loads XG back (twelve tokens left to compute each:
  piecewise) and ZG (each hit leaves one token: a decode-shaped batch, replayed as a full graph);
- G-sync, ``maru_overlap_load_with_compute=false`` (the whole load before the forward): loads XG
  as a batch of concurrent hits, then computes a batch YG, settles and loads YG back.

"Same output": ``same_greedy`` (identical, or a bf16 near-tie where each side's token is in the
other's top-5); a wrong or missing layer shows up as ``different``.
Run on a GPU host with vLLM: ``pytest -m gpu tests/e2e/test_gpu_vllm_graphs_e2e.py`` (about 3
minutes on an H200, most of it compiling and capturing).
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:  # pragma: no cover
    pytest.skip("vLLM is not installed", allow_module_level=True)

from bench.vllm_harness import (  # noqa: E402
    GPU_MODEL,
    Engine,
    make_model,
    maru_kv_config,
    random_prompt,
)
from tests.e2e.gpu_runs import Runs, assert_same, generate_counted  # noqa: E402
from tests.helpers import ServerProcess  # noqa: E402

BS, C = 16, 256
MAX_TOKENS = 8
XG = [random_prompt(1500, 600 + i, GPU_MODEL.vocab) for i in range(4)]
YG = [random_prompt(1200, 700 + i, GPU_MODEL.vocab) for i in range(4)]
ZG = [random_prompt(1201, 800 + i, GPU_MODEL.vocab) for i in range(4)]  # a hit leaves one token
PIECEWISE = "requires PIECEWISE CUDA graph mode"  # vLLM's line when a connector asks for it
CAPTURED = "Graph capturing finished"  # vLLM's line once its graphs are captured


def offered(prompt: list[int]) -> int:
    return (len(prompt) - 1) // BS * BS


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tmp = tmp_path_factory.mktemp("gpu-vllm-graphs")
    logs = Path(os.environ.get("MARU_GPU_E2E_LOG_DIR", tmp))
    default_dir = Path(tempfile.gettempdir()) / "h4-model-l3kv"
    model = str(make_model(os.environ.get("MARU_GPU_E2E_MODEL_DIR", default_dir), GPU_MODEL))
    srv = ServerProcess(tmp, pool_size="2G", log_level="WARNING")
    srv.start()
    base = {"model": model, "dtype": GPU_MODEL.dtype, "block_size": BS, "max_model_len": 2048,
            "kv_cache_memory_bytes": 2 << 30, "max_num_batched_tokens": 8192,
            "gpu_memory_utilization": 0.1, "enforce_eager": False}  # fmt: skip
    extra = {"maru_server_url": srv.url, "maru_kv_chunk_tokens": C, "maru_log_timing": True}
    specs = {
        "G": {**base, "kv_transfer_config": maru_kv_config(extra)},
        "G-sync": {
            **base,
            "kv_transfer_config": maru_kv_config({**extra, "maru_overlap_load_with_compute": False}),
        },
    }
    eng = {n: Engine(f"graphs-{n}", s, logs / f"test-graphs-{n}.log").start() for n, s in specs.items()}
    res = Runs()
    stage = res.stage

    try:
        g, o = eng["G"], eng["G-sync"]
        stage("G-XG", lambda: generate_counted(g, XG, MAX_TOKENS))
        stage("G-ZG", lambda: generate_counted(g, ZG, MAX_TOKENS))
        stage("G-settle", lambda: g.settle())
        stage("G-XG-load", lambda: {**generate_counted(g, XG, MAX_TOKENS), "sched": g.stats()["scheduler"]})
        stage("G-ZG-load", lambda: {**generate_counted(g, ZG, MAX_TOKENS), "sched": g.stats()["scheduler"]})
        stage("sync-XG", lambda: generate_counted(o, XG, MAX_TOKENS))
        stage("sync-YG", lambda: generate_counted(o, YG, MAX_TOKENS))
        stage("sync-settle", lambda: o.settle())
        stage("sync-YG-load", lambda: generate_counted(o, YG, MAX_TOKENS))
        for n, e in eng.items():
            e.close()
            res.setdefault("logs", {})[n] = e.log_path.read_text(errors="replace")
        yield res
    finally:
        for e in eng.values():
            e.close()
        srv.cleanup()


def _assert_loaded_and_same(r: dict[str, Any], ref: dict[str, Any], prompts: list[list[int]]) -> None:
    assert r["cached"] == [offered(p) for p in prompts]  # every concurrent hit loaded whole
    d = r["delta"]
    assert d["tokens_loaded"] == sum(offered(p) for p in prompts) and d["load_errors"] == 0
    assert_same(r, ref)


def test_both_engines_ran_cuda_graphs_and_neither_gave_up_its_full_graphs(runs: Runs) -> None:
    runs.need("sync-YG-load")
    logs = runs["logs"]
    assert CAPTURED in logs["G"] and CAPTURED in logs["G-sync"]
    assert PIECEWISE not in logs["G"] and PIECEWISE not in logs["G-sync"]


def test_the_default_configuration_under_cuda_graphs_loads_a_batch_of_hits_layer_by_layer(runs: Runs) -> None:
    assert runs.need("G-XG")["cached"] == [0] * 4  # computed (and stored) by G itself
    assert runs.need("G-settle")["ok"]  # stores published, its own prefix cache empty
    r = runs.need("G-XG-load")
    _assert_loaded_and_same(r, runs["G-XG"], XG)
    d = r["delta"]
    assert d["async_loads"] == 0 and d["loads_from_held_pins"] >= 1
    assert d["overlap_loads"] >= 1 and d["layer_loads_unwaited"] == 0  # placed under the forward
    # maru_early_load (the default): the steps' loads issued when vLLM planned them.
    assert d["early_loads"] >= 1 and r["sched"]["early_loads"]["started"] >= d["early_loads"], r["sched"]


def test_the_default_configuration_loads_a_full_graph_step_before_its_forward_with_the_same_output(
    runs: Runs,
) -> None:
    assert runs.need("G-ZG")["cached"] == [0] * 4
    r = runs.need("G-ZG-load")
    assert [len(p) - c for p, c in zip(ZG, r["cached"], strict=True)] == [1] * 4  # one token left each
    _assert_loaded_and_same(r, runs["G-ZG"], ZG)
    d = r["delta"]
    assert d["overlap_full_graph_loads"] >= 1  # vLLM replayed that step as a full graph
    assert d["layer_loads_unwaited"] == 0
    # Issued at the plan (the default maru_early_load), waited for before the full graph's replay.
    assert d["early_loads"] >= 1, r["sched"]["early_loads"]


def test_loads_before_the_forward_under_cuda_graphs_keep_the_output(runs: Runs) -> None:
    r = runs.need("sync-XG")
    _assert_loaded_and_same(r, runs.need("G-XG"), XG)  # stored by G
    assert r["delta"]["overlap_loads"] == 0 and r["delta"]["overlap_full_graph_loads"] == 0
    assert runs.need("sync-YG")["cached"] == [0] * 4
    assert runs.need("sync-settle")["ok"]
    _assert_loaded_and_same(runs.need("sync-YG-load"), runs["sync-YG"], YG)
