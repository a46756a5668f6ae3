"""The layer-overlap load through the copy engines: ``DevicePipeline``'s *copied* layer way.

Per layer i: ONE ``cudaMemcpyBatchAsync`` brings the rows of layer i that the load reads, of every
chunk object, from the pool into a staging slot on the device; then the direct layer kernel
(``direct_kernel.direct_scatter_layer``, the same kernel and table as the direct way) places and
checksums them from that slot instead of over the bus; one event is recorded. Why: the direct way
reads host memory with the SMs, so inside a forward pass it shares them with the model: on an H200,
a burst step's load beside a stream of GEMMs ran at 68% of pinned bandwidth and made the GEMMs take
2.96x as long, where these copies ran at 97.8% and cost the GEMMs 6% (``bench/layer_contention.py``,
bench/RESULTS.md). It needs the batched copy (CUDA >= 12.8): one ``cudaMemcpyAsync`` per chunk and
layer costs more host time than the direct way saves (4.2-4.4 ms for a 30-chunk step).

Invariants:

* A staging slot holds one layer of every object of the call, each object's region laid out as the
  object's own layer ([KV, T, ROW], full planes), at the object's offset in the slot. The table's
  addresses name the regions of slot 0; layer i is read ``stage_off`` = slot ``i % R``'s offset
  further, and summed as layer i (its checksum words are the object's).
* Only rows the kernel reads are copied: per object and plane, from its first to its last row read
  (slot > -2 with checksums, >= 0 without). Rows outside that range are never read.
* The copy into slot s waits for the placement that last read s (layer i - R of this call, or the
  previous call's last placement); the placement of layer i waits for its copy alone.
* The placements start after the work queued on the caller's stream (``_after_caller``); the
  copies do not wait for it (they write only the staging, and read pool pages the caller pinned).

Opt-in (``layer_path="copied"``), not the default: inside real vLLM 0.26 on an H200 (bench/RESULTS.md,
thirty-sixth pass) the issue of a warm burst step (30 chunks, 32 layers: 32 batched copies of ~45
ranges, 32 kernel launches, 128 event calls) took 6.5-7.5 ms of the worker's host time, against
~2.4 ms for the direct way's one graph launch, and the step's forward took 19.7 ms (V2 runner) and
15.6 ms (V1) against 12-13 ms: the host issue, not the bus, bounds it there. What it would need:
the placements in one CUDA graph (event-wait nodes for the copies) and the copies issued off the
forward's thread.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from maru.announce import announce_once
from maru.kv_ops import ops
from maru.kv_ops.cuda_sync import BatchCopies
from maru.kv_ops.device_handles import LayerLoad
from maru.kv_ops.layer_paths import _bucket
from maru.kv_ops.pipeline_inputs import CHECKED

log = logging.getLogger("maru.kv_ops")

RING_LAYERS = 4  # staging slots at most: copies run up to this many layers ahead of the placements
# The staging's size a call aims at: as many slots (2 to RING_LAYERS) as fit. Two suffice for the
# bus (placing a layer from device memory takes a few percent of its copy's time); more absorb
# issue jitter. A 30-chunk burst step (30 MiB a layer) gets 4 slots, a 64k-token one 2 of 256 MiB.
STAGING_BUDGET = 256 << 20


@dataclass
class CopyPlan:
    """What a copied layer load moves, for layer 0 into slot 0 (``of``), then for every layer
    (``layers``). Host-side numpy only: tested on the CPU against a byte-level replay."""

    src0: np.ndarray  # per copy: source address in layer 0 (int64)
    dst0: np.ndarray  # per copy: offset in a staging slot (int64)
    sizes: np.ndarray  # per copy: bytes (uint64)
    step: np.ndarray  # per copy: source bytes from one layer to the next (int64)
    offset: np.ndarray  # per object: its region's offset in a slot
    slot_bytes: int  # one layer of every object
    SLOT_ALIGN = 512  # slots start at multiples of this: a slot's offset keeps its launch's facts

    @property
    def slot_stride(self) -> int:
        """Bytes from one staging slot to the next."""
        return -(-self.slot_bytes // self.SLOT_ALIGN) * self.SLOT_ALIGN

    @classmethod
    def of(cls, lengths: np.ndarray, read: np.ndarray, ptrs: np.ndarray, kv: int, row_b: int) -> CopyPlan:
        """``lengths``: tokens per object; ``read``: per token of all objects, whether the kernel
        reads its row; ``ptrs``: object addresses; ``kv`` planes of rows of ``row_b`` bytes. An
        object read whole is one copy a layer (its planes are contiguous on both sides); one read
        in part is one copy a plane, of its rows from the first to the last it reads."""
        lengths = np.asarray(lengths, dtype=np.int64)
        starts = np.cumsum(lengths) - lengths
        within = np.arange(int(lengths.sum()), dtype=np.int64) - np.repeat(starts, lengths)
        first = np.minimum.reduceat(np.where(read, within, 1 << 40), starts)
        last = np.maximum.reduceat(np.where(read, within + 1, 0), starts)
        first = np.minimum(first, last)
        plane_b = lengths * row_b
        region = kv * plane_b  # one layer of one object, in the object's layout and in the slot
        offset = np.cumsum(region) - region
        whole = (first == 0) & (last == lengths)
        part = ~whole & (last > first)
        head = first[part] * row_b
        src = [ptrs[whole], *(ptrs[part] + p * plane_b[part] + head for p in range(kv))]
        dst = [offset[whole], *(offset[part] + p * plane_b[part] + head for p in range(kv))]
        size = [region[whole], *([(last[part] - first[part]) * row_b] * kv)]
        step = [region[whole], *([region[part]] * kv)]
        return cls(
            np.concatenate(src).astype(np.int64),
            np.concatenate(dst).astype(np.int64),
            np.ascontiguousarray(np.concatenate(size), dtype=np.uint64),
            np.concatenate(step).astype(np.int64),
            offset,
            int(region.sum()),
        )

    def layers(self, num_layers: int, base: int, ring: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(sources, destinations) as ``[num_layers, copies]`` uint64 (row i: layer i, into slot
        i % ``ring`` of a staging that starts at ``base``, slots ``slot_stride`` apart), and the
        sizes (the same every layer)."""
        ix = np.arange(num_layers, dtype=np.int64)[:, None]
        srcs = self.src0[None, :] + ix * self.step[None, :]
        dsts = base + self.dst0[None, :] + (ix % ring) * self.slot_stride
        return (
            np.ascontiguousarray(srcs.astype(np.uint64)),
            np.ascontiguousarray(dsts.astype(np.uint64)),
            self.sizes,
        )


