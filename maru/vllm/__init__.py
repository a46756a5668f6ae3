"""Maru's vLLM integration: ``MaruKVConnector`` (load it with ``kv_connector_module_path: "maru.vllm"``).

The connector is imported lazily, so ``import maru.vllm`` stays cheap and works without vLLM;
``from maru.vllm import MaruKVConnector`` (what vLLM's connector factory does) imports vLLM's
connector base class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from maru.vllm.connector import MaruKVConnector as MaruKVConnector


def __getattr__(name: str) -> Any:
    if name == "MaruKVConnector":
        from maru.vllm.connector import MaruKVConnector

        return MaruKVConnector
    raise AttributeError(f"module 'maru.vllm' has no attribute {name!r}")


__all__ = ["MaruKVConnector"]
