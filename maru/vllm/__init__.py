"""Maru's vLLM integration: ``MaruKVConnector`` (load it with ``kv_connector_module_path: "maru.vllm"``).

The connector is imported lazily, so ``import maru.vllm`` stays cheap and works without vLLM;
``from maru.vllm import MaruKVConnector`` (what vLLM's connector factory does) imports vLLM's
connector base class.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from maru.vllm.connector import MaruKVConnector as MaruKVConnector
    from maru.vllm.offline import settle_stores as settle_stores


def __getattr__(name: str) -> Any:
    if name == "MaruKVConnector":
        from maru.vllm.connector import MaruKVConnector

        return MaruKVConnector
    if name == "settle_stores":  # in-process engines: before sleep, pause or a cache reset
        from maru.vllm.offline import settle_stores

        return settle_stores
    raise AttributeError(f"module 'maru.vllm' has no attribute {name!r}")


__all__ = ["MaruKVConnector", "settle_stores"]
