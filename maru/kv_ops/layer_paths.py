"""The layer-overlap load of ``DevicePipeline``: layer i of every chunk placed, one event per layer.

Two ways, chosen once and announced once: *direct* (the Triton kernel reads the chunk objects in
place over the bus, one kernel per layer, no staging; needs a pool registered with CUDA under
unified addressing) and *staged* (the copy engine brings layer i of every chunk into a staging
buffer, the single-layer kernel places it). Either way the caller's stream waits for layer i alone
(``LayerLoad.wait_for_layer``), and nothing starts before the work already queued on it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from maru.announce import announce_once
from maru.kv_ops import checksum as ck
from maru.kv_ops import ops
from maru.kv_ops.cuda_sync import D2H
from maru.kv_ops.device_handles import LayerLoad
from maru.kv_ops.pipeline_inputs import CHECKED

log = logging.getLogger("maru.kv_ops")

Placer = Callable[[torch.Tensor, int, torch.Tensor], None]


def _rows_are_words(layout: Any, esize: int) -> bool:
    from maru.kv_ops.triton_kernels import fused_checksum_ok

    return fused_checksum_ok(layout, esize)


def _bucket(tokens: int) -> int:
    """Graph bucket of a layer load of ``tokens`` tokens: a power of two, at least 16."""
    tb = 16
    while tb < tokens:
        tb *= 2
    return tb


class LayerPaths:
    """The layer-path half of ``DevicePipeline`` (a mixin: it uses the pipeline's streams, events,
    placers and geometry; see ``device_pipeline.DevicePipeline`` for the attributes)."""

    # Set by DevicePipeline.__init__.
    caches: Any
    layout: Any
    device: Any
    dtype: Any
    esize: int
    object_token_bytes: int
    num_layers: int
    cross_layer: bool
    backend: str | None
    layer_path: str
    lazy_capture: bool
    _sync: Any
    _host_sums: Any
    _copy_stream: Any
    _place_stream: Any
    _layer_placer: Any
    _layer_own: Any
    _layer_free: Any
    _direct_ok: bool | None
    _scratch: Any
    _place_h: int
    _done_event: Callable[[], Any]
    _after_caller: Callable[..., None]

    def _eager_layer(
        self, obj_layer: torch.Tensor, layer: int, slots: torch.Tensor, placer: Placer | None
    ) -> None:
        if placer is not None:
            placer(obj_layer, layer, slots)
        elif self.cross_layer:
            ops.scatter_layer(obj_layer, self.caches, self.layout, slots, layer=layer, backend=self.backend)
        else:
            ops.scatter_layer(obj_layer, self.caches[layer], self.layout, slots, backend=self.backend)

    def _layer_staging(self, tokens: int, placer: Placer | None) -> tuple[torch.Tensor, int, bool]:
        """(staging [L, KV, Tb, ROW], Tb, graph-backed) for a call of ``tokens`` tokens.

        With graphs, Tb is ``tokens`` rounded up to a power of two (at least 16), so a handful of
        static buffers and graphs serve every request size; pad slots are -1 (never written).
        """
        if placer is None and self._layer_placer is not None:
            tb = _bucket(tokens)
            try:
                return self._layer_placer.staging(tb).view(self.dtype), tb, True
            except ValueError:
                announce_once(
                    log,
                    "kv_ops.layer-placer-full",
                    logging.INFO,
                    "maru.kv_ops: layer-overlap load of %d tokens has no graph bucket left; eager launches",
                    tokens,
                )
        numel = self.num_layers * self.layout.num_kv * tokens * self.layout.row_size
        if self._layer_own is None or self._layer_own.numel() < numel:
            if self._layer_free is not None:
                self._sync.synchronize(self._layer_free)
            self._layer_own = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self._layer_own[:numel].view(self.object_shape(tokens)), tokens, False

    def _issue_layers(
        self,
        objs: list[torch.Tensor],
        slots: torch.Tensor,
        nbytes: int,
        placer: Placer | None,
        checksums: bool = False,
    ) -> LayerLoad:
        t0 = time.perf_counter()
        total = slots.numel()
        kv, row, es = self.layout.num_kv, self.layout.row_size, self.esize
        staging, tb, graphed = self._layer_staging(total, placer)
        copied, placed = self._layer_events()
        sync, copy, place = self._sync, self._copy_stream, self._place_stream
        self._start()
        if self._layer_free is not None:
            sync.wait(copy, self._layer_free)  # the previous call's placements read this staging
        raw = sync.raw
        st_ptr, st_layer, st_plane = staging.data_ptr(), staging.stride(0) * es, staging.stride(1) * es
        chunks = [(o.data_ptr(), o.shape[2]) for o in objs]
        copy_handle = copy.cuda_stream
        # Phase A: every layer's copies, layer-major (layer 0 lands first), one event per layer.
        for i in range(self.num_layers):
            if raw:
                token0 = 0
                for ptr, t in chunks:
                    plane = t * row * es  # one plane of one layer of this chunk, contiguous in the pool
                    src = ptr + i * kv * plane
                    dst = st_ptr + i * st_layer + token0 * row * es
                    # One chunk filling its bucket: the layer's planes are contiguous on both sides.
                    if tb == t:
                        sync.copy(dst, src, kv * plane, copy_handle)
                    else:  # planes land Tb rows apart in the staging: a copy per plane
                        for p in range(kv):
                            sync.copy(dst + p * st_plane, src + p * plane, plane, copy_handle)
                    token0 += t
            else:
                with torch.cuda.stream(copy):
                    token0 = 0
                    for obj in objs:
                        t = obj.shape[2]
                        staging[i, :, token0 : token0 + t].copy_(obj[i], non_blocking=True)
                        token0 += t
            sync.record(copied[i], copy)
        t_copies = time.perf_counter()
        # Phase B: per layer, wait for its copy, place it (a graph replay), record its event.
        with torch.cuda.stream(place):  # placements launch on the current stream
            if graphed:
                if tb != total:
                    padded = torch.full((tb,), -1, dtype=torch.int64, device=self.device)
                    padded[:total] = slots
                    slots = padded
                self._layer_placer.set_slots(slots)
            t_place = time.perf_counter()
            for i in range(self.num_layers):
                sync.wait(place, copied[i])
                if graphed:
                    self._layer_placer.scatter_layer(i, tb)
                else:
                    self._eager_layer(staging[i], i, slots, placer)
                sync.record(placed[i], place)
            done, sums, keep = None, None, None
            if checksums:  # one launch over every (layer, plane, chunk) piece of the staging
                done, sums, keep = self._staging_checksums(staging, objs, tb)
        t_end = time.perf_counter()
        self._layer_free = done if done is not None else placed[-1]
        handle = LayerLoad(nbytes, placed, sync, (objs, slots, keep), done)
        if sums is not None:
            handle.set_checksums(sums, [o.numel() * es for o in objs], self._host_sums)
        handle.graphed = graphed
        handle.issue_s = time.perf_counter() - t0
        handle.copy_issue_s = t_copies - t0  # includes the fixed per-call setup
        handle.place_issue_s = t_end - t_place  # the per-layer placements alone
        return handle

    def _check_layer_checksums(self) -> None:
        if not _rows_are_words(self.layout, self.esize):
            raise ValueError(
                f"layer loads with checksums need rows of whole 8-byte words; a row here is "
                f"{self.layout.row_size} elements of {self.esize} bytes: load by chunk instead"
            )

    def _staging_checksums(
        self, staging: torch.Tensor, objs: list[torch.Tensor], tb: int
    ) -> tuple[Any, torch.Tensor, Any]:
        """Queue (current stream) the checksums of the objects as the layer staging holds them:
        layer i, plane p of chunk k lies at ``staging[i, p, token0:token0+T_k]``, which is word
        ``((i * KV + p) * T_k * ROW * esize) / 8`` onwards of object k. Returns (event after the
        sums reached the host, pinned host sums, what must stay alive until then)."""
        kv, row, es = self.layout.num_kv, self.layout.row_size, self.esize
        lengths = np.array([o.shape[2] for o in objs], dtype=np.int64)
        token0 = np.cumsum(lengths) - lengths
        n, L = len(objs), self.num_layers
        i = np.repeat(np.arange(L, dtype=np.int64), kv * n)
        p = np.tile(np.repeat(np.arange(kv, dtype=np.int64), n), L)
        k = np.tile(np.arange(n, dtype=np.int64), L * kv)
        t = lengths[k]
        st = staging.stride()
        host = torch.empty((4, L * kv * n), dtype=torch.int64, pin_memory=True)
        tab = host.numpy()
        tab[0] = staging.data_ptr() + (i * st[0] + p * st[1] + token0[k] * st[2]) * es
        tab[1] = t * row * es
        tab[2] = (i * kv + p) * t * row * es // 8
        tab[3] = k
        dev_tab = host.to(self.device, non_blocking=True)
        acc = torch.zeros(n, dtype=torch.int64, device=self.device)
        ck.accumulate_pieces(dev_tab, acc, staging, int(lengths.max()) * row * es)
        sums = ck.to_host(acc, self._host_sums)
        done = self._done_event()
        self._sync.record(done, torch.cuda.current_stream(self.device))
        return done, sums, (host, dev_tab, acc)

    # ------------------------------------------------------------------ direct (zero-copy) layer path

    def _use_direct(self, obj: torch.Tensor) -> bool:
        """Whether the layer load reads the objects in place: decided once, announced once.

        Needs the Triton backend and host memory the GPU addresses at the same pointer (a pool
        registered with CUDA, or pinned memory, under unified addressing).
        """
        if self.layer_path == "staged":
            return False
        if self._direct_ok is None:
            why = self._direct_blocker(obj)
            self._direct_ok = why is None
            if why is None:
                announce_once(
                    log,
                    "kv_ops.layer-direct",
                    logging.INFO,
                    "maru.kv_ops: layer-overlap load reads chunk objects in place (zero-copy: one kernel "
                    "per layer over the bus, no staging, no per-chunk copies)",
                )
            elif self.layer_path == "direct":
                raise RuntimeError(f"layer_path='direct' cannot run: {why}")
            else:
                announce_once(
                    log,
                    "kv_ops.layer-staged",
                    logging.WARNING,
                    "maru.kv_ops: layer-overlap load uses staged copies (one host call per chunk and layer, "
                    "~20 us each): %s. Fix: register the pool with CUDA (maru doctor) and use the triton backend",
                    why,
                )
        return self._direct_ok

    def _direct_blocker(self, obj: torch.Tensor) -> str | None:
        from maru.kv_ops.selection import choose

        if self.backend == "reference" or (self.backend is None and choose("cuda").name != "triton"):
            return "the placement backend is not triton"
        if not obj.is_pinned():
            return "the chunk objects are pageable host memory (the GPU cannot address them)"
        if self._sync.raw:
            dev = self._sync.device_pointer(obj.data_ptr())
            if dev != obj.data_ptr():
                return f"CUDA maps the pool at another device address ({dev}); in-place reads need UVA"
        return None

    def _issue_layers_direct(
        self,
        objs: list[torch.Tensor],
        slot_mapping: Any,
        skip_tokens: int,
        nbytes: int,
        checksums: bool = False,
        segments: list[Any] | None = None,
    ) -> LayerLoad:
        """One direct kernel (a graph replay) and one event per layer; no copies to issue.

        The per-call table (source address, plane stride and slot of every token) is built on the
        host and uploaded with one async copy on the placement stream; the graphs read it from a
        static buffer of the call's bucket, so a later call's upload is ordered after this call's
        kernels by the stream.
        """
        from maru.kv_ops import direct_kernel as dk

        t0, c0 = time.perf_counter(), time.thread_time()
        if not isinstance(objs, CHECKED):  # load_layers passes them checked; anyone else, checked here
            objs = self._objects(objs)
        lengths = objs.tokens  # read once, by ``_objects``: a tensor's shape costs ~0.2 us a read
        slot_mapping = self._check_slots(slot_mapping, objs, skip_tokens, lengths)
        total = int(slot_mapping.numel())
        on_device = slot_mapping.device.type != "cpu"
        host_slots, prefill, unread = dk.direct_host_slots(
            slot_mapping, lengths, skip_tokens, segments if checksums else None
        )
        t_checked = time.perf_counter()
        graphed = self._layer_placer is not None
        tb = _bucket(total) if graphed else total
        if graphed and not self.lazy_capture and not self._layer_placer.has_direct(tb, checksum=checksums):
            announce_once(
                log,
                f"kv_ops.direct-cold-{tb}",
                logging.INFO,
                "maru.kv_ops: layer load of %d tokens: no warmed graphs for its %d-token bucket; eager "
                "launches (~30 us of host time a layer). Warm the engine for that size at start",
                total,
                tb,
            )
            graphed, tb = False, total  # eager: no capture while serving, no padding
        sync, place = self._sync, self._place_stream
        scratch = self._scratch if sync.raw else None
        ticket = None
        t_taken = t_checked
        if scratch is not None:  # the table in a pinned buffer of the pipeline's ring
            ticket, buf = scratch.take(dk.DIRECT_ROWS * (tb + 1))
            t_taken = time.perf_counter()
            host_tab = dk.direct_table_spans(
                objs.ptrs, lengths, host_slots, self.layout.row_size, self.esize, tb, out=buf, prefill=prefill
            )
        else:
            host_tab = dk.direct_table_spans(
                objs.ptrs, lengths, host_slots, self.layout.row_size, self.esize, tb, prefill=prefill
            )
        t_table = time.perf_counter()
        self._after_caller(place)
        tab = None
        if graphed:
            try:
                tab = self._layer_placer.direct_table(tb)
            except ValueError:
                graphed = False
        one_launch = graphed and self._layer_placer.has_direct_all(tb, checksum=checksums)
        done = sums = None
        if one_launch and ticket is not None and not on_device:
            # The lean issue (the layer-overlap load's common case): three raw calls and a graph
            # launch on the placement stream, no torch op and no stream switch.
            place_h = self._place_h
            sync.copy(tab.data_ptr(), host_tab.data_ptr(), host_tab.numel() * 8, place_h)
            scratch.uploaded(ticket, place_h)
            ticket = None
            t_place = time.perf_counter()
            placed = self._layer_placer.scatter_direct_all(tb, checksum=checksums, stream=place_h)
            if checksums:  # the kernels summed every object into row 5 of the table
                sums, done = self._table_sums(tab, len(objs))
        else:
            try:
                tab, placed, done, sums, t_place = self._issue_direct_torch(
                    objs, tab, host_tab, slot_mapping, skip_tokens, total, tb, graphed, one_launch, checksums
                )
            finally:
                if ticket is not None:  # the upload that reads the table is queued (or nothing is)
                    scratch.uploaded(ticket, self._place_h)
        t_end, c_end = time.perf_counter(), time.thread_time()
        # Not ``host_tab``: torch's caching host allocator holds its block until the upload that
        # reads it ran (the copy records an event on it), so dropping it now lets the next call
        # reuse it instead of a fresh cudaHostAlloc (hundreds of us for a 16k-token table).
        handle = LayerLoad(nbytes, placed, sync, (objs, tab, slot_mapping), done)
        if sums is not None:
            per = self.object_token_bytes
            handle.set_checksums(sums, [t * per for t in lengths], self._host_sums)
        handle.path = "layers-direct"
        handle.unread_bytes = (
            unread * self.num_layers * self.layout.num_kv * self.layout.row_size * self.esize
        )
        handle.graphed = graphed
        handle.one_launch = one_launch
        handle.issue_s = t_end - t0
        handle.copy_issue_s = t_place - t0  # the table: built on the host and uploaded
        handle.place_issue_s = t_end - t_place
        # Where the issue's host time went (bench/gpu_connector.py prints the medians): the checks
        # and the partial-read plan, the bucket's graphs looked up and a scratch buffer taken, the
        # table, the stream order and upload, the launch and sums. (A compiled table, the same
        # bytes, did not shorten "table" on an H100 host: bench/RESULTS.md, fifty-second pass.)
        handle.issue_parts = {
            "checks": t_checked - t0,
            "take": t_taken - t_checked,
            "table": t_table - t_taken,
            "upload": t_place - t_table,
            "launch": t_end - t_place,
        }
        # This thread's CPU time over the same span: well under issue_s means the issue waited
        # (the GIL, a blocking call), not computed.
        handle.issue_cpu_s = c_end - c0
        return handle

    def _table_sums(self, tab: torch.Tensor, n: int) -> tuple[torch.Tensor, Any]:
        """Queue (raw, placement stream) the copy of the ``n`` sums the direct kernels added into
        row 5 of device table ``tab`` to pinned host sums; returns them and the event after it."""
        from maru.kv_ops import direct_kernel as dk

        sums = self._host_sums.take(n)
        row5 = tab.data_ptr() + dk.DIRECT_SUMS_ROW * tab.stride(0) * 8
        self._sync.copy(sums.data_ptr(), row5, n * 8, self._place_h, D2H)
        done = self._done_event()
        self._sync.record_on(done, self._place_h)
        return sums, done

    def _issue_direct_torch(
        self,
        objs: list[torch.Tensor],
        tab: torch.Tensor | None,
        host_tab: torch.Tensor,
        slot_mapping: torch.Tensor,
        skip_tokens: int,
        total: int,
        tb: int,
        graphed: bool,
        one_launch: bool,
        checksums: bool,
    ) -> tuple[torch.Tensor, list[Any], Any, Any, float]:
        """The direct layer issue through torch, on the placement stream: a device slot mapping,
        no raw calls, per-layer launches, or a table without a graph. Returns (the device table,
        the per-layer events, the done event, the host sums, when the placements started)."""
        from maru.kv_ops import direct_kernel as dk

        sync, place = self._sync, self._place_stream
        with torch.cuda.stream(place):  # the table upload and the kernels run on the placement stream
            if tab is None:
                tab = torch.empty((dk.DIRECT_ROWS, tb + 1), dtype=torch.int64, device=self.device)
            tab.copy_(host_tab, non_blocking=True)
            if slot_mapping.device.type != "cpu":  # the slot row comes from the device mapping
                tab[2, :total].copy_(slot_mapping.to(torch.int64), non_blocking=True)
                if skip_tokens:
                    tab[2, :skip_tokens].fill_(-1)
            t_place = time.perf_counter()
            if one_launch:
                # One launch: every layer's kernel, each followed by its event (recorded in the graph).
                placed = self._layer_placer.scatter_direct_all(tb, checksum=checksums)
            else:  # per-layer launches, each followed by an event of a recycled set
                _copied, placed = self._layer_events()
                refs = None if graphed else ops.layer_refs(self.caches, self.layout)
                for i in range(self.num_layers):
                    if graphed:
                        self._layer_placer.scatter_layer_direct(i, tb, checksum=checksums)
                    else:
                        dk.direct_scatter_layer(tab, refs[i], self.layout, i, tb, checksum=checksums)
                    sync.record(placed[i], place)
            done = sums = None
            if checksums:  # the kernels summed every object into row 5 of the table
                sums = self._host_sums.take(len(objs))
                sums.copy_(tab[5, : len(objs)], non_blocking=True)
                done = self._done_event()
                sync.record(done, place)
        return tab, placed, done, sums, t_place
