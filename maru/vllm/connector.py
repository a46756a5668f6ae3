"""``MaruKVConnector``: vLLM's KV-connector interface, a thin facade over two small classes.

vLLM builds one instance per role: the SCHEDULER instance delegates to
``MaruSchedulerConnector`` (what to load and store), each WORKER instance to
``MaruWorkerConnector`` (moving the bytes through ``maru.transfer``). They share nothing
but the per-step ``MaruConnectorMetadata`` and the key scheme (``KeySpace``), which both
roles derive from the same vLLM config, so they agree without talking.

Load it with::

    --kv-transfer-config '{"kv_connector":"MaruKVConnector","kv_connector_module_path":"maru.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"maru_server_url":"tcp://127.0.0.1:5555"}}'
"""

from __future__ import annotations

import logging
import sys
from functools import partial
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from maru.vllm import early_loads
from maru.vllm.adapters import AdapterDigests, RequestScopes, lora_compute
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.early_loads import EarlyLoads
from maru.vllm.engine_config import (
    key_space,
    runner_known,
    same_step_load_failures_unrecoverable,
    set_load_failure_policy,
    warn_if_untested_vllm,
)
from maru.vllm.hook_times import hook_times_for, timed, timed_wall_as
from maru.vllm.interpreter_clock import CLOCK as GC_CLOCK
from maru.vllm.interpreter_clock import PythonPace
from maru.vllm.keys import ChunkKeyer
from maru.vllm.layer_loads import forward_runs_layer_hooks
from maru.vllm.metadata import MaruConnectorMetadata, MaruWorkerMeta
from maru.vllm.refusal import RefusalReport, refusal_info, report_only_client
from maru.vllm.scheduler import MaruSchedulerConnector

try:  # vLLM >= 0.32 labels where external hits come from
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    _HIT_SOURCE: Any = CacheHitSource.HOST
except ImportError:  # pragma: no cover
    _HIT_SOURCE = None

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig

    from maru.vllm.worker import MaruWorkerConnector

# The metadata record is plain (torch- and vLLM-free, for the scheduler side); vLLM sees it as its own.
KVConnectorMetadata.register(MaruConnectorMetadata)
try:  # the workers' per-step report to the scheduler side (vLLM 0.26 and later)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

    KVConnectorWorkerMetadata.register(MaruWorkerMeta)
    _WORKER_META = hasattr(KVConnectorBase_V1, "build_connector_worker_meta")
except ImportError:  # pragma: no cover - an older vLLM: the workers look their loads up themselves
    _WORKER_META = False
try:  # ... and its word at engine start that it can load (the same record, as handshake metadata)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

    KVConnectorHandshakeMetadata.register(MaruWorkerMeta)
except ImportError:  # pragma: no cover - then offers wait for the first step's report
    pass

logger = logging.getLogger("maru.vllm")

_TIMING_LOG_S = 10.0  # maru_log_timing: the scheduler side's periodic hook-time line (an API instance of the bench lives ~30 s)


def _pin_trips(pins: Any) -> str:
    """``N round trips, X ms (Y us each)`` of the offer pins' snapshot; ``off`` without pins."""
    if not isinstance(pins, dict):
        return "off"
    n, ms = pins.get("pin_trips", 0), pins.get("pin_trip_ms", 0.0)
    out = f"{n} round trips, {ms:.1f} ms ({ms * 1e3 / n if n else 0.0:.0f} us each)"
    if pins.get("pin_posts"):  # posted at arrival (V2 runner): how many offers still waited
        out += (
            f", {pins['pin_posts']} posted at arrival ({pins.get('pins_posted', 0)} keys, "
            f"{pins.get('post_waits', 0)} offers waited {pins.get('post_wait_ms', 0.0):.1f} ms, "
            f"{pins.get('posts_failed', 0)} failed)"
        )
    if reads := pins.get("post_reads", 0):  # where the offers' time reading them goes
        out += (
            f"; replies read by {reads} offers, {pins.get('post_read_ms', 0.0) * 1e3 / reads:.0f} us each "
            f"({pins.get('post_read_cpu_ms', 0.0) * 1e3 / reads:.0f} on CPU)"
        )
    return out


def _reply_waits(w: Any) -> str:
    """``N read while polling (spin S us), M blocked past it`` of a client's ``reply_waits``."""
    if not isinstance(w, dict) or not w:
        return "-"
    return f"{w.get('replies_spun', 0)} read while polling (spin {w.get('spin_us', 0)} us), {w.get('spun_out', 0)} blocked past it"


