"""Data paths: how chunk bytes move between the paged cache and pool pages, one class per path.

``DataPath`` is the whole interface: ``gather`` (cache -> objects over reserved pool pages),
``scatter`` (objects -> cache), ``scatter_layers`` (layer by layer, the layer-overlap load) and
``settle`` (after a failure, wait for whatever the path queued). Each returns a handle of
``maru.transfer.handles``. Slot mappings come in as host int64 tensors (one per chunk); a path
moves them where it needs them.

Integrity: a scatter given ``expected`` (each object's committed checksum) checks the bytes it actually
placed from, after the copy that placed them (the handle's ``mismatched()``): CPU: the pool object after
the scatter (numpy); staged: the device copy; pipelined: the device staging slot after its copy; direct
layer load: inside the kernel, over the rows it read. A gather on a device path also returns the
checksums of what it wrote (``checksums()``), computed on the device.

* ``CpuPath``: kv_ops straight on pool memory (CPU caches).
* ``PipelinedPath`` (``maru.transfer.device_path``): a ``kv_ops.DevicePipeline`` over the
  CUDA-registered pool (copy engine and placement kernels overlapped); asynchronous handles.
* ``StagedPath``: per chunk through device memory with plain host copies (the announced slower
  path when the pipeline cannot be built).

``choose_path`` is the one place a path is picked. Adding a path (say, direct CXL) is one class.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from maru import kv_ops
from maru.kv_ops.checksum import checksum_tensor, host_segment_sums, placed_checksum
from maru.transfer.handles import (
    CompletedHandle,
    LayerHandle,
    ThreadedLayerHandle,
    TransferHandle,
)
from maru.transfer.slot_plan import DeferredSlots, LayerGroup, listed

logger = logging.getLogger("maru.transfer")


class DataPath(ABC):
    """Moves chunk objects between one worker's paged caches and pool pages (see module docstring).

    ``defers_store_gather``: a write-behind store gathers on the drain thread (work that must not stall
    the forward thread), not when it is issued; the forward thread only takes a ``mark()`` that the
    later ``gather(..., after=mark)`` is ordered after. ``registration``: the pool mapping's CUDA
    registration record where one was attempted; ``close()`` undoes it (before the pool is unmapped).
    """

    name: ClassVar[str]
    defers_store_gather: ClassVar[bool] = False
    # Layer loads placed by the device under the forward: the layer-overlap load's default there.
    places_layers_on_device: ClassVar[bool] = False
    pipeline: Any = None  # the kv_ops.DevicePipeline, on the pipelined path
    # Tokens a segment of the segment sums a gather computes with each checksum (maru.segments);
    # None: none (set by the engine, from the cache's block size and the chunk size), and why not.
    segment_tokens: int | None = None
    no_segments: str | None = None

    def segments_off(self) -> str | None:
        """Why this path's stores commit no segment sums (None: they do, or were not asked to)."""
        return self.no_segments

    def __init__(self, caches: list[torch.Tensor], layout: Any, *, backend: str | None = None) -> None:
        self.caches = caches
        self.layout = layout
        self.backend = backend
        self.device = caches[0].device
        self.num_layers = int(layout.num_layers) if layout.is_cross_layer else len(caches)
        self.registration: Any = None
        self._registered_mapping: Any = None

    @abstractmethod
    def gather(
        self, objs: list[torch.Tensor], slots: list[torch.Tensor], *, paced: bool = False, after: Any = None
    ) -> TransferHandle:
        """Fill each object from the cache at its slots. Bytes are complete only once the handle is.

        ``paced``: the store runs behind the inference engine (write-behind); where the path can, it
        yields the copy engine between chunks and shares no stream with loads. ``after``: a
        ``mark()`` taken on the thread that wrote the cache; the gather reads what was queued
        before it (None: what was queued on this thread's current stream)."""

    def mark(self) -> Any:
        """What a gather issued later, from another thread, must be ordered after: the work queued
        so far on this thread's current stream (None where the caches are written synchronously)."""
        return None

    @abstractmethod
    def scatter(
        self,
        objs: list[torch.Tensor],
        slots: list[torch.Tensor] | DeferredSlots,
        expected: list[int] | None = None,
        segments: list[Any] | None = None,
    ) -> TransferHandle:
        """Place each object's tokens at its slots (-1: skipped). Raises if it could not be issued.
        ``slots``: per object, or ``DeferredSlots`` (made when the path needs them). ``expected``: committed checksums, checked against the placed bytes (``mismatched()``);
        ``segments``: their committed segment sums (or None each), which let a path that can read
        only the segments it places."""

    @abstractmethod
    def scatter_layers(
        self,
        groups: list[LayerGroup],
        expected: list[list[int]] | None = None,
        segments: list[list[Any]] | None = None,
    ) -> LayerHandle:
        """Place every group (one request's chunks) layer by layer; items of the handle are groups.
        ``expected``: per group, its objects' committed checksums (``mismatched()`` is flat);
        ``segments``: per group, their committed segment sums (as ``scatter``)."""

    def settle(self) -> None:  # noqa: B027 - nothing is queued on a synchronous path
        """After a failed transfer: wait for whatever this path queued (never raises)."""

    @property
    def paces_stores(self) -> bool:
        """Whether ``gather(..., paced=True)`` really paces (yields the copy engine between chunks)."""
        return False

    @property
    def store_ways(self) -> frozenset[str]:
        """Every way the stores' per-chunk work was queued so far, where a path has a choice."""
        return frozenset()

    def report(self, layer_overlap: bool) -> tuple[dict[str, str], list[str]]:
        """What this path tells ``maru stats``: extra path entries, and why it is slow (if it is)."""
        return {}, []

    def close(self) -> None:
        """Settle, then unregister the pool mapping this path registered (idempotent, never raises)."""
        self.settle()
        mapping, self._registered_mapping = self._registered_mapping, None
        if mapping is None:
            return
        try:
            from maru.client import cuda_host

            cuda_host.unregister_host_mapping(mapping)
        except Exception as e:
            logger.warning("Maru: unregistering the pool mapping from CUDA failed: %s", e)


