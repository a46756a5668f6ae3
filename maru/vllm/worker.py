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
    BackgroundRunner,
    ChunkRef,
    KVTransferEngine,
    LayerwiseLoad,
    LoadReport,
    RequestTransfer,
    StoreReport,
)

logger = logging.getLogger("maru.vllm")

_RECONNECT_S = 10.0
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
        self._layer_load: LayerwiseLoad | None = None
        self._layer_load_reqs: dict[str, RequestTransfer] = {}
        self._loader: BackgroundRunner | None = None  # maru_async_load
        self._drain: BackgroundRunner | None = None  # maru_async_store

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
        return True

    def _lost(self, why: str) -> None:
        """The server went away mid-step: drop the connection, retry later, say so once."""
        client, self._client, self.engine = self._client, None, None
        self._next_connect = time.monotonic() + _RECONNECT_S
        warn_once(
            unreachable_key(self.cfg.server_url), UNREACHABLE_MSG, self.cfg.server_url, why, _RECONNECT_S
        )
        if client is not None:
            try:
                client.close()
            except Exception:
                pass

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
        """Pin every chunk of the step now (the lookup decides), then place layer by layer behind."""
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
        self._layer_load = LayerwiseLoad(self.engine, pinned).start()
        self.stats.overlap_loads += 1

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this layer of the step's load is placed (other layers may still be in flight)."""
        ll = self._layer_load
        if ll is None:
            return
        self.stats.layer_waits += 1
        i = self._layer_index.get(layer_name)
        if i is None or i >= ll.num_layers:
            ll.wait()  # a name we do not know: wait for every layer rather than risk a partial read
        else:
            ll.wait_for_layer(i)

    def _finish_layer_load(self) -> None:
        """Join the step's layer load (after the forward) and account for it; failures -> recompute."""
        ll, self._layer_load = self._layer_load, None
        if ll is None:
            return
        by_id, self._layer_load_reqs = self._layer_load_reqs, {}
        rep = ll.wait()
        for req_id, why in rep.failed.items():
            self._fail(by_id[req_id], why)
        self._account_load(rep)

    # ------------------------------------------------------------------ async load
    def _start_async_loads(self, loads: list[RequestTransfer]) -> None:
        """Hand each parked request's load to the loader thread; ``get_finished`` reports it."""
        if self._loader is None:
            self._loader = BackgroundRunner("maru-loader")
        for rt in loads:
            self.stats.async_loads += 1
            if not self.cfg.enable_load or not self._connect() or self.engine is None:
                why = "maru_enable_load is false" if not self.cfg.enable_load else None
                why = why or self.disabled_reason or "maru server not reachable"
                self._loader.submit(rt, _failed_load, rt.req_id, why)
            else:
                # The engine object is captured now: a reconnect later builds a new one.
                self._loader.submit(rt, self.engine.load_and_sync, [self._rank(rt)])

    def _collect_async_loads(self) -> set[str]:
        done: set[str] = set()
        if self._loader is None:
            return done
        for rt, res in self._loader.poll():
            done.add(rt.req_id)
            if isinstance(res, BaseException):
                self.stats.async_load_failures += 1
                self._fail(rt, f"{type(res).__name__}: {res}")
                continue
            assert isinstance(res, LoadReport)
            if rt.req_id in res.failed:
                self.stats.async_load_failures += 1
                self._fail(rt, res.failed[rt.req_id])
                if res.server_lost:
                    self._lost(res.failed[rt.req_id])
            self._account_load(res)
        return done

    def _account_load(self, rep: LoadReport) -> None:
        self.stats.loads += len(rep.loaded_req_ids)
        self.stats.tokens_loaded += rep.tokens
        self.stats.chunks_loaded += rep.chunks
        self.stats.bytes_loaded += rep.bytes
        self.stats.load_seconds += rep.seconds
        if self.cfg.log_timing and rep.loaded_req_ids:
            logger.info(
                "Maru timing: load %d req %d tokens %d chunks %.1f MiB in %.2f ms (%.2f GB/s)%s",
                len(rep.loaded_req_ids),
                rep.tokens,
                rep.chunks,
                rep.bytes / 2**20,
                rep.seconds * 1e3,
                rep.bytes / max(rep.seconds, 1e-9) / 1e9,
                " (async)" if self.cfg.async_load else " (layer by layer)",
            )

    def get_finished(
        self, finished_req_ids: set[str] | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) for vLLM: async loads that completed or failed.

        A failed async load is reported finished *and* its blocks go to
        ``get_block_ids_with_load_errors`` (vLLM reads both in the same step), so vLLM leaves the
        wait and recomputes the request. Nothing is ever in ``finished_sending``: the write-behind
        store has read the blocks before ``wait_for_save`` returns (see ``wait_for_save``).
        """
        recving: set[str] = set()
        try:
            self._collect_commits()
            recving = self._collect_async_loads()
        except Exception:  # never raise into vLLM
            logger.exception("Maru: collecting finished transfers failed")
        return None, (recving or None)

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
        self.stats.loads += len(rep.loaded_req_ids)
        self.stats.tokens_loaded += rep.tokens
        self.stats.chunks_loaded += rep.chunks
        self.stats.bytes_loaded += rep.bytes
        self.stats.load_seconds += rep.seconds
        if self.cfg.log_timing:
            logger.info(
                "Maru timing: load %d req %d tokens %d chunks %.1f MiB in %.2f ms (%.2f GB/s)%s",
                len(rep.loaded_req_ids),
                rep.tokens,
                rep.chunks,
                rep.bytes / 2**20,
                rep.seconds * 1e3,
                rep.bytes / max(rep.seconds, 1e-9) / 1e9,
                f", {len(rep.failed)} failed" if rep.failed else "",
            )

    # ------------------------------------------------------------------ store
    def wait_for_save(self, meta: MaruConnectorMetadata | None) -> None:
        try:
            # The layer load must be complete (and its failures known) before this step's stores
            # are filtered, and before the step ends.
            self._finish_layer_load()
        except Exception:
            logger.exception("Maru: finishing the layer-by-layer load failed")
        if meta is None or not meta.stores or not self.cfg.enable_store:
            return
        try:
            self._store(meta)
        except Exception:  # never raise into vLLM; a lost store is a future cache miss
            self.stats.store_failures += sum(len(rt.chunks) for rt in meta.stores)
            logger.exception("Maru: storing failed unexpectedly; those chunks stay uncached")

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
            # Write-behind: gather now, on the forward thread, so the paged blocks are read before
            # vLLM can free or reuse them; only the commit (a server round trip) is deferred.
            prep = self.engine.prepare_store(stores)
            if self._drain is None:
                self._drain = BackgroundRunner("maru-store-drain")
            self._drain.submit(None, self.engine.commit_store, prep)
            self.stats.deferred_commits += 1
            self._collect_commits()
            return
        self._account_store(self.engine.store(stores))

    def _collect_commits(self, wait_s: float | None = 0.0) -> None:
        if self._drain is None:
            return
        done = self._drain.poll() if wait_s == 0.0 else self._drain.drain(wait_s)
        for _, res in done:
            if isinstance(res, BaseException):
                res = StoreReport(failed=1, error=f"{type(res).__name__}: {res}")
            self._account_store(res)

    def flush_stores(self, timeout_s: float = 30.0) -> None:
        """Wait until every write-behind commit submitted so far is done (tests, shutdown)."""
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
            if self._loader is not None:
                self._loader.close(timeout=self.cfg.timeout_s)
            if self._drain is not None:
                # Publish what was gathered: a clean shutdown loses no store.
                self._collect_commits(self.cfg.timeout_s)
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


def _failed_load(req_id: str, why: str) -> LoadReport:
    return LoadReport(failed={req_id: why})


def _kv_ops_backend() -> str:
    try:
        return str(kv_ops.backend())
    except Exception:
        return "unknown"
