"""Worker side of the connector: executes the scheduler's plan against the paged KV cache.

``register_kv_caches`` detects the cache layout (``maru.kv_ops``) and connects to the server;
``start_load_kv`` places this step's loads before the forward; ``wait_for_save`` stores the
chunks this step completed after the forward (every layer's KV of the step is written by
then), with one multi-layer gather per chunk straight into pool memory and one commit.

Failure policy: nothing Maru-side ever raises into vLLM. An unsupported layout disables the
connector for good (one warning naming the layout and what to do); an unreachable server
disables it until a reconnect succeeds (one warning, retried at most every few seconds). A
load that cannot be done completely is reported through ``get_block_ids_with_load_errors``
and vLLM recomputes those blocks; the stores of any request touching those blocks in the
same step are dropped, because their KV was computed on top of the missing context.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from maru import kv_ops
from maru.errors import UnsupportedLayout
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.logs import UNREACHABLE_MSG, forget, unreachable_key, warn_once
from maru.vllm.metadata import MaruConnectorMetadata
from maru.vllm.scheduler import rank_keys
from maru.vllm.transfer import (
    AsyncLoader,
    BackgroundRunner,
    ChunkRef,
    KVTransferEngine,
    LayerwiseLoad,
    LoadReport,
    PendingStore,
    PipelinedLayerLoad,
    RequestTransfer,
    StoreReport,
)

logger = logging.getLogger("maru.vllm")

_RECONNECT_S = 10.0
# Test hook: seconds the write-behind drain thread sleeps before each store (a slow drain).
DRAIN_DELAY_ENV = "MARU_TEST_STORE_DRAIN_DELAY_S"
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class WorkerStats:
    """Cumulative counters of one worker (``MaruKVConnector.maru_stats()``)."""

    loads: int = 0
    tokens_loaded: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    load_errors: int = 0
    load_seconds: float = 0.0
    chunks_stored: int = 0
    chunks_present: int = 0
    tokens_stored: int = 0
    bytes_stored: int = 0
    store_failures: int = 0
    stores_dropped: int = 0
    store_seconds: float = 0.0
    async_loads: int = 0  # maru_async_load: loads started on the loader thread
    async_load_failures: int = 0
    overlap_loads: int = 0  # maru_overlap_load_with_compute: steps placed layer by layer
    layer_waits: int = 0  # wait_for_layer_load calls that found a layer load in flight
    deferred_commits: int = 0  # maru_async_store: store batches committed by the drain thread
    stores_in_flight: int = 0  # maru_async_store, now: store batches issued and not yet drained
    sending_held: int = 0  # maru_async_store, now: finished requests whose blocks wait for their stores
    sending_reported: int = 0  # maru_async_store: requests reported in finished_sending (blocks freed)
    preemption_waits: int = 0  # preemption barriers that waited for a store still reading the blocks
    stores_cancelled: int = 0  # store batches given up at a preemption barrier (published nothing)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def order_layers(kv_caches: dict[str, torch.Tensor]) -> list[str]:
    """Layer names in model order (by the ``layers.<i>.`` index in the name; else as given)."""
    names = list(kv_caches)
    idx = [_LAYER_RE.search(n + ".") for n in names]
    if all(m is not None for m in idx):
        return [n for _, n in sorted(zip((int(m.group(1)) for m in idx if m), names, strict=True))]
    return names


class MaruWorkerConnector:
    """Worker-side execution. One per worker process (one per tensor-parallel rank)."""

    def __init__(
        self,
        cfg: MaruConnectorConfig,
        *,
        block_size: int,
        num_kv_heads: int,
        head_size: int,
        tp_rank: int = 0,
        tp_size: int = 1,
        client_factory: Any = None,
        backend_name_of: Any = None,
    ) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self._client_factory = client_factory
        self._backend_name_of = backend_name_of
        self.engine: KVTransferEngine | None = None
        self.layout: Any = None
        self.caches: list[torch.Tensor] = []
        self.disabled_reason: str | None = None
        self._client: Any = None
        self._next_connect = 0.0
        self._load_errors: set[int] = set()
        self._failed_blocks_step: set[int] = set()
        self._next_store_warning = 0.0
        self.stats = WorkerStats()
        self._layer_index: dict[str, int] = {}
        self._layer_load: LayerwiseLoad | PipelinedLayerLoad | None = None
        self._layer_load_reqs: dict[str, RequestTransfer] = {}
        # CUDA layer loads after their forward: unpinned once done() (get_finished polls them).
        self._layer_releases: list[PipelinedLayerLoad] = []
        self._loader: AsyncLoader | None = None  # maru_async_load
        self._drain: BackgroundRunner | None = None  # maru_async_store
        # Write-behind bookkeeping (maru_async_store). ``_owed``: requests with a store planned since
        # their last preemption, exactly the ones the scheduler delays the free of; each is reported
        # once in finished_sending after it appeared in finished_req_ids (``_finished``) and every
        # store batch naming it drained (``_inflight`` counts them; ``_batches`` for the barrier).
        self._owed: set[str] = set()
        self._finished: set[str] = set()
        self._inflight: dict[str, int] = {}
        self._batches: list[tuple[PendingStore, KVTransferEngine]] = []
        self._drain_delay_s = float(os.environ.get(DRAIN_DELAY_ENV, "0") or 0)
        self._write_behind_mode = "not connected yet"

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = order_layers(kv_caches)
        self.caches = [kv_caches[n] for n in names]
        self._layer_index = {n: i for i, n in enumerate(names)}
        backend = None
        if self._backend_name_of is not None:
            try:
                backend = self._backend_name_of(names[0])
            except Exception:
                backend = None
        try:
            self.layout = kv_ops.detect_layouts(
                self.caches,
                block_size=self.block_size,
                num_kv_heads=self.num_kv_heads,
                head_size=self.head_size,
                attn_backend=backend,
            )
        except UnsupportedLayout as e:
            self.disabled_reason = f"unsupported KV-cache layout ({e})"
            logger.warning(
                "Maru: connector disabled for this engine: %s. vLLM computes every prompt itself. "
                "Report the layout (shape, strides, attention backend %s) to the Maru project.",
                self.disabled_reason,
                backend,
            )
            return
        logger.info(
            "Maru: KV cache %s (%d layers, backend %s, kv_ops %s); server %s",
            self.layout.describe(),
            len(self.caches),
            backend,
            _kv_ops_backend(),
            self.cfg.server_url,
        )
        self._connect()

    def _connect(self) -> bool:
        if self.engine is not None:
            return True
        if self.disabled_reason is not None or self.layout is None or self._client_factory is None:
            return False
        now = time.monotonic()
        if now < self._next_connect:
            return False
        try:
            self._client = self._client_factory()
        except Exception as e:
            self._next_connect = now + _RECONNECT_S
            warn_once(
                unreachable_key(self.cfg.server_url),
                UNREACHABLE_MSG,
                self.cfg.server_url,
                f"{type(e).__name__}: {e}",
                _RECONNECT_S,
            )
            return False
        if forget(unreachable_key(self.cfg.server_url)):
            logger.warning("Maru: reconnected to maru server at %s", self.cfg.server_url)
        self.engine = KVTransferEngine(self.caches, self.layout, self._client)
        if self.cfg.async_store:
            self._announce_write_behind(self.engine.data_path)
        self._report_paths()
        return True

    def data_paths(self) -> dict[str, Any]:
        """The client-info map (role, paths, slow) this worker reports to the server.

        ``maru stats`` shows it and ``maru doctor`` warns when ``slow`` is not empty: the paths a
        process actually runs are visible from outside it, not only in its own log.
        """
        eng = self.engine
        paths: dict[str, Any] = {
            "device": str(eng.device) if eng else "?",
            "kv_ops": _kv_ops_backend(),
            "layout": self.layout.describe() if self.layout is not None else "?",
            "async_load": "on" if self.cfg.async_load else "off",
            "layer_overlap": "on" if self.cfg.overlap_load_with_compute else "off",
            "store": "write-behind" if self.cfg.async_store else "sync",
        }
        slow: list[str] = []
        if eng is not None:
            paths["load"] = eng.data_path
            reg = eng.host_registration
            if eng.device.type == "cuda":
                paths["pool"] = reg.state if reg is not None else "not registered"
                if reg is None or not reg.registered:
                    why = reg.describe() if reg is not None else "the client exposes no pool mapping"
                    slow.append(
                        f"pool not registered with CUDA ({why}): pool<->GPU copies are pageable, ~11x "
                        "slower. Fix: see `maru doctor` (pool registered with CUDA) and docs/gpu.md"
                    )
            if eng.data_path == "staged":
                slow.append(
                    "KV moves through the staged per-chunk path (the pipelined GPU engine could not be "
                    "built; the worker log says why). Fix: CUDA caches and a working triton install"
                )
            pipe = eng.pipeline
            if pipe is not None and self.cfg.overlap_load_with_compute:
                paths["layer_graphs"] = "on" if pipe.layer_graphs else "off"
                if not pipe.layer_graphs:
                    slow.append(
                        "layer-overlap load without CUDA graphs: ~30 us of host time a layer instead of "
                        "~6-9. Fix: the triton backend (maru doctor: kv_ops backend)"
                    )
        return {"role": "vllm-connector", "rank": self.tp_rank, "paths": paths, "slow": slow}

    def _report_paths(self) -> None:
        report = getattr(self._client, "set_client_info", None)
        if report is None:
            return
        try:
            report(self.data_paths())
        except Exception as e:  # a report is informative; it must never cost the connection
            logger.info("Maru: could not report the data paths to the server: %s", e)

    def _announce_write_behind(self, data_path: str) -> None:
        mode = {
            "cpu": "the drain thread reserves, gathers and publishes",
            "pipelined": "the gather is queued on the copy engine after the forward; the drain thread "
            "waits for it, then publishes",
            "staged": "the gather runs synchronously after the forward (staged path); the drain thread publishes",
        }.get(data_path, data_path)
        if mode != self._write_behind_mode:
            self._write_behind_mode = mode
            logger.info(
                "Maru: write-behind store (%s data path): %s; a finished request's blocks are freed "
                "once its stores drained (finished_sending), a preempted request's once its gather read them",
                data_path,
                mode,
            )

    def _lost(self, why: str) -> None:
        """The server went away mid-step: drop the connection, retry later, say so once."""
        client, engine = self._client, self.engine
        self._client, self.engine = None, None
        self._next_connect = time.monotonic() + _RECONNECT_S
        warn_once(
            unreachable_key(self.cfg.server_url), UNREACHABLE_MSG, self.cfg.server_url, why, _RECONNECT_S
        )
        if client is not None:
            if self._drain is not None and len(self._drain):
                # Write-behind stores queued on the drain thread still use this client (and its
                # pool mapping): close it behind them, in order.
                self._drain.submit(None, _close_engine_then_client, engine, client)
                return
            _close_engine_then_client(engine, client)

    def _rank(self, rt: RequestTransfer) -> RequestTransfer:
        if self.tp_size == 1:
            return rt
        chunks = tuple(
            ChunkRef(
                rank_keys(c.key, self.tp_size)[self.tp_rank],
                c.start,
                c.num_tokens,
                c.place_begin,
                c.place_end,
            )
            for c in rt.chunks
        )
        return RequestTransfer(rt.req_id, rt.block_ids, chunks)

    # ------------------------------------------------------------------ load
    def start_load_kv(self, meta: MaruConnectorMetadata | None) -> None:
        self._failed_blocks_step = set()
        if meta is None:
            return
        if meta.async_loads:
            self._start_async_loads(meta.async_loads)
        if not meta.loads:
            return
        try:
            if self.cfg.overlap_load_with_compute and self.cfg.enable_load:
                self._start_layer_load(meta)
            else:
                self._load(meta)
        except Exception as e:  # never raise into the forward; recompute instead
            logger.exception("Maru: loading failed unexpectedly; vLLM recomputes those blocks")
            for rt in meta.loads:
                self._fail(rt, f"{type(e).__name__}: {e}")

    # ------------------------------------------------------------------ layer overlap
    def _start_layer_load(self, meta: MaruConnectorMetadata) -> None:
        """Pin every chunk of the step now (the lookup decides), then place layer by layer behind.

        CUDA caches: one ``load_layers`` call for every ready request, issued here on the forward
        thread (``PipelinedLayerLoad``); a failure at issue is reported at once, before the forward
        reads anything. CPU caches: the ``LayerwiseLoad`` thread places layer by layer.
        """
        self._release_layer_loads()
        if not self._connect() or self.engine is None:
            why = self.disabled_reason or "maru server not reachable"
            for rt in meta.loads:
                self._fail(rt, why)
            return
        by_id = {rt.req_id: rt for rt in meta.loads}
        pinned = self.engine.pin([self._rank(rt) for rt in meta.loads])
        for req_id, why in pinned.failed.items():
            self._fail(by_id[req_id], why)
        if pinned.server_lost:
            self._lost(next(iter(pinned.failed.values())))
            return
        if not pinned.ready:
            self.engine.release(pinned)
            return
        pinned.failed = {}  # reported above; the layer load reports only its own failures
        self._layer_load_reqs = by_id
        ll = self.engine.start_layer_load(pinned)
        self._layer_load = ll
        self.stats.overlap_loads += 1
        if isinstance(ll, PipelinedLayerLoad):
            for req_id, why in ll.report.failed.items():
                self._fail(by_id[req_id], why)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this layer of the step's load is placed (other layers may still be in flight)."""
        ll = self._layer_load
        if ll is None:
            return
        self.stats.layer_waits += 1
        i = self._layer_index.get(layer_name)
        if i is None or i >= ll.num_layers:
            # A name we do not know: wait for every layer rather than risk a partial read.
            if isinstance(ll, PipelinedLayerLoad):
                ll.wait_on()  # GPU-side, like wait_for_layer
            else:
                ll.wait()
        else:
            ll.wait_for_layer(i)  # CUDA: the forward stream waits for the layer's event

    def _finish_layer_load(self) -> None:
        """Join the step's layer load (after the forward) and account for it; failures -> recompute."""
        ll, self._layer_load = self._layer_load, None
        if ll is None:
            return
        by_id, self._layer_load_reqs = self._layer_load_reqs, {}
        if isinstance(ll, PipelinedLayerLoad):
            # Everything queued after the forward on this stream waits for every layer (a layer the
            # model never waited for included): GPU-side, the host does not block here. Failures at
            # issue were reported before the forward. The pins are held until the transfer is
            # done(): get_finished polls it (not a host wait here, which would stall the forward
            # thread until the last layer is placed).
            ll.wait_on()
            self._layer_releases.append(ll)
            self._account_load(ll.report, " (layer by layer)")
            return
        rep = ll.wait()
        for req_id, why in rep.failed.items():
            self._fail(by_id[req_id], why)
        self._account_load(rep, " (layer by layer)")

    def _release_layer_loads(self, wait: bool = False) -> None:
        """Unpin the finished CUDA layer loads (every one with ``wait``: shutdown)."""
        keep: list[PipelinedLayerLoad] = []
        for ll in self._layer_releases:
            if wait or ll.done():
                ll.release()  # waits only when not done (wait=True)
            else:
                keep.append(ll)
        self._layer_releases = keep

    # ------------------------------------------------------------------ async load
    def _start_async_loads(self, loads: list[RequestTransfer]) -> None:
        """Hand each parked request's load to the loader thread; ``get_finished`` reports it.

        The loader thread only looks up, pins and issues (``AsyncLoader``): on CUDA caches the
        transfer runs on the engine's streams while the loader thread goes on to the next request,
        and ``get_finished`` reports the request once its transfer is ``done()``. On CPU caches the
        placement runs on the loader thread and the load is complete when it comes back.
        """
        if self._loader is None:
            self._loader = AsyncLoader("maru-loader")
        for rt in loads:
            self.stats.async_loads += 1
            if not self.cfg.enable_load or not self._connect() or self.engine is None:
                why = "maru_enable_load is false" if not self.cfg.enable_load else None
                why = why or self.disabled_reason or "maru server not reachable"
                self._loader.fail(rt, rt.req_id, why)
            else:
                # The engine object is captured now: a reconnect later builds a new one.
                self._loader.submit(rt, self.engine, [self._rank(rt)])

    def _collect_async_loads(self) -> set[str]:
        """Requests whose async load completed or failed since the last call (never blocks)."""
        done: set[str] = set()
        if self._loader is None:
            return done
        for rt, res in self._loader.poll():
            done.add(rt.req_id)
            if rt.req_id in res.failed:
                self.stats.async_load_failures += 1
                self._fail(rt, res.failed[rt.req_id])
                if res.server_lost:
                    self._lost(res.failed[rt.req_id])
            self._account_load(res, " (async)")
        return done

    def _account_load(self, rep: LoadReport, how: str = "") -> None:
        """Add a load's report to the stats (and the timing log line, labelled ``how``)."""
        self.stats.loads += len(rep.loaded_req_ids)
        self.stats.tokens_loaded += rep.tokens
        self.stats.chunks_loaded += rep.chunks
        self.stats.bytes_loaded += rep.bytes
        self.stats.load_seconds += rep.seconds
        if self.cfg.log_timing and (rep.loaded_req_ids or rep.failed):
            logger.info(
                "Maru timing: load %d req %d tokens %d chunks %.1f MiB in %.2f ms (%.2f GB/s)%s%s",
                len(rep.loaded_req_ids),
                rep.tokens,
                rep.chunks,
                rep.bytes / 2**20,
                rep.seconds * 1e3,
                rep.bytes / max(rep.seconds, 1e-9) / 1e9,
                how,
                f", {len(rep.failed)} failed" if rep.failed else "",
            )

    def get_finished(
        self, finished_req_ids: set[str] | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) for vLLM.

        ``finished_recving``: async loads that completed or failed. A failed async load is reported
        finished *and* its blocks go to ``get_block_ids_with_load_errors`` (vLLM reads both in the
        same step), so vLLM leaves the wait and recomputes the request. Never waits for a transfer:
        a load is reported once its ``done()`` is true. Also unpins the CUDA layer loads that are done.
        ``finished_sending`` (``maru_async_store``): see ``_finished_sending``.
        """
        sending: set[str] = set()
        try:
            sending = self._finished_sending(finished_req_ids or set())
        except Exception:  # never raise into vLLM
            logger.exception("Maru: collecting finished write-behind stores failed")
        try:
            self._release_layer_loads()
        except Exception:  # never raise into vLLM
            logger.exception("Maru: releasing finished layer loads failed")
        recving: set[str] = set()
        try:
            recving = self._collect_async_loads()
        except Exception:  # never raise into vLLM
            logger.exception("Maru: collecting finished transfers failed")
        return (sending or None), (recving or None)

    def _fail(self, rt: RequestTransfer, why: str) -> None:
        blocks = rt.placed_block_ids(self.block_size)
        self._load_errors |= blocks
        self._failed_blocks_step |= blocks
        self.stats.load_errors += 1
        logger.warning(
            "Maru: load of request %s failed (%s); vLLM recomputes its %d tokens",
            rt.req_id,
            why,
            rt.num_placed_tokens(),
        )

    def _load(self, meta: MaruConnectorMetadata) -> None:
        if not self.cfg.enable_load:
            # The scheduler never offers with loads disabled; defensive: recompute.
            for rt in meta.loads:
                self._fail(rt, "maru_enable_load is false")
            return
        if not self._connect() or self.engine is None:
            why = self.disabled_reason or "maru server not reachable"
            for rt in meta.loads:
                self._fail(rt, why)
            return
        reqs = [self._rank(rt) for rt in meta.loads]
        rep = self.engine.load(reqs)
        by_id = {rt.req_id: rt for rt in meta.loads}
        for req_id, why in rep.failed.items():
            self._fail(by_id[req_id], why)
        if rep.server_lost:
            self._lost(next(iter(rep.failed.values())))
        self._account_load(rep)

    # ------------------------------------------------------------------ store
    def wait_for_save(self, meta: MaruConnectorMetadata | None) -> None:
        try:
            # The layer load must be complete (and its failures known) before this step's stores
            # are filtered, and before the step ends.
            self._finish_layer_load()
        except Exception:
            logger.exception("Maru: finishing the layer-by-layer load failed")
        if meta is not None and self.cfg.async_store:
            # Before anything can fail: the scheduler delays the free of every request it planned
            # a store for, whatever becomes of the store here (dropped, failed, connector off).
            self._owe(meta)
        if meta is None or not meta.stores or not self.cfg.enable_store:
            return
        try:
            self._store(meta)
        except Exception:  # never raise into vLLM; a lost store is a future cache miss
            self.stats.store_failures += sum(len(rt.chunks) for rt in meta.stores)
            logger.exception("Maru: storing failed unexpectedly; those chunks stay uncached")

    def _owe(self, meta: MaruConnectorMetadata) -> None:
        """Requests vLLM keeps the blocks of until we report them in ``finished_sending``.

        The scheduler's rule (``MaruSchedulerConnector._track_sending``): a step's preemptions
        clear a request, then the step's stores mark it. Idempotent per step, so both
        ``handle_preemptions`` and ``wait_for_save`` apply it (either alone keeps us exact).
        """
        preempted = meta.preempted_req_ids
        if preempted:
            self._owed -= preempted
            self._finished -= preempted
        self._owed.update(rt.req_id for rt in meta.stores)

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
            self._issue_write_behind(stores)
            return
        self._account_store(self.engine.store(stores))

    def _issue_write_behind(self, stores: list[RequestTransfer]) -> None:
        """Write-behind: issue the gather here (CUDA) or nothing (CPU); the drain thread does the rest.

        vLLM holds the blocks of these requests until ``get_finished`` reports them (delayed free)
        and ``handle_preemptions`` waits for the gather before a preempted request's blocks are reused.
        """
        assert self.engine is not None
        engine = self.engine  # captured: a reconnect later builds a new one
        pending = engine.issue_store(stores)
        if self._drain is None:
            self._drain = BackgroundRunner("maru-store-drain")
        for r in pending.req_ids:
            self._inflight[r] = self._inflight.get(r, 0) + 1
        self._batches.append((pending, engine))
        self._drain.submit(pending, self._drain_one, engine, pending)
        self.stats.deferred_commits += 1
        self.stats.stores_in_flight = len(self._batches)
        self._collect_commits()

    def _drain_one(self, engine: KVTransferEngine, pending: PendingStore) -> StoreReport:
        if self._drain_delay_s > 0:
            time.sleep(self._drain_delay_s)  # test hook: a slow drain (the blocks must stay held)
        return engine.complete_store(pending)

    def _collect_commits(self, wait_s: float | None = 0.0) -> None:
        if self._drain is None:
            return
        done = self._drain.poll() if wait_s == 0.0 else self._drain.drain(wait_s)
        for tag, res in done:
            if isinstance(tag, PendingStore):
                self._batch_drained(tag)
            if res is None:
                continue  # not a store (a client closed behind the stores)
            if isinstance(res, BaseException):
                res = StoreReport(failed=1, error=f"{type(res).__name__}: {res}")
            self._account_store(res)

    def _batch_drained(self, pending: PendingStore) -> None:
        self._batches = [b for b in self._batches if b[0] is not pending]
        self.stats.stores_in_flight = len(self._batches)
        for r in pending.req_ids:
            n = self._inflight.get(r, 0) - 1
            if n > 0:
                self._inflight[r] = n
            else:
                self._inflight.pop(r, None)

    def _finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        """Requests whose blocks vLLM may free now: finished, and every store naming them drained.

        vLLM reports a finished request in ``finished_req_ids`` one step after it finished (and
        requires a reported id to be one of those); ids seen there wait in ``_finished`` until
        their last store batch is collected. Exactly the requests the scheduler delayed are
        reported (``_owed``), each once, on every tensor-parallel rank.
        """
        self._collect_commits()
        self._finished |= finished_req_ids & self._owed
        done = {r for r in self._finished if not self._inflight.get(r)}
        self._finished -= done
        self._owed -= done
        self.stats.sending_reported += len(done)
        self.stats.sending_held = len(self._finished)
        return done

    def handle_preemptions(self, meta: MaruConnectorMetadata | None) -> None:
        """Before the step's forward: make the blocks of the step's preempted requests safe to reuse.

        vLLM freed those blocks when it preempted the requests, and this very step may write them
        (a forward, or a load): block until no write-behind store still reads them
        (``KVTransferEngine.wait_store_read``: CUDA waits for the gather's copies; CPU gathers a
        batch the drain thread has not started right here). A gather that does not finish within
        ``maru_timeout_s`` is cancelled (it publishes nothing). A preempted request is no longer
        owed a ``finished_sending`` (the scheduler forgets it too).
        """
        if meta is None or not self.cfg.async_store:
            return
        ids = set(meta.preempted_req_ids)
        self._owe(meta)
        for pending, engine in list(self._batches):
            if not (pending.req_ids & ids) or pending.read_done.is_set():
                continue
            self.stats.preemption_waits += 1
            if not engine.wait_store_read(pending, self.cfg.timeout_s):
                self.stats.stores_cancelled += 1
                logger.warning(
                    "Maru: a write-behind store of preempted request(s) %s did not finish reading its "
                    "blocks within %.1f s; it is cancelled (those chunks stay uncached)",
                    sorted(pending.req_ids & ids),
                    self.cfg.timeout_s,
                )

    @property
    def write_behind_mode(self) -> str | None:
        """How the write-behind store runs on this worker (None: ``maru_async_store`` is off)."""
        if not self.cfg.async_store:
            return None
        return self._write_behind_mode

    def flush_stores(self, timeout_s: float | None = 30.0) -> None:
        """Wait until every write-behind store submitted so far is done (tests, shutdown)."""
        self._collect_commits(timeout_s)

    def _account_store(self, rep: StoreReport) -> None:
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

    # ------------------------------------------------------------------ results
    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def shutdown(self) -> None:
        try:
            self._finish_layer_load()
            self._release_layer_loads(wait=True)
            if self._loader is not None:
                self._loader.close(timeout=self.cfg.timeout_s)
            if self._drain is not None:
                # Every store issued is completed and published (or fails, each bounded by the
                # client's timeout): a clean shutdown loses no store.
                self._collect_commits(None)
                self._drain.close(timeout=0)
        except Exception:
            logger.exception("Maru: stopping the background transfers failed")
        client, engine, self._client, self.engine = self._client, self.engine, None, None
        if engine is not None:
            # Before the client unmaps the pool: CUDA must not keep a registration of pages
            # that are no longer the pool's.
            engine.close()
        if client is not None:
            try:
                client.close()
            except Exception:
                pass


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:
        pass


def _close_engine_then_client(engine: Any, client: Any) -> None:
    """Drain the engine's GPU transfers and unregister the pool from CUDA, then close the client.

    In this order: a copy still queued must not read pages the client unmaps, and a CUDA
    registration must not outlive the mapping it pins.
    """
    if engine is not None:
        try:
            engine.close()
        except Exception as e:  # closing is best effort once the server is gone
            logger.warning("Maru: closing the transfer engine failed: %s", e)
    _close_quietly(client)


def _kv_ops_backend() -> str:
    try:
        return str(kv_ops.backend())
    except Exception:
        return "unknown"
