"""The data path of CUDA caches: ``PipelinedPath``, a ``kv_ops.DevicePipeline`` over the registered pool.

Chunks move between the CUDA-registered pool and the caches through the pipeline's copy engine
and placement kernels, ordered after the work on the caller's stream; every handle completes
asynchronously. ``build`` captures the graphs at start (never while serving). The interface and
the host paths are in ``maru.transfer.paths``; ``choose_path`` there picks this one for CUDA caches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from maru.kv_ops.cuda_sync import current_stream_handle, gil_note
from maru.kv_ops.pool_objects import PoolObjects
from maru.transfer.handles import DeviceHandle, DeviceLayerHandle, LayerHandle, TransferHandle
from maru.transfer.paths import DataPath
from maru.transfer.slot_plan import DeferredSlots, LayerGroup, joined_slots

logger = logging.getLogger("maru.transfer")

# Layer-load graphs are captured at start per power-of-two bucket up to this many tokens (larger: eager).
LAYER_WARM_TOKENS = 16384


class PipelinedPath(DataPath):
    """CUDA caches: a ``kv_ops.DevicePipeline`` moves chunks between the registered pool and the
    caches, ordered after the work on the caller's stream; handles complete asynchronously."""

    name = "pipelined"
    places_layers_on_device = True
    # The gather's issue (2-4 ms of host time for 8-32 chunks on the H200 host, plus the RESERVE
    # round trip before it) runs on the drain thread, ordered after the forward by a CUDA event.
    defers_store_gather = True

    def __init__(self, pipeline: Any, *, backend: str | None = None) -> None:
        caches = pipeline.caches if isinstance(pipeline.caches, list) else [pipeline.caches]
        super().__init__(caches, pipeline.layout, backend=backend)
        self.pipeline = pipeline
        self._follower: Any = None  # the stream a gather issued ``after`` a mark is queued from

    MARKS = 16  # raw mark events used in turn

    def mark(self) -> Any:
        if not self.pipeline.on_gpu:
            return None  # CPU caches: written before the forward returned
        sync = self.pipeline._sync
        if not sync.raw:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            return ev
        # On the forward thread: one raw record (~2 us, against ~30 for a new torch event and its
        # record on the H200 host). The events are reused in turn; a gather that waits on one
        # re-recorded since waits for a later point of the forward's stream: late, never early.
        if not hasattr(self, "_marks"):
            self._marks = [sync.event() for _ in range(self.MARKS)]
            self._next_mark = 0
        ev = self._marks[self._next_mark]
        self._next_mark = (self._next_mark + 1) % self.MARKS
        sync.record_on(ev, current_stream_handle(self.device))
        return RawMark(ev, sync)

    def gather(
        self, objs: list[torch.Tensor], slots: list[torch.Tensor], *, paced: bool = False, after: Any = None
    ) -> TransferHandle:
        try:
            if after is None:
                return DeviceHandle(self._store(objs, slots, paced))
            # From another thread: the pipeline follows its caller's current stream, so that stream
            # is one that first waits for the mark (the forward's writes queued before it).
            if self._follower is None:
                self._follower = torch.cuda.Stream(self.device)
            with torch.cuda.stream(self._follower):
                if isinstance(after, RawMark):
                    self.pipeline._sync.wait_on(self._follower.cuda_stream, after.event)
                else:
                    self._follower.wait_event(after)
                return DeviceHandle(self._store(objs, slots, paced))
        except ValueError:
            raise  # rejected before anything was queued
        except Exception:
            self.settle()  # an issue that failed half way may have queued copies
            raise

    def _store(self, objs: list[torch.Tensor], slots: list[torch.Tensor], paced: bool) -> Any:
        seg = self.segment_tokens
        return self.pipeline.store(objs, joined_slots(slots), checksums=True, paced=paced, segment_tokens=seg)

    def scatter(
        self,
        objs: list[torch.Tensor],
        slots: list[torch.Tensor] | DeferredSlots,
        expected: list[int] | None = None,
        segments: list[Any] | None = None,
    ) -> TransferHandle:
        # A whole-chunk load copies each object whole (the copy engine): its checksum reads it all.
        try:
            # Deferred slots are made after the first chunk copy is queued (``DevicePipeline.load``).
            mapping = slots.joined if isinstance(slots, DeferredSlots) else joined_slots(slots)
            load = self.pipeline.load(objs, mapping, checksums=expected is not None)
            return DeviceHandle(load, expected)
        except Exception:
            self.settle()  # a failure at issue may leave copies queued
            raise

    def scatter_layers(
        self,
        groups: list[LayerGroup],
        expected: list[list[int]] | None = None,
        segments: list[list[Any]] | None = None,
    ) -> LayerHandle:
        # One call for every group: they succeed or fail together. Each group's mapping is whole:
        # one join a request (none for one request), not one a chunk.
        segs = None if segments is None else [s for g in segments for s in g]
        # Objects over the pool tensor stay that (``PoolObjects``): the direct issue makes none.
        pool = [g.objs for g in groups if g.objs]
        joined = PoolObjects.joined(pool) if all(isinstance(p, PoolObjects) for p in pool) else None
        try:
            load = self.pipeline.load_layers(
                joined if joined is not None else [o for p in pool for o in p],
                joined_slots([g.slots for g in groups if g.objs]),
                checksums=expected is not None,
                segments=segs,
            )
        except Exception:
            self.settle()
            raise
        want = None if expected is None else [c for g in expected for c in g]
        return DeviceLayerHandle(load, self.num_layers, want)

    def settle(self) -> None:
        try:
            self.pipeline.synchronize()
        except Exception as e:  # a sticky CUDA error: the context runs nothing any more
            logger.error("Maru: waiting for the GPU transfer engine after a failure failed: %s", e)

    @property
    def store_ways(self) -> frozenset[str]:
        """How the pipeline queued its staged stores so far: "libcudart", "torch (<why>)"."""
        return self.pipeline.store_ways

    def segments_off(self) -> str | None:
        return self.no_segments or getattr(self.pipeline, "segments_off", None)

    @property
    def paces_stores(self) -> bool:
        # The paced lane needs nothing beyond CUDA (``kv_ops.paced_store``: each chunk's gather is
        # the kernel between two copies; no device sleep).
        return True

    def report(self, layer_overlap: bool) -> tuple[dict[str, str], list[str]]:
        from maru.kv_ops.launch import slower_launches

        given_up = slower_launches()
        entries = {"kernel_launch": "triton binding" if given_up else "direct"}
        slow = []
        if given_up:
            slow.append(
                "Triton kernels launch through Triton's per-call argument binding (about 5 us of host "
                f"time a call more): {'; '.join(given_up)}. Fix: Triton 3.6 (the release measured)"
            )
        for why in ("segments_unwarmed", "tails_unwarmed"):  # kv_ops.store_segments, paced_store
            if unwarmed := getattr(self.pipeline, why, None):
                slow.append(unwarmed)
        if note := gil_note():  # an A/B left set
            slow.append(note)
        if hasattr(self.pipeline, "load_checksum_way"):
            way, why = self.pipeline.load_checksum_way()  # kv_ops.chunk_loads
            entries["load_checksum"] = way
            slow += [why] if why else []
        if not layer_overlap:
            return entries, slow
        way, why = self.pipeline.layer_way()  # kv_ops.layer_copies
        entries.update({"layer_way": way} if way else {})
        slow += [why] if why else []
        if way == "copy engines":  # no layer graphs to report
            return entries, slow
        graphs = bool(getattr(self.pipeline, "layer_graphs", False))
        placer = getattr(self.pipeline, "_layer_placer", None)
        one_launch = (
            graphs
            and bool(getattr(self.pipeline, "one_launch_layers", False))
            and placer is not None
            and placer.can_launch_all()
        )
        if not graphs:
            slow.append(
                "layer-overlap load without CUDA graphs: ~30 us of host time a layer instead of ~5-8. "
                "Fix: the triton backend (maru doctor: kv_ops backend)"
            )
        elif not one_launch:
            slow.append(
                "layer-overlap load replays one graph per layer (~14-17 us of host time a layer) instead "
                "of one launch for all layers (~5-8): the capture was refused or libcudart is not "
                "reachable (the worker log says which). Fix: a CUDA runtime with event-record nodes "
                "in stream capture (11.1 or later), loaded by torch"
            )
        entries["layer_graphs"] = "on" if graphs else "off"
        entries["layer_launch"] = "one" if one_launch else "per layer"
        return entries, slow

    @classmethod
    def build(
        cls,
        caches: list[torch.Tensor],
        layout: Any,
        *,
        backend: str | None = None,
        chunk_tokens: int | None = None,
        layer_path: str = "auto",
    ) -> PipelinedPath:
        """The pipeline over ``caches``, its graphs captured now (never while serving): the layer-
        overlap graphs, and the chunk graphs for ``chunk_tokens`` (chunks of other sizes, and every
        chunk when it is None, are placed by eager launches)."""
        from maru.kv_ops.device_pipeline import DevicePipeline

        pipeline = DevicePipeline(
            caches[0] if layout.is_cross_layer else caches,
            layout,
            backend=backend,
            # Chunk paths replay the graphs of the chunk size warmed here and launch other sizes
            # eagerly: a graph captured on first use could be captured while the forward runs.
            use_graphs=bool(chunk_tokens),
            layer_graphs=True,
            lazy_capture=False,
            layer_checksums=True,  # the engine verifies every load: warm those graphs
            layer_path=layer_path,
        )
        if chunk_tokens and pipeline.graphs:
            pipeline.warm(int(chunk_tokens))
        if pipeline.layer_graphs and LAYER_WARM_TOKENS:
            t0 = time.perf_counter()
            pipeline.warm(0, layer_tokens=_buckets_up_to(LAYER_WARM_TOKENS))
            logger.info(
                "Maru: layer-overlap loads warmed (%s) for loads up to %d tokens in %.2f s",
                "copy engines" if pipeline._copied_ok else "graphs captured",
                LAYER_WARM_TOKENS,
                time.perf_counter() - t0,
            )
        return cls(pipeline, backend=backend)


def _buckets_up_to(tokens: int) -> list[int]:
    out, tb = [], 16
    while tb <= tokens:
        out.append(tb)
        tb *= 2
    return out


@dataclass(frozen=True)
class RawMark:
    """``PipelinedPath.mark`` through libcudart: a raw ``cudaEvent_t`` recorded on the forward's
    stream, and the ``RawSync`` it belongs to."""

    event: int
    sync: Any

    def query(self) -> bool:
        """Whether the forward's stream passed the mark (as ``torch.cuda.Event.query``)."""
        return bool(self.sync.query(self.event))
