"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Every key Maru reads starts with ``maru_``; keys without that prefix belong to someone else
(vLLM passes the whole dict, and a user may share it with another connector) and are ignored.
An unknown ``maru_*`` key is an error that names the valid ones, because a typo such as
``maru_kv_chunk_token`` would otherwise silently run with the default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Any

from maru.config import DEFAULT_SERVER_URL, LAYER_PATHS, MIN_CPUS_TO_SPIN, usable_cpus
from maru.errors import ConfigError
from maru.vllm.model_runner import or_v1_runner

logger = logging.getLogger("maru.vllm")

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_TIMEOUT_S = 5.0
# The asynchronous-load window: requests, and chunks (what bounds the bytes pinned and queued on
# the bus). A batch of many requests loads at bus speed; the request cap only bounds bookkeeping.
DEFAULT_MAX_INFLIGHT_LOADS = 64
DEFAULT_MAX_INFLIGHT_LOAD_CHUNKS = 256
# The scheduler side's client polls for each server reply this long before it blocks
# (``maru.client.rpc``, "Waiting for a reply"): on vLLM's scheduling thread a blocking wait hands
# the GIL to the engine's other threads, and the thread got it back ~470 us after a ~110 us
# round trip on an H200 host. A few bare round trips long; the most one request can spin.
DEFAULT_SCHEDULER_REPLY_SPIN_US = 500
MAX_REPLY_SPIN_US = 10_000  # maru.client.rpc.MAX_REPLY_SPIN_S (not imported: this module stays free of zmq)
# maru_store_yield_to_prefill_ms: longer holds keep finished requests' blocks from vLLM for longer.
MAX_STORE_HOLD_MS = 2000.0
DEFAULT_STORE_YIELD_MS = 250.0  # longer than a burst's prefill on the 8B-shaped model (~50-150 ms)
# Below MIN_CPUS_TO_SPIN usable cores (maru.config, the server's polling uses the same bound) the
# default is not to poll: a polling client, its ZeroMQ I/O thread, the server and the server's I/O
# thread must all run at once, beside the engine's own busy threads (2 cores: a 1-key lookup's p50
# went from 347 to 856 us, 272 of 303 replies outlasting the polling, bench/reply_spin.py; 16
# cores, the H200 host: the pin round trip 580 -> 380-399 us).


def reply_wait_mode(waits: dict[str, int]) -> str:
    """How the scheduler side waits for the server's replies (``maru stats``, ``paths.reply_wait``),
    from its client's ``reply_waits``: polling (how long) or blocking, and whether its sends and
    ready reads keep the GIL (``maru.client.gil_io``)."""
    us = waits.get("spin_us", 0)
    io = "sends and reads keep the GIL" if waits.get("gil_kept") else "sends and reads through pyzmq"
    if not us:
        return f"blocks (maru_scheduler_reply_spin_us 0, or fewer than {MIN_CPUS_TO_SPIN} usable cores); {io}"
    return f"polls up to {us} us, keeping the GIL, then blocks; {io}"


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    ):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{name} must be true or false, got {value!r}")


def _as_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        n = int(value)
    except ValueError:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if n < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {n}")
    return n


def _as_float(name: str, value: Any, minimum: float) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{name} must be a number > {minimum}, got {value!r}")
    try:
        x = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be a number > {minimum}, got {value!r}") from None
    if not x > minimum:
        raise ConfigError(f"{name} must be a number > {minimum}, got {x}")
    return x


def _as_str(name: str, value: Any) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{name} must be a string, got {value!r}")
    return value


# Keys that existed once, each with why it went and what to do: a config that still sets one is
# refused (as any unknown key) with that reason, not only the list of valid keys.
REMOVED_KEYS = {
    "maru_store_after_next_forward": (
        "was removed: it held each write-behind batch until the next forward had started, and paired "
        "with the default in real vLLM it gained nothing (bench/RESULTS.md, fifty-fifth pass); drop it"
    ),
}


