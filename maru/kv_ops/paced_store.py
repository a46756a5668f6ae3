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


class PacedStores:
    """The paced half of ``DevicePipeline``'s stores (a mixin; see the module docstring)."""

    # Set by DevicePipeline.__init__.
    device: Any
    esize: int
    _sync: Any
    _place_stream: Any

    def _paced(self) -> tuple[Any, Any, list[StagingSlot]] | None:
        """(gather stream, device-to-host stream, staging slots) of the paced stores, made on first
        use; None (announced once) where torch has no device sleep to pace with."""
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
            slots = [StagingSlot(self, self._new_placer()) for _ in range(PACED_SLOTS)]  # type: ignore[arg-type, attr-defined]
            self._paced_state = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device), slots)
        return self._paced_state or None

    def _issue_store_paced(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, checksums: bool
    ) -> Transfer | None:
        """Queue the whole store on the paced streams (returns at once); None where it cannot pace."""
        state = self._paced()
        if state is None:
            return None
        t0 = time.perf_counter()
        gs, ds, ring = state
        sync = self._sync
        # The placement stream waited for the caller's stream, then moved the slot mapping (``_slots``).
        self._follow(self._place_stream, gs)  # type: ignore[attr-defined]
        with torch.cuda.stream(gs):  # gathers (graph replays or launches) run on the current stream
            acc = torch.zeros(len(objs), dtype=torch.int64, device=self.device) if checksums else None
            for k, (host, chunk_slots) in enumerate(self._per_chunk(objs, slots)):  # type: ignore[attr-defined]
                slot = ring[k % PACED_SLOTS]
                stage, graphed = slot.buffer(host.shape[2])
                if slot.used:
                    sync.wait(gs, slot.free)  # its copy to the pool has read it
                slot.place(stage, graphed, chunk_slots, load=False)
                sync.record(slot.ready, gs)
                sync.wait(ds, slot.ready)
                if k:
                    yield_copy_engine(ds)
                self._d2h(host, stage, ds)  # type: ignore[attr-defined]
                sync.record(slot.free, ds)
                slot.used = True
                if acc is not None:  # after ``ready``: the copy does not wait for the sum
                    ck.accumulate(stage, acc, k)
            sums = ck.to_host(acc, self._host_sums)  # type: ignore[attr-defined]
        if sums is not None:
            ds.wait_stream(gs)  # the done event covers the sums too
        return self._handle("store", "paced", nbytes, ds, t0, objs, slots, acc, sums)  # type: ignore[attr-defined]

    def _warm_paced(self, chunk_tokens: int) -> None:
        """Capture the paced slots' gather graphs for ``chunk_tokens`` (``DevicePipeline.warm``)."""
        state = self._paced()
        if state is not None:
            for slot in state[2]:
                if slot.placer is not None and not slot.used:  # a used slot's static slots are real
                    slot.placer.warm(int(chunk_tokens))

    def _settle_paced(self) -> None:
        """Wait for the paced streams (the pipeline's ``synchronize``)."""
        if getattr(self, "_paced_state", None):
            gs, ds, _ = self._paced_state
            gs.synchronize()
            ds.synchronize()
