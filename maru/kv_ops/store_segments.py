"""The segment sums of a store on the device (``maru.segments``), queued by ``DevicePipeline.store``.

A mixin of ``DevicePipeline``: it uses the pipeline's caches, layout and host sums buffers. The
kernel (``kv_ops.segment_kernels``) reads the caches themselves, on the caller's stream, before the
store's own work.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from maru.announce import announce_once
from maru.kv_ops import checksum as ck
from maru.kv_ops.cuda_sync import current_stream_handle
from maru.kv_ops.layout import KVLayout

log = logging.getLogger("maru.kv_ops")


class StoreSegments:
    """``_queue_segments`` and its warm-up (a mixin of ``DevicePipeline``)."""

    # Set by DevicePipeline.__init__.
    caches: Any
    layout: KVLayout
    device: torch.device
    esize: int
    _host_sums: Any
    _scratch: Any
    _sync: Any
    _sums_to_host: Any
    # Device buffers of the raw way, per raw stream handle: {"tab": ..., "acc": ...}
    _segment_bufs: dict[int, dict[str, torch.Tensor]]
    segments_off: str | None = None
    # Why the warm-up could not compile the kernel, a slow path of maru doctor's (None: it did)
    segments_unwarmed: str | None = None

    def _warm_segments(self, chunk_tokens: int) -> None:
        """Compile the segment-sum kernel a store launches (``_queue_segments``) now. Left to first
        use, the first store compiled it on the write-behind drain thread: 0.4-1.0 s of an H200
        instance's first store (bench/RESULTS.md, fortieth pass), the GIL mostly held, the first
        request's blocks held as long. One launch over the caches' first ``chunk_tokens`` slots
        (read only; its sums are dropped): Triton specialises on nothing a store's sizes change
        (token counts are whole blocks)."""
        from maru.kv_ops import segment_kernels as sk

        if not ck._triton_runs_on(self.device) or not sk.supported(self.layout, self.esize):
            return
        slots = np.arange(chunk_tokens, dtype=np.int64) % max(1, self.layout.num_slots)
        try:
            sk.queue_cache_segments(
                self.caches, self.layout, [chunk_tokens], slots, self.layout.block_size, self.device
            )
        except Exception as e:  # a warm-up must not cost the engine: the first store compiles it
            self.segments_unwarmed = (
                f"the segment-sum kernel could not be compiled at start ({type(e).__name__}: {e}): the "
                "first store compiles it (up to ~1 s on the write-behind drain thread, the first "
                "request's blocks held meanwhile). Fix: report it with `maru doctor` output"
            )
            announce_once(
                log, "kv_ops.segments-warm", logging.WARNING, "maru.kv_ops: %s", self.segments_unwarmed
            )

    def _queue_segments(self, objs: list[torch.Tensor], slot_mapping: Any, seg: int) -> tuple | None:
        """Queue the segment sums of a store on the caller's stream, before the store's own work
        (which waits for that stream): ``Transfer.set_segments``' arguments, or None where they
        cannot be computed (rows not whole words, a slot mapping on the device or with a
        negative slot: nothing to vouch for there)."""
        from maru.kv_ops import segment_kernels as sk

        why = None
        if not sk.supported(self.layout, self.esize):
            why = f"a row of the cache is {self.layout.row_size * self.esize} bytes, not whole 8-byte words"
        elif getattr(slot_mapping, "device", None) is None or slot_mapping.device.type != "cpu":
            why = "the store's slot mapping is not a host tensor"
        else:
            host = (
                slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
            ).numpy()
            if host.size and int(host.min()) < 0:
                why = "the store's slot mapping has negative slots"
        self.segments_off = why  # shown by maru doctor (the worker's reported paths)
        if why is not None:
            announce_once(
                log,
                "kv_ops.no-segment-sums",
                logging.WARNING,
                "maru.kv_ops: stores commit no segment sums (%s): a later load that places only a "
                "chunk's last tokens reads the whole chunk to verify it. Fix: pass host slot mappings "
                "of written tokens (the connector does)",
                why,
            )
            return None
        lengths = [o.shape[2] for o in objs]
        if self._scratch is not None and self._sync.raw and host.size:
            stream = current_stream_handle(self.device)
            acc, most = self._queue_segments_raw(lengths, host, seg, stream)
            sums = self._sums_to_host(acc, stream)
        else:
            acc, most = sk.queue_cache_segments(self.caches, self.layout, lengths, host, seg, self.device)
            sums = ck.to_host(acc, self._host_sums)
        return seg, most, lengths, sums, self._host_sums

    def _queue_segments_raw(
        self, lengths: list[int], host: np.ndarray, seg: int, stream: int
    ) -> tuple[torch.Tensor, int]:
        """``queue_cache_segments`` without a torch op but the launch: the table written into a
        pinned scratch buffer (``HostScratch``) and sent with one raw copy, the accumulators
        zeroed with a raw memset, both in device buffers kept per stream. The write-behind drain
        thread queues it: each torch op there (a pinned allocation, an upload, a fill; six a store
        before) let go of the GIL and took it back beside vLLM's loop, ~0.2-2 ms a store batch of
        its wall time in an H200 engine (the forty-first pass's profile, bench/RESULTS.md)."""
        from maru.kv_ops import segment_kernels as sk

        total = int(host.size)  # queued on raw ``stream``, the caller's current one
        ticket, buf = self._scratch.take(sk.SEG_ROWS * total)
        try:
            _, most = sk.segments_table(lengths, host, seg, out=buf.numpy())
            tab = self._segment_words(stream, "tab", sk.SEG_ROWS * total).view(sk.SEG_ROWS, total)
            acc = self._segment_words(stream, "acc", len(lengths) * most)
            self._sync.zero(acc.data_ptr(), 8 * acc.numel(), stream)
            self._sync.copy(tab.data_ptr(), buf.data_ptr(), 8 * sk.SEG_ROWS * total, stream)
        finally:
            self._scratch.uploaded(ticket, stream)
        sk.launch_cache_segments(self.caches, self.layout, tab, acc)
        return acc, most

    def _segment_words(self, stream: int, name: str, n: int) -> torch.Tensor:
        """``n`` int64 of a device buffer kept for the segment sums queued on raw ``stream``: every
        writer and reader of it is queued on that stream (the sums' download too), so a later
        store's writes follow this one's reads. Grown, never shrunk; allocated while that stream is
        the current one (the caller's), so the allocator orders any reuse of a replaced one after it."""
        bufs = self._segment_bufs.setdefault(stream, {})
        buf = bufs.get(name)
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(int(n), 4096), dtype=torch.int64, device=self.device)
            bufs[name] = buf
        return buf[:n]
