"""The chunk-by-chunk load of ``DevicePipeline`` (``load``): the staging ring, copies R chunks
ahead of placements, one checksum per object.

A mixin: it uses the pipeline's streams, ring, sync and scratch buffers (see
``device_pipeline.DevicePipeline`` for the attributes and the invariants: every operation starts
after the caller's queued work; issue never blocks the host on the GPU).
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from maru.env_flags import flag
from maru.kv_ops import checksum as ck
from maru.kv_ops.cuda_sync import D2D, D2H
from maru.kv_ops.device_handles import Transfer
from maru.kv_ops.staging_slot import StagingSlot

# Opt-in until measured on a device: the chunk load's checksum inside its scatter (one kernel, one
# read of the staged bytes) instead of a checksum kernel beside it.
FUSED_ENV = "MARU_FUSED_LOAD_CHECKSUM"


def fused_checksums_wanted() -> bool:
    """Whether the chunk load sums inside its scatter: the default, measured faster on an H200
    (bench/RESULTS.md, 2026-12-05); ``FUSED_ENV=0`` turns it off (``maru.env_flags``)."""
    return flag(FUSED_ENV, default=True)


def _same_page(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two chunk objects are the same bytes: one host address, one shape."""
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape


def _lead_of(lead: list[int], k: int) -> int:
    """The first object of the copy object ``k`` is placed from (``lead`` ascending, lead[0] = 0)."""
    return lead[bisect.bisect_right(lead, k) - 1]


@dataclass
class Prestaged:
    """A host object's copy queued into a staging slot ahead of its load (``ChunkLoads.prestage``)."""

    address: int
    nbytes: int
    slot: StagingSlot
    stage: torch.Tensor
    graphed: bool


