"""One staging slot of ``DevicePipeline``'s ring: a chunk-sized GPU buffer and the means to place it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from maru.announce import announce_once
from maru.kv_ops import ops

if TYPE_CHECKING:
    from maru.kv_ops.device_pipeline import DevicePipeline

log = logging.getLogger("maru.kv_ops")


class StagingSlot:
    """One staging slot of the ring: a chunk-sized GPU buffer plus the means to place it.

    With a ``GraphedPlacer`` the buffer is the placer's static staging for T tokens and placement is
    a graph replay; otherwise the buffer is a plain tensor and placement an eager kv_ops call.
    ``free`` is recorded when the slot's last user (copy or kernel) finished with it.
    """

    def __init__(self, engine: DevicePipeline, placer: Any) -> None:
        self.engine = engine
        self.placer = placer
        self.own: torch.Tensor | None = None
        self.free = engine._sync.event()
        self.ready = engine._sync.event()
        self.used = False

    def buffer(self, tokens: int) -> tuple[torch.Tensor, bool]:
        """``[L, KV, T, ROW]`` staging for ``tokens`` tokens, and whether it is graph-backed."""
        e = self.engine
        # Without lazy capture only warmed sizes replay graphs: nothing is captured while serving.
        if self.placer is not None and (e.lazy_capture or self.placer.has_chunk_graphs(tokens)):
            try:
                # The placer's buffers hold the cache's bits (an integer dtype of the same width).
                return self.placer.staging(tokens).view(self.engine.dtype), True
            except ValueError:
                announce_once(
                    log,
                    "kv_ops.placer-full",
                    logging.INFO,
                    "maru.kv_ops: chunk of %d tokens has no graph bucket left; placing it with an eager launch",
                    tokens,
                )
        numel = e.num_layers * e.layout.num_kv * tokens * e.layout.row_size
        if self.own is None or self.own.numel() < numel:
            if self.used:
                e._sync.synchronize(self.free)  # the old buffer may still be read by a queued copy
            self.own = torch.empty(numel, dtype=e.dtype, device=e.device)
        return self.own[:numel].view(e.object_shape(tokens)), False

    def place(self, stage: torch.Tensor, graphed: bool, slots: torch.Tensor, *, load: bool) -> None:
        """Scatter ``stage`` into the caches (load) or gather into it (store), on the current stream."""
        e = self.engine
        if graphed:
            t = self.placer.set_slots(slots)
            if load:
                self.placer.scatter(t)
            else:
                self.placer.gather(t)
        elif load:
            ops.scatter(stage, e.caches, e.layout, slots, backend=e.backend)
        else:
            ops.gather(e.caches, e.layout, slots, backend=e.backend, out=stage)