class _HostPlacement(DataPath):
    """Paths whose placements run on the calling thread: per-chunk failures, threaded layer loads."""

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather(
        self, objs: list[torch.Tensor], slots: list[torch.Tensor], *, paced: bool = False, after: Any = None
    ) -> TransferHandle:
        # Host placement has no copy engine to share (``paced`` changes nothing) and runs where it is
        # called: CPU caches are written synchronously, and the staged path never defers (``after``).
        failed: dict[int, str] = {}
        sums: list[int | None] = []
        segs: list[Any] = []
        for i, (obj, s) in enumerate(zip(objs, slots, strict=True)):
            try:
                cs, seg = self._gather_one(obj, s)
            except Exception as e:  # that object is aborted, never published
                failed[i] = f"{type(e).__name__}: {e}"
                cs, seg = None, None
            sums.append(cs)
            segs.append(seg)
        return CompletedHandle(failed, sums=sums, segments=segs)

    def scatter(
        self,
        objs: list[torch.Tensor],
        slots: list[torch.Tensor] | DeferredSlots,
        expected: list[int] | None = None,
        segments: list[Any] | None = None,
    ) -> TransferHandle:
        failed: dict[int, str] = {}
        bad: list[int] = []
        unread = 0
        for i, (obj, s) in enumerate(zip(objs, listed(slots), strict=True)):
            try:
                placed = self._to_device(obj)
                kv_ops.scatter(placed, self.caches, self.layout, self._to_device(s), backend=self.backend)
            except Exception as e:  # this chunk fails alone: only its request is recomputed
                failed[i] = f"{type(e).__name__}: {e}"
                continue
            # After the scatter: a change to the pool object before or during it shows here.
            if expected is not None:
                seg = segments[i] if segments is not None else None
                cs, skipped = self._checksum(obj, placed, s, seg)
                unread += skipped
                if cs != expected[i]:
                    bad.append(i)
        self.sync()  # complete on return: it may be reported from any thread
        handle = CompletedHandle(failed, mismatched=bad)
        handle.unread_bytes = unread
        return handle

    def scatter_layers(
        self,
        groups: list[LayerGroup],
        expected: list[list[int]] | None = None,
        segments: list[list[Any]] | None = None,
    ) -> LayerHandle:
        moved = [[(obj, self._to_device(s)) for obj, s in g.chunks()] for g in groups]
        return ThreadedLayerHandle(self, moved, self.num_layers, expected, segments)

    def placed_checksums(
        self, parts: list[tuple[torch.Tensor, Any]], segments: list[Any] | None = None
    ) -> tuple[list[int], int]:
        """After a layer-by-layer placement of ``parts`` (object, slots): the checksum each object
        vouches with (``_checksum``), and the bytes left unread."""
        segs = segments if segments is not None else [None] * len(parts)
        got = [
            self._checksum(obj, self._to_device(obj), s, seg)
            for (obj, s), seg in zip(parts, segs, strict=True)
        ]
        return [c for c, _ in got], sum(u for _, u in got)

    def _checksum(
        self, obj: torch.Tensor, placed: torch.Tensor, slots: Any = None, segs: Any = None
    ) -> tuple[int, int]:
        """(The checksum of the bytes a placement read, the bytes it left unread.) The pool object
        itself on the CPU: given its committed segment sums, only the segments holding a placed
        token (``slots`` >= 0) are read and the others count at their committed sums
        (``maru.segments.host_checksum``)."""
        if segs is not None and slots is not None and placed.device.type == "cpu":
            return placed_checksum(placed, slots.cpu().numpy() >= 0, segs)
        return checksum_tensor(placed), 0

    def place_layer(self, obj: torch.Tensor, slots: torch.Tensor, layer: int) -> None:
        """Place layer ``layer`` of one chunk object ``[L, KV, T, ROW]`` at ``slots``."""
        part = self._to_device(obj[layer])
        slots = self._to_device(slots)  # no-op when already there
        if self.layout.is_cross_layer:
            kv_ops.scatter_layer(part, self.caches[0], self.layout, slots, layer=layer, backend=self.backend)
        else:
            kv_ops.scatter_layer(part, self.caches[layer], self.layout, slots, backend=self.backend)

    def sync(self) -> None:
        """Wait until the work this thread queued on the caches' device ran (no-op on CPU)."""

    @abstractmethod
    def _gather_one(self, obj: torch.Tensor, slots: torch.Tensor) -> tuple[int | None, Any]:
        """Gather one object; its checksum and segment sums where the path computed them (else None)."""