class ChunkLoads:
    """``_issue_load`` and its helpers (a mixin of ``DevicePipeline``)."""

    # Set by DevicePipeline.__init__ (or its other mixins).
    device: Any
    graphs: bool
    ring_slots: int
    _sync: Any
    _scratch: Any
    _host_sums: Any
    _copy_stream: Any
    _place_stream: Any
    _place_h: int
    _check_slots: Callable[..., torch.Tensor]
    _slots: Callable[..., torch.Tensor]
    _start: Callable[[], None]
    _take_slot: Callable[[], StagingSlot]
    _h2d: Callable[[torch.Tensor, torch.Tensor], None]
    _handle: Callable[..., Transfer]
    _lock: Any
    on_gpu: bool
    esize: int
    object_bytes: Callable[[int], int]
    _prestaged: Prestaged | None = None
    prestages = 0  # first chunks copied before their load was prepared (``issuing``)
    prestages_unused = 0  # of them, the ones the load did not start with (copied, never placed)
    fuse_checksums = False  # set by DevicePipeline: checksum inside the scatter where it can
    fused_checksums = 0  # objects whose checksum their scatter computed (``load_checksum_way``)
    lazy_capture: bool

    @contextlib.contextmanager
    def issuing(self, address: int = 0, nbytes: int = 0, tokens: int = 0) -> Iterator[None]:
        """Hold the pipeline for one load's issue, its first object copied at once where given.

        With ``address`` (a host object of ``nbytes`` bytes and ``tokens`` tokens, the load's first
        placed chunk): its copy into the next staging slot is queued before anything else
        (``prestage``), so that the caller's checks, objects and slot mappings run while it is on
        the bus (a one-chunk load: ~0.1 ms of host work before its copy started). The ``load``
        called inside starts with that copy if its first object is these bytes; otherwise the copy
        is dropped (the slot is free again for the copies after it, nothing reads the bytes).
        The lock is held throughout: no other transfer can take the slot meanwhile.
        """
        with self._lock:
            if address:
                self.prestage(address, nbytes, tokens)
            try:
                yield
            finally:
                if self._prestaged is not None:
                    self._drop(self._prestaged)
                    self._prestaged = None

    def _drop(self, pre: Prestaged) -> None:
        """A prestaged copy no load starts with: the slot's next user (a copy, or a store's gather
        on another stream) must still wait for it, so the slot's ``free`` is recorded after it."""
        self._sync.record(pre.slot.free, self._copy_stream)
        self.prestages_unused += 1

    def prestage(self, address: int, nbytes: int, tokens: int) -> bool:
        """Queue the copy of the host object at ``address`` into the next staging slot (under
        ``issuing``, which holds the lock); whether it was queued. Only with the raw CUDA calls on
        a GPU and an object of this pipeline's geometry (else the load copies it as usual). The
        copy waits for the slot's previous placement only, not for the caller's stream: it writes
        nothing the caller's work reads, and the placement waits for both."""
        if not self.on_gpu or not self._sync.raw or nbytes != self.object_bytes(tokens) or nbytes <= 0:
            return False
        sync, copy = self._sync, self._copy_stream
        slot = self._take_slot()
        stage, graphed = slot.buffer(tokens)
        if slot.used:
            sync.wait(copy, slot.free)  # its previous placement must have read it
        sync.copy(stage.data_ptr(), address, nbytes, copy.cuda_stream)
        sync.record(slot.ready, copy)
        slot.used = True
        self._prestaged = Prestaged(address, nbytes, slot, stage, graphed)
        self.prestages += 1
        return True

    def _issue_load(
        self,
        objs: list[torch.Tensor],
        slot_mapping: torch.Tensor | Callable[[], torch.Tensor],
        skip_tokens: int,
        nbytes: int,
        checksums: bool,
    ) -> Transfer:
        """Copies run up to R chunks ahead of placements; the first copy is queued before anything else.

        Consecutive objects over the same host page (one prefix chunk wanted by several requests of
        a step, e.g. a shared system prompt) share one copy: the staged chunk is placed once per
        object, and its slot is freed after the last of them. Each object keeps its own checksum.

        The first chunk's copy is queued before the slot mapping's host work (made by the caller's
        function, checked, uploaded): a one-chunk load is then on the bus from its first
        microseconds. The mapping's upload may queue behind that copy on the copy engine, and the
        first placement waits for that copy anyway; the later copies follow the upload.

        With the raw CUDA calls and a host slot mapping, the mapping goes up from a pinned scratch
        buffer in one raw copy and into each graph's static slot buffer with one raw copy a chunk
        (no torch op, no pinning per call); the checksum sums are zeroed and copied back raw.
        """
        t0 = time.perf_counter()
        pre, self._prestaged = self._prestaged, None
        if not callable(slot_mapping):
            slot_mapping = self._check_slots(slot_mapping, objs, skip_tokens)  # before any copy is queued
        sync, copy, place = self._sync, self._copy_stream, self._place_stream
        place_h = self._place_h
        self._start()
        n = len(objs)
        # lead[j]: the first object of copy j; later objects up to lead[j + 1] are the same page.
        lead = [k for k in range(n) if k == 0 or not _same_page(objs[k], objs[k - 1])]
        staged: list[tuple[StagingSlot, torch.Tensor, bool]] = []

        def issue_copy(j: int) -> None:
            nonlocal pre
            obj = objs[lead[j]]
            if pre is not None:  # queued already (``issuing``): the first copy, if it is these bytes
                used, pre = pre, None
                if used.address == obj.data_ptr() and used.nbytes == obj.numel() * self.esize:
                    staged.append((used.slot, used.stage, used.graphed))
                    return
                self._drop(used)
            slot = self._take_slot()
            stage, graphed = slot.buffer(obj.shape[2])
            if slot.used:
                sync.wait(copy, slot.free)  # its previous placement must have read it
            self._h2d(stage, obj)
            sync.record(slot.ready, copy)
            slot.used = True
            staged.append((slot, stage, graphed))

        copies, ahead = len(lead), min(self.ring_slots, len(lead))
        issue_copy(0)
        if callable(slot_mapping):  # raising here, the caller settles the queued copy (paths.py)
            slot_mapping = self._check_slots(slot_mapping(), objs, skip_tokens)
        # The mapping goes up before the other copies (a few KB: behind them on the copy engine it
        # would hold the first placements back until R copies ran).
        pinned = self._pinned_slots(slot_mapping, skip_tokens)
        slots = None
        if pinned is not None:
            try:
                slots = self._device_words("_slots_dev", pinned[1].numel())
                sync.copy(slots.data_ptr(), pinned[1].data_ptr(), 8 * pinned[1].numel(), place_h)
            finally:
                self._scratch.uploaded(pinned[0], place_h)
        for j in range(1, ahead):
            issue_copy(j)
        if slots is None:  # validated and moved while the bus is busy
            slots = self._slots(slot_mapping, objs, skip_tokens)
        with torch.cuda.stream(place):  # placements launch on the current stream
            acc = None
            if checksums:
                if sync.raw:
                    acc = self._device_words("_acc_dev", n)
                    sync.zero(acc.data_ptr(), n * 8, place_h)
                else:
                    acc = torch.zeros(n, dtype=torch.int64, device=self.device)
            j, token0 = -1, 0
            # A chunk's slots reach its graph's static buffer by a device-to-device copy from
            # the uploaded mapping (not a host-to-device copy a chunk: behind the chunk copies).
            rows = slots.data_ptr() if pinned is not None else 0
            for k, obj in enumerate(objs):
                t = obj.shape[2]
                first = j + 1 < copies and lead[j + 1] == k  # the first object of copy j + 1
                if first:
                    j += 1
                    slot, stage, graphed = staged[j]
                fast = pinned is not None and graphed
                if fast:
                    # The chunk's slots from the uploaded rows into its graph's static buffer,
                    # queued before the wait for the copy (the buffer's last reader, the
                    # slot's previous placement, is earlier on this stream).
                    sync.copy(slot.placer.slots(t).data_ptr(), rows + 8 * token0, 8 * t, place_h, D2D)
                if first:
                    sync.wait(place, slot.ready)
                # A copy's first object placed and summed by one kernel where it can be.
                summed = first and fast and acc is not None and self._scatter_summed(slot.placer, t, acc, k)
                if not summed:
                    if first and acc is not None:  # the bytes in the slot are the bytes placed
                        ck.accumulate(stage, acc, k)
                    if fast:
                        slot.placer.scatter(t)
                    else:
                        slot.place(stage, graphed, slots[token0 : token0 + t], load=True)
                token0 += t
                if k + 1 == n or (j + 1 < copies and lead[j + 1] == k + 1):  # the copy's last object
                    sync.record(slot.free, place)
                    if j + ahead < copies:
                        issue_copy(j + ahead)
            if acc is not None and copies < n:  # an object sharing a copy shares its sum (one launch)
                src = torch.tensor([_lead_of(lead, k) for k in range(n)], dtype=torch.int64)
                acc = acc.index_select(0, src.to(self.device, non_blocking=True))
            sums = self._sums_to_host(acc)
        handle = self._handle("load", "pipelined", nbytes, place, t0, objs, slots, acc, sums)
        handle.copies_shared = n - copies
        return handle

    def _scatter_summed(self, placer: Any, tokens: int, acc: torch.Tensor, k: int) -> bool:
        """A copy's first object placed with its checksum inside its scatter (one read of the staged
        bytes, one launch), its raw sum then copied into ``acc[k]`` before the slot is freed (the
        placer's sum buffer is the slot's, as its staging is); False, with nothing queued, where
        it is not (the setting off, a size not warmed without lazy capture, a refused kernel)."""
        if not (
            self.fuse_checksums
            and (self.lazy_capture or placer.has_scatter_checksum(tokens))
            and placer.scatter_checksum(tokens)  # False where the placer cannot (said why)
        ):
            return False
        self._sync.copy(acc.data_ptr() + 8 * k, placer.sum_address(tokens), 8, self._place_h, D2D)
        self.fused_checksums += 1
        return True

    def load_checksum_way(self) -> tuple[str, str | None]:
        """How the chunk load checks what it placed, and why not fused (None: it is, or no GPU)."""
        if not self.on_gpu:
            return "host", None
        if not self.fuse_checksums:
            if fused_checksums_wanted():
                return "separate kernel", None  # told so by its builder (a test, a bench's A/B)
            return "separate kernel", (
                f"{FUSED_ENV}=0 is set: the chunk load checksums its objects in a second kernel (one "
                "more read of the staged bytes and one more launch a chunk). Fix: unset it"
            )
        placer = self._ring[0].placer if getattr(self, "_ring", None) else None
        if placer is None or not self._sync.raw or not self.graphs:
            return "separate kernel", (
                "the fused load checksum (the default) needs CUDA graphs and the raw CUDA calls: the "
                "chunk load checksums in a second kernel (maru doctor: kv_ops backend, libcudart)"
            )
        if getattr(placer, "fused_refused", None):
            return "separate kernel", (
                f"the fused load checksum was refused ({placer.fused_refused}): the checksum stays a "
                f"second kernel. Fix: set {FUSED_ENV}=0 to stop trying, and report the Triton version"
            )
        if not placer.fused_checksum:
            return "separate kernel", (
                f"this cache's rows are not whole 64-bit words ({placer.layout.row_size} elements), "
                "which the fused load checksum needs: the checksum stays a second kernel (the same "
                "check, one launch more; a property of the model's KV layout, nothing to set)"
            )
        return f"fused ({self.fused_checksums} objects)", None

    def _pinned_slots(self, slot_mapping: torch.Tensor, skip_tokens: int) -> tuple[int, torch.Tensor] | None:
        """A host slot mapping copied into a pinned scratch buffer (skipped tokens -1): (ticket,
        int64 rows); None where the raw calls or a host mapping are missing (``_slots`` then)."""
        if self._scratch is None or not self.graphs or slot_mapping.device.type != "cpu":
            return None
        return self._scratch.take_slots(slot_mapping, skip_tokens)  # type: ignore[no-any-return]

    def _device_words(self, name: str, n: int, stream: Any = None) -> torch.Tensor:
        """``n`` int64 of a device buffer the pipeline keeps (attribute ``name``) for the work of
        one stream (``stream``, default the placement stream): every writer and reader of it is
        queued on that stream, so a later transfer's writes follow this one's reads. Grown, never
        shrunk; a replaced buffer was allocated on that stream, so the allocator reuses it only in
        its order."""
        buf = getattr(self, name, None)
        if buf is None or buf.numel() < n:
            with torch.cuda.stream(self._place_stream if stream is None else stream):
                buf = torch.empty(max(int(n), 4096), dtype=torch.int64, device=self.device)
            setattr(self, name, buf)
        return buf[:n]

    def _sums_to_host(self, acc: torch.Tensor | None, stream: int | None = None) -> torch.Tensor | None:
        """Queue the copy of device sums into host sums (``HostSums``) on the current stream,
        which is the raw ``stream`` (default: the placement stream) on the raw way."""
        if acc is None or not self._sync.raw:
            return ck.to_host(acc, self._host_sums)
        sums = self._host_sums.take(acc.numel())
        at = self._place_h if stream is None else stream
        self._sync.copy(sums.data_ptr(), acc.data_ptr(), acc.numel() * 8, at, D2H)
        return sums