class CopiedLayers:
    """The copied layer way (a mixin of ``DevicePipeline``; see the module docstring)."""

    # Set by DevicePipeline.__init__ (or its other mixins).
    caches: Any
    layout: Any
    device: Any
    esize: int
    object_token_bytes: int
    num_layers: int
    layer_path: str
    backend: str | None
    _sync: Any
    _scratch: Any
    _host_sums: Any
    _copy_stream: Any
    _place_stream: Any
    _place_h: int
    _after_caller: Callable[..., None]
    _layer_events: Callable[[], tuple[list[Any], list[Any]]]
    _check_slots: Callable[..., torch.Tensor]
    _table_sums: Callable[[torch.Tensor, int], tuple[torch.Tensor, Any]]

    _batch: BatchCopies | None = None
    _copied_ok: bool | None = None  # decided once, on the first layer load that could use it
    copied_off: str | None = None  # why the copied way is not used (None: it is, or not decided)
    copies_oom: str | None = None  # why some loads took the direct way (no staging memory), if any
    _stage: Any = None  # the staging slots (device bytes), grown to a call's need
    _stage_free: Any = None  # event: the last placement that read the staging
    _copy_tab: Any = None  # the device table the placements read

    def _use_copies(self, slot_mapping: Any, obj: torch.Tensor | None = None) -> bool:
        """Whether this layer load takes the copied way (``layer_path="copied"`` only): checked
        once per engine (the batched copy proved on one probe batch, the first objects pinned: the
        pool registered with CUDA; if not, the direct way, announced with the reason and reported
        by ``layer_way``), then per call (a host slot mapping: the rows to copy are planned on the
        host; a device one takes the direct way)."""
        if self.layer_path != "copied":  # opt-in: see the module docstring's last paragraph
            return False
        if self._copied_ok is None:
            why = self._copied_blocker(obj)
            self._copied_ok, self.copied_off = why is None, why
            if why is not None:  # the direct way instead: announced, and a slow path (layer_way)
                announce_once(
                    log,
                    "kv_ops.layer-not-copied",
                    logging.WARNING,
                    "maru.kv_ops: layer_path='copied' cannot run (%s); layer loads take the direct way",
                    why,
                )
                return False
            announce_once(
                log,
                "kv_ops.layer-copied",
                logging.INFO,
                "maru.kv_ops: layer-overlap load through the copy engines (one batched copy a layer into "
                "a device staging slot, then the placement kernel from device memory)",
            )
        return bool(self._copied_ok) and slot_mapping.device.type == "cpu"

    def layer_way(self) -> tuple[str | None, str | None]:
        """(``paths.layer_way`` for the worker's report, or None: the direct way with its default grid; a slow
        path's sentence, or None): what ``layer_path="copied"`` got."""
        if self._copied_ok and self.copies_oom is not None:
            return "copy engines", (
                f"some layer-overlap loads found no device memory for their staging and read the pool "
                f"with the SMs instead ({self.copies_oom}). Fix: vLLM's gpu_memory_utilization a few "
                "hundredths lower"
            )
        if self._copied_ok:
            return "copy engines", None
        if self.copied_off is not None:
            return "direct (the SMs read the pool)", (
                f"layer_path 'copied' was asked for, but layer-overlap loads read the pool with the SMs "
                f"beside the forward pass: {self.copied_off}. Fix: as the reason says (a CUDA runtime "
                "of 12.8 or later, the pool registered with CUDA: maru doctor), or maru_layer_path=auto"
            )
        from maru.kv_ops.direct_kernel import grid_override
        from maru.kv_ops.triton_kernels import TuneParams

        override = grid_override()
        if override is None:
            return None, None
        return f"direct, grid of MARU_DIRECT_PROGRAMS={TuneParams.direct_programs}", (
            f"the direct layer kernel's grid is {override}"
        )

    def _copied_blocker(self, obj: torch.Tensor | None) -> str | None:
        from maru.kv_ops.selection import choose

        if obj is not None and not obj.is_pinned():
            return "the chunk objects are pageable host memory (the copy engines need pinned memory)"
        if self.backend == "reference" or (self.backend is None and choose("cuda").name != "triton"):
            return "the placement backend is not triton"
        if not self._sync.raw:
            return "libcudart is not reachable through ctypes in this process"
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        batch = BatchCopies.load(index)
        if batch is None:
            return BatchCopies.why_not
        why = batch.probe(self.device)
        if why is not None:
            return f"the batched copy failed its probe: {why}"
        self._batch = batch
        return None

    def _staging(self, slot_bytes: int, ring: int) -> torch.Tensor:
        """``ring`` staging slots of ``slot_bytes`` (uint8, on the device), grown, never shrunk.
        A replaced buffer may still be read by the last call's placements: wait for them first.
        Raises ``torch.OutOfMemoryError`` before anything is queued (the caller loads directly)."""
        need = slot_bytes * ring
        if self._stage is None or self._stage.numel() < need:
            if self._stage_free is not None:
                self._sync.synchronize(self._stage_free)
            self._stage = None
            self._stage = torch.empty(need, dtype=torch.uint8, device=self.device)
            # The allocator hands out blocks in the current stream's order; the copies run on
            # another stream, so they wait for the work queued there that may still use the block.
            self._copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        return self._stage

    def _copies_failed(self, error: BaseException) -> None:
        """A copied load that could not get its staging: this call loads directly (announced once,
        and a slow path in ``layer_way`` from now on)."""
        self.copies_oom = str(error).splitlines()[0][:160]
        announce_once(
            log,
            "kv_ops.layer-copied-oom",
            logging.WARNING,
            "maru.kv_ops: no device memory for a layer load's staging (%s); this load reads the pool with "
            "the SMs instead (the direct way). Fix: leave the GPU a little headroom (vLLM's "
            "gpu_memory_utilization a few hundredths lower): the staging holds 2 to %d layers of a "
            "step's loaded tokens, about %d MiB at most unless one layer of them is larger",
            self.copies_oom,
            RING_LAYERS,
            STAGING_BUDGET >> 20,
        )

    def _issue_layers_copied(
        self,
        objs: list[torch.Tensor],
        slot_mapping: Any,
        skip_tokens: int,
        nbytes: int,
        checksums: bool = False,
        segments: list[Any] | None = None,
    ) -> LayerLoad:
        """Queue the copied layer load (module docstring); returns at once."""
        from maru.kv_ops import direct_kernel as dk

        t0 = time.perf_counter()
        if not isinstance(objs, CHECKED):  # load_layers passes them checked; anyone else, checked here
            objs = self._objects(objs)
        slot_mapping = self._check_slots(slot_mapping, objs, skip_tokens, objs.tokens)
        # The direct way's host slots (skipped rows -1; with checksums, segments placing nothing -2,
        # counted at their committed sums): a host mapping only (``_use_copies``).
        marked, prefill, unread = dk.direct_host_slots(
            slot_mapping, objs.tokens, skip_tokens, segments if checksums else None
        )
        lengths = np.asarray(objs.tokens, dtype=np.int64)
        n = len(objs)
        kv, row_b = self.layout.num_kv, self.layout.row_size * self.esize
        ptrs = np.asarray(objs.ptrs, dtype=np.int64)
        read = marked > -2 if checksums else marked >= 0
        plan = CopyPlan.of(lengths, read, ptrs, kv, row_b)
        stride = plan.slot_stride
        ring = max(2, min(RING_LAYERS, STAGING_BUDGET // stride, self.num_layers))
        staging = self._staging(stride, ring)
        base = staging.data_ptr()
        srcs, dsts, sizes = plan.layers(self.num_layers, base, ring)
        m, total, offset = int(sizes.size), int(marked.size), plan.offset
        # The table names slot 0's regions; ``stage_off`` moves each layer's reads to its slot.
        sync, copy_h, place_h = self._sync, self._copy_stream.cuda_stream, self._place_h
        staged = (base + offset).tolist()  # where each object's rows sit in slot 0 of the staging
        scratch, ticket = self._scratch, None
        # A power-of-two width (the padding's slots are -1): the launches' integer arguments keep
        # the facts their compiled kernels were bound on at warm-up (``kv_ops.launch``).
        width = _bucket(total)
        if scratch is not None:
            ticket, buf = scratch.take(dk.DIRECT_ROWS * (width + 1))
            host_tab = dk.direct_table_spans(
                staged, objs.tokens, marked, self.layout.row_size, self.esize, width, out=buf, prefill=prefill
            )
        else:
            host_tab = dk.direct_table_spans(
                staged, objs.tokens, marked, self.layout.row_size, self.esize, width, prefill=prefill
            )
        # The copies write only the staging and read pinned pool pages: they need not wait for the
        # caller's queued work (a previous step's forward), only the placements do.
        self._after_caller(self._place_stream)
        if self._stage_free is not None:  # the last call's placements read the staging
            sync.wait_on(copy_h, self._stage_free)
        tab = self._table(width)
        try:
            sync.copy(tab.data_ptr(), host_tab.data_ptr(), host_tab.numel() * 8, place_h)
        finally:
            if ticket is not None:
                scratch.uploaded(ticket, place_h)
        copied, placed = self._layer_events()
        refs = ops.layer_refs(self.caches, self.layout)
        t_copies = time.perf_counter()
        batch, row8 = self._batch, m * 8  # bytes of one layer's row of the address arrays
        with torch.cuda.stream(self._place_stream):  # the kernels launch on the current stream
            for i in range(self.num_layers):
                if i >= ring:  # slot i % ring was last read by layer i - ring's placement
                    sync.wait_on(copy_h, placed[i - ring])
                if m:
                    at = i * row8
                    batch.copy(dsts.ctypes.data + at, srcs.ctypes.data + at, sizes.ctypes.data, m, copy_h)
                sync.record_on(copied[i], copy_h)
                sync.wait_on(place_h, copied[i])
                slot = (i % ring) * stride
                dk.direct_scatter_layer(
                    tab, refs[i], self.layout, i, width, checksum=checksums, stage_off=slot
                )
                sync.record_on(placed[i], place_h)
        done = sums = None
        if checksums:  # the kernels summed every object into row 5 of the table
            sums, done = self._table_sums(tab, n)
        t_end = time.perf_counter()
        self._stage_free = done if done is not None else placed[-1]
        handle = LayerLoad(nbytes, placed, sync, (objs, tab, staging, srcs, dsts, sizes), done)
        if sums is not None:
            per = self.object_token_bytes
            handle.set_checksums(sums, [t * per for t in objs.tokens], self._host_sums)
        handle.path = "layers-copied"
        handle.unread_bytes = unread * self.num_layers * kv * row_b
        handle.issue_s = t_end - t0
        handle.copy_issue_s = t_copies - t0  # the plan, the table and its upload
        handle.place_issue_s = t_end - t_copies  # the copies and placements, layer by layer
        return handle

    def _table(self, width: int) -> torch.Tensor:
        """The ``[DIRECT_ROWS, width + 1]`` device table of a call: one buffer, grown, written and
        read on the placement stream only (a later call's upload follows this call's kernels)."""
        from maru.kv_ops import direct_kernel as dk

        need = dk.DIRECT_ROWS * (width + 1)
        if self._copy_tab is None or self._copy_tab.numel() < need:
            with torch.cuda.stream(self._place_stream):
                self._copy_tab = torch.empty(max(need, 1 << 15), dtype=torch.int64, device=self.device)
        return self._copy_tab[:need].view(dk.DIRECT_ROWS, width + 1)

    def warm_copied(self) -> bool:
        """Compile and bind the copied way's kernels now, with loads that place nothing: every
        layer's launch, with and without checksums, at 16, 32 and 64 tokens (a call of 64 tokens
        or more launches the tiles of 64: ``triton_kernels.tiles``). False where this engine does
        not take the copied way; a kernel that does not compile turns it off (announced)."""
        if not self._use_copies(torch.empty(0, dtype=torch.int64)):
            return False
        try:
            for tokens in (16, 32, 64):
                obj = torch.zeros(self.object_shape(tokens), dtype=self.dtype).pin_memory()  # type: ignore[attr-defined]
                none = torch.full((tokens,), -1, dtype=torch.int64)
                for checksums in (False, True):
                    self._issue_layers_copied([obj], none, 0, 0, checksums).wait()
        except Exception as e:  # a compiler that refuses this layout's kernel: the direct way stays
            self._copied_ok, self.copied_off = (
                False,
                f"its kernel failed to build here ({type(e).__name__}: {e})",
            )
            if self._sync.raw:
                self._sync.clear_error()
            announce_once(
                log,
                "kv_ops.layer-copied-build",
                logging.WARNING,
                "maru.kv_ops: the copied layer way is off: %s; layer loads read the pool with the SMs",
                self.copied_off,
            )
            return False
        return True
