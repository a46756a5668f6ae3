"""Maru: a KV-cache sharing engine for LLM serving.

Several inference instances attach to one memory pool (CXL memory exposed as a DAX device, or
host shared memory under /dev/shm). KV bytes go straight into and out of the shared memory;
only metadata goes through ``maru server``.

Public entry points: ``maru.MaruHandler`` (the client), ``maru.kv_ops`` (paged-KV placement),
``maru.vllm.MaruKVConnector`` (the vLLM connector) and the ``maru`` command.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from maru.client import MaruHandler as MaruHandler


def __getattr__(name: str) -> Any:
    # Lazy, so `import maru` stays cheap and does not pull zmq/torch where unused.
    if name == "MaruHandler":
        from maru.client import MaruHandler

        return MaruHandler
    raise AttributeError(f"module 'maru' has no attribute {name!r}")


__all__ = ["MaruHandler", "__version__"]
