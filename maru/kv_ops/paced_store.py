"""The paced store of ``DevicePipeline`` (``store(..., paced=True)``): a store that yields the copy
engine between chunks and shares no stream or buffer with loads, for stores that run behind the
inference engine (write-behind).

What it is built against (bench/copy_interference.py, H200, 16 chunks of 256 tokens, 0.54 GB):
copies of one direction share the copy engine, and the engine keeps serving a stream whose next
item is a copy. Queued back to back, the store's copies held another stream's 4 KiB
device-to-host copy (vLLM's sampled tokens) for 9.0-9.6 ms, the whole store. With a 5 us kernel
queued on the copy stream between each two chunk copies the small copy waited 0.28 ms (about
half a chunk) and the store still ran at 52.5 GB/s (53.7 back to back); a host thread issuing
one copy after the other completed got 0.34 ms at 47.5 GB/s, with a host wake-up per chunk that
depends on the GIL. So the pacing is on the device: the whole store is queued at once, on the
calling thread, and nothing has to run on the host while it drains.

One stream and one staging slot of its own: a store's slot mapping copied once into the lane's
state (``kv_ops.paced_batch``), then per chunk its graph (its slots fetched from that state, the
gather into the slot, the staged bytes' sum into the state) and its copy to the pool page: two
libcudart calls a chunk, in stream order, so no event orders the slot's reuse and the next
chunk's gather is the kernel between two copies that lets the copy engine serve other streams.
The earlier lane (a gather stream, a copy stream, two slots, a yield kernel between copies) took
ten calls a chunk, three of them copies: the drain thread's host time a store batch is what the
storing instance's requests pay (bench/RESULTS.md, fifty-seventh pass: ~1-1.6 ms of TTFT a ms of
drain CPU a batch). The gathers no longer run beside the previous chunk's copy: a chunk's
gather and sum read ~2x its bytes in device memory (~30 us for 32 MiB on an H100) against its
copy over the bus (~640 us); the store ran 7% slower (47.4 against 51.0 GB/s), behind the engine
anyway. It halved the drain's CPU for the API workload's batch (2.08 against 4.60 ms), and in
real vLLM the storing instance's TTFT did not move (0.999 of the old lane's; RESULTS, sixtieth
pass).

Each chunk's copy goes in pieces of at most ``PIECE_BYTES`` (8 MiB) with a one-kernel graph between
two pieces (``PacedBatch.pause``): a small device-to-host copy of vLLM's waits for the piece in
flight instead of what is left of a 32 MiB chunk (~0.65 ms whole). Small copies sampled all
through a 16-chunk store on an H100 waited 0.09 / 0.18 ms (p50 / max) against 0.53 / 0.61 with
whole copies, the store at 46.2 GB/s against 48.6; the API workload's cold rounds in real vLLM did
not move (1.008 of whole copies, 95% CI 0.993-1.024; RESULTS, sixty-first pass): kept as a bound
on what a store adds to each of vLLM's steps, whatever the chunk's size. 2 x pieces libcudart
calls a chunk: 8 for a 32 MiB chunk instead of 2.

A load issued while a store drains (the forward thread, the next step) waits neither for the
store's copies (its own copy stream, another direction: another engine) nor for its staging slot,
nor for its gathers.

Invariants:

* The gathers read the caches after the work queued on the caller's stream when ``store`` was
  called (the forward that wrote them); the slot mapping is moved before they run.
* A paced chunk's staging is rewritten only by a later chunk's gather, which its own stream
  queues after this chunk's copy out of it.
* As for every store, publish keys only after ``wait()`` (or ``done()``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from maru.announce import announce_once
from maru.kv_ops import checksum as ck
from maru.kv_ops.cuda_sync import D2D, D2H
from maru.kv_ops.device_handles import Transfer
from maru.kv_ops.paced_batch import MAX_CHUNKS, MAX_TOKENS, PacedBatch
from maru.kv_ops.staging_slot import StagingSlot

log = logging.getLogger("maru.kv_ops")

PACED_SLOTS = 1  # one stream: a chunk's gather follows the previous chunk's copy out of the slot
# A chunk's copy to the pool goes in pieces of at most this many bytes, a tiny kernel (the lane's
# pause graph) between two pieces: a small copy of vLLM's (its sampled tokens, each step) waits for
# the piece in flight, not the whole chunk (a 32 MiB chunk is ~0.65 ms on the bus: it waited
# ~0.3-0.5 ms, bench/copy_interference.py). Pieces start at multiples of PIECE_ALIGN bytes.
PIECE_BYTES = 8 << 20
PIECE_ALIGN = 64 << 10
# A store's partial tail (a prompt's end) is a block multiple below the chunk: the paced slots
# capture raw graphs for each such size at warm-up, up to this many sizes (more: tails go the
# torch way, ~5x the drain thread's host time a chunk, said in ``store_ways``).
MAX_TAIL_SIZES = 64


def pieces(nbytes: int, piece_bytes: int = 0, align: int = 0) -> list[tuple[int, int]]:
    """(offset, bytes) of a copy of ``nbytes`` in pieces of at most ``piece_bytes`` (default
    ``PIECE_BYTES``), as even as ``align`` (default ``PIECE_ALIGN``) allows: together exactly
    ``[0, nbytes)``, in order, each piece but the last a multiple of ``align``."""
    piece_bytes = piece_bytes or PIECE_BYTES
    align = align or PIECE_ALIGN
    if nbytes <= piece_bytes:
        return [(0, nbytes)]
    n = -(-nbytes // piece_bytes)
    size = -(-nbytes // n)
    size = min(-(-size // align) * align, max(align, piece_bytes // align * align))
    return [(at, min(size, nbytes - at)) for at in range(0, nbytes, size)]


def tail_sizes(chunk_tokens: int, block_size: int) -> list[int]:
    """The partial-tail sizes a store can meet (every block multiple below the chunk), or none
    where there are more than ``MAX_TAIL_SIZES`` of them or the block does not divide the chunk."""
    if block_size <= 0 or chunk_tokens % block_size or chunk_tokens // block_size - 1 > MAX_TAIL_SIZES:
        return []
    return list(range(block_size, chunk_tokens, block_size))


@dataclass(frozen=True)
class RawChunk:
    """One chunk of a store queued through libcudart: its slot, size, the raw graph executables of
    its gather and checksum (-1: no checksum; 0: the gather graph sums the staged bytes itself,
    the paced lane's ``("paced-chunk", T, None)``), its staging buffer's address, its byte count
    and the address of its sum. ``gather`` 0: this chunk alone is queued the torch way (its size
    has no raw graph: a prompt's partial tail), in its turn, on the same streams and slot."""

    slot: StagingSlot
    tokens: int
    gather: int
    checksum: int
    stage: int
    nbytes: int
    sum_at: int  # where the checksum graph leaves the chunk's raw sum


@dataclass(frozen=True)
class StoreLane:
    """Where a staged store runs (``DevicePipeline._queue_store``): the gathers on ``gather`` into
    ``slots`` (chunk k into ``slots[k % len(slots)]``, or the pipeline's ring when empty), the
    copies to the pool on ``copy``; ``path`` names it in the handle. ``paced``: the write-behind
    lane, one stream (``gather`` is ``copy``), one slot of its own and the store state its chunk
    graphs read (``batch``, a ``PacedBatch``), each chunk's graph queued between two copies
    (``_queue_chunks_serial``)."""

    gather: Any
    copy: Any
    slots: tuple[StagingSlot, ...]
    paced: bool
    path: str
    batch: Any = None


class PacedStores:
    """``DevicePipeline``'s staged stores (a mixin): one routine, ``_queue_store``, on the ring's lane
    (``_issue_store``) or the paced lane (``_issue_store_paced``, see the module docstring)."""

    # Every way the staged stores were queued so far: "libcudart", "torch (<why>)". It only grows
    # (reasons name no sizes), so what is reported from it changes a handful of times a process,
    # however the stores alternate (e.g. full chunks through libcudart, a prompt's tail through torch).
    store_ways: frozenset[str] = frozenset()
    # Set by DevicePipeline.__init__.
    device: Any
    esize: int
    _sync: Any
    _place_stream: Any

    def _issue_store(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, checksums: bool
    ) -> Transfer:
        """The ring store: gathers on the placement stream, copies on the copy stream."""
        t0 = time.perf_counter()
        self._start()  # type: ignore[attr-defined]
        lane = StoreLane(self._place_stream, self._copy_stream, (), paced=False, path="pipelined")  # type: ignore[attr-defined]
        return self._queue_store(lane, objs, slots, nbytes, checksums, t0)

    def _queue_store(
        self,
        lane: StoreLane,
        objs: list[torch.Tensor],
        slots: torch.Tensor,
        nbytes: int,
        checksums: bool,
        t0: float,
    ) -> Transfer:
        """Queue a staged store on ``lane``: per chunk, the gather into a staging slot, then its copy
        to the pool page behind it; every per-chunk call through libcudart where it can
        (``_raw_plan``; ``_queue_chunks_serial`` on the paced lane, ``_queue_chunks_raw`` on the
        ring, where the kernel runs up to a slot ahead of the copy engine), else through torch
        (``_queue_chunks_each``). Its streams already wait for what the gathers must read after."""
        if lane.paced:
            # A graph captured now (lazy capture, a new size) runs once outside its capture, and a
            # paced chunk graph moves the lane's state: with the lane's stream current, that run
            # follows the stores still queued there (``GraphedPlacer._graph``), never inside one.
            with torch.cuda.stream(lane.gather):
                plan = self._raw_plan(lane, objs, slots, checksums)
        else:
            plan = self._raw_plan(lane, objs, slots, checksums)
        with torch.cuda.stream(lane.gather):
            if plan is not None and lane.paced:
                acc = self._queue_chunks_serial(lane, plan, objs, slots)  # the sums: the lane's state
                acc = acc if checksums else None
            else:
                acc = self._zeroed_sums(lane, len(objs)) if checksums else None
                if plan is None:
                    self._queue_chunks_each(lane, objs, slots, acc)
                else:
                    self._queue_chunks_raw(lane, plan, objs, slots, acc)
            sums = self._sums_to_host(acc, lane.gather.cuda_stream)  # type: ignore[attr-defined]
        if sums is not None and lane.copy is not lane.gather:  # done (on ``copy``) covers the sums
            self._follow(lane.gather, lane.copy)  # type: ignore[attr-defined]
        return self._handle("store", lane.path, nbytes, lane.copy, t0, objs, slots, acc, sums)  # type: ignore[attr-defined, no-any-return]

    def _zeroed_sums(self, lane: StoreLane, n: int) -> torch.Tensor:
        """``n`` zeroed int64 for a store's sums, in a buffer the lane keeps: every writer and reader
        of it (the zeroing, the chunks' sums, the copy to the host sums) is queued on the lane's
        gather stream, so the next store's zeroing follows this one's copy out. (A torch.empty a
        store cost the drain thread up to ~0.5 ms of host time when the allocator's lock was
        contended.)"""
        acc = self._device_words(f"_store_acc_{lane.path}", n, lane.gather)  # type: ignore[attr-defined]
        if self._sync.raw:  # a memset, not a torch fill kernel (~30 us of host time on the H200 host)
            self._sync.zero(acc.data_ptr(), 8 * n, lane.gather.cuda_stream)
        else:
            acc.zero_()
        return acc

    def _raw_plan(
        self, lane: StoreLane, objs: list[torch.Tensor], slots: torch.Tensor, checksums: bool
    ) -> list[RawChunk] | None:
        """Per chunk, its slot and the raw graph executables of its gather (and checksum), when the
        whole store can be queued through libcudart: a raw sync, every slot graph-backed for every
        chunk size (captured now where captures are lazy), the slot mapping's chunks contiguous.
        None: the store goes the torch way (same bytes, ~5x the host time a chunk), announced
        once with the reason (a missing libcudart is announced where the pipeline is built). A
        chunk of a size without raw graphs (a prompt's partial tail) goes the torch way alone,
        the others through libcudart: both ways are then noted."""
        if not self._sync.raw:
            self._note_way("torch (libcudart not reachable)")
            return None
        plan, why = self._raw_chunks(lane, objs, slots, checksums)
        if plan is not None:
            self._note_way("libcudart")
        if why:
            self._note_way(f"torch ({why})")
            announce_once(
                log,
                "kv_ops.store-torch-way",
                logging.INFO,
                "maru.kv_ops: a store (or a chunk of it) is queued through torch, not libcudart (%s): "
                "the same bytes, about 5x the drain thread's host time a chunk",
                why,
            )
        return plan

    def _note_way(self, way: str) -> None:
        if way not in self.store_ways:  # a new set, never changed in place: readers on other threads
            self.store_ways = self.store_ways | {way}

    def _raw_chunks(
        self, lane: StoreLane, objs: list[torch.Tensor], slots: torch.Tensor, checksums: bool
    ) -> tuple[list[RawChunk] | None, str]:
        if not slots.is_contiguous():
            return None, "a non-contiguous slot mapping"
        if lane.paced and not PacedBatch.fits(int(slots.numel()), len(objs)):
            return None, (
                f"a store larger than the paced lane's state (at most {MAX_TOKENS} tokens and "
                f"{MAX_CHUNKS} chunks)"
            )
        lazy = self.lazy_capture  # type: ignore[attr-defined]
        ring = list(lane.slots) or [
            self._ring[(self._next_slot + k) % self.ring_slots] for k in range(len(objs))
        ]  # type: ignore[attr-defined]
        plan: list[RawChunk] = []
        why = ""
        for k, obj in enumerate(objs):
            slot = ring[k % len(ring)]
            t = int(obj.shape[2])
            if slot.placer is None:
                return None, "eager placement (no graph placer)"
            if not obj.is_contiguous():
                return None, "a non-contiguous chunk object"
            nbytes = obj.numel() * self.esize
            stage = None
            try:
                if lane.paced:  # one graph a chunk: slots, gather, sum (``_queue_chunks_serial``)
                    gather, summed = slot.placer.raw_exec(("paced-chunk", t, None), capture=lazy), 0
                    if lazy:  # the pause between a copy's pieces
                        slot.placer.warm_pause()
                else:
                    gather = slot.placer.raw_exec(("gather", t, None), capture=lazy)
                    summed = slot.placer.raw_exec(("checksum", t, None), capture=lazy) if checksums else -1
                stage = slot.placer.staging(t) if gather and (summed or lane.paced) else None
            except ValueError:  # the placer holds buffers for enough sizes already
                reason, gather = "no graph bucket left for a chunk size", 0
            else:
                # Sizes are not named: a prompt's partial tail can be any multiple of the block size.
                reason = (
                    "no raw graph for a chunk size not warmed at start (a prompt's partial tail), or "
                    "this torch hides graph executables"
                )
            if stage is None or not gather:  # this chunk alone the torch way, in its turn
                why = reason
                plan.append(RawChunk(slot, t, 0, 0, 0, nbytes, 0))
                continue
            plan.append(
                RawChunk(
                    slot,
                    t,
                    gather,
                    summed,
                    stage.data_ptr(),
                    nbytes,
                    slot.placer.sum_address(t),
                )
            )
        torch_way = [c for c in plan if not c.gather]
        if torch_way and len(torch_way) == len(plan):
            return None, why
        return plan, why if torch_way else ""

    def _queue_chunks_raw(
        self,
        lane: StoreLane,
        plan: list[RawChunk],
        objs: list[torch.Tensor],
        slots: torch.Tensor,
        acc: torch.Tensor | None,
    ) -> None:
        """The ring lane's chunks with every call a libcudart call that keeps the GIL (about a
        microsecond each): the slot mapping copied into the slot's graph (device to device), the
        gather graph, then on the copy stream the copy to the pool; before ``ready`` the checksum
        graph, its sum copied into ``acc``. The same streams, slots and events as
        ``_queue_chunks_each``, whose way a chunk without raw graphs (``gather`` 0) takes, in its
        turn."""
        sync = self._sync
        g, c = lane.gather.cuda_stream, lane.copy.cuda_stream
        acc_at = acc.data_ptr() if acc is not None else 0
        slot_at, token0 = slots.data_ptr(), 0
        for k, (ch, obj) in enumerate(zip(plan, objs, strict=True)):
            if not ch.gather:
                self._queue_one_each(lane, ch.slot, k, obj, slots[token0 : token0 + ch.tokens], acc)
                token0 += ch.tokens
                continue
            slot, placer = ch.slot, ch.slot.placer
            if slot.used:
                sync.wait_on(g, slot.free)  # its previous copy to the pool must have read it
            placer.slots_from(slot_at + 8 * token0, ch.tokens, g)
            sync.launch_graph(ch.gather, g)
            if acc is not None:
                # Before ``ready``: the slot's ``free`` (after the copy to the pool, which waits for
                # ``ready``) then covers this read of it too. A ring slot's next user may be a
                # load's copy on another stream that waits for ``free`` alone.
                sync.launch_graph(ch.checksum, g)
                sync.copy(acc_at + 8 * k, ch.sum_at, 8, g, D2D)
            sync.record_on(slot.ready, g)
            sync.wait_on(c, slot.ready)
            sync.copy(obj.data_ptr(), ch.stage, ch.nbytes, c, D2H)
            sync.record_on(slot.free, c)
            slot.used = True
            token0 += ch.tokens
        if not lane.slots:  # the ring's slots were taken in turn
            self._next_slot = (self._next_slot + len(objs)) % self.ring_slots  # type: ignore[attr-defined]

    def _queue_chunks_serial(
        self, lane: StoreLane, plan: list[RawChunk], objs: list[torch.Tensor], slots: torch.Tensor
    ) -> torch.Tensor:
        """The paced lane's chunks on its one stream: the store's start (its slot mapping into the
        lane's state, the state and sums zeroed: ``PacedBatch.start``), then per chunk its graph
        (its slots from the state, the gather, its sum into the state) and its copy to the pool in
        ``pieces``, the lane's pause graph between two pieces (``PacedBatch.pause``; 0: whole
        copies). Stream order alone keeps the slot's staging until its copy read it, and puts a
        kernel (the next chunk's gather, or a pause) between every two copies: the copy engine
        serves other streams there. A chunk without a graph (``gather`` 0) goes the torch way in
        its turn and moves the state past it. Returns the store's sums (device, raw; entry k for
        chunk k)."""
        sync, s = self._sync, lane.copy.cuda_stream
        batch = lane.batch
        pause = batch.pause  # 0: no pause graph (not warmed), each copy whole
        acc = batch.start(sync, slots, len(objs), s)
        token0 = 0
        for k, (ch, obj) in enumerate(zip(plan, objs, strict=True)):
            if not ch.gather:
                self._queue_one_each(lane, ch.slot, k, obj, slots[token0 : token0 + ch.tokens], acc)
                batch.advance(ch.tokens)
            else:
                sync.launch_graph(ch.gather, s)
                dst = obj.data_ptr()
                for at, n in pieces(ch.nbytes) if pause else ((0, ch.nbytes),):
                    if at:
                        sync.launch_graph(pause, s)
                    sync.copy(dst + at, ch.stage + at, n, s, D2H)
                ch.slot.used = True
            token0 += ch.tokens
        return acc  # type: ignore[no-any-return]

    def _queue_chunks_each(
        self, lane: StoreLane, objs: list[torch.Tensor], slots: torch.Tensor, acc: torch.Tensor | None
    ) -> None:
        """The chunks through torch (on the gather stream, current): placements, copies and
        checksums each a torch call."""
        for k, (host, chunk_slots) in enumerate(self._per_chunk(objs, slots)):  # type: ignore[attr-defined]
            slot = lane.slots[k % len(lane.slots)] if lane.slots else self._take_slot()  # type: ignore[attr-defined]
            self._queue_one_each(lane, slot, k, host, chunk_slots, acc)

    def _queue_one_each(
        self,
        lane: StoreLane,
        slot: StagingSlot,
        k: int,
        host: torch.Tensor,
        chunk_slots: torch.Tensor,
        acc: torch.Tensor | None,
    ) -> None:
        """Chunk ``k`` of a store through torch, into ``slot`` (the gather stream is current)."""
        sync, gather, copy = self._sync, lane.gather, lane.copy
        stage, graphed = slot.buffer(host.shape[2])
        if slot.used:
            sync.wait(gather, slot.free)  # its previous copy to the pool must have read it
        slot.place(stage, graphed, chunk_slots, load=False)
        if acc is not None:
            # Before ``ready``: the slot's ``free`` then covers this read of it too (a ring slot's
            # next user may be a load's copy on another stream, which waits for ``free`` alone).
            ck.accumulate(stage, acc, k)
        sync.record(slot.ready, gather)
        sync.wait(copy, slot.ready)
        self._d2h(host, stage, copy)  # type: ignore[attr-defined]
        sync.record(slot.free, copy)
        slot.used = True

    def _paced(self) -> StoreLane:
        """The paced stores' lane (a stream and a staging slot of their own), made on first use."""
        lane = getattr(self, "_paced_state", None)
        if lane is None:
            slots = tuple(StagingSlot(self, self._new_placer()) for _ in range(PACED_SLOTS))  # type: ignore[arg-type, attr-defined]
            placers = [slot.placer for slot in slots if slot.placer is not None]
            # Without a graph placer the store goes the torch way (``_raw_chunks``): no state to keep.
            batch = PacedBatch(self.device) if placers else None
            for placer in placers:
                placer.batch = batch  # its "paced-chunk" graphs read and advance it
            stream = torch.cuda.Stream(self.device)
            lane = self._paced_state = StoreLane(stream, stream, slots, True, "paced", batch)
        return lane

    def _issue_store_paced(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, checksums: bool
    ) -> Transfer:
        """Queue the whole store on the paced lane (returns at once)."""
        lane = self._paced()
        t0 = time.perf_counter()
        # The placement stream waited for the caller's stream, then moved the slot mapping (``_slots``).
        self._follow(self._place_stream, lane.gather)  # type: ignore[attr-defined]
        return self._queue_store(lane, objs, slots, nbytes, checksums, t0)  # type: ignore[attr-defined, no-any-return]

    def _warm_paced(self, chunk_tokens: int) -> None:
        """Capture the paced slot's summing gather graphs for ``chunk_tokens`` and for every
        partial-tail size (``tail_sizes``: one chunk-sized staging buffer, viewed at each size;
        ``DevicePipeline.warm``). Without the tails' graphs, every request's last chunk (its
        prompt's end) went the torch way: ~0.5 ms of the drain thread's host time instead of ~0.01
        (H200, RESULTS "forty-fourth pass")."""
        tails = tail_sizes(int(chunk_tokens), int(self.layout.block_size))  # type: ignore[attr-defined]
        for slot in self._paced().slots:
            if slot.placer is not None and not slot.used:  # a used slot's static slots are real
                self._warm_slot(slot.placer, int(chunk_tokens), tails, loads=False)

    tails_unwarmed: str | None = None  # why some tail sizes have no graphs (``maru doctor``)

    def _warm_slot(self, placer: Any, chunk_tokens: int, tails: list[int], *, loads: bool) -> None:
        """A staging slot's graphs: the chunk size's, then each tail size's over the slot's one
        chunk-sized staging (``share_staging``). The paced slot: the gather that sums; with
        ``loads`` (a ring slot, which loads too) the gather, the checksum and the scatter (and
        the fused one where asked for)."""
        fused = loads and getattr(self, "fuse_checksums", False)
        placer.share_staging(chunk_tokens)
        if loads:
            placer.warm(chunk_tokens, checksum=True, fused=fused)
        else:
            placer.warm_gather(chunk_tokens)
        for t in tails:
            try:
                if loads:
                    placer.warm(t, checksum=True, fused=fused)
                else:
                    placer.warm_gather(t)
            except RuntimeError as e:
                # The sizes not captured keep the torch way or an eager launch (the same bytes,
                # more host time): said once, and in ``maru doctor`` (``tails_unwarmed``).
                if hasattr(self._sync, "clear_error"):  # the raw calls: reset the runtime's error
                    self._sync.clear_error()
                self.tails_unwarmed = (
                    f"the graphs for a {t}-token partial tail could not be captured ({e}): tails of "
                    "that size and up go the torch way or an eager launch (the same bytes, ~0.5 ms "
                    "of host time a chunk). Fix: report the CUDA and torch versions (maru doctor)"
                )
                announce_once(
                    log, "kv_ops.tail-graphs", logging.WARNING, "maru.kv_ops: %s", self.tails_unwarmed
                )
                return

    def _settle_paced(self) -> None:
        """Wait for the paced streams (the pipeline's ``synchronize``)."""
        lane = getattr(self, "_paced_state", None)
        if lane is not None:
            lane.copy.synchronize()  # its one stream
