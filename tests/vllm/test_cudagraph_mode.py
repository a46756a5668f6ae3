"""vLLM's CUDA graphs and the connector: full graphs stay on, the layer-overlap load follows each forward.

vLLM asks ``requires_piecewise_for_cudagraph`` through its connector factory before capturing
graphs (asked here the way vLLM asks it). A full-graph replay skips the per-layer hook that the
layer-overlap load waits in, so the worker reads from each step's forward context whether the hook
will run (``forward_runs_layer_hooks``), against vLLM's own forward contexts: the V1 runner's
(``cudagraph_runtime_mode``) and the empty one the V2 runner starts a full-graph step's loads in.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import CUDAGraphMode, KVTransferConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402

from maru.vllm.layer_loads import forward_runs_layer_hooks  # noqa: E402


def _asked(extra: dict) -> bool:
    cfg = KVTransferConfig(
        kv_connector="MaruKVConnector",
        kv_connector_module_path="maru.vllm.connector",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls.__name__ == "MaruKVConnector"
    return bool(cls.requires_piecewise_for_cudagraph(cfg.kv_connector_extra_config))


@pytest.mark.parametrize(
    "extra",
    [
        {"maru_server_url": "tcp://127.0.0.1:1"},
        {"maru_server_url": "tcp://127.0.0.1:1", "maru_async_load": True},
        {"maru_server_url": "tcp://127.0.0.1:1", "maru_async_store": False},
        {"maru_server_url": "tcp://127.0.0.1:1", "maru_overlap_load_with_compute": True},
        {"maru_server_url": "tcp://127.0.0.1:1", "maru_no_such_option": 1},
    ],
    ids=["default", "async-load", "sync-store", "layer-overlap", "unparsed"],
)
def test_no_configuration_takes_vllms_full_graphs_away(extra: dict) -> None:
    assert _asked(extra) is False


@pytest.fixture(scope="module")
def vllm_config() -> VllmConfig:
    return VllmConfig()


@pytest.mark.parametrize(
    "mode,runs",
    [(CUDAGraphMode.NONE, True), (CUDAGraphMode.PIECEWISE, True), (CUDAGraphMode.FULL, False)],
)
def test_the_v1_runners_forward_context_says_whether_attention_calls_the_layer_hook(
    vllm_config: VllmConfig, mode: CUDAGraphMode, runs: bool
) -> None:
    with set_forward_context(
        {"model.layers.0.self_attn.attn": object()}, vllm_config, cudagraph_runtime_mode=mode
    ):
        assert forward_runs_layer_hooks(get_forward_context()) is runs


def test_the_v2_runners_full_graph_step_starts_its_loads_without_attention_metadata(
    vllm_config: VllmConfig,
) -> None:
    # vLLM 0.26's V2 runner, full-graph replay: pre_forward outside any forward context, so
    # ``set_forward_context(None, vllm_config)`` around start_load_kv; attention would skip the hook.
    with set_forward_context(None, vllm_config):
        assert forward_runs_layer_hooks(get_forward_context()) is False


def test_an_unknown_forward_context_is_taken_as_skipping_the_hook() -> None:
    class Odd:
        attn_metadata = {"l": 1}
        cudagraph_runtime_mode = "FULL_AND_SOMETHING"

    assert forward_runs_layer_hooks(None) is False
    assert forward_runs_layer_hooks(object()) is False
    assert forward_runs_layer_hooks(Odd()) is False
