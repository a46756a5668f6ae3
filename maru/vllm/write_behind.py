"""``maru_async_store`` on one worker: stores queued on the forward thread, gathered and published by a drain thread.

``WriteBehind`` keeps the state vLLM's delayed free depends on, and its invariants:

* Delayed free: ``owed`` holds the requests with a store planned since their last preemption,
  exactly the ones the scheduler delays the free of (``MaruSchedulerConnector._track_sending``:
  a step's preemptions clear a request, then the step's stores mark it).
* Exactly once: each owed request is reported in ``finished_sending`` once, after it appeared in
  vLLM's ``finished_req_ids`` and every store batch naming it finished reading its blocks
  (``PendingStore.reading_done``: the gather's device work completed, or on CPU the drain
  thread's gather; the publish may still be ahead, it reads the pool pages, not the blocks),
  whatever became of the stores (published, failed, dropped, connector off), on every
  tensor-parallel rank. Holding the blocks until the publish would keep them from vLLM for the
  drain thread's queue of commits.
* Preemption barrier: before a step's forward no store still reads a preempted request's blocks
  (its gather completed, or it is cancelled and publishes nothing).
* Off the forward thread: on the CPU and CUDA paths ``wait_for_save`` only queues the store (on
  CUDA with an event recorded on the forward's stream); the RESERVE round trip, the gather's issue
  and the publish run on the drain thread, the gather ordered after that event. Only the
  preemption barrier may gather on the forward thread (a store the drain has not started).
* With ``maru_store_helper`` a batch goes to the helper process (``maru.vllm.store_helper``)
  wherever it takes one; its reply ends its read of the blocks, and every rule above holds for it
  as for a drain-thread batch (the barrier waits for the reply, or stops the helper).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from maru import gil_calls
from maru.transfer.background import BackgroundRunner
from maru.transfer.engine import KVTransferEngine
from maru.transfer.records import RequestTransfer, StoreReport
from maru.transfer.stores import PendingStore
from maru.vllm.metadata import MaruConnectorMetadata
from maru.vllm.prefill_gate import PrefillGate
from maru.vllm.sampled_profile import profile_for
from maru.vllm.store_helper import RefusedHelper, StoreHelper
from maru.vllm.worker_stats import WorkerStats

logger = logging.getLogger("maru.vllm")

_MODES = {
    "cpu": "the drain thread reserves, gathers and publishes",
    "pipelined": "the forward thread records an event; the drain thread reserves, queues the gather on "
    "the copy engine after that event, waits for it and publishes",
    "staged": "the gather runs synchronously after the forward (staged path); the drain thread publishes",
    "pipelined, paced": "the forward thread records an event; the drain thread reserves, queues the gather "
    "and the copies after that event on streams of their own, yielding the copy engine between chunks "
    "(vLLM's own copies wait for one chunk at most, not a whole store), waits for them and publishes",
}


class WriteBehind:
    """The write-behind store state of one worker (see the module docstring for its invariants).

    ``account(report)`` receives every drained store's report. ``drain_delay_s``: the drain thread
    sleeps this long before each store (tests of a slow drain). ``gate``: each batch the drain
    thread stores waits for a step without prefill first (``maru_store_yield_to_prefill_ms``,
    ``PrefillGate``; None: drained at once).
    """

    def __init__(
        self,
        stats: WorkerStats,
        account: Callable[[StoreReport], None],
        *,
        timeout_s: float,
        drain_delay_s: float = 0.0,
        gate: PrefillGate | None = None,
    ) -> None:
        self.stats = stats
        self.gate = gate
        self._account = account
        self._timeout_s = timeout_s
        self._drain_delay_s = drain_delay_s
        self._drain: BackgroundRunner | None = None
        self._owed: set[str] = set()
        self._finished: set[str] = set()  # owed, seen in finished_req_ids, a store still reading
        self._finished_at: dict[str, float] = {}  # of _finished: when vLLM named it finished
        # (store, what completes it): a PendingStore and its engine (the drain thread), or a
        # HelperBatch and the StoreHelper (maru_store_helper); both have ``req_ids``,
        # ``reading_done()``, ``read_done`` and ``wait_store_read``.
        self._batches: list[tuple[Any, Any]] = []
        self.draining = False  # the drain thread is at work on a store (set on that thread)
        self.mode = "not connected yet"
        # maru_store_helper: the drain in a process of its own (or why it cannot run here)
        self.helper: StoreHelper | RefusedHelper | None = None

    def announce(self, data_path: str, *, paced: bool = False) -> None:
        """Log how the store runs on ``data_path`` (once per change of path); ``paced``: the path
        paces write-behind stores (``maru_paced_store``; only the pipelined path can)."""
        if paced:
            data_path += ", paced"
        mode = _MODES.get(data_path, data_path)
        if mode != self.mode:
            self.mode = mode
            logger.info(
                "Maru: write-behind store (%s data path): %s; a finished request's blocks are freed once "
                "its stores read them (finished_sending), a preempted request's before the next forward",
                data_path,
                mode,
            )

    def owe(self, meta: MaruConnectorMetadata) -> None:
        """Apply a step's plan to ``owed``: preemptions first, then the step's stores.

        Idempotent per step, so both ``handle_preemptions`` and ``wait_for_save`` apply it (either
        alone keeps the worker exact).
        """
        preempted = meta.preempted_req_ids
        if preempted:
            self._owed -= preempted
            self._finished -= preempted
            for r in preempted:
                self._finished_at.pop(r, None)
        self._owed.update(rt.req_id for rt in meta.stores)

    def use_helper(self, helper: StoreHelper | RefusedHelper) -> None:
        """Send the stores to ``helper`` from now on, whenever it takes them (``StoreHelper.takes``)."""
        self.helper = helper

    def helper_path(self) -> tuple[str, str | None]:
        """(how the stores run with ``maru_store_helper``, the slow-path sentence or None)."""
        h = self.helper
        if h is None:
            return "drain thread", None
        if h.state == "refused":
            return "drain thread (the store helper cannot run here)", h.why
        if h.state == "failed":
            return "drain thread (the store helper failed)", h.why
        return f"helper process, {h.state} (pid {h.pid})", h.note

    def issue(self, engine: KVTransferEngine, stores: list[RequestTransfer]) -> None:
        """Issue ``stores`` (forward thread): to the store helper where it takes them, else on
        ``engine`` with their completion queued on the drain thread."""
        h = self.helper
        if h is not None:
            batch = h.submit(stores) if h.takes() else None
            if batch is not None:
                self._batches.append((batch, h))
                self.stats.helper_batches += 1
                self.stats.stores_in_flight = len(self._batches)
                self.collect()
                return
            self.stats.helper_missed += 1  # starting, every event in use, or failed: the drain thread
        pending = engine.issue_store(stores)
        if self._drain is None:
            self._drain = BackgroundRunner("maru-store-drain")
        self._batches.append((pending, engine))
        inference = torch.is_inference_mode_enabled()  # vLLM's forward runs in inference mode
        self._drain.submit(pending, self._drain_one, engine, pending, inference, time.monotonic())
        self.stats.deferred_commits += 1
        self.stats.stores_in_flight = len(self._batches)
        self.collect()

    def _drain_one(
        self, engine: KVTransferEngine, pending: PendingStore, inference: bool, queued_at: float
    ) -> StoreReport:
        if self._drain_delay_s > 0:
            time.sleep(self._drain_delay_s)  # a slow drain: the blocks must stay held meanwhile
        if self.gate is not None:
            self.gate.wait(queued_at)  # maru_store_yield_to_prefill_ms
        cpu0, wall0, held0 = time.thread_time(), time.perf_counter(), gil_calls.held_ns()
        self.draining = True  # read by the GIL probe (maru_gil_probe_ms)
        try:
            # In the forward thread's mode: the engine's buffers (slot mappings, staging) are made and
            # updated in place on both threads (the preemption barrier gathers on the forward thread),
            # and an inference tensor may be updated in place only under inference mode.
            with torch.inference_mode(inference):
                prof = profile_for("drain")  # MARU_PROFILE: a diagnosis, off by default
                if prof is not None:
                    rep = prof.run(engine.complete_store, pending)
                else:
                    rep = engine.complete_store(pending)
            for phase, s in rep.cpu.items():
                self.stats.drain_phase_cpu_s[phase] = self.stats.drain_phase_cpu_s.get(phase, 0.0) + s
            return rep
        finally:
            self.draining = False
            # Floats added on one thread, read on the other: a torn read is impossible under the GIL.
            self.stats.drain_cpu_s += time.thread_time() - cpu0
            self.stats.drain_wall_s += time.perf_counter() - wall0
            self.stats.drain_gil_held_s += (gil_calls.held_ns() - held0) / 1e9  # MARU_THREAD_CENSUS
            self.stats.drain_batches += 1  # the divisor of the two: batches in flight are not in them

    def on_device(self) -> bool:
        """Whether a store batch issued earlier may still have device work running: its read of the
        blocks (the gather, and the copies behind it) not known complete. Never blocks."""
        return any(not p.reading_done() for p, _ in self._batches)

    def busy(self) -> bool:
        """Whether work is queued on the drain thread."""
        return self._drain is not None and len(self._drain) > 0

    def run_behind(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the drain thread after every store queued so far (its result is ignored)."""
        if self._drain is None:
            self._drain = BackgroundRunner("maru-store-drain")
        self._drain.submit(None, fn, *args)

    def collect(self, wait_s: float | None = 0.0) -> None:
        """Account every drained store (waiting up to ``wait_s`` seconds for the rest; None: all,
        the helper's each bounded by the timeout)."""
        if self.helper is not None:
            if wait_s != 0.0:
                self.helper.wait_all(self._timeout_s if wait_s is None else wait_s)
            for batch, rep in self.helper.poll():
                self._batch_drained(batch)
                self._account(rep)
        if self._drain is None:
            return
        if wait_s != 0.0 and self.gate is not None:
            self.gate.open()  # waiting for the stores: no step may come to release them
        done = self._drain.poll() if wait_s == 0.0 else self._drain.drain(wait_s)
        for tag, res in done:
            if isinstance(tag, PendingStore):
                self._batch_drained(tag)
            if res is None:
                continue  # not a store (something run behind the stores)
            if isinstance(res, BaseException):
                res = StoreReport(failed=1, error=f"{type(res).__name__}: {res}")
            self._account(res)

    def _batch_drained(self, pending: Any) -> None:
        self._batches = [b for b in self._batches if b[0] is not pending]
        self.stats.stores_in_flight = len(self._batches)

    def _reading(self, req_id: str) -> bool:
        """Whether a store batch still reads (or has yet to read) ``req_id``'s blocks."""
        return any(req_id in p.req_ids and not p.reading_done() for p, _ in self._batches)

    def finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks vLLM may free now: finished, and every store naming them done
        reading them (see the module docstring; never blocks).

        vLLM reports a finished request in ``finished_req_ids`` one step after it finished (and
        requires a reported id to be one of those); ids seen there wait until their last store
        batch read their blocks.
        """
        self.collect()
        now = time.monotonic()
        self._finished |= finished_req_ids & self._owed
        done = {r for r in self._finished if not self._reading(r)}
        self._finished -= done
        self._owed -= done
        for r in self._finished.difference(self._finished_at):
            self._finished_at[r] = now  # held: its stores still read its blocks
        for r in done:
            since = self._finished_at.pop(r, None)
            if since is not None:
                self.stats.sending_delayed += 1
                self.stats.sending_delay_s += now - since
        self.stats.sending_reported += len(done)
        self.stats.sending_held = len(self._finished)
        return done

    def preemption_barrier(self, meta: MaruConnectorMetadata) -> None:
        """Block until no store still reads the blocks of the step's preempted requests.

        vLLM freed those blocks when it preempted the requests, and this very step may write them.
        A gather that does not finish within the timeout is cancelled (it publishes nothing). A
        preempted request is no longer owed a ``finished_sending`` (the scheduler forgets it too).
        """
        ids = set(meta.preempted_req_ids)
        self.owe(meta)
        for pending, engine in list(self._batches):
            if not (pending.req_ids & ids) or pending.read_done.is_set():
                continue
            self.stats.preemption_waits += 1
            if not engine.wait_store_read(pending, self._timeout_s):
                self.stats.stores_cancelled += 1
                logger.warning(
                    "Maru: a write-behind store of preempted request(s) %s did not finish reading its "
                    "blocks within %.1f s; it is cancelled (those chunks stay uncached)",
                    sorted(pending.req_ids & ids),
                    self._timeout_s,
                )

    def close(self) -> None:
        """Complete and publish every store issued (each bounded by the client's timeout), then stop."""
        if self.helper is not None:
            self.helper.close(self._timeout_s)
            self.collect()
        if self._drain is not None:
            self.collect(None)
            self._drain.close(timeout=0)
