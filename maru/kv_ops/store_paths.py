"""The in-place store of ``DevicePipeline`` (``store_path="direct"``, opt-in): the gather kernel
writes the chunk objects where they lie.

What it was built against: copies of one direction share the copy engine, and the engine keeps
serving a stream that has copies queued. A store of 16 chunks (0.5 GB) queued through the staging
ring (the default: gather into a GPU slot, then a copy-engine copy to the pool page) holds back
another stream's small device-to-host copy by 9.3 ms on an H200, close to the whole store; the same
store written by the kernel over the bus, from the SMs into host memory the GPU addresses (a pool
registered with CUDA, or pinned memory, under unified addressing), ran at 51 GB/s and the small
copy waited 0.25 ms (bench/copy_interference.py).

Why it is not the default: in real vLLM (bench/gpu_vllm_pass.sh, 2026-12-01) the write-behind store
cost as much or more of the time to first token in place as through the ring (1 x 4k +24% against
+21%, 8 x 4k +19% against +6%): the kernel holds SMs for the whole store, and the step after it
waits for them instead of for the copy engine; with checksums the store ran at 24 GB/s, not 47.
Kept for engines whose steps wait on copies rather than on SMs, and measured beside the ring.

Checksums (``checksums=True``): behind each chunk's kernel, on a second stream, one launch reads
the object back from the pool and sums it (``kv_ops.checksum.accumulate_pieces``) while the next
chunks are written: the checksum committed with a key vouches for the bytes that landed in the
pool, not for a copy of them on the GPU.

Invariant: as for every store, ``Transfer.wait()`` (or ``done()``) before the keys are published.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from maru.announce import announce_once
from maru.kv_ops import checksum as ck
from maru.kv_ops import ops
from maru.kv_ops.device_handles import Transfer

log = logging.getLogger("maru.kv_ops")

STORE_PATHS = ("staged", "direct")  # the first is the default


class StorePaths:
    """The store half of ``DevicePipeline`` that writes in place (a mixin; see ``DevicePipeline``)."""

    # Set by DevicePipeline.__init__ (and used from LayerPaths: _direct_blocker, _after_caller).
    caches: Any
    layout: Any
    device: Any
    esize: int
    store_path: str
    _direct_store_ok: bool | None
    _sync: Any
    _place_stream: Any

    def _use_direct_store(self, obj: torch.Tensor) -> bool:
        """Whether stores write the chunk objects in place (``store_path="direct"``); raises with
        the reason when asked for where it cannot run. Decided on the first store, announced once."""
        if self.store_path != "direct":
            return False
        if self._direct_store_ok is None:
            why = self._direct_blocker(obj)  # type: ignore[attr-defined]
            if why is not None:
                raise RuntimeError(f"store_path='direct' cannot run: {why}; use store_path='staged'")
            self._direct_store_ok = True
            announce_once(
                log,
                "kv_ops.store-direct",
                logging.INFO,
                "maru.kv_ops: stores write chunk objects in place (store_path='direct': the gather kernel "
                "writes the pool over the bus; no copy-engine copies, the SMs busy for the whole store)",
            )
        return True

    def _checksum_stream(self) -> Any:
        """The stream of the read-back checksums, and the event that orders it (made on first use)."""
        if getattr(self, "_ck_stream", None) is None:
            self._ck_stream = torch.cuda.Stream(self.device)
            self._written = self._sync.event()
        return self._ck_stream

    def _issue_store_direct(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, checksums: bool
    ) -> Transfer:
        from maru.kv_ops import triton_kernels as tk

        t0 = time.perf_counter()
        sync, place = self._sync, self._place_stream
        self._after_caller(place)  # type: ignore[attr-defined]  # read what the forward wrote
        refs = ops.layer_refs(self.caches, self.layout)
        acc = tab = None
        sizes = [o.numel() * self.esize for o in objs]
        if checksums:
            # Read back on a stream of its own, chunk by chunk behind the kernel that wrote it: the
            # reads (host to GPU) overlap the later chunks' writes (GPU to host) on the bus.
            ck_stream = self._checksum_stream()
            with torch.cuda.stream(place):
                acc = torch.zeros(len(objs), dtype=torch.int64, device=self.device)
                pieces = [(o.data_ptr(), n, 0, k) for k, (o, n) in enumerate(zip(objs, sizes, strict=True))]
                tab = ck.pieces_table(pieces).pin_memory().to(self.device, non_blocking=True)
        with torch.cuda.stream(place):
            for k, (host, chunk_slots) in enumerate(self._per_chunk(objs, slots)):  # type: ignore[attr-defined]
                tk.place(refs, self.layout, chunk_slots, ops.as_bits(host), gather=True)
                if tab is not None:
                    # One event re-recorded per chunk: each wait is queued at once and captures
                    # the record just made (as DevicePipeline._follow does).
                    sync.record(self._written, place)
                    sync.wait(ck_stream, self._written)
                    with torch.cuda.stream(ck_stream):
                        ck.accumulate_pieces(tab[:, k : k + 1], acc, acc, sizes[k])
        end = place
        if tab is not None:
            end = ck_stream
        with torch.cuda.stream(end):
            sums = ck.to_host(acc, self._host_sums)  # type: ignore[attr-defined]
        # Recorded on ``end``: the checksum stream ran behind every chunk's kernel.
        return self._handle("store", "direct", nbytes, end, t0, objs, slots, acc, sums, tab)  # type: ignore[attr-defined]
