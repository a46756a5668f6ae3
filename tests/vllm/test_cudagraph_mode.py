"""vLLM's CUDA-graph question to the connector (``requires_piecewise_for_cudagraph``).

vLLM asks it through its connector factory before capturing graphs; a full-graph replay skips the
per-layer hooks, which only the layer-overlap load needs. Asked here the way vLLM asks it.
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402


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
    ],
    ids=["default", "async-load", "sync-store"],
)
def test_loads_before_the_forward_and_stores_after_it_allow_full_graphs(extra: dict) -> None:
    assert _asked(extra) is False


def test_the_layer_overlap_load_asks_for_piecewise_graphs() -> None:
    assert _asked({"maru_server_url": "tcp://127.0.0.1:1", "maru_overlap_load_with_compute": True}) is True


def test_a_config_that_does_not_parse_never_answers_the_unsafe_way() -> None:
    assert _asked({"maru_server_url": "tcp://127.0.0.1:1", "maru_no_such_option": 1}) is True
