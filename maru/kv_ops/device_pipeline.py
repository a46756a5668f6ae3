"""``DevicePipeline``: chunk objects in host memory (the pool) <-> one device's paged KV caches.

It takes the per-layer caches and their ``KVLayout`` once, then stores and loads chunk objects
``[L, KV, T, ROW]`` (``kv_ops.geometry``) that live in host memory, normally tensors over the
CUDA-registered pool mapping. On a GPU a ring of staging slots overlaps the copy engine with the
placement kernels:

* LOAD: the copy of chunk i into slot ``i % R`` runs while chunk i-1 is scattered out of its slot;
  events order each placement after its copy and each copy after the slot's previous placement.
* STORE mirrors it (gather into a slot, then copy to the pool page); ``store_path="direct"`` has the
  gather kernel write the pool pages in place instead (``kv_ops.store_paths``); ``paced=True``
  runs it on a stream and a slot of its own, each chunk's gather between two chunk copies, so that the
  inference engine's own copies are not held behind it (``kv_ops.paced_store``). Commit (publish keys) only after
  ``Transfer.wait()`` / ``done()``: a visible key means complete bytes.
* LAYERS (``load_layers``): see ``kv_ops.layer_copies`` (the copy engines, the default where CUDA
  has batched copies) and ``kv_ops.layer_paths`` (direct and staged); one event per layer.

Invariants:

* Every operation starts after the work already queued on the caller's current stream: a load never
  races the computation that last used those blocks, a store reads what the forward just wrote.
* Issue never blocks the host on the GPU (except when a graph is first captured). The host objects
  stay referenced by the handle until it has completed.
* Kernels receive the caches as detected (``KVLayout`` carries the physical strides).
* A skipped token (negative slot, or within ``skip_tokens``) is never written into the cache; in a
  stored object the rows of negative slots are unspecified.
* On CPU caches there is nothing to pipeline: each call runs ``kv_ops`` directly between the pool
  and the cache (announced once, at info level: the normal CPU path).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from maru.announce import announce_once
from maru.config import LAYER_PATHS
from maru.kv_ops import checksum as ck
from maru.kv_ops import ops
from maru.kv_ops.chunk_loads import ChunkLoads, fused_checksums_wanted
from maru.kv_ops.cuda_sync import D2H, RawSync, TorchSync, current_stream_handle
from maru.kv_ops.device_handles import LayerLoad, Transfer
from maru.kv_ops.geometry import ObjectGeometry, host_object
from maru.kv_ops.host_scratch import HostScratch
from maru.kv_ops.layer_copies import CopiedLayers
from maru.kv_ops.layer_paths import LayerPaths, Placer, _bucket
from maru.kv_ops.layout import KVLayout
from maru.kv_ops.paced_store import PacedStores, tail_sizes
from maru.kv_ops.pipeline_inputs import PipelineInputs
from maru.kv_ops.staging_slot import StagingSlot
from maru.kv_ops.store_paths import STORE_PATHS, StorePaths
from maru.kv_ops.store_segments import StoreSegments
from maru.segments import SegmentSums

log = logging.getLogger("maru.kv_ops")

DEFAULT_RING_SLOTS = 3  # one slot filling, one draining, one spare to absorb issue jitter


__all__ = ["DEFAULT_RING_SLOTS", "DevicePipeline", "LayerLoad", "Transfer", "host_object"]


# ---------------------------------------------------------------------- the engine


class DevicePipeline(
    PipelineInputs, ChunkLoads, CopiedLayers, LayerPaths, StorePaths, PacedStores, StoreSegments
):
    """Stores and loads chunk objects between host memory and one set of paged caches.

    ``caches``: the per-layer cache tensors (or the one cross-layer tensor) as the inference engine
    allocated them (they never move); ``layout``: ``kv_ops.detect_layouts`` of them. GPU state
    (streams, events, the staging ring, graphs) is made once here or on first use. Thread-safe: issue
    is serialized by a lock; handles may be waited on from any thread.

    ``use_graphs``: replay placements from CUDA graphs (kv_ops's ``GraphedPlacer``) when Triton runs;
    ``raw_cuda``: issue the layer path's copies and events through libcudart directly;
    ``layer_checksums``: the layer loads will ask for checksums (``warm`` captures those graphs);
    ``store_path``: "staged" (the staging ring and the copy engine) or "direct" (the gather kernel
    writes the objects in place, ``kv_ops.store_paths``; raises where the GPU cannot address them).

    Checksums (``checksums=True`` on ``load``/``store``/``load_layers``): the handle's
    ``checksums()`` gives, once complete, ``maru.checksum`` of each object as the transfer saw it:
    the staging slot after its copy (load) or after the gather (store), the rows the direct
    layer kernel read; computed on the device (``kv_ops.checksum``), no host pass over the bytes.
    """

    # Why the last store committed no segment sums (None: it did, or none were asked for).
    segments_off: str | None = None

    def __init__(
        self,
        caches: Any,
        layout: KVLayout,
        *,
        ring_slots: int = DEFAULT_RING_SLOTS,
        backend: str | None = None,
        use_graphs: bool = True,
        raw_cuda: bool = True,
        layer_path: str = "auto",
        layer_graphs: bool | None = None,
        lazy_capture: bool = True,
        layer_checksums: bool = False,
        store_path: str = "staged",
        fuse_checksums: bool | None = None,
    ) -> None:
        if layer_path not in LAYER_PATHS:
            raise ValueError(f"layer_path must be one of {LAYER_PATHS}, got {layer_path!r}")
        if store_path not in STORE_PATHS:
            raise ValueError(f"store_path must be one of {STORE_PATHS}, got {store_path!r}")
        self.store_path = store_path
        self._direct_store_ok: bool | None = None  # decided on the first store (needs an object)
        if isinstance(caches, dict):
            caches = list(caches.values())
        self.layout = layout
        self.cross_layer = layout.is_cross_layer
        self.caches: Any = caches if self.cross_layer else list(caches)
        first = caches if isinstance(caches, torch.Tensor) else self.caches[0]
        self.dtype = first.dtype
        self.device = first.device
        self.num_layers = int(layout.num_layers) if self.cross_layer else len(self.caches)
        self.backend = backend
        self.esize = first.element_size()
        self.geometry = ObjectGeometry.of(self.caches, layout)
        self.layer_token_bytes = layout.num_kv * layout.row_size * self.esize  # one token of one layer
        self.object_token_bytes = self.num_layers * self.layer_token_bytes  # one token of a chunk object
        self.ring_slots = max(int(ring_slots), 1)
        self.layer_path = layer_path
        self.layer_checksums = layer_checksums  # which direct layer graphs ``warm`` captures
        # The chunk load's checksum inside its scatter (``ChunkLoads``); None: the environment's.
        self.fuse_checksums = fused_checksums_wanted() if fuse_checksums is None else fuse_checksums
        self._direct_ok: bool | None = None  # decided on the first layer load (needs an object)
        self._lock = threading.RLock()  # ``issuing`` holds it across a load's issue
        self.on_gpu = self.device.type == "cuda"
        self.graphs = False
        self._scratch: HostScratch | None = None
        if not self.on_gpu:
            announce_once(
                log,
                "kv_ops.cpu-direct",
                logging.INFO,
                "maru.kv_ops: no CUDA: direct CPU placement (caches on %s; pool <-> cache with kv_ops, no staging)",
                self.device,
            )
            return
        raw = RawSync.load() if raw_cuda else None
        if raw_cuda and raw is None:
            announce_once(
                log,
                "kv_ops.raw-cuda",
                logging.INFO,
                "maru.kv_ops: libcudart not found in this process; the layer-overlap load issues copies and "
                "events through torch (same bytes, a few microseconds more issue time per layer)",
            )
        self._sync: Any = raw or TorchSync()
        self._copy_stream = torch.cuda.Stream(self.device)
        self._place_stream = torch.cuda.Stream(self.device)
        self._place_h = int(self._place_stream.cuda_stream)  # the raw handle: read once, used per call
        # Pinned buffers for the loads' uploads (slot mappings, direct tables); raw calls only.
        self._scratch = HostScratch(raw) if raw is not None else None
        self.graphs = use_graphs and self._graphs_usable()
        self._ring = [StagingSlot(self, self._new_placer()) for _ in range(self.ring_slots)]
        self._host_sums = ck.HostSums()  # the checksums' device-to-host buffers, reused
        self._segment_bufs = {}  # the store's segment sums' device buffers, per stream (StoreSegments)
        self._next_slot = 0
        # The layer path may replay graphs while the chunk paths run eagerly (layer_graphs=True,
        # use_graphs=False): per-layer issue cost is what the layer-overlap load is judged on.
        want_layer_graphs = use_graphs if layer_graphs is None else layer_graphs
        self.layer_graphs = want_layer_graphs and (self.graphs or self._graphs_usable())
        self.lazy_capture = lazy_capture
        self._layer_placer = self._new_placer(self.layer_graphs)
        # Warmed direct-path sizes also get one graph for all layers (one launch a load).
        self.one_launch_layers = True
        self._layer_own: torch.Tensor | None = None
        self._layer_free: Any = None  # event: last placement out of the layer staging
        self._event_sets: list[tuple[list[Any], list[Any]]] = []
        self._event_set_next = 0
        self._checked_pinned = False

    # ------------------------------------------------------------------ setup helpers

    def _graphs_usable(self) -> bool:
        from maru.kv_ops.selection import choose

        if self.backend == "reference" or (self.backend is None and choose("cuda").name != "triton"):
            return False
        try:
            from maru.kv_ops.placer import GraphedPlacer  # noqa: F401
        except ImportError as exc:
            announce_once(
                log,
                "kv_ops.no-placer",
                logging.INFO,
                "maru.kv_ops: no graph placer (%s); placements are eager launches (~30 us of host time each)",
                exc,
            )
            return False
        return True

    def _new_placer(self, graphs: bool | None = None) -> Any:
        if not (self.graphs if graphs is None else graphs):
            return None
        from maru.kv_ops.placer import GraphedPlacer

        return GraphedPlacer(self.caches, self.layout, launcher=self._sync if self._sync.raw else None)

    def _layer_events(self) -> tuple[list[Any], list[Any]]:
        """(copied, placed) event lists for one layer-path call, recycled over 4 calls."""
        if len(self._event_sets) < 4:
            s = self._sync
            self._event_sets.append(
                ([s.event() for _ in range(self.num_layers)], [s.event() for _ in range(self.num_layers)])
            )
            return self._event_sets[-1]
        self._event_set_next = (self._event_set_next + 1) % 4
        return self._event_sets[self._event_set_next]

    # ------------------------------------------------------------------ geometry

    def object_shape(self, tokens: int) -> tuple[int, int, int, int]:
        """Shape of a chunk object of ``tokens`` tokens: ``[L, KV, T, ROW]``."""
        return self.geometry.shape(tokens)

    def object_bytes(self, tokens: int) -> int:
        return self.geometry.nbytes(tokens)

    def host_object(self, buffer: Any, tokens: int, offset: int = 0) -> torch.Tensor:
        """A chunk object of ``tokens`` tokens over ``buffer`` at byte ``offset`` (no copy)."""
        return self.geometry.over(buffer, tokens, offset)

    # ------------------------------------------------------------------ public operations

    def load(
        self,
        objects: Sequence[torch.Tensor] | torch.Tensor,
        slot_mapping: torch.Tensor | Callable[[], torch.Tensor],
        *,
        skip_tokens: int = 0,
        pipelined: bool = True,
        checksums: bool = False,
    ) -> Transfer:
        """Scatter chunk objects (host) into the caches at ``slot_mapping`` (their tokens, in order).

        ``slot_mapping`` may be a function returning it: the pipelined path calls it once its first
        chunk copy is queued (the mapping's host work then runs while that copy is on the bus).
        ``skip_tokens=n`` leaves the first n tokens of the call unwritten (blocks shared with the
        engine's own prefix cache). Returns at once on a GPU; ``wait()``/``wait_on()`` the handle.
        ``checksums``: see the class docstring (skipped tokens are part of their object).
        """
        objs = self._objects(objects)
        nbytes = sum(objs.tokens) * self.object_token_bytes
        with self._lock:
            if self.on_gpu and pipelined:
                self._check_pinned(objs)
                return self._issue_load(objs, slot_mapping, skip_tokens, nbytes, checksums)
            if callable(slot_mapping):
                slot_mapping = slot_mapping()
            slots = self._slots(slot_mapping, objs, skip_tokens)
            if not self.on_gpu:
                for obj, s in self._per_chunk(objs, slots):
                    ops.scatter(obj, self.caches, self.layout, s, backend=self.backend)
                return ck.attach_host_checksums(Transfer("load", "cpu-direct", nbytes), objs, checksums)
            self._check_pinned(objs)
            return self._sync_path(objs, slots, nbytes, load=True, checksums=checksums)

    def store(
        self,
        objects: Sequence[torch.Tensor] | torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        pipelined: bool = True,
        checksums: bool = False,
        paced: bool = False,
        segment_tokens: int | None = None,
    ) -> Transfer:
        """Gather the caches' KV at ``slot_mapping`` into chunk objects (host, e.g. pool pages).

        The objects' bytes are complete only after ``wait()`` (or once ``done()`` is True): commit
        (publish the keys) after that, never before. ``checksums``: see the class docstring (of
        the gathered bytes, the checksum to commit with them). ``paced`` (GPU, staged store path):
        a store behind the inference engine's back (write-behind) that yields the copy engine
        between chunks and shares nothing with loads (``kv_ops.paced_store``; path "paced").
        ``segment_tokens`` (with ``checksums``): also compute each object's segment sums of that
        many tokens a segment (``maru.segments``; the handle's ``segment_sums()``): on a GPU from
        the caches themselves, before the store's own work (``kv_ops.segment_kernels``).
        """
        objs = self._objects(objects)
        nbytes = sum(objs.tokens) * self.object_token_bytes
        seg = int(segment_tokens) if checksums and segment_tokens else None
        with self._lock:
            # Queued first: every wait of the store's streams on the caller's stream comes after it,
            # so the store's completion covers these sums.
            segs = self._queue_segments(objs, slot_mapping, seg) if seg and self.on_gpu else None
            slots = self._slots(slot_mapping, objs, 0)
            if not self.on_gpu:
                for obj, s in self._per_chunk(objs, slots):
                    ops.gather(self.caches, self.layout, s, backend=self.backend, out=obj)
                handle = Transfer("store", "cpu-direct", nbytes)
                return ck.attach_host_checksums(handle, objs, checksums, segment_tokens=seg)
            self._check_pinned(objs)
            if pipelined and self._use_direct_store(objs[0]):
                handle = self._issue_store_direct(objs, slots, nbytes, checksums)
            elif (
                pipelined
                and paced
                and (paced_handle := self._issue_store_paced(objs, slots, nbytes, checksums))
            ):
                handle = paced_handle
            elif pipelined:
                handle = self._issue_store(objs, slots, nbytes, checksums)
            else:
                handle = self._sync_path(objs, slots, nbytes, load=False, checksums=checksums)
            if segs is not None:
                handle.set_segments(*segs)
            return handle

    def load_layers(
        self,
        objects: Sequence[torch.Tensor] | torch.Tensor,
        slot_mapping: torch.Tensor,
        *,
        skip_tokens: int = 0,
        placer: Placer | None = None,
        checksums: bool = False,
        segments: Sequence[SegmentSums | None] | None = None,
    ) -> LayerLoad:
        """Issue a load layer by layer (the layer-overlap load); returns at once.

        For each layer i: the copy engine brings layer i of every chunk into a staging buffer, the
        single-layer kernel places it, an event is recorded. The forward pass calls
        ``wait_for_layer(i)`` before attention of layer i and waits on layer i's event only.
        ``placer(obj_layer [KV, T, ROW], layer, slots)`` replaces the built-in placement.
        ``checksums``: see the class docstring; the direct kernel computes them as it reads (the
        skipped rows too), the staged way sums the staging after the last layer (one launch). On a
        GPU both need rows of whole 8-byte words (``triton_kernels.fused_checksum_ok``).
        ``segments`` (with ``checksums``): each object's committed segment sums (``maru.segments``)
        or None; where the direct kernel and the CPU place only some segments of an object, they
        read only those, and its checksum counts the others at their committed sums.
        """
        objs = self._objects(objects)
        nbytes = sum(objs.tokens) * self.object_token_bytes
        segments = list(segments) if checksums and segments is not None and any(segments) else None
        if segments is not None and len(segments) != len(objs):
            raise ValueError(f"{len(segments)} segment sums for {len(objs)} objects")
        with self._lock:
            if not self.on_gpu:
                slots = self._slots(slot_mapping, objs, skip_tokens)
                for i in range(self.num_layers):
                    for obj, s in self._per_chunk(objs, slots):
                        self._eager_layer(obj[i], i, s, placer)
                handle = LayerLoad(nbytes, None, None, None)
                return ck.attach_host_checksums(handle, objs, checksums, slots, segments)
            self._check_pinned(objs)
            if checksums:
                self._check_layer_checksums()
            if placer is None and self._use_copies(slot_mapping, objs[0]):
                try:
                    return self._issue_layers_copied(
                        objs, slot_mapping, skip_tokens, nbytes, checksums, segments
                    )
                except torch.OutOfMemoryError as e:  # its staging: nothing was queued yet
                    self._copies_failed(e)
            if placer is None and self._use_direct(objs[0]):
                return self._issue_layers_direct(objs, slot_mapping, skip_tokens, nbytes, checksums, segments)
            slots = self._slots(slot_mapping, objs, skip_tokens)
            return self._issue_layers(objs, slots, nbytes, placer, checksums)

    def warm(self, chunk_tokens: int, layer_tokens: Sequence[int] = ()) -> None:
        """Capture the CUDA graphs and compile the checksum kernels now (about a millisecond each, with
        a device sync; a fresh host's first Triton compile ~0.6 s), not on a request's first use.

        ``chunk_tokens``: the chunk size of the pipelined paths (every ring slot); ``layer_tokens``:
        request sizes the layer-overlap load will see (rounded up to their power-of-two bucket).
        The warm-up launches place nothing: the static slot buffers hold -1 until a call sets them.
        No-op without graphs (CPU, reference backend). With ``lazy_capture=False`` only warmed sizes
        are replayed from graphs; other sizes launch eagerly (no capture while serving).
        """
        if not self.on_gpu:
            return
        with self._lock, torch.cuda.stream(self._place_stream):
            if chunk_tokens and self.backend != "reference":  # the kernels launched eagerly, compiled now
                ck.warm(
                    torch.empty(self.object_shape(int(chunk_tokens)), dtype=self.dtype, device=self.device)
                )
                self._warm_segments(int(chunk_tokens))
            if chunk_tokens and self.graphs:
                if any(slot.used for slot in self._ring):
                    # A capture replays its op once eagerly; after a transfer the static slots hold
                    # real slots.
                    raise RuntimeError("DevicePipeline.warm(chunk_tokens) must run before the first transfer")
                # Every block multiple below the chunk too (a prompt's partial tail: a sync store's
                # gather, a chunk load's scatter), each a view of the slot's one chunk-sized staging.
                tails = tail_sizes(int(chunk_tokens), int(self.layout.block_size))
                for slot in self._ring:
                    self._warm_slot(slot.placer, int(chunk_tokens), tails, loads=True)
                self._warm_paced(int(chunk_tokens))
            if layer_tokens and self.warm_copied():
                return  # the copied way replays no graphs: none to capture for the direct way
            if self._layer_placer is None:
                return
            for tokens in layer_tokens:
                tb = _bucket(tokens)
                if self.layer_path == "staged":
                    if self._layer_free is not None:
                        raise RuntimeError(
                            "DevicePipeline.warm(layer_tokens) must run before the first layer load"
                        )
                    self._layer_placer.warm(tb, per_layer=True)
                else:
                    # The direct path needs only its per-layer graphs (no staging). Its capture replays
                    # the kernel once eagerly: clear the table's slots first (stream-ordered after any
                    # earlier load), so that replay places nothing.
                    self._layer_placer.direct_table(tb)[2].fill_(-1)
                    self._layer_placer.warm_direct(tb, checksum=self.layer_checksums)
                    if self.one_launch_layers and self._layer_placer.can_launch_all():
                        self._warm_one_launch(tb)

    def _warm_one_launch(self, tb: int) -> None:
        """Capture the one-launch layer loads of bucket ``tb``; if CUDA refuses, the per-layer
        replays stay (same bytes, ~10 us more host time a layer), announced once."""
        try:
            self._layer_placer.warm_direct_all(tb, checksum=self.layer_checksums)
        except Exception as e:  # a driver without event-record nodes in captures, say
            self.one_launch_layers = False
            if self._sync.raw:
                self._sync.clear_error()  # torch's next launch check would otherwise report it
            announce_once(
                log,
                "kv_ops.one-launch",
                logging.WARNING,
                "maru.kv_ops: the one-launch layer load could not be captured (%s: %s); each layer is "
                "issued on its own (same bytes, ~10 us more host time a layer). Fix: a CUDA runtime with "
                "event-record nodes in stream capture (11.1 or later); maru stats shows the path in use",
                type(e).__name__,
                e,
            )

    def synchronize(self) -> None:
        """Wait for everything this engine issued (tests, shutdown)."""
        if self.on_gpu:
            self._copy_stream.synchronize()
            self._place_stream.synchronize()
            self._settle_paced()

    # ------------------------------------------------------------------ GPU paths

    def _start(self) -> None:
        """Both engine streams start after the work queued so far on the caller's stream."""
        self._after_caller(self._copy_stream, self._place_stream)

    def _after_caller(self, *streams: Any) -> None:
        """Each of ``streams`` waits for the work queued so far on the caller's current stream."""
        if not self._sync.raw:
            self._follow(torch.cuda.current_stream(self.device), *streams)
            return
        # The raw handle of the current stream: no torch Stream object built on the issue path.
        if getattr(self, "_follow_event", None) is None:
            self._follow_event = self._sync.event()
        self._sync.record_on(self._follow_event, current_stream_handle(self.device))
        for s in streams:
            self._sync.wait_on(s.cuda_stream, self._follow_event)

    def _follow(self, source: Any, *streams: Any) -> None:
        """Each of ``streams`` waits for the work queued so far on ``source``.

        Through libcudart when available: one engine-owned event recorded on ``source``, one wait on
        it per stream (a few us, against ~15 us for each of torch's ``wait_stream``). Re-recording
        the event later (here, or for another source) is safe: each wait captured the recording it
        saw, and every record and wait is queued under the engine's lock.
        """
        if not self._sync.raw:
            for s in streams:
                s.wait_stream(source)
            return
        if getattr(self, "_follow_event", None) is None:
            self._follow_event = self._sync.event()
        self._sync.record(self._follow_event, source)
        for s in streams:
            self._sync.wait(s, self._follow_event)

    def _h2d(self, stage: torch.Tensor, host: torch.Tensor) -> None:
        """Queue ``stage <- host`` on the copy stream (raw cudaMemcpyAsync when available)."""
        if self._sync.raw:
            self._sync.copy(
                stage.data_ptr(), host.data_ptr(), host.numel() * self.esize, self._copy_stream.cuda_stream
            )
        else:
            with torch.cuda.stream(self._copy_stream):
                stage.copy_(host, non_blocking=True)

    def _d2h(self, host: torch.Tensor, stage: torch.Tensor, stream: Any = None) -> None:
        """Queue ``host <- stage`` on ``stream`` (default: the copy stream)."""
        stream = stream or self._copy_stream
        if self._sync.raw:
            n = host.numel() * self.esize
            self._sync.copy(host.data_ptr(), stage.data_ptr(), n, stream.cuda_stream, D2H)
        else:
            with torch.cuda.stream(stream):
                host.copy_(stage, non_blocking=True)

    def _take_slot(self) -> StagingSlot:
        slot = self._ring[self._next_slot]
        self._next_slot = (self._next_slot + 1) % self.ring_slots
        return slot

    def _handle(
        self,
        kind: str,
        path: str,
        nbytes: int,
        stream: Any,
        t0: float,
        objs: list[torch.Tensor],
        slots: Any,
        acc: Any,
        sums: Any,
        *keep: Any,
    ) -> Transfer:
        """The handle of a transfer whose last work is queued on ``stream``: its done event recorded
        there, the checksums attached, the tensors its work reads kept alive (``keep``: more)."""
        # A store's completion is waited for by the write-behind drain thread: a blocking event, so
        # that wait sleeps instead of spinning a core (loads are waited for on the forward thread).
        done = self._done_event(blocking=kind == "store")
        self._sync.record(done, stream)
        handle = Transfer(kind, path, nbytes, done, self._sync, (objs, slots, acc, *keep))
        if sums is not None:
            handle.set_checksums(sums, [o.numel() * self.esize for o in objs], self._host_sums)
        handle.issue_s = time.perf_counter() - t0
        return handle

    def _done_event(self, blocking: bool = False) -> Any:
        # Raw events are engine-owned; done events of the pipelined path are recycled over 64 calls
        # (a handle kept longer waits, at worst, for a later transfer: never too early). Blocking
        # and spinning events are two rings.
        if not self._sync.raw:
            return self._sync.event(blocking=blocking)
        rings = self.__dict__.setdefault("_done_rings", {})
        ring = rings.get(blocking)
        if ring is None:
            ring = rings[blocking] = [[self._sync.event(blocking=blocking) for _ in range(64)], 0]
        ring[1] = (ring[1] + 1) % len(ring[0])
        return ring[0][ring[1]]

    def _sync_path(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, *, load: bool, checksums: bool
    ) -> Transfer:
        """The unpipelined baseline: per chunk the whole copy, then the whole kernel, one stream, then wait."""
        t0 = time.perf_counter()
        stream = torch.cuda.current_stream(self.device)
        stream.wait_stream(self._place_stream)  # the slot mapping was moved there
        acc = torch.zeros(len(objs), dtype=torch.int64, device=self.device) if checksums else None
        for k, (obj, s) in enumerate(self._per_chunk(objs, slots)):
            if load:
                dev = obj.to(self.device, non_blocking=True)
                ops.scatter(dev, self.caches, self.layout, s, backend=self.backend)
            else:
                dev = ops.gather(self.caches, self.layout, s, backend=self.backend)
                obj.copy_(dev, non_blocking=True)
            if acc is not None:
                ck.accumulate(dev, acc, k)
        stream.synchronize()
        handle = Transfer("load" if load else "store", "sync", nbytes)
        if acc is not None:
            handle.set_checksums(acc.cpu(), [o.numel() * self.esize for o in objs])
        handle.issue_s = time.perf_counter() - t0
        return handle
