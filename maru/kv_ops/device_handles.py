"""Handles of transfers issued on a ``DevicePipeline``: poll ``done()``, ``wait()``, or make a stream wait.

A handle keeps the host objects (pool pages) and device tensors its copies use alive until it
has completed; drop it only after ``done()`` or ``wait()``.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from maru.kv_ops.cuda_sync import current_raw_stream

_SUMS_LOCK = threading.Lock()


class Transfer:
    """Handle of one issued store or load. ``wait()`` before committing keys or unpinning entries."""

    def __init__(
        self,
        kind: str,
        path: str,
        nbytes: int,
        done_event: Any = None,
        sync: Any = None,
        keepalive: Any = None,
    ) -> None:
        self.kind = kind  # "load" | "store"
        self.path = path  # "pipelined" | "sync" | "cpu-direct" | "layers"
        self.nbytes = nbytes
        self.issue_s = 0.0  # host seconds spent issuing
        self.copies_shared = 0  # objects placed from another object's copy (the same host page)
        self.unread_bytes = 0  # bytes of segments a verifying load neither placed nor read
        # A store's segment sums (``maru.segments``): (tokens a segment, segments an object at most,
        # tokens per object, host raw sums valid once done, the HostSums they came from).
        self._segments: tuple[int, int, list[int], Any, Any] | None = None
        self._event = done_event  # None when complete at return (CPU, sync)
        self._sync = sync
        self._keepalive = keepalive
        # Checksums of the bytes this transfer moved (``checksums=True``): raw sums per object in a
        # host tensor written by the transfer itself (valid once done), and each object's length.
        self._sums: torch.Tensor | list[int] | None = None
        self._sizes: list[int] = []
        self._sums_pool: Any = None  # the HostSums the sums buffer came from, while this handle owns it

    def set_checksums(self, sums: torch.Tensor | list[int], sizes: list[int], pool: Any = None) -> None:
        """Attach the raw checksum sums (``kv_ops.checksum``) the transfer writes, per object.
        ``pool``: the ``HostSums`` that ``sums`` came from (given back once read after completion)."""
        self._sums, self._sizes, self._sums_pool = sums, list(sizes), pool

    def checksums(self) -> list[int] | None:
        """``maru.checksum`` of each object's bytes as this transfer saw them (the staging slot
        after the copy, or the rows the direct kernel read); None when not asked for. Call after
        ``wait()`` or once ``done()``: before that the values are not written yet."""
        if self._sums is None:
            return None
        from maru.kv_ops.checksum import finalize

        # One lock for every handle (each reads its sums once or twice): two threads reading one
        # handle's sums must not give its buffer back twice, nor read it after it was handed out.
        with _SUMS_LOCK:
            sums = self._sums
            if isinstance(sums, torch.Tensor):
                raw = sums.tolist()
                if self.done():  # nothing writes into the buffer any more: keep the values, free it
                    self._sums = raw
                    pool, self._sums_pool = self._sums_pool, None
                    if pool is not None:
                        pool.give_back(sums)
            else:
                raw = sums
        return [finalize(r, n) for r, n in zip(raw, self._sizes, strict=True)]

    def set_segments(self, tokens: int, most: int, lengths: list[int], sums: Any, pool: Any = None) -> None:
        """Attach a store's segment sums: ``sums[k * most + s]`` is segment ``s`` of object ``k``
        (raw, int64), written by work this transfer's completion covers."""
        self._segments = (tokens, most, list(lengths), sums, pool)

    def segment_sums(self) -> list[Any] | None:
        """Each object's ``SegmentSums`` (None where not computed). After ``wait()`` or ``done()``."""
        if self._segments is None:
            return None
        from maru.checksum import MASK64
        from maru.segments import SegmentSums

        with _SUMS_LOCK:
            tokens, most, lengths, sums, pool = self._segments
            if isinstance(sums, torch.Tensor):
                raw = sums.tolist()
                if self.done():
                    self._segments = (tokens, most, lengths, raw, None)
                    if pool is not None:
                        pool.give_back(sums)
            else:
                raw = sums
        out = []
        for k, t in enumerate(lengths):
            n = -(-t // tokens)
            # Raw sums come back as int64 (two's complement): as unsigned 64-bit values.
            out.append(SegmentSums(tokens, tuple(int(r) & MASK64 for r in raw[k * most : k * most + n])))
        return out

    def done(self) -> bool:
        """True once every copy and kernel of this transfer finished (never blocks)."""
        if self._event is None or self._sync.query(self._event):
            self._keepalive = None
            return True
        return False

    def wait(self) -> None:
        """Block the calling thread until the transfer completed."""
        if self._event is not None:
            self._sync.synchronize(self._event)
        self._keepalive = None

    def wait_on(self, stream: Any = None) -> None:
        """Make ``stream`` (default: the current stream) wait for this transfer; the host does not block."""
        if self._event is None:
            return
        if stream is None and getattr(self._sync, "raw", False):
            self._sync.wait_on(current_raw_stream(), self._event)
            return
        self._sync.wait(stream or torch.cuda.current_stream(), self._event)


class LayerLoad(Transfer):
    """A load issued layer by layer: ``wait_for_layer(i)`` waits for layer i alone.

    Layer events are recycled after a few later calls; waiting on a recycled event waits for a
    *later* load of the same layer, which is later in stream order: never too early, at worst late.
    """

    def __init__(
        self,
        nbytes: int,
        layer_events: list[Any] | None,
        sync: Any,
        keepalive: Any,
        done_event: Any = None,
    ) -> None:
        # ``done_event``: recorded after work queued behind the last layer (its checksums).
        done = done_event if done_event is not None else (layer_events[-1] if layer_events else None)
        super().__init__("load", "layers" if layer_events else "cpu-direct", nbytes, done, sync, keepalive)
        self._layer_events = layer_events
        self.graphed = False  # placements replayed from CUDA graphs
        self.copy_issue_s = 0.0  # host time to queue every layer's copies (and the call's setup)
        self.place_issue_s = 0.0  # host time to queue the per-layer placements and their events
        self.issue_parts: dict[str, float] = {}  # the direct issue's host seconds by part (layer_paths)
        self.issue_cpu_s = 0.0  # the issuing thread's CPU seconds over issue_s (the direct issue)

    def wait_for_layer(self, layer: int, stream: Any = None) -> None:
        """Make ``stream`` (default: current) wait until layer ``layer`` is placed. No host block.
        Called once a layer from inside the forward: the raw calls take the current stream's handle
        without building a torch Stream."""
        if self._layer_events is None:
            return
        if stream is None and getattr(self._sync, "raw", False):
            self._sync.wait_on(current_raw_stream(), self._layer_events[layer])
            return
        self._sync.wait(stream or torch.cuda.current_stream(), self._layer_events[layer])

    def layer_done(self, layer: int) -> bool:
        return self._layer_events is None or self._sync.query(self._layer_events[layer])