@dataclass(frozen=True)
class MaruConnectorConfig:
    """Validated connector settings. Field ``x`` is read from extra-config key ``maru_x``.

    Invariant: ``kv_chunk_tokens`` is a positive multiple of the block size once
    ``aligned_to_block_size`` has been applied (the connector always applies it).
    """

    server_url: str = DEFAULT_SERVER_URL
    kv_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    namespace: str = ""
    model_id: str = ""
    model_revision: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    # None: DEFAULT_SCHEDULER_REPLY_SPIN_US where the process has MIN_CPUS_TO_SPIN cores, else 0.
    scheduler_reply_spin_us: int | None = None
    enable_load: bool = True
    enable_store: bool = True
    # Run in an engine with vLLM's sleep mode (its device state made outside vLLM's KV-cache pool,
    # which a sleep discards: maru.vllm.own_thread; run on an H100). False: stay off there.
    allow_sleep_mode: bool = True
    store_partial_tail: bool = True
    log_timing: bool = False
    # Milliseconds between the wake-ups of a probe thread in the engine process that times how late
    # each wake-up is (its wait for the GIL, ``maru.vllm.gil_probe``), in the timing line and
    # ``maru_stats``. 0: no probe. A diagnostic: one GIL hand-off a period.
    gil_probe_ms: float = 0.0
    async_load: bool = False
    max_inflight_loads: int = DEFAULT_MAX_INFLIGHT_LOADS
    max_inflight_load_chunks: int = DEFAULT_MAX_INFLIGHT_LOAD_CHUNKS
    # With maru_async_load: a hit of fewer tokens beyond what vLLM holds is computed, not loaded.
    # An asynchronous load parks the request for at least one engine step (10-30 ms under load on
    # an H200), more than computing a short remainder costs (256 tokens of an 8B model: ~3 ms):
    # the later turns of a conversation, a prompt that differs after its shared prefix. None: one
    # chunk (``kv_chunk_tokens``); 0: every hit loads.
    async_min_load_tokens: int | None = None
    # None: on where the KV caches are on a GPU and loads are not asynchronous (``layer_overlap``):
    # there the copy engine places the layers under the forward, the fastest warm load measured on
    # an H200, and vLLM keeps its full CUDA graphs (a step replayed as one is loaded before it).
    # Off on CPU caches, where the layers are placed by a thread that competes with the forward.
    overlap_load_with_compute: bool | None = None
    # The scheduler side pins what it offers until the workers placed it (``maru.vllm.offer_pins``):
    # nothing offered can be evicted before its load, and a worker's load makes no lookup round
    # trip. Off: the worker looks its loads up itself, and an eviction in between is recomputed.
    hold_offers: bool = True
    # Where offers are pinned one at a time (vLLM's V2 runner): a request's pins are posted when it
    # arrives (vLLM's ``on_new_request``), not waited for; its offer reads the reply. Requests
    # arriving together have their round trips in flight together instead of one after another on
    # vLLM's scheduling thread. Off: a round trip waited for at each offer. (On the V1 runner a
    # step's loads share one round trip: nothing is posted there.)
    pin_on_arrival: bool = True
    # Write-behind is the default: its safety rests on vLLM's delayed free (finished_sending) and
    # preemption hook (handle_preemptions), both in every vLLM the connector supports; the
    # connector turns it off, announced, on a vLLM without the hook (``without_write_behind``).
    async_store: bool = True
    # Write-behind stores on a GPU yield the copy engine between chunks and share no stream with
    # loads (kv_ops.paced_store): vLLM's own small copies wait for one chunk at most, not a whole store.
    paced_store: bool = True
    # Write-behind stores in a helper process of the worker's (``maru.vllm.store_helper``): the
    # drain's reserve, issue, wait and publish out of vLLM's interpreter, whose loop pays a drain
    # thread's CPU by its amount (bench/RESULTS.md, fifty-seventh pass). Off by default: in real vLLM
    # on a GPU without MPS it was no faster (its device work takes turns with vLLM's; fifty-eighth
    # pass). Needs caches a process can share (CUDA IPC).
    store_helper: bool = False
    # How a GPU worker's layer-by-layer load reads the pool (``kv_ops.device_pipeline.LAYER_PATHS``):
    # ``auto`` (the direct kernel, the SMs reading the pool), or ``copied`` (one batched copy a
    # layer on the copy engines: kinder to the forward beside it, but a longer host issue; see
    # docs/gpu.md), ``direct``, ``staged``. One that cannot run here is replaced, announced.
    layer_path: str = "auto"
    # Issue a step's layer-by-layer load when the scheduler side plans the step
    # (``build_connector_meta``) instead of when the forward starts (``start_load_kv``), where the
    # worker shares the scheduler's thread (one GPU, vLLM's in-process executor): the pool is read
    # while vLLM prepares the step's inputs (~3-5 ms of host time on the H100 host). Only in steps
    # where nothing else writes the loaded blocks before the forward (``maru.vllm.early_loads``).
    # None (the default): on where it applies, said once at info level where it does not (tensor
    # parallel, CPU caches, async loads, a vLLM build it was not checked on); True: the same, said
    # as a warning there; False: off.
    early_load: bool | None = None
    # Write-behind: the drain thread holds each store batch (before its reserve and gather) until the
    # step that started last schedules no prefill, for at most this many milliseconds after the batch
    # was queued (``maru.vllm.prefill_gate``): a burst's stores run beside its decode steps, not
    # beside its later prefill steps, whose requests wait for their first token. In real vLLM on an
    # H100 a cold storing instance paid 1.035x a round's TTFT without a connector with it, 1.078x
    # without (bench/RESULTS.md, sixty-second pass). 0: stores drain at once.
    store_yield_to_prefill_ms: float = DEFAULT_STORE_YIELD_MS
    # Seconds the write-behind drain waits before each store: a slow drain on demand, for tests that
    # must observe blocks held by a store in flight. Never set it in production.
    store_drain_delay_s: float = 0.0
    # Not a key: one sentence (reason and fix) per setting the connector replaced with a slower
    # one (``without_write_behind``, ``loading_before_the_request_runs``). The worker reports
    # them as its ``slow`` paths, so ``maru stats`` and ``maru doctor`` show them.
    fallbacks: tuple[str, ...] = field(default=(), metadata={"key": False})
    # Not a key: set by ``failing_same_step_loads`` (its sentence): vLLM ends a request whose
    # same-step load failed with an error instead of recomputing it (kv_load_failure_policy=fail).
    load_failures_fail: str = field(default="", metadata={"key": False})

    @classmethod
    def valid_keys(cls) -> list[str]:
        return sorted("maru_" + f.name for f in fields(cls) if f.metadata.get("key", True))

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> MaruConnectorConfig:
        """Parse ``kv_connector_extra_config``. Raises ``ConfigError`` on an unknown or bad ``maru_*`` key."""
        extra = dict(extra or {})
        valid = set(cls.valid_keys())
        unknown = sorted(k for k in extra if isinstance(k, str) and k.startswith("maru_") and k not in valid)
        if unknown:
            gone = [f"{k} {REMOVED_KEYS[k]}" for k in unknown if k in REMOVED_KEYS]
            raise ConfigError(
                f"unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                + (f"{'; '.join(gone)}; " if gone else "")
                + f"valid Maru keys are: {', '.join(sorted(valid))}"
            )
        kw: dict[str, Any] = {}
        for key, value in extra.items():
            if key not in valid:
                continue
            name = key[len("maru_") :]
            if name in ("server_url", "namespace", "model_id", "model_revision"):
                kw[name] = _as_str(key, value)
            elif name == "layer_path":
                kw[name] = _as_str(key, value)
                if kw[name] not in LAYER_PATHS:
                    raise ConfigError(f"{key} must be one of {', '.join(LAYER_PATHS)}, got {value!r}")
            elif name in ("kv_chunk_tokens", "max_inflight_loads", "max_inflight_load_chunks"):
                kw[name] = _as_int(key, value, 1)
            elif name == "async_min_load_tokens":
                kw[name] = _as_int(key, value, 0)
            elif name == "scheduler_reply_spin_us":
                kw[name] = _as_int(key, value, 0)
                if kw[name] > MAX_REPLY_SPIN_US:
                    raise ConfigError(
                        f"{key} must be at most {MAX_REPLY_SPIN_US} (us; a round trip to a local server "
                        f"takes ~100-300 us), got {kw[name]}; 0 turns the polling off"
                    )
            elif name == "timeout_s":
                kw[name] = _as_float(key, value, 0.0)
            elif name == "gil_probe_ms":
                kw[name] = 0.0 if value in (0, "0") else _as_float(key, value, 0.0)
                if kw[name] > 1000:
                    raise ConfigError(
                        f"{key} must be at most 1000 (ms; 1-5 resolves GIL waits), got {value!r}"
                    )
            elif name == "store_drain_delay_s":
                kw[name] = 0.0 if value in (0, "0") else _as_float(key, value, 0.0)
            elif name == "store_yield_to_prefill_ms":
                kw[name] = 0.0 if value in (0, "0") else _as_float(key, value, 0.0)
                if kw[name] > MAX_STORE_HOLD_MS:
                    raise ConfigError(
                        f"{key} must be at most {MAX_STORE_HOLD_MS:g} (ms a store batch may wait for a "
                        f"step without prefill; a burst's prefill takes ~50-300 ms), got {value!r}; 0 "
                        "drains stores at once"
                    )
            else:
                kw[name] = _as_bool(key, value)
        if "server_url" in kw and not kw["server_url"].strip():
            raise ConfigError("maru_server_url must not be empty; for example tcp://127.0.0.1:5555")
        if kw.get("async_load") and kw.get("overlap_load_with_compute"):
            raise ConfigError(
                "maru_async_load and maru_overlap_load_with_compute exclude each other: an asynchronous "
                "load completes while the request waits, before any forward pass it could overlap with. "
                "Set one of them to false (async load suits many concurrent requests; overlap suits a "
                "single long prefix on a GPU)"
            )
        return cls(**kw)

    def data_path(self) -> dict[str, Any]:
        """The optional data-path settings in effect (for the startup line and ``maru_stats``)."""
        return {
            "async_load": self.async_load,
            "max_inflight_loads": self.max_inflight_loads,
            "max_inflight_load_chunks": self.max_inflight_load_chunks,
            "async_min_load_tokens": self.min_async_load(),
            "overlap_load_with_compute": "auto (on GPU caches)"
            if self._overlap_by_path
            else bool(self.overlap_load_with_compute),
            "async_store": self.async_store,
            "paced_store": self.paced_store,
            "store_helper": self.store_helper,
            "layer_path": self.layer_path,
            "early_load": "auto (where it applies)" if self.early_load is None else self.early_load,
            "store_yield_to_prefill_ms": self.store_yield_to_prefill_ms,
        }

    def reply_spin_us(self, cpus: int | None = None) -> int:
        """How long the scheduler side polls for a reply (``scheduler_reply_spin_us``): as set, else
        the default where this process may run on ``MIN_CPUS_TO_SPIN`` cores or more (``cpus``: how
        many; None: this process's CPU affinity), else 0."""
        if self.scheduler_reply_spin_us is not None:
            return self.scheduler_reply_spin_us
        n = cpus if cpus is not None else usable_cpus()
        return DEFAULT_SCHEDULER_REPLY_SPIN_US if n >= MIN_CPUS_TO_SPIN else 0

    def layer_overlap(self, pipelined: bool) -> bool:
        """Whether a worker places its same-step loads layer by layer under the forward: as set,
        else where its data path is ``pipelined`` (GPU caches, the copy engine placing each layer
        under the forward) unless loads are async. Not on CPU caches, nor on the staged GPU path
        (announced as slow already), where a thread would place the layers beside the forward."""
        if self.overlap_load_with_compute is not None:
            return self.overlap_load_with_compute
        return pipelined and self._overlap_by_path

    @property
    def _overlap_by_path(self) -> bool:
        """``maru_overlap_load_with_compute`` unset and loads not async: each worker's data path decides."""
        return self.overlap_load_with_compute is None and not self.async_load

    @property
    def early_load_wanted(self) -> bool:
        """``maru_early_load`` set or left to its default (on where it applies): not false."""
        return self.early_load is not False

    def min_async_load(self) -> int:
        """Fewest tokens an asynchronous load is made for (``async_min_load_tokens``; None: a chunk)."""
        return self.kv_chunk_tokens if self.async_min_load_tokens is None else self.async_min_load_tokens

    def data_path_lines(self) -> list[str]:
        """One sentence per optional path that is on: what it does (logged once at startup)."""
        out = []
        if self.async_load:
            out.append(
                "maru_async_load: prefix hits load on a loader thread while the request waits in "
                "WAITING_FOR_REMOTE_KVS, every request parked since the loader's last turn in one "
                f"batch (at most {self.max_inflight_loads} loads and {self.max_inflight_load_chunks} "
                "chunks in flight; more hits wait a step); other requests keep running; a hit of fewer "
                f"than {self.min_async_load()} tokens is computed (maru_async_min_load_tokens)"
            )
        if self.overlap_load_with_compute or self._overlap_by_path:
            out.append(
                "maru_overlap_load_with_compute"
                + (" (on GPU caches, the default)" if self._overlap_by_path else "")
                + ": all chunks of a step's loads are pinned before the forward, then placed layer by "
                "layer under it (GPU: the copy engine; CPU: a background thread); each attention layer "
                "waits only for its own layer; a step vLLM replays as a full CUDA graph is loaded "
                "before its forward"
            )
        layered = bool(self.overlap_load_with_compute) or self._overlap_by_path
        if self.early_load is True or (self.early_load is None and layered):
            out.append(
                "maru_early_load"
                + (" (the default)" if self.early_load is None else "")
                + ": a step's layer-by-layer load is issued when the step is planned, "
                "where the worker shares vLLM's scheduling thread (one GPU), in steps that preempt "
                "nothing and have no new blocks zeroed or copied by vLLM; other steps load at the forward"
            )
        if self.async_store:
            out.append(
                "maru_async_store: write-behind store: the forward thread only queues the store (CUDA: "
                "the gather is issued on the copy engine); a drain thread gathers or waits for it and "
                "publishes the keys. vLLM keeps a finished request's blocks until its stores drained "
                "(finished_sending); a preempted request's blocks are reused only after the gather read them"
                + (
                    "; on a GPU the store yields the copy engine between chunks (maru_paced_store), so "
                    "vLLM's own copies never queue behind a whole store"
                    if self.paced_store
                    else ""
                )
                + (
                    "; each store batch waits for a step without prefill, at most "
                    f"{self.store_yield_to_prefill_ms:g} ms (maru_store_yield_to_prefill_ms"
                    + (", the default)" if self.store_yield_to_prefill_ms == DEFAULT_STORE_YIELD_MS else ")")
                    if self.store_yield_to_prefill_ms
                    else ""
                )
            )
            if self.store_helper:
                out.append(
                    "maru_store_helper: the drain is to run in a helper process of each worker (its "
                    "reserve, issue, wait and publish out of vLLM's interpreter); stores use the drain "
                    "thread until it is ready, where it cannot start (said) and from the moment it fails"
                )
        return out

    def without_write_behind(self, why: str) -> MaruConnectorConfig:
        """A copy with ``async_store`` off, announced (``why``: what makes write-behind unsafe here)."""
        if not self.async_store:
            return self
        sentence = (
            f"write-behind store (maru_async_store) is off: {why}. Stores run synchronously after "
            "the forward (cold prompts pay for the gather). Fix: a vLLM whose connector API has "
            "handle_preemptions"
        )
        logger.warning("Maru: %s", sentence)
        return self._replaced(sentence, async_store=False)

    def loading_before_the_request_runs(self, reason: str) -> MaruConnectorConfig:
        """A copy whose every load uses vLLM's asynchronous-load protocol (``async_load``).

        For engines where vLLM cannot recompute a failed load of a request it is already running
        (``reason`` says why): a synchronous or layer-overlap load fails in the step that also
        computes the request, and the request would go on with KV that was never placed. Under the
        asynchronous protocol a load completes or fails while the request waits in
        WAITING_FOR_REMOTE_KVS, and vLLM schedules it afterwards from what was really placed.
        Announced once per connector instance (reason and fix); a no-op when loads are off or
        already asynchronous.
        """
        if self.async_load or not self.enable_load:
            return self
        mode = {True: "maru_overlap_load_with_compute", False: "synchronous loads"}.get(
            self.overlap_load_with_compute, "same-step loads (layer by layer on GPU caches)"
        )
        sentence = (
            f"{mode} replaced by maru_async_load (a hit waits one engine step for its load, and a hit "
            f"of fewer than {self.min_async_load()} tokens (maru_async_min_load_tokens) is computed "
            "instead: a conversation's next turn usually is one, so instances sharing conversations "
            f"get little from Maru this way): {reason}. "
            "Fix: set maru_async_load=true to silence this"
            f"{or_v1_runner(' to keep same-step loads')}."
        )
        logger.warning("Maru: %s", sentence)
        # The default (None) needs no change: asynchronous loads turn its layer overlap off.
        overlap = None if self.overlap_load_with_compute is None else False
        return self._replaced(sentence, async_load=True, overlap_load_with_compute=overlap)

    def failing_same_step_loads(self, reason: str) -> MaruConnectorConfig:
        """A copy that keeps same-step loads where vLLM cannot recompute one that fails (``reason``).

        Only with offer pins (``hold_offers``, checked by the caller): an offered chunk cannot be
        evicted before its load, so the ordinary failure, a miss, cannot happen; what still can
        (bytes that fail their checksum, a copy error) ends the request with an error, never wrong
        KV: the connector sets vLLM's ``kv_load_failure_policy`` to "fail". Announced once, with
        the ways to have such a load recomputed instead. A no-op when loads are off or async.
        """
        if self.async_load or not self.enable_load:
            return self
        sentence = (
            "same-step loads kept: offered chunks are pinned until placed, so no eviction can fail a "
            f"load; one that still fails (bytes that fail their checksum, a copy error) cannot be "
            f"recomputed here ({reason}), so vLLM ends that request with an error "
            "(kv_load_failure_policy=fail) instead of serving KV that was never placed. To have such "
            f"loads recomputed instead: set maru_async_load=true{or_v1_runner()}"
        )
        logger.warning("Maru: %s", sentence)
        return MaruConnectorConfig(**{**self.__dict__, "load_failures_fail": sentence})

    def off(self, why: str) -> MaruConnectorConfig:
        """A copy with loads and stores off, announced once (``why``: the reason and the fix) and
        kept in ``fallbacks`` (the worker reports it: ``maru doctor``). A no-op when both are off."""
        if not (self.enable_load or self.enable_store):
            return self
        logger.warning("Maru: %s", why)
        return self._replaced(why, enable_load=False, enable_store=False)

    def _replaced(self, sentence: str, **changes: Any) -> MaruConnectorConfig:
        """A copy with ``changes`` applied and ``sentence`` (reason and fix) added to ``fallbacks``."""
        return MaruConnectorConfig(**{**self.__dict__, **changes, "fallbacks": (*self.fallbacks, sentence)})

    def aligned_to_block_size(self, block_size: int) -> MaruConnectorConfig:
        """Return a copy whose chunk size is a multiple of ``block_size`` (rounded down, at least one block).

        Chunks are stored and loaded whole blocks at a time, so a chunk that ended inside a
        block could never be offered to vLLM; rounding it is announced once.
        """
        ct = self.kv_chunk_tokens
        aligned = max(block_size, (ct // block_size) * block_size)
        if aligned == ct:
            return self
        logger.warning(
            "Maru: maru_kv_chunk_tokens=%d is not a multiple of vLLM's block size %d; using %d. "
            "Set maru_kv_chunk_tokens to a multiple of the block size to silence this.",
            ct,
            block_size,
            aligned,
        )
        return MaruConnectorConfig(**{**self.__dict__, "kv_chunk_tokens": aligned})