class CpuPath(_HostPlacement):
    """CPU caches: kv_ops reads and writes pool memory in place."""

    name = "cpu"
    defers_store_gather = True

    def _gather_one(self, obj: torch.Tensor, slots: torch.Tensor) -> tuple[int | None, Any]:
        kv_ops.gather(self.caches, self.layout, slots, backend=self.backend, out=obj)
        segs = host_segment_sums(obj, self.segment_tokens) if self.segment_tokens else None
        if segs is None:
            return None, None  # batch_store checksums the pool object (the same pass it would be here)
        # One read of the object gives both: the segment sums add up to the checksum.
        return segs.checksum(obj.numel() * obj.element_size()), segs


class StagedPath(_HostPlacement):
    """Device caches without the pipeline: each chunk is staged through device memory with plain
    (pageable, synchronous) host copies. Correct, announced, slower."""

    name = "staged"

    def __init__(self, caches: list[torch.Tensor], layout: Any, *, backend: str | None = None) -> None:
        super().__init__(caches, layout, backend=backend)
        logger.warning(
            "Maru: KV cache on %s: chunks are staged through device memory and copied to/from the pool "
            "with plain (unregistered) host copies; expect host-copy bandwidth. Fix: CUDA caches with a "
            "working kv_ops.DevicePipeline (see the warning above, if any)",
            self.device,
        )

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device)

    def _gather_one(self, obj: torch.Tensor, slots: torch.Tensor) -> tuple[int | None, Any]:
        staged = kv_ops.gather(self.caches, self.layout, slots.to(self.device), backend=self.backend)
        obj.copy_(staged)  # synchronous: the object is complete before it is published
        return checksum_tensor(staged), None  # on the device: no CPU pass over the pool bytes

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def report(self, layer_overlap: bool) -> tuple[dict[str, str], list[str]]:
        return {}, [
            "KV moves through the staged per-chunk path (the pipelined GPU engine could not be built; "
            "the worker log says why). Fix: CUDA caches and a working triton install"
        ]


def choose_path(
    caches: list[torch.Tensor],
    layout: Any,
    client: Any,
    *,
    backend: str | None = None,
    pipelined: bool = True,
    chunk_tokens: int | None = None,
    layer_path: str = "auto",
) -> DataPath:
    """The data path for ``caches``: CPU, else pipelined (pool registered with CUDA), else staged.

    A failed registration is announced by ``cuda_host`` and the pipeline still runs (on pageable
    copies, announced again by it); a pipeline that cannot be built falls back to the staged path,
    announced.
    """
    device = caches[0].device
    if device.type == "cpu":
        return CpuPath(caches, layout, backend=backend)
    registration, mapping = (None, None)
    path: DataPath | None = None
    if device.type == "cuda" and pipelined:
        from maru.transfer.device_path import PipelinedPath

        try:
            registration, mapping = _register_pool(client)
            path = PipelinedPath.build(
                caches, layout, backend=backend, chunk_tokens=chunk_tokens, layer_path=layer_path
            )
        except Exception as e:  # any problem here must leave a working (slower) connector
            logger.warning(
                "Maru: the pipelined GPU transfer engine could not be built (%s: %s); using the staged "
                "per-chunk path",
                type(e).__name__,
                e,
            )
    if path is None:
        path = StagedPath(caches, layout, backend=backend)
    path.registration = registration
    path._registered_mapping = mapping
    return path


def _register_pool(client: Any) -> tuple[Any, Any]:
    """Register the client's pool mapping with CUDA (once per process): (record, mapping it pins)."""
    from maru.client import cuda_host

    mapping = getattr(client, "pool_mapping", None)
    if mapping is None:
        logger.warning(
            "Maru: the client %s exposes no pool mapping; pool pages are not registered with CUDA and "
            "pool<->GPU copies are pageable (slower). Fix: use a MaruHandler",
            type(client).__name__,
        )
        return None, None
    record = cuda_host.register_host_mapping(mapping)
    return record, (mapping if record.registered else None)
