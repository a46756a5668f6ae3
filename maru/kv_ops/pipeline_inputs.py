"""Argument checks of ``DevicePipeline``: chunk objects, slot mappings, pinned host memory.

A mixin: it reads the pipeline's geometry (``num_layers``, ``layout``, ``dtype``), device and streams.
Every check raises ``ValueError`` naming the argument, the value and what was expected.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from maru.announce import announce_once
from maru.kv_ops.geometry import ObjectGeometry
from maru.kv_ops.pool_objects import PoolObjects

log = logging.getLogger("maru.kv_ops")


class CheckedObjects(list):
    """Chunk objects ``[L, KV, T, ROW]`` that passed ``PipelineInputs._objects``, with what the load
    paths read of each again: ``tokens[i]`` (T of object i) and ``ptrs[i]`` (its first byte's
    address). Invariant: both as long as the list and in its order, taken when the list was made
    (the objects are views of pool pages that do not move); never changed after (a path that
    reorders or subsets objects makes a plain list, which the layer issues check again). Why: a
    64-chunk load read each object's shape and address three or four times on its issue path,
    ~0.2 us a read with hot caches and several times that with the cold ones a load meets
    (bench/RESULTS.md, forty-fifth pass)."""

    def __init__(self, objs: list[torch.Tensor], tokens: list[int], ptrs: list[int]) -> None:
        super().__init__(objs)
        self.tokens = tokens
        self.ptrs = ptrs


# What ``PipelineInputs._objects`` returns: the layer issues take either without checking again.
CHECKED = (CheckedObjects, PoolObjects)


class PipelineInputs:
    """``_objects``, ``_slots``/``_check_slots``, ``_per_chunk`` and ``_check_pinned``."""

    # Set by DevicePipeline.__init__ (GPU only where noted).
    _scratch: Any  # HostScratch, None without the raw calls
    _place_h: int  # GPU
    _sync: Any
    geometry: ObjectGeometry  # the caches' chunk-object geometry

    def _objects(self, objects: Sequence[torch.Tensor] | torch.Tensor) -> CheckedObjects | PoolObjects:
        """The objects checked (host, the caches' dtype, contiguous, ``[L, KV, T, ROW]`` or flat
        with whole tokens, viewed as that), with their token counts and addresses. ``PoolObjects``
        made for this geometry are checked already (``PoolObjects.make``): returned as they are,
        none of them made (the direct layer load reads only their addresses); made for another
        geometry, each is made and checked here (and refused)."""
        if isinstance(objects, PoolObjects) and objects.geometry == self.geometry:
            if not len(objects):
                raise ValueError("no chunk objects given")
            return objects
        objs = [objects] if isinstance(objects, torch.Tensor) else list(objects)
        if not objs:
            raise ValueError("no chunk objects given")
        per_token = self.num_layers * self.layout.num_kv * self.layout.row_size
        # Per object a handful of cheap reads (``is_cpu``, one ``shape``): this runs on every load's
        # issue path, once per chunk (64 for a 16k-token step), and ``device.type`` or a sliced
        # shape tuple cost several times more.
        L, KV, ROW, dtype = self.num_layers, self.layout.num_kv, self.layout.row_size, self.dtype
        out: list[torch.Tensor] = []
        tokens: list[int] = []
        ptrs: list[int] = []
        for c, obj in enumerate(objs):
            if not obj.is_cpu:
                raise ValueError(
                    f"chunk object {c} is on {obj.device}; the engine moves host objects (pool pages) to and "
                    f"from the caches: pass a tensor over the pool mapping (host_object)"
                )
            if obj.dtype != dtype:
                raise ValueError(f"chunk object {c} is {obj.dtype}, the caches are {dtype}")
            if not obj.is_contiguous():
                raise ValueError(
                    f"chunk object {c} must be contiguous (one pool page), got strides {obj.stride()}"
                )
            shape = obj.shape
            if len(shape) != 4:
                if obj.numel() % per_token:
                    raise ValueError(
                        f"chunk object {c} has {obj.numel()} elements, not a whole number of tokens of "
                        f"{per_token} elements ([L={L}, KV={KV}, T, {ROW}])"
                    )
                obj = obj.view(self.object_shape(obj.numel() // per_token))
                shape = obj.shape
            elif shape[0] != L or shape[1] != KV or shape[3] != ROW:
                raise ValueError(f"chunk object {c} has shape {list(shape)}, expected [{L}, {KV}, T, {ROW}]")
            out.append(obj)
            tokens.append(shape[2])
            ptrs.append(obj.data_ptr())
        return CheckedObjects(out, tokens, ptrs)

    @staticmethod
    def _check_slots(
        slot_mapping: Any, objs: list[torch.Tensor], skip_tokens: int, lengths: list[int] | None = None
    ) -> torch.Tensor:
        """The slot mapping as a tensor, checked against the objects' tokens (``lengths``: each
        object's token count where the caller has them: ~0.2 us an object saved)."""
        total = sum(o.shape[2] for o in objs) if lengths is None else sum(lengths)
        if not isinstance(slot_mapping, torch.Tensor):
            slot_mapping = torch.as_tensor(slot_mapping, dtype=torch.int64)
        if slot_mapping.dim() != 1 or slot_mapping.numel() != total:
            raise ValueError(
                f"slot_mapping has shape {list(slot_mapping.shape)}, expected [{total}] (one slot per token "
                f"of the {len(objs)} chunk object(s), in order)"
            )
        if skip_tokens < 0 or skip_tokens > total:
            raise ValueError(f"skip_tokens={skip_tokens} must be in [0, {total}]")
        return slot_mapping

    def _slots(self, slot_mapping: Any, objs: list[torch.Tensor], skip_tokens: int) -> torch.Tensor:
        """The slot mapping as int64 on the caches' device (moved on the placement stream)."""
        slot_mapping = self._check_slots(slot_mapping, objs, skip_tokens)
        if self.on_gpu and self._scratch is not None and slot_mapping.device.type == "cpu":
            return self._slots_raw(slot_mapping, skip_tokens)
        if self.on_gpu:
            caller = torch.cuda.current_stream(self.device)
            if slot_mapping.device.type == "cpu" and not slot_mapping.is_pinned():
                # From pageable memory an async copy first syncs the stream: pin (cached) to stay async.
                slot_mapping = slot_mapping.to(torch.int64).pin_memory()
            with torch.cuda.stream(self._place_stream):
                # Wait for whatever produced a device mapping on the caller's stream.
                self._place_stream.wait_stream(caller)
                slots = slot_mapping.to(self.device, torch.int64, non_blocking=True)
                if skip_tokens:  # a negative slot is never written: skipping is masking
                    slots = slots.clone() if slots is slot_mapping else slots
                    slots[:skip_tokens] = -1
            return slots
        slots = slot_mapping.to(torch.int64)
        if skip_tokens:
            slots = slots.clone() if slots is slot_mapping else slots
            slots[:skip_tokens] = -1
        return slots

    def _slots_raw(self, slot_mapping: torch.Tensor, skip_tokens: int) -> torch.Tensor:
        """``_slots`` of a host mapping with the raw calls: the rows written into a pinned scratch
        buffer (``HostScratch``) and sent with one raw copy on the placement stream, after it
        waited for the caller's stream (as ``_slots``); the device tensor is allocated on the
        placement stream, as ``_slots`` allocates it. No pinning and no torch copy per call."""
        n = int(slot_mapping.numel())
        ticket, buf = self._scratch.take_slots(slot_mapping, skip_tokens)
        place_h = self._place_h
        try:
            self._after_caller(self._place_stream)
            with torch.cuda.stream(self._place_stream):
                slots = torch.empty(n, dtype=torch.int64, device=self.device)
            self._sync.copy(slots.data_ptr(), buf.data_ptr(), 8 * n, place_h)
        finally:
            self._scratch.uploaded(ticket, place_h)
        return slots

    @staticmethod
    def _per_chunk(objs: list[torch.Tensor], slots: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out, token0 = [], 0
        for obj in objs:
            t = obj.shape[2]
            out.append((obj, slots[token0 : token0 + t]))
            token0 += t
        return out

    def _check_pinned(self, objs: list[torch.Tensor]) -> None:
        if self._checked_pinned:
            return
        self._checked_pinned = True
        if not objs[0].is_pinned():
            announce_once(
                log,
                "kv_ops.pageable",
                logging.WARNING,
                "maru.kv_ops: SLOW PATH: chunk objects live in pageable host memory (the pool mapping is not "
                "registered with CUDA): host<->GPU copies run ~11x below the bus (4.9 vs 55 GB/s on an H200). "
                "Fix: maru.client.cuda_host.register_host_mapping(pool_mapping) once per process "
                "(see `maru doctor`)",
            )
