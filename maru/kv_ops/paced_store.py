"""The paced store of ``DevicePipeline`` (``store(..., paced=True)``): a store that yields the copy
engine between chunks, for stores that run behind the inference engine (write-behind).

What it is built against (bench/copy_interference.py, H200): copies of one direction share the copy
engine, and the engine keeps serving a stream that has copies queued. A store of 16 chunks (0.5 GB)
queued at once holds back another stream's 4 KiB device-to-host copy (vLLM's sampled tokens) for
9.3 ms, the whole store; the next chunk queued before the last finished changes nothing (9.5 ms).
With the device-to-host stream run dry between chunks the small copy waited 0.45 ms. In real vLLM
that wait is the write-behind store's cost on the time to first token.

How it runs:

* ``store(..., paced=True)`` (any thread) validates, moves the slot mapping (on the placement
  stream, behind the caller's stream) and records an event there; nothing else is queued, and it
  returns a ``PacedStore`` at once.
* ``PacedStore.wait()`` (the drain thread, or the preemption barrier) issues the chunks: each is
  gathered into one of two staging buffers of its own on a gather stream, then copied to its pool
  page on a device-to-host stream of its own; the host waits for that copy before queueing the
  next one, so the copy stream runs dry between chunks and other streams' copies get the engine
  (at most one chunk, ~0.6 ms at 256 tokens of an 8B model, in front of them). The next chunk's
  gather is queued before that wait, so the gap on the bus is the host's wake-up and one copy call.
* Its streams, buffers and events are its own: a load issued meanwhile (forward thread) shares
  nothing with it but the device. One paced store issues at a time (``_pace_lock``).

Invariants:

* A paced store's gathers read the caches after the work queued on the caller's stream when
  ``store`` was called (the forward that wrote them), through an event no one re-records before
  the gathers are queued behind it.
* ``done()`` never issues anything: it is False until ``wait()`` issued every chunk and they
  completed. Publish keys only after ``wait()`` returned, as for every store.
* The caches' slots of a paced store must not be rewritten until ``wait()`` returned (the caller's
  delayed free and preemption barrier hold the blocks; vLLM never rewrites a stored token's slot).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from maru.kv_ops import checksum as ck
from maru.kv_ops.device_handles import Transfer
from maru.kv_ops.staging_slot import StagingSlot

PACED_SLOTS = 2  # one chunk in the copy engine, the next one gathered behind it


class PacedStore(Transfer):
    """Handle of a paced store: ``wait()`` issues its chunks one copy at a time, then returns.

    Thread-safe: any number of threads may call ``wait()``; one issues, the others block until it
    finished (an error raised while issuing is raised to each of them).
    """

    def __init__(
        self,
        engine: PacedStores,
        chunks: list[tuple[torch.Tensor, torch.Tensor]],
        nbytes: int,
        after: Any,
        checksums: bool,
    ) -> None:
        super().__init__("store", "paced", nbytes, None, engine._sync, chunks)
        self._engine = engine
        self._chunks = chunks
        self._after = after
        self._want_sums = checksums
        self._lock = threading.Lock()
        self._issued = False
        self._error: BaseException | None = None
        self.gap_s = 0.0  # host seconds between one chunk's copy completing and the next queued

    def done(self) -> bool:
        """True once ``wait()`` issued every chunk and they completed (never issues, never blocks)."""
        return self._issued and self._error is None and super().done()

    def wait(self) -> None:
        with self._lock:
            if self._error is not None:
                raise RuntimeError(f"the paced store failed while issuing: {self._error}") from self._error
            if not self._issued:
                try:
                    self._engine._pump(self)
                except BaseException as e:
                    self._error = e
                    raise
                finally:
                    self._issued = True
        super().wait()


class PacedStores:
    """The paced half of ``DevicePipeline``'s stores (a mixin; see the module docstring)."""

    # Set by DevicePipeline.__init__.
    device: Any
    esize: int
    _sync: Any
    _place_stream: Any

    def _paced(self) -> tuple[Any, Any, list[StagingSlot]]:
        """(gather stream, device-to-host stream, staging slots) of the paced stores, made on first use."""
        if getattr(self, "_paced_state", None) is None:
            # Plain buffers, eager gathers: a graph capture on the drain thread would stall the device
            # and make other threads' CUDA calls fail while it runs.
            slots = [StagingSlot(self, None) for _ in range(PACED_SLOTS)]  # type: ignore[arg-type]
            self._paced_state = (torch.cuda.Stream(self.device), torch.cuda.Stream(self.device), slots)
            self._pace_lock = threading.Lock()
            self._after_events: list[Any] = []
        return self._paced_state

    def _issue_store_paced(
        self, objs: list[torch.Tensor], slots: torch.Tensor, nbytes: int, checksums: bool
    ) -> PacedStore:
        """Record where the caller's stream is and hand back the store unissued (under ``_lock``)."""
        self._paced()
        # Events are reused only once the store that waited on them queued its wait: none is
        # re-recorded between a store's issue and its gathers.
        after = self._after_events.pop() if self._after_events else self._sync.event()
        # The placement stream waited for the caller's stream, then moved the slot mapping (``_slots``).
        self._sync.record(after, self._place_stream)
        chunks = self._per_chunk(objs, slots)  # type: ignore[attr-defined]
        return PacedStore(self, chunks, nbytes, after, checksums)

    def _pump(self, h: PacedStore) -> None:
        """Issue ``h``'s chunks: gather one ahead, copy one at a time, the copy stream dry in between."""
        gs, ds, ring = self._paced()
        sync, n = self._sync, len(h._chunks)
        with self._pace_lock, torch.cuda.stream(gs):
            sync.wait(gs, h._after)
            self._after_events.append(h._after)
            acc = torch.zeros(n, dtype=torch.int64, device=self.device) if h._want_sums else None
            stages: list[torch.Tensor] = []

            def gather(k: int) -> None:
                host, chunk_slots = h._chunks[k]
                slot = ring[k % PACED_SLOTS]
                stage, _ = slot.buffer(host.shape[2])
                if slot.used:
                    sync.wait(gs, slot.free)  # its copy to the pool has read it (complete by now)
                slot.place(stage, False, chunk_slots, load=False)
                sync.record(slot.ready, gs)
                if acc is not None:  # after ``ready``: the copy does not wait for the sum
                    ck.accumulate(stage, acc, k)
                stages.append(stage)

            gather(0)
            woke = None
            for k in range(n):
                slot = ring[k % PACED_SLOTS]
                sync.wait(ds, slot.ready)
                self._d2h(h._chunks[k][0], stages[k], ds)  # type: ignore[attr-defined]
                if woke is not None:
                    h.gap_s += time.perf_counter() - woke
                sync.record(slot.free, ds)
                slot.used = True
                if k + 1 < n:
                    gather(k + 1)
                    sync.synchronize(slot.free)  # the copy stream runs dry: other copies get the engine
                    woke = time.perf_counter()
            sums = ck.to_host(acc)
            ds.wait_stream(gs)  # the done event covers the sums too
        done = self._done_event()  # type: ignore[attr-defined]
        sync.record(done, ds)
        h._event, h._keepalive = done, (h._chunks, stages, acc)
        if sums is not None:
            h.set_checksums(sums, [host.numel() * self.esize for host, _ in h._chunks])

    def _settle_paced(self) -> None:
        """Wait for the paced streams (the pipeline's ``synchronize``)."""
        if getattr(self, "_paced_state", None) is not None:
            gs, ds, _ = self._paced_state
            gs.synchronize()
            ds.synchronize()
