"""Paged-KV placement: move KV between an engine's paged cache and Maru's contiguous objects.

* ``detect_layout`` / ``detect_layouts``: a cache tensor's shape and strides -> ``KVLayout``
  (pure Python; ``UnsupportedLayout`` for anything unknown).
* ``gather`` / ``scatter`` (all layers, by slot mapping), ``gather_layer`` / ``scatter_layer`` (one
  layer), ``gather_blocks`` / ``scatter_blocks`` (whole blocks by id).
* ``backend()``: which implementation runs here and why ("reference" PyTorch or "triton").

The object format is ``[L, 2, T, NH*HS]`` (per layer: K plane, then V plane), ``[L, 1, T, D]`` for MLA.
Torch is imported only when an operation is used, so layout detection works without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from maru.kv_ops.layout import KVLayout, detect_layout, detect_layouts

if TYPE_CHECKING:  # pragma: no cover
    from maru.kv_ops.selection import BackendChoice

_OPS = ("gather", "scatter", "gather_layer", "scatter_layer", "gather_blocks", "scatter_blocks")


def backend(device: str | None = None) -> BackendChoice:
    """Which implementation ``backend=None`` runs for tensors on ``device`` ("cuda"/"cpu"; None: the
    GPU if one is visible, else the CPU), and why. ``str()`` of it is one line for logs and doctor."""
    from maru.kv_ops.selection import choose

    return choose(device)


def __getattr__(name: str) -> Any:
    # Lazy: the operations import torch; detection must not.
    if name in _OPS:
        from maru.kv_ops import ops

        fn = getattr(ops, name)
        globals()[name] = fn  # resolved once: later lookups skip this hook (host time per call)
        return fn
    if name == "GraphedPlacer":
        from maru.kv_ops.placer import GraphedPlacer

        return GraphedPlacer
    raise AttributeError(f"module 'maru.kv_ops' has no attribute {name!r}")


__all__ = ["KVLayout", "backend", "detect_layout", "detect_layouts", "GraphedPlacer", *_OPS]
