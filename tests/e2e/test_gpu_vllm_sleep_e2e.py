"""vLLM's sleep mode with Maru on a GPU (real vLLM): a sleep resets the connector's cache.

vLLM calls the connector's ``reset_cache`` when it sleeps (level 1 discards the KV cache, and a
weight update usually follows). One engine with ``enable_sleep_mode`` and the default Maru
configuration: a batch stored, the engine put to sleep and woken, the batch again: nothing of what
was stored before the sleep is loaded (the engine cannot know its weights did not change), the
output is the same (the same weights); stored again under the new key epoch, it loads from there.
A second engine that never slept loads what the first stored before its sleep.

``pytest -m gpu tests/e2e/test_gpu_vllm_sleep_e2e.py`` on a GPU host with vLLM (about a minute on
an H200; ``bench/gpu_vllm_pass.sh`` with ``TEST_PATHS`` runs it on the device).
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

from bench.vllm_harness import GPU_MODEL, Engine, make_model, maru_kv_config, random_prompt  # noqa: E402
from tests.e2e.gpu_runs import assert_same, generate_counted  # noqa: E402
from tests.helpers import ServerProcess  # noqa: E402

BS, C = 16, 256
X = [random_prompt(1500, 700 + i, GPU_MODEL.vocab) for i in range(2)]
OFFERED = sum((len(p) - 1) // BS * BS for p in X)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    tmp = tmp_path_factory.mktemp("gpu-sleep")
    logs = Path(os.environ.get("MARU_GPU_E2E_LOG_DIR", tmp))
    model = str(
        make_model(
            os.environ.get("MARU_GPU_E2E_MODEL_DIR", Path(tempfile.gettempdir()) / "h4-model-l3kv"), GPU_MODEL
        )
    )
    srv = ServerProcess(tmp, pool_size="1G", log_level="WARNING")
    srv.start()
    base = {"model": model, "dtype": GPU_MODEL.dtype, "block_size": BS, "max_model_len": 2048,
            "kv_cache_memory_bytes": 1 << 30, "gpu_memory_utilization": 0.1}  # fmt: skip
    kv = maru_kv_config({"maru_server_url": srv.url, "maru_kv_chunk_tokens": C})
    res: dict[str, Any] = {}
    s = Engine("S", {**base, "kv_transfer_config": kv, "enable_sleep_mode": True}, logs / "S.log").start()
    try:
        res["cold"] = generate_counted(s, X, 8)
        s.call({"op": "sleep", "level": 1})
        s.call({"op": "wake_up"})
        res["after_sleep"] = generate_counted(s, X, 8)
        assert s.settle()["ok"]  # published, and vLLM's own copy gone
        res["new_epoch"] = generate_counted(s, X, 8)
        res["sched"] = s.stats()["scheduler"]
    finally:
        s.close()
    other = Engine("N", {**base, "kv_transfer_config": kv}, logs / "N.log").start()
    try:
        res["other"] = generate_counted(other, X, 8)
    finally:
        other.close()
        srv.cleanup()
    yield res


def test_after_a_sleep_nothing_stored_before_is_loaded_and_the_output_is_the_same(
    runs: dict[str, Any],
) -> None:
    assert runs["after_sleep"]["delta"].get("tokens_loaded", 0) == 0
    assert runs["after_sleep"]["cached"] == [0, 0]  # vLLM's own cache was discarded too
    assert_same(runs["after_sleep"], runs["cold"])
    sched = runs["sched"]
    assert sched["cache_resets"] >= 1  # a sleep resets the connector's cache (once or more)


def test_the_new_epochs_stores_load_and_an_engine_that_never_slept_loads_the_old_ones(
    runs: dict[str, Any],
) -> None:
    assert runs["new_epoch"]["delta"]["tokens_loaded"] == OFFERED
    assert_same(runs["new_epoch"], runs["cold"])
    assert runs["other"]["delta"]["tokens_loaded"] == OFFERED
    assert_same(runs["other"], runs["cold"])
