"""The direct store of ``DevicePipeline``: the gather kernel writes the chunk objects in place.

Why not the staging ring (gather into a GPU slot, then a copy-engine copy to the pool page): copies
of one direction share the copy engine, and the engine keeps serving a stream that has copies
queued. A store of 16 chunks (0.5 GB) queued at the end of a forward held back the inference
engine's next small device-to-host copy (vLLM's sampled token ids) by 9.3 ms on an H200, close to
the whole store; so the write-behind store cost a 4k-token request +21% of its time to first token
although nothing waited for the store itself (bench/copy_interference.py, bench/RESULTS.md).

Written by the kernel instead, over the bus from the SMs into host memory the GPU addresses (a
pool registered with CUDA, or pinned memory, under unified addressing), the same store ran at
51 GB/s (52 through the copy engine) and the small copy waited 0.25 ms. Nothing is staged, and one
launch per chunk is all the host issues.

Checksums (``checksums=True``): behind each chunk's kernel, on a second stream, one launch reads
the object back from the pool and sums it (``kv_ops.checksum.accumulate_pieces``), while the next
chunks are written (reads and writes go opposite ways on the bus): the checksum committed with a
key vouches for the bytes that landed in the pool, not for a copy of them on the GPU.

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

STORE_PATHS = ("auto", "direct", "staged")


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
        """Whether stores write the chunk objects in place: decided once, announced once."""
        if self.store_path == "staged":
            return False
        if self._direct_store_ok is None:
            why = self._direct_blocker(obj)  # type: ignore[attr-defined]
            self._direct_store_ok = why is None
            if why is None:
                announce_once(
                    log,
                    "kv_ops.store-direct",
                    logging.INFO,
                    "maru.kv_ops: stores write chunk objects in place (the gather kernel writes the pool "
                    "over the bus; the copy engine stays free for the inference engine's own copies)",
                )
            elif self.store_path == "direct":
                raise RuntimeError(f"store_path='direct' cannot run: {why}")
            else:
                announce_once(
                    log,
                    "kv_ops.store-staged",
                    logging.WARNING,
                    "maru.kv_ops: SLOWER PATH: stores go through GPU staging and the copy engine, where a "
                    "store queued behind a forward delays the inference engine's next device-to-host copy "
                    "(its sampled tokens) until the store finished: %s. Fix: register the pool with CUDA "
                    "(maru doctor) and use the triton backend",
                    why,
                )
        return self._direct_store_ok

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
                    # the record just made (as LayerPaths._after_caller does).
                    sync.record(self._written, place)
                    sync.wait(ck_stream, self._written)
                    with torch.cuda.stream(ck_stream):
                        ck.accumulate_pieces(tab[:, k : k + 1], acc, acc, sizes[k])
        end = place
        if tab is not None:
            end = ck_stream
        with torch.cuda.stream(end):
            sums = ck.to_host(acc)
        done = self._done_event()  # type: ignore[attr-defined]
        sync.record(done, end)  # the checksum stream ran behind every chunk's kernel
        handle = Transfer("store", "direct", nbytes, done, sync, (objs, slots, acc, tab))
        if sums is not None:
            handle.set_checksums(sums, sizes)
        handle.issue_s = time.perf_counter() - t0
        return handle