def _ensure_logging() -> None:
    """Give Maru's logger a stderr handler when nobody configured one.

    vLLM configures only its own ``vllm`` logger; without this, Maru's INFO lines (the
    ``maru_log_timing`` output, the layout it detected) would be dropped.
    """
    root = logging.getLogger("maru")
    if root.handlers:
        return
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(_formatter("maru"))
    h.set_name(_HANDLER)
    root.addHandler(h)
    root.setLevel(logging.INFO)
    root.propagate = False


_HANDLER = "maru-connector"


def _formatter(tag: str) -> logging.Formatter:
    return logging.Formatter(f"%(levelname)s %(asctime)s [{tag}] %(message)s", "%m-%d %H:%M:%S")


def _label_rank(rank: int) -> None:
    """Under tensor parallelism each worker process logs as ``[maru rank N]`` (its own handler only:
    a logging setup someone else made is left alone)."""
    for h in logging.getLogger("maru").handlers:
        if h.get_name() == _HANDLER:
            h.setFormatter(_formatter(f"maru rank {rank}"))


class MaruKVConnector(KVConnectorBase_V1):
    """Shares KV-cache prefixes between vLLM instances through a Maru pool. See docs/vllm.md."""

    # Why this engine cannot recompute a failed same-step load (None: it can). A class attribute
    # so a test can run the V2 runner's protocol on vLLM's CPU build, which has only the V1 runner.
    _same_step_failures_unrecoverable = staticmethod(same_step_load_failures_unrecoverable)

    if _HIT_SOURCE is not None:
        _cache_hit_source = _HIT_SOURCE

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        _ensure_logging()
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        block_size = int(vllm_config.cache_config.block_size)
        self.maru_config = MaruConnectorConfig.from_extra_config(extra).aligned_to_block_size(block_size)
        if not hasattr(KVConnectorBase_V1, "handle_preemptions"):
            # Without the hook a preempted request's blocks may be rewritten while a write-behind
            # gather still reads them: a store of wrong bytes. Never run write-behind there.
            self.maru_config = self.maru_config.without_write_behind(
                "this vLLM never calls handle_preemptions (the preemption barrier)"
            )
        cfg = self.maru_config
        self.key_space = key_space(vllm_config, cfg)
        pc = vllm_config.parallel_config
        self._scheduler: MaruSchedulerConnector | None = None
        self._worker: MaruWorkerConnector | None = None
        # maru_early_load: the engine both roles name (vLLM gives each engine a fresh id), the
        # scheduler side's hand-off of each planned step to a worker in this process.
        self._engine_id = str(getattr(vllm_config.kv_transfer_config, "engine_id", None) or "")
        self._early: EarlyLoads | None = None
        self._last_reported: dict[str, Any] = {}
        # Host time inside each vLLM hook (``timed``); their parts with maru_log_timing only.
        self.hook_times = hook_times_for(cfg.log_timing)
        self._pace = PythonPace()  # the forward thread's Python pace (``maru_log_timing``)
        if cfg.log_timing:
            GC_CLOCK.install()  # the process's collections, timed (``interpreter_clock``)
        wanted = cfg.enable_load or cfg.enable_store  # before any refusal below turns both off
        if (pp := int(getattr(pc, "pipeline_parallel_size", 1))) > 1:
            cfg = self.maru_config = cfg.off(
                f"pipeline parallelism (pipeline_parallel_size={pp}) is not supported: the connector "
                "stays off and vLLM computes every prompt itself. Fix: run with pipeline_parallel_size=1 "
                "(tensor parallelism is supported)"
            )

        sleep_mode = bool(getattr(vllm_config.model_config, "enable_sleep_mode", False))
        if sleep_mode and not cfg.allow_sleep_mode:
            cfg = self.maru_config = cfg.off(
                "vLLM's sleep mode is on (enable_sleep_mode) and maru_allow_sleep_mode=false: the connector "
                "stays off and vLLM computes every prompt itself. Fix: leave maru_allow_sleep_mode at its "
                "default (true: Maru runs under sleep mode, tests/e2e/test_gpu_vllm_sleep_e2e.py)"
            )

        self._refusal: RefusalReport | None = None
        if role == KVConnectorRole.SCHEDULER and wanted and not (cfg.enable_load or cfg.enable_store):
            # Off by a refusal: ``maru doctor`` must show it, not only vLLM's log (``refusal``).
            connect = partial(report_only_client, cfg.server_url, cfg.timeout_s)
            self._refusal = RefusalReport(connect, refusal_info(cfg.fallbacks))

        unrecoverable = self._same_step_failures_unrecoverable(vllm_config)
        if unrecoverable is not None:
            # Both roles read the same vLLM config, so they switch together. With offer pins no
            # miss can fail a same-step load (see ``failing_same_step_loads``); without them, or
            # when the runner is unknown, every load waits for its request to leave the runner.
            if cfg.hold_offers and _WORKER_META and runner_known(vllm_config):
                cfg = self.maru_config = cfg.failing_same_step_loads(unrecoverable)
            else:
                cfg = self.maru_config = cfg.loading_before_the_request_runs(unrecoverable)

        # vLLM's scheduling thread waits for each reply polling (it keeps the GIL); the workers'
        # round trips run beside the forward and block as usual.
        spin_s = cfg.reply_spin_us() * 1e-6 if role == KVConnectorRole.SCHEDULER else 0.0

        def client_factory() -> Any:
            from maru.client import MaruHandler

            return MaruHandler(cfg.server_url, timeout_s=cfg.timeout_s, reply_spin_s=spin_s)

        for line in cfg.data_path_lines() if (cfg.enable_load or cfg.enable_store) else ():
            # Once per connector instance (one per role and worker): says which optional path runs.
            logger.info("Maru (%s): %s", "scheduler" if role == KVConnectorRole.SCHEDULER else "worker", line)

        if role == KVConnectorRole.SCHEDULER:
            warn_if_untested_vllm()
            set_load_failure_policy(vllm_config, "fail" if cfg.load_failures_fail else "recompute")
            self._scheduler = MaruSchedulerConnector(
                cfg,
                ChunkKeyer(self.key_space),
                block_size,
                tp_size=self.key_space.tp_size,
                hook_times=self.hook_times,
                client_factory=client_factory if (cfg.enable_load or cfg.enable_store) else None,
                # vLLM's default is on; an unresolved None counts as on.
                local_prefix_cache=getattr(vllm_config.cache_config, "enable_prefix_caching", True)
                is not False,
                hold_offers=cfg.hold_offers and _WORKER_META,
                pin_at_offer=bool(cfg.load_failures_fail),
                scopes=RequestScopes(AdapterDigests(lora_compute(vllm_config))),
            )
            self._scheduler.connect_now()
            if cfg.early_load_wanted and cfg.enable_load and self._engine_id:
                self._early = EarlyLoads.for_engine(self._engine_id, explicit=cfg.early_load is True)
            logger.info(
                "Maru: scheduler side up (server %s, chunk %d tokens, block %d, keys %s, load %s, store %s)",
                cfg.server_url,
                cfg.kv_chunk_tokens,
                block_size,
                self.key_space.prefix(),
                cfg.enable_load,
                cfg.enable_store,
            )
        else:
            from maru.vllm.worker import MaruWorkerConnector  # the worker side imports torch

            tp_rank = 0
            if self.key_space.tp_size > 1:
                from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

                tp_rank = int(get_tensor_model_parallel_rank())
                _label_rank(tp_rank)
            static_ctx = vllm_config.compilation_config.static_forward_context

            def backend_name_of(layer_name: str) -> str | None:
                layer = static_ctx.get(layer_name)
                backend = getattr(layer, "attn_backend", None)
                return backend.get_name() if backend is not None else None

            self._worker = MaruWorkerConnector(
                cfg,
                block_size=block_size,
                num_kv_heads=self.key_space.num_kv_heads,
                head_size=self.key_space.head_size,
                tp_rank=tp_rank,
                tp_size=self.key_space.tp_size,
                hook_times=self.hook_times,
                client_factory=client_factory if (cfg.enable_load or cfg.enable_store) else None,
                backend_name_of=backend_name_of,
                sleep_mode=sleep_mode,
            )
            if cfg.early_load_wanted and cfg.enable_load and self.key_space.tp_size == 1 and self._engine_id:
                early_loads.register(self._engine_id, self._worker)

    @property
    def requires_kv_delivery(self) -> bool:
        # Maru is a best-effort cache: a store lost to preemption is a future miss, not an error.
        return False

    # ------------------------------------------------------------------ introspection
    def maru_stats(self) -> dict[str, Any]:
        """This instance's counters (scheduler or worker side) and the data-path options in effect."""
        if self._scheduler is not None:
            out = dict(self._scheduler.stats.__dict__)
            out["inflight_loads"] = len(self._scheduler.inflight_loads)
            out["delayed_frees_now"] = len(self._scheduler.delayed_frees)
            out.update(self._scheduler.probe_view())
            out["async_load_sharing"] = self._scheduler.load_sharing
            if self._early is not None:
                out["early_loads"] = self._early.snapshot()
            out["adapter_bytes_hashed"] = self._scheduler.scopes.adapters.hashed_bytes  # LoRA keys
            pins = self._scheduler.pins
            out["offer_pins"] = pins.snapshot() if pins is not None else "off"
        else:
            assert self._worker is not None
            out = self._worker.stats.as_dict()
            out["write_behind"] = self._worker.write_behind_mode
        out["hook_ms"] = self.hook_times.as_dict()
        out["data_path"] = self.maru_config.data_path()
        if self._worker is not None:  # what this worker decided for its caches' device
            out["data_path"]["overlap_load_with_compute"] = self._worker.layer_overlap
        out["fallbacks"] = list(self.maru_config.fallbacks)  # settings replaced, each with reason and fix
        out["load_failures_fail"] = self.maru_config.load_failures_fail  # "" where vLLM recomputes
        return out

    @property
    def maru_worker(self) -> MaruWorkerConnector | None:
        return self._worker

    @property
    def maru_scheduler(self) -> MaruSchedulerConnector | None:
        return self._scheduler

    def _meta(self) -> MaruConnectorMetadata | None:
        meta = self._connector_metadata
        return meta if isinstance(meta, MaruConnectorMetadata) else None

    # ------------------------------------------------------------------ worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        try:
            self._worker.register_kv_caches(kv_caches)
        except Exception as e:  # never take the engine down for Maru
            logger.exception("Maru: registering the KV caches failed; the connector stays off")
            self._worker.disable(
                f"registering the KV caches failed ({type(e).__name__}: {e}): the connector is off for this "
                "engine and vLLM computes every prompt itself. Fix: see the traceback in vLLM's log and "
                "report it to the Maru project"
            )

    @timed
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start_load_kv(self._meta(), forward_runs_layer_hooks(forward_context))

    def wait_for_layer_load(self, layer_name: str) -> None:
        # vLLM calls this before every attention layer of every step (32 a step for an 8B model).
        # Only a step with a layer load in flight has anything to wait for; every other step returns
        # here, before the timing (24 -> 3 us a 32-layer step on the CI machine; 2-3 us a call in an
        # engine on the device hosts: up to ~2% of a decode step's host time).
        w = self._worker
        if w is None or not w.layer_loads.in_flight:
            return
        self._wait_for_layer_load(layer_name)

    @timed_wall_as("wait_for_layer_load")
    def _wait_for_layer_load(self, layer_name: str) -> None:
        try:
            self._worker.wait_for_layer_load(layer_name)  # type: ignore[union-attr]
        except Exception:  # never raise into the forward
            logger.exception("Maru: waiting for layer %s failed", layer_name)

    @timed
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before each forward: wait until no write-behind store reads a preempted request's blocks."""
        if self._worker is None:
            return
        meta = kv_connector_metadata if isinstance(kv_connector_metadata, MaruConnectorMetadata) else None
        try:
            self._worker.handle_preemptions(meta)
        except Exception:  # never raise into the forward
            logger.exception("Maru: handling this step's preemptions failed")

    @timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        out = self._worker.get_finished(finished_req_ids)
        if self.maru_config.log_timing:
            GC_CLOCK.arm()
            self._pace.maybe_sample()
        if self.maru_config.log_timing and self.hook_times.due(_TIMING_LOG_S):
            logger.info("Maru: host time in vLLM's hooks (worker, so far): %s", self._worker_times())
        return out

    def _worker_times(self) -> str:
        """The worker's hook times, and the device time of its forwards by kind of step."""
        assert self._worker is not None
        clock = self._worker.step_clock.line()
        return (
            self.hook_times.line()
            + self._worker.stats.timing_note()
            + (f"; device time of the forwards: {clock}" if clock else "")
            + GC_CLOCK.note(self.hook_times.gc_s)
            + self._pace.note()
        )

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # stores happen once per step in wait_for_save, all layers at a time

    @timed
    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.wait_for_save(self._meta())

    def get_kv_connector_stats(self) -> Any:
        """The worker's counters since the last call, for vLLM's ``KV Transfer metrics`` log line."""
        if self._worker is None:
            return None
        try:
            from maru.vllm.stats import counters, interval_stats

            now = counters(self._worker.stats)
            out = interval_stats(now, self._last_reported)
            self._last_reported = now
            return out
        except Exception:  # diagnostics must never break a step
            return None

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Asked by vLLM before it captures CUDA graphs (not in eager mode): never.

        The layer-overlap load (``maru_overlap_load_with_compute``) waits for each layer in
        ``wait_for_layer_load``, which a full-graph replay skips (a one-token remainder after a
        Maru hit makes a decode-shaped batch, which vLLM replays as a full graph). Rather than have
        vLLM give up its full graphs for every step (True here: piecewise graphs only, which made
        the rest of each answer ~1.8x slower on an H200), the worker reads in ``start_load_kv``
        whether the coming forward calls the hook (``forward_runs_layer_hooks``) and loads that
        step synchronously, before the forward, when it does not. A forward that still skips the
        hook fails its layer loads' requests (``LayerLoads``), never keeps what it read.
        """
        return False

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        from maru.vllm.stats import MaruKVConnectorStats

        return MaruKVConnectorStats(data=dict(data or {}))

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def get_handshake_metadata(self) -> Any:
        """Whether this worker can load (``MaruWorkerMeta`` ready / unready), once its KV caches are
        registered, where a failed load ends its request; else None. vLLM collects every worker's
        after registration and hands them to the scheduler side (``set_xfer_handshake_metadata``)
        before the first request: offers need not wait for a step's report."""
        return self._worker.readiness() if self._worker is not None else None

    def set_xfer_handshake_metadata(self, metadata: dict[int, Any]) -> None:
        if self._scheduler is not None:
            self._scheduler.workers_at_start(list(metadata.values()))

    def build_connector_worker_meta(self) -> Any:
        """The held loads this worker no longer reads (``MaruWorkerMeta``): the scheduler side
        releases their pins once every rank reported them."""
        return self._worker.build_worker_meta() if self._worker is not None else None

    def shutdown(self) -> None:
        if self.maru_config.log_timing and self.hook_times.calls:
            side = "scheduler" if self._scheduler is not None else "worker"
            line = self._worker_times() if self._worker is not None else self.hook_times.line()
            logger.info("Maru: host time in vLLM's hooks (%s): %s", side, line)
        if self._worker is not None:
            if self.maru_config.log_timing:
                logger.info("Maru: worker stats %s", self._worker.stats.as_dict())
            early_loads.unregister(self._engine_id, self._worker)
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._refusal is not None:
            self._refusal.close()

    # ------------------------------------------------------------------ scheduler side
    @timed
    def on_new_request(self, request: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.on_new_request(request)

    @timed
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @timed
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @timed
    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_connector_meta(scheduler_output)
        if self._early is not None:
            self._early.after_plan(meta, scheduler_output)  # maru_early_load
        return meta

    @timed
    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is not None:
            self._scheduler.update_connector_output(connector_output)
            if self.maru_config.log_timing:
                GC_CLOCK.arm()
            if self.maru_config.log_timing and self.hook_times.due(_TIMING_LOG_S):
                st = self.maru_stats()
                logger.info(
                    "Maru: host time in vLLM's hooks (scheduler, so far): %s; probes: %s (%s local, %s "
                    "remote); async loads planned %d, shared %d, window-deferred %d; offer pins: %s; "
                    "replies: %s%s%s",
                    self.hook_times.line(),
                    st.get("probe_path"),
                    st.get("probes_local", 0),
                    st.get("probes_remote", 0),
                    st["async_loads_planned"],
                    st["async_loads_shared"],
                    st["async_loads_deferred"],
                    _pin_trips(st.get("offer_pins")),
                    _reply_waits(st.get("reply_waits")),
                    f"; early loads: {self._early.line()}" if self._early is not None else "",
                    GC_CLOCK.note(self.hook_times.gc_s),
                )

    def reset_cache(self) -> bool | None:
        """vLLM's reset of the connector's cache (``reset_prefix_cache(reset_connector=True)``, and
        the sleeps and pauses that clear caches for a weight update): the scheduler side moves to a
        new key epoch (``MaruSchedulerConnector.reset_cache``). False, where that failed, makes
        vLLM report the reset failed: never a reset that silently kept serving the old KV."""
        if self._scheduler is None:
            return None
        try:
            return self._scheduler.reset_cache()
        except Exception:
            logger.exception("Maru: resetting the connector's cache failed; vLLM reports the reset failed")
            return False

    @timed
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        return self._scheduler.request_finished(request, block_ids)
