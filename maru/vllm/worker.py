"""Worker side of the connector: executes the scheduler's plan against the paged KV cache.

``register_kv_caches`` detects the cache layout (``maru.kv_ops``) and connects to the server;
``start_load_kv`` places this step's loads before the forward; ``wait_for_save`` stores the
chunks this step completed after the forward (every layer's KV of the step is written by
then), with one multi-layer gather per chunk straight into pool memory and one commit.
The layer-overlap load (``LayerLoads``), the asynchronous load (``AsyncLoads``) and the
write-behind store (``WriteBehind``) each live in a class of their own that the worker owns.

Failure policy: nothing Maru-side ever raises into vLLM. An unsupported layout disables the
connector for good (one warning naming the layout and what to do); an unreachable server
disables it until a reconnect succeeds (one warning, retried at most every few seconds). A
load that cannot be done completely is reported through ``get_block_ids_with_load_errors``
and vLLM recomputes those blocks; the stores of any request touching those blocks in the
same step are dropped, because their KV was computed on top of the missing context.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import re
import threading
import time
from functools import partial
from typing import Any

import torch

from maru import kv_ops
from maru.errors import UnsupportedLayout
from maru.transfer.engine import KVTransferEngine
from maru.transfer.records import ChunkRef, LoadReport, RequestTransfer
from maru.vllm import early_loads
from maru.vllm.async_loads import AsyncLoads
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.gil_probe import GilProbe
from maru.vllm.hook_times import HookTimes, hook_times_for, timed_part
from maru.vllm.keys import rank_keys
from maru.vllm.layer_loads import LayerLoads
from maru.vllm.load_hooks import LoadHooks
from maru.vllm.logs import reconnected, warn_unreachable
from maru.vllm.metadata import MaruConnectorMetadata, MaruWorkerMeta
from maru.vllm.own_thread import on_own_thread
from maru.vllm.prefill_gate import PrefillGate
from maru.vllm.refusal import RefusalReport, refusal_info, report_only_client
from maru.vllm.step_clock import LAYERED, LOADED, PLAIN, StepClock
from maru.vllm.store_helper import helper_for
from maru.vllm.worker_paths import kv_ops_backend, worker_data_paths
from maru.vllm.worker_stats import WorkerStats
from maru.vllm.worker_stores import WorkerStores
from maru.vllm.write_behind import WriteBehind

logger = logging.getLogger("maru.vllm")

_RECONNECT_S = 10.0
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


def order_layers(kv_caches: dict[str, torch.Tensor]) -> list[str]:
    """Layer names in model order (by the ``layers.<i>.`` index in the name; else as given)."""
    names = list(kv_caches)
    idx = [_LAYER_RE.search(n + ".") for n in names]
    if all(m is not None for m in idx):
        return [n for _, n in sorted(zip((int(m.group(1)) for m in idx if m), names, strict=True))]
    return names


class MaruWorkerConnector(WorkerStores):
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
        hook_times: HookTimes | None = None,
        sleep_mode: bool = False,
    ) -> None:
        """``hook_times``: where the parts of its hooks are counted (the connector's).
        ``sleep_mode``: vLLM's ``enable_sleep_mode`` (the device state is then made on a thread of its
        own, outside the KV-cache pool a sleep discards: ``maru.vllm.own_thread``)."""
        self.cfg = cfg
        self.sleep_mode = sleep_mode
        self.hook_times = hook_times if hook_times is not None else hook_times_for(cfg.log_timing)
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
        self._refusal: RefusalReport | None = None  # why it is off, for ``maru doctor`` (``disable``)
        self._client: Any = None
        self._next_connect = 0.0
        self._load_errors: set[int] = set()
        self._failed_blocks_step: set[int] = set()
        self._next_store_warning = 0.0
        self.stats = WorkerStats()
        self.step_clock = StepClock(cfg.log_timing)  # device time of the forwards, by kind of step
        self._stepped_at = -1e9  # monotonic time of the last start_load_kv: the GIL probe's "active"
        probe_s = cfg.gil_probe_ms / 1e3
        self.gil_probe = (
            GilProbe(probe_s, self.stats, self._stepping, lambda: self.write_behind.draining)
            if probe_s > 0
            else None
        )
        # What Maru did in the step under way (step_clock's kinds); None between a step's wait_for_save
        # and the next start_load_kv.
        self._step_kind: str | None = None
        self._layer_index: dict[str, int] = {}
        # ``maru_early_load``: the thread the forwards run on (start_load_kv's), and the token of the
        # last step whose loads ``start_early`` issued.
        self._forward_thread: int | None = None
        self._early_token = 0
        hooks = LoadHooks(
            connect=self._engine_or_why,
            rank=self._rank,
            fail=self._fail,
            lost=self._lost,
            account=self._account_load,
            done=self._held_done,
        )
        # Tickets of held loads (``RequestTransfer.held``) this worker no longer reads, for the next
        # ``build_connector_worker_meta``; appended by the forward and loader threads.
        self._tickets_done: collections.deque[str] = collections.deque()
        self.layer_loads = LayerLoads(self.stats, hooks)  # maru_overlap_load_with_compute
        self.async_loads = AsyncLoads(  # maru_async_load
            self.stats, hooks, enable_load=cfg.enable_load, timeout_s=cfg.timeout_s
        )
        # The stores' ways and why they commit no segment sums, as last reported (_report_paths).
        self._store_ways: tuple[Any, ...] = ()
        hold_ms = cfg.store_yield_to_prefill_ms if cfg.async_store else 0.0
        self.write_behind = WriteBehind(
            self.stats,
            self._account_store,
            timeout_s=cfg.timeout_s,
            drain_delay_s=cfg.store_drain_delay_s,
            gate=PrefillGate(self.stats, hold_ms / 1e3) if hold_ms > 0 else None,
        )

    # ------------------------------------------------------------------ setup
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._forward_thread = threading.get_ident()  # vLLM's in-process executor: the engine's thread
        names = order_layers(kv_caches)
        self.caches = [kv_caches[n] for n in names]
        if self.caches and self.caches[0].is_cuda:
            self.step_clock.use_cuda(torch, self.caches[0].device.index)
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
            self.disable(
                f"{self.disabled_reason}, attention backend {backend}: the connector is off for this engine "
                "and vLLM computes every prompt itself. Fix: report this message (it names the layout) "
                "to the Maru project; another attention backend may have a supported layout"
            )
            return
        logger.info(
            "Maru: KV cache %s (%d layers, backend %s, kv_ops %s); server %s",
            self.layout.describe(),
            len(self.caches),
            backend,
            kv_ops_backend(),
            self.cfg.server_url,
        )
        if self.caches[0].is_cuda and self.sleep_mode:
            # Outside vLLM's KV-cache pool, which a sleep discards (run on an H100, with and without
            # sleeps). Only under sleep mode: every other engine keeps the path its tests ran.
            on_own_thread(self._connect, self.caches[0].device)
        else:
            self._connect()

    def disable(self, why: str) -> None:
        """Off for this engine (``why``: reason and fix), said once in vLLM's log and reported to
        the server so ``maru doctor`` shows it (a report-only client: ``maru.vllm.refusal``)."""
        logger.warning("Maru: %s", why)
        if self.disabled_reason is None:
            self.disabled_reason = why
        if self._refusal is None and self._client_factory is not None:
            connect = partial(report_only_client, self.cfg.server_url, self.cfg.timeout_s)
            self._refusal = RefusalReport(connect, refusal_info([why], role="vllm-worker"))

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
            warn_unreachable(self.cfg.server_url, f"{type(e).__name__}: {e}", _RECONNECT_S)
            return False
        reconnected(self.cfg.server_url)
        self.engine = KVTransferEngine(
            self.caches,
            self.layout,
            self._client,
            chunk_tokens=self.cfg.kv_chunk_tokens,
            paced_store=self.cfg.paced_store,
            layer_path=self.cfg.layer_path,
        )
        if self.cfg.async_store:
            self.write_behind.announce(self.engine.data_path, paced=self.engine.paces_stores)
        if self.write_behind.helper is None and (h := helper_for(self.caches, self.layout, self.cfg)):
            self.write_behind.use_helper(h)  # once: a reconnect keeps it (or why it cannot run)
        self._report_paths()
        return True

    @property
    def layer_overlap(self) -> bool:
        """Whether same-step loads go layer by layer under the forward (``maru_overlap_load_with_compute``,
        decided by the data path; before the engine exists, GPU caches are taken for the pipelined path)."""
        if self.engine is not None:
            return self.cfg.layer_overlap(self.engine.path.places_layers_on_device)
        return self.cfg.layer_overlap(bool(self.caches) and self.caches[0].is_cuda)

    def _engine_or_why(self) -> KVTransferEngine | str:
        """The engine (connecting first where needed), or why there is none."""
        if self._connect() and self.engine is not None:
            return self.engine
        return self.disabled_reason or "maru server not reachable"

    def data_paths(self) -> dict[str, Any]:
        """The client-info map (role, paths, slow) this worker reports to the server (``worker_paths``)."""
        return worker_data_paths(self)

    def _report_paths(self) -> None:
        # The stores' ways when last reported (a reconnect reports afresh, with them).
        path = self.engine.path if self.engine is not None else None
        self._store_ways = self._ways_seen(path)
        report = getattr(self._client, "set_client_info", None)
        if report is None:
            return
        try:
            report(self.data_paths())
        except Exception as e:  # a report is informative; it must never cost the connection
            logger.info("Maru: could not report the data paths to the server: %s", e)

    def _lost(self, why: str) -> None:
        """The server went away mid-step: drop the connection, retry later, say so once."""
        client, engine = self._client, self.engine
        self._client, self.engine = None, None
        self._next_connect = time.monotonic() + _RECONNECT_S
        warn_unreachable(self.cfg.server_url, why, _RECONNECT_S)
        if client is not None:
            if self.write_behind.busy():
                # Write-behind stores queued on the drain thread still use this client (and its
                # pool mapping): close it behind them, in order.
                self.write_behind.run_behind(_close_engine_then_client, engine, client)
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
        return dataclasses.replace(rt, chunks=chunks)  # ``held`` names every rank's keys already

    # ------------------------------------------------------------------ load
    def start_load_kv(self, meta: MaruConnectorMetadata | None, layer_hooks: bool = True) -> None:
        """Start the step's loads. ``layer_hooks``: whether the forward that follows calls
        ``wait_for_layer_load`` before each layer (``forward_runs_layer_hooks``); without it, the
        layer-overlap mode loads the step synchronously here instead (a load ``start_early`` issued
        is waited for, on the device, before the forward)."""
        self._forward_thread = threading.get_ident()
        if self.write_behind.gate is not None:  # maru_store_yield_to_prefill_ms (unknown: no prefill)
            self.write_behind.gate.step_started(meta is not None and meta.prefill)
        early = meta is not None and meta.early_token != 0 and meta.early_token == self._early_token
        if not early:
            self._failed_blocks_step = set()
        if meta is not None:
            self.step_clock.started(meta.scheduled_at, meta.scheduled_cpu, meta.scheduled_threads)
        else:
            self.step_clock.started()
        if self.gil_probe is not None:
            self._stepped_at = time.monotonic()
            self.gil_probe.start()  # in the engine process: the first step (once)
        if self._step_kind is not None:  # the last step's start_load_kv saw no wait_for_save
            self.stats.steps_without_forward += 1
        self._step_kind = PLAIN
        if meta is None:
            return
        if not early:
            self._note_held(meta)
        if meta.async_loads:
            self.async_loads.start(meta.async_loads)
        if not meta.loads:
            return
        if early:
            self._step_kind = LAYERED
            if not layer_hooks:  # a full-graph replay never waits per layer: all of it first
                self.layer_loads.wait_before_forward()
                self.stats.overlap_full_graph_loads += 1
            return
        layered = self.layer_overlap and self.cfg.enable_load
        if layered and not layer_hooks:
            layered = False
            self.stats.overlap_full_graph_loads += 1
        self._step_kind = LAYERED if layered else LOADED
        if layered:
            self._issue_layered(meta)
            return
        try:
            self._load(meta)
        except Exception as e:  # never raise into the forward; recompute instead
            logger.exception("Maru: loading failed unexpectedly; vLLM recomputes those blocks")
            for rt in meta.loads:
                self._fail(rt, f"{type(e).__name__}: {e}")
        self._held_done(meta.loads)  # the synchronous load has completed (or failed) here

    def start_early(self, meta: MaruConnectorMetadata) -> str | None:
        """``maru_early_load``: issue ``meta``'s layer load now, as its step is planned on this
        worker's forward thread (``maru.vllm.early_loads``, which checks the step). None when issued
        (``meta.early_token`` names it for ``start_load_kv``), else why not: it loads at the forward."""
        if threading.get_ident() != self._forward_thread:
            return early_loads.OTHER_THREAD
        if not (self.layer_overlap and self.cfg.enable_load):
            return early_loads.NOT_LAYERED
        if self.layer_loads.in_flight:
            return early_loads.UNFINISHED
        self._early_token += 1
        meta.early_token = self._early_token
        self._failed_blocks_step = set()
        self._note_held(meta)
        # As vLLM's forward writes the caches (its execute_model runs in inference mode; a placing
        # thread on CPU caches adopts the issuer's mode): the plan itself runs outside it.
        with torch.inference_mode():
            self._issue_layered(meta)
        self.stats.early_loads += 1
        return None

    def _note_held(self, meta: MaruConnectorMetadata) -> None:
        held = sum(1 for rt in (*meta.loads, *meta.async_loads) if rt.held)
        self.stats.loads_from_held_pins += held
        if self.engine is None and held:
            # The scheduler side just pinned these through the server: it is up, so reconnect now
            # rather than after the back-off (on vLLM's V2 runner a failed same-step load ends
            # its request instead of being recomputed).
            self._next_connect = 0.0

    def _issue_layered(self, meta: MaruConnectorMetadata) -> None:
        """Issue the step's layer load; it reports the tickets once its layers are placed."""
        try:
            self._start_layer_load(meta)
        except Exception as e:  # never raise into the forward (or the plan); recompute instead
            logger.exception("Maru: loading failed unexpectedly; vLLM recomputes those blocks")
            for rt in meta.loads:
                self._fail(rt, f"{type(e).__name__}: {e}")
            # A layer load already issued still reads its pages: its finish reports them.
            if not self.layer_loads.in_flight:
                self._held_done(meta.loads)

    @timed_part("start_load_kv/layer_issue")
    def _start_layer_load(self, meta: MaruConnectorMetadata) -> None:
        self.layer_loads.start(meta.loads)

    @property
    def layer_names(self) -> list[str]:
        """The registered attention layers, in the order the forward runs them."""
        return list(self._layer_index)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The forward waits until this layer of the step's load is placed (GPU-side on CUDA)."""
        self.layer_loads.wait_for_layer(self._layer_index.get(layer_name))

    def _account_load(self, rep: LoadReport, how: str = "", under_forward: bool = False) -> None:
        """Add a load's report to the stats (and the timing log line, labelled ``how``). A layer load
        runs ``under_forward``: its bytes count, its host time is no transfer time (no GB/s)."""
        self.stats.add_load(rep, under_forward)
        if self.cfg.log_timing and (rep.loaded_req_ids or rep.failed):
            logger.info(
                "Maru timing: load %d req %d tokens %d chunks%s %.1f MiB%s in %.2f ms %s%s%s%s",
                len(rep.loaded_req_ids),
                rep.tokens,
                rep.chunks,
                f" ({rep.copies_shared} placed from a shared copy)" if rep.copies_shared else "",
                rep.bytes / 2**20,
                f" ({_size(rep.unread_bytes)} of it left unread)" if rep.unread_bytes else "",
                rep.seconds * 1e3,
                "of host time" if under_forward else f"({rep.bytes / max(rep.seconds, 1e-9) / 1e9:.2f} GB/s)",
                how,
                f", {len(rep.failed)} failed" if rep.failed else "",
                f" ({p})" if (p := rep.phases_line()) else "",
            )

    def get_finished(
        self, finished_req_ids: set[str] | None = None
    ) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving) for vLLM.

        ``finished_recving``: async loads that completed or failed. A failed async load is reported
        finished *and* its blocks go to ``get_block_ids_with_load_errors`` (vLLM reads both in the
        same step), so vLLM leaves the wait and recomputes the request. Never waits for a transfer:
        a load is reported once its ``done()`` is true. Also unpins the CUDA layer loads that are done.
        ``finished_sending`` (``maru_async_store``): see ``WriteBehind.finished_sending``.
        """
        self.step_clock.collect()
        sending = self._finished_sending(finished_req_ids or set())
        self._release_layer_loads()
        recving = self._finished_recving()
        return (sending or None), (recving or None)

    # get_finished's parts, timed apart: which of them a costly get_finished spent its time in.
    @timed_part("get_finished/sending")
    def _finished_sending(self, finished_req_ids: set[str]) -> set[str]:
        try:
            return self.write_behind.finished_sending(finished_req_ids)
        except Exception:  # never raise into vLLM
            logger.exception("Maru: collecting finished write-behind stores failed")
            return set()

    @timed_part("get_finished/layer_release")
    def _release_layer_loads(self) -> None:
        try:
            self.layer_loads.release()
        except Exception:  # never raise into vLLM
            logger.exception("Maru: releasing finished layer loads failed")

    @timed_part("get_finished/recving")
    def _finished_recving(self) -> set[str]:
        try:
            return self.async_loads.collect()
        except Exception:  # never raise into vLLM
            logger.exception("Maru: collecting finished transfers failed")
            return set()

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

    @timed_part("start_load_kv/load")
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

    def _held_done(self, rts: Any) -> None:
        self._tickets_done.extend(rt.ticket for rt in rts if rt.ticket)

    # ------------------------------------------------------------------ results
    def build_worker_meta(self) -> MaruWorkerMeta | None:
        """The tickets of held loads done since the last call (``MaruWorkerMeta``), or None; where a
        failed load ends its request, every step, with whether this worker can load now."""
        done: dict[str, int] = {}
        while self._tickets_done:
            done[self._tickets_done.popleft()] = 1
        said = self.readiness()
        if said is not None:
            said.done = done
            return said
        return MaruWorkerMeta(done) if done else None

    def readiness(self) -> MaruWorkerMeta | None:
        """Whether this worker can load now (KV-cache layout supported, connected), where a failed
        load ends its request (``load_failures_fail``); None elsewhere (vLLM recomputes it). Sent
        at engine start through vLLM's handshake metadata and after every step."""
        if not self.cfg.load_failures_fail:
            return None
        able = self.cfg.enable_load and self.disabled_reason is None and self.engine is not None
        return MaruWorkerMeta(ready=int(able), unready=int(not able))

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The blocks of this step's failed loads, once. The step's layer load is finished first
        (a no-op where ``wait_for_save`` did it): with a speculative decoder vLLM reads these right
        after the forward and calls ``wait_for_save`` only after the drafter (0.32's V1 runner,
        0.34's V2 runner), and a layer that failed under the forward must be in this step's errors,
        not the next one's (its sampled token would be kept)."""
        self.finish_layer_load()
        out, self._load_errors = self._load_errors, set()
        return out

    def _stepping(self) -> bool:
        """Whether the engine ran a step within the last quarter second (a step's forward of a
        large prefill takes tens of ms; an idle engine runs none)."""
        return time.monotonic() - self._stepped_at < 0.25

    def shutdown(self) -> None:
        if self._refusal is not None:
            self._refusal.close()
        if self.gil_probe is not None:
            self.gil_probe.stop()
        try:
            self.layer_loads.finish()
            self.layer_loads.release(wait=True)
            self.async_loads.close()
            # Every store issued is completed and published (or fails, each bounded by the
            # client's timeout): a clean shutdown loses no store.
            self.write_behind.close()
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


def _size(nbytes: int) -> str:
    """MiB with one decimal, or KiB below a tenth of a MiB (a small model's few rows)."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 // 10 else f"{nbytes / 2**10:.1f} KiB"
