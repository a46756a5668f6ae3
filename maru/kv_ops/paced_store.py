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

Streams and buffers of its own: the gathers run on a gather stream into ``PACED_SLOTS`` staging
slots of their own, the copies on a device-to-host stream of their own. A load issued while a
store drains (the forward thread, the next step) waits neither for the store's copies (its own
copy stream, another direction: another engine) nor for its staging slots, nor for its gathers
(which wait for those copies to free their slots).

Invariants:

* The gathers read the caches after the work queued on the caller's stream when ``store`` was
  called (the forward that wrote them); the slot mapping is moved before they run.
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
from maru.kv_ops.device_handles import Transfer
from maru.kv_ops.staging_slot import StagingSlot

log = logging.getLogger("maru.kv_ops")

PACED_SLOTS = 2  # one chunk in the copy engine, the next one gathered behind it
# The kernel queued between two chunk copies: while it is the stream's next item, the copy engine
# serves other streams' copies. 10k cycles is 5 us at 2 GHz (the H200's boost clock).
YIELD_CYCLES = 10_000


def yield_copy_engine(stream: Any) -> None:
    """Queue a short kernel on ``stream``: between two of its copies, the copy engine goes to others."""
    with torch.cuda.stream(stream):
        torch.cuda._sleep(YIELD_CYCLES)


@dataclass(frozen=True)
class StoreLane:
    """Where a staged store runs (``DevicePipeline._queue_store``): the gathers on ``gather`` into
    ``slots`` (chunk k into ``slots[k % len(slots)]``, or the pipeline's ring when empty), the
    copies to the pool on ``copy``, a short kernel between two copies when ``paced``; ``path``
    names it in the handle."""

    gather: Any
    copy: Any
    slots: tuple[StagingSlot, ...]
    paced: bool
    path: str


class PacedStores:
    """``DevicePipeline``'s staged stores (a mixin): one routine, ``_queue_store``, on the ring's lane
    (``_issue_store``) or the paced lane (``_issue_store_paced``, see the module docstring)."""

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
        to the pool page behind it (the kernel runs up to a slot ahead of the copy engine). Its
        streams already wait for what the gathers must read after."""
        sync, gather, copy = self._sync, lane.gather, lane.copy
        with torch.cuda.stream(gather):  # gathers (graph replays or launches) run on the current stream
            acc = torch.zeros(len(objs), dtype=torch.int64, device=self.device) if checksums else None
            for k, (host, chunk_slots) in enumerate(self._per_chunk(objs, slots)):  # type: ignore[attr-defined]
                slot = lane.slots[k % len(lane.slots)] if lane.slots else self._take_slot()  # type: ignore[attr-defined]
                stage, graphed = slot.buffer(host.shape[2])
                if slot.used:
                    sync.wait(gather, slot.free)  # its previous copy to the pool must have read it
                slot.place(stage, graphed, chunk_slots, load=False)
                sync.record(slot.ready, gather)
                sync.wait(copy, slot.ready)
                if k and lane.paced:
                    yield_copy_engine(copy)  # the copy engine serves other streams in between
                self._d2h(host, stage, copy)  # type: ignore[attr-defined]
                sync.record(slot.free, copy)
                slot.used = True
                if acc is not None:
                    # After ``ready``: the copy to the pool does not wait for it; the slot's next
                    # gather is queued behind it on this stream.
                    ck.accumulate(stage, acc, k)
            sums = ck.to_host(acc, self._host_sums)  # type: ignore[attr-defined]
        if sums is not None:
            copy.wait_stream(gather)  # done (recorded on the copy stream) covers the sums too
        return self._handle("store", lane.path, nbytes, copy, t0, objs, slots, acc, sums)  # type: ignore[attr-defined, no-any-return]

    def _paced(self) -> StoreLane | None:
        """The paced stores' lane (a gather stream, a device-to-host stream and staging slots of
        their own), made on first use; None (announced once) where torch has no device sleep."""
        if getattr(self, "_paced_state", None) is None:
            if not hasattr(torch.cuda, "_sleep"):
                announce_once(
                    log,
                    "kv_ops.no-pacing",
                    logging.WARNING,
                    "maru.kv_ops: this torch has no torch.cuda._sleep: write-behind stores are queued back "
                    "to back, and a small copy of the inference engine may wait for a whole store (about "
                    "10 ms per 0.5 GB). Fix: torch 2.x as measured (2.11); maru stats shows the store path",
                )
                self._paced_state = False
                return None
            slots = tuple(StagingSlot(self, self._new_placer()) for _ in range(PACED_SLOTS))  # type: ignore[arg-type, attr-defined]
            gs, ds = torch.cuda.Stream(self.device), torch.cuda.Stream(self.device)
            self._paced_state = StoreLane(gs, ds, slots, paced=True, path="paced")
        return self._paced_state or None

    def _issue_store_paced(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, checksums: bool
    ) -> Transfer | None:
        """Queue the whole store on the paced lane (returns at once); None where it cannot pace."""
        lane = self._paced()
        if lane is None:
            return None
        t0 = time.perf_counter()
        # The placement stream waited for the caller's stream, then moved the slot mapping (``_slots``).
        self._follow(self._place_stream, lane.gather)  # type: ignore[attr-defined]
        return self._queue_store(lane, objs, slots, nbytes, checksums, t0)  # type: ignore[attr-defined, no-any-return]

    def _warm_paced(self, chunk_tokens: int) -> None:
        """Capture the paced slots' gather graphs for ``chunk_tokens`` (``DevicePipeline.warm``)."""
        lane = self._paced()
        if lane is not None:
            for slot in lane.slots:
                if slot.placer is not None and not slot.used:  # a used slot's static slots are real
                    slot.placer.warm(int(chunk_tokens))

    def _settle_paced(self) -> None:
        """Wait for the paced streams (the pipeline's ``synchronize``)."""
        lane = getattr(self, "_paced_state", None)
        if lane:
            lane.gather.synchronize()
            lane.copy.synchronize()
