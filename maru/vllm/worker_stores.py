"""The worker's store side (a mixin of ``MaruWorkerConnector``): ``wait_for_save`` after the
forward, the write-behind's preemption barrier, and each store's accounting.

The stores of a request touching a block whose load failed this step are dropped (their KV was
computed on top of the missing context); nothing here raises into vLLM (a lost store is a future
cache miss).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from maru.transfer.records import RequestTransfer, StoreReport
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.hook_times import timed_part
from maru.vllm.metadata import MaruConnectorMetadata
from maru.vllm.step_clock import PLAIN, kind_of_step

logger = logging.getLogger("maru.vllm")


class WorkerStores:
    """``wait_for_save``, ``handle_preemptions``, ``flush_stores`` and the store accounting."""

    # Set by MaruWorkerConnector.__init__ (or its other methods).
    cfg: MaruConnectorConfig
    block_size: int
    engine: Any
    stats: Any
    step_clock: Any
    write_behind: Any
    layer_loads: Any
    _step_kind: str | None
    _failed_blocks_step: set[int]
    _store_ways: tuple[Any, ...]
    _next_store_warning: float

    _report_paths: Callable[[], None]
    _connect: Callable[[], bool]
    _rank: Callable[[RequestTransfer], RequestTransfer]
    _lost: Callable[[str], None]

    def wait_for_save(self, meta: MaruConnectorMetadata | None) -> None:
        kind, self._step_kind = self._step_kind or PLAIN, None  # None: this step had its forward
        if self.step_clock.enabled:
            stores_now = meta is not None and bool(meta.stores) and self.cfg.enable_store
            beside = kind == PLAIN and not stores_now and self.write_behind.on_device()
            kind = kind_of_step(kind, stores_now, beside)
        # The forward is queued: its end, before Maru queues more.
        self.step_clock.ended(kind, *((meta.step_tokens, meta.prefill) if meta is not None else ()))
        # The layer load must be complete (and its failures known) before this step's stores are
        # filtered, and before the step ends (a no-op where the load errors' read did it).
        self.finish_layer_load()
        if meta is not None and self.cfg.async_store:
            # Before anything can fail: the scheduler delays the free of every request it planned
            # a store for, whatever becomes of the store here (dropped, failed, connector off).
            self.write_behind.owe(meta)
        if meta is None or not meta.stores or not self.cfg.enable_store:
            return
        try:
            self._store(meta)
        except Exception:  # never raise into vLLM; a lost store is a future cache miss
            self.stats.store_failures += sum(len(rt.chunks) for rt in meta.stores)
            logger.exception("Maru: storing failed unexpectedly; those chunks stay uncached")

    def finish_layer_load(self) -> None:
        """The step's layer load finished, its failures in this step's load errors. Idempotent:
        from ``wait_for_save``, and from ``get_block_ids_with_load_errors``, which vLLM calls before
        ``wait_for_save`` with a speculative decoder."""
        try:
            unwaited = self.stats.layer_loads_unwaited
            self._finish_layer_load()
            if not unwaited and self.stats.layer_loads_unwaited:  # the first: maru doctor shows it
                self._report_paths()
        except Exception:
            logger.exception("Maru: finishing the layer-by-layer load failed")

    @timed_part("wait_for_save/layer_finish")
    def _finish_layer_load(self) -> None:
        """The step's layer load accounted (a verifying one: the host waits for its checksums)."""
        if self.layer_loads.in_flight:
            self.layer_loads.finish()

    @timed_part("wait_for_save/store")
    def _store(self, meta: MaruConnectorMetadata) -> None:
        stores = []
        for rt in meta.stores:
            top = max(c.end for c in rt.chunks)
            if (
                self._failed_blocks_step
                and rt.block_ids_of(0, top, self.block_size) & self._failed_blocks_step
            ):
                self.stats.stores_dropped += len(rt.chunks)
                continue
            stores.append(self._rank(rt))
        if not stores or not self._connect() or self.engine is None:
            return
        if self.cfg.async_store:
            # The engine is captured by the store: a reconnect later builds a new one.
            self.write_behind.issue(self.engine, stores)
            return
        self._account_store(self.engine.store(stores))

    def handle_preemptions(self, meta: MaruConnectorMetadata | None) -> None:
        """Before the step's forward: make the blocks of the step's preempted requests safe to reuse.

        vLLM freed those blocks when it preempted the requests, and this very step may write them
        (a forward, or a load): block until no write-behind store still reads them
        (``KVTransferEngine.wait_store_read``: a batch the drain thread has not started is gathered
        right here, after its event on CUDA; one being gathered is waited for). A gather that does not finish within
        ``maru_timeout_s`` is cancelled (it publishes nothing). A preempted request is no longer
        owed a ``finished_sending`` (the scheduler forgets it too).
        """
        if meta is None or not self.cfg.async_store:
            return
        self.write_behind.preemption_barrier(meta)

    @property
    def write_behind_mode(self) -> str | None:
        """How the write-behind store runs on this worker (None: ``maru_async_store`` is off)."""
        if not self.cfg.async_store:
            return None
        return self.write_behind.mode

    def flush_stores(self, timeout_s: float | None = 30.0) -> None:
        """Wait until every write-behind store submitted so far is done (tests, shutdown)."""
        self.write_behind.collect(timeout_s)

    def _ways_seen(self, path: Any) -> tuple[Any, ...]:
        """What the stores' reported paths depend on: the data path's store ways and segment-sum
        reason, and where the write-behind drain runs (``maru_store_helper``)."""
        ways = (path.store_ways, path.segments_off()) if path is not None else (frozenset(), None)
        return (*ways, self.write_behind.helper_path()[0])

    def _account_store(self, rep: StoreReport) -> None:
        path = self.engine.path if self.engine is not None else None
        if self._ways_seen(path) != self._store_ways:  # new: report it (maru stats, doctor)
            self._report_paths()
        self.stats.chunks_stored += rep.stored
        self.stats.chunks_present += rep.present
        self.stats.tokens_stored += rep.tokens
        self.stats.bytes_stored += rep.bytes
        self.stats.store_seconds += rep.seconds
        if rep.failed:
            self.stats.store_failures += rep.failed
            if rep.server_lost:
                self._lost(rep.error or "store failed")
            elif time.monotonic() >= self._next_store_warning:
                # Rate-limited: a full pool would otherwise warn every step.
                self._next_store_warning = time.monotonic() + 60.0
                logger.warning(
                    "Maru: %d chunks not stored: %s (%d store failures so far; next warning in 60 s at most)",
                    rep.failed,
                    rep.error,
                    self.stats.store_failures,
                )
        if self.cfg.log_timing:
            logger.info(
                "Maru timing: store %d chunks (%d new, %d present) %d tokens %.1f MiB in %.2f ms",
                rep.stored + rep.present,
                rep.stored,
                rep.present,
                rep.tokens,
                rep.bytes / 2**20,
                rep.seconds * 1e3,
            )
