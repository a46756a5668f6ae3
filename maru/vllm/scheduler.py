"""Scheduler side of the connector: decides what each step loads from and stores to Maru.

It only asks which keys exist (``PrefixProbe``: from the server's key index, or one or two
``exists`` round trips per request), covering the prompt's chunk keys and the block-aligned
partial-chunk candidates where its hit ends; the bytes move on the worker side.

Offer rule (``get_num_new_matched_tokens``): the run of present full chunks from where vLLM's
own hit ends (what vLLM holds locally is never asked about), extended by the longest present
*tail* (a partial chunk stored where another prompt with the same tokens ended), capped at
``align_down(prompt_len - 1, block_size)`` so vLLM always computes at least the last prompt
token, minus what vLLM already has locally.

Store rule (``build_connector_meta``): a full chunk is stored in the step that computes its
last token; a request's own tail (``[F*C, align_down(P-1, BS))`` with ``F = P // C``) in the
step that computes that tail's last token. Each is planned at most once per request, skipped
when the probe found it already present (loaded or stored by someone else), and re-planned
only if the worker reports that the step computing it also failed a load (its KV is then
recomputed). Tails are stored only where a prompt ends, so they cost at most one partial chunk
per distinct prompt, and a longer prompt that extends a stored one reuses the stored tail only
when its tokens there are exactly the same (the key says so); nothing else is ever assumed.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any

from maru.errors import MaruError
from maru.transfer.records import ChunkRef, RequestTransfer
from maru.vllm import thread_census
from maru.vllm.adapters import RequestScope, RequestScopes, Skipped
from maru.vllm.cache_reset import CacheResets
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.hook_times import HookTimes, hook_times_for, timed_step
from maru.vllm.key_cache import ChunkKeyCache
from maru.vllm.keys import ChunkKeyer, PromptKeys
from maru.vllm.load_admission import LoadAdmission, SharedWaits
from maru.vllm.load_plan import LoadPlanning
from maru.vllm.metadata import MaruConnectorMetadata
from maru.vllm.offer_pins import OfferPins
from maru.vllm.prefill_gate import prefill_step
from maru.vllm.prefix_probe import PrefixProbe
from maru.vllm.recent_keys import RecentBlocks, RecentKeys
from maru.vllm.scheduler_client import SchedulerClient
from maru.vllm.scheduler_state import RequestState, SchedulerStats
from maru.vllm.step_clock import cpu_stamp

logger = logging.getLogger("maru.vllm")


class MaruSchedulerConnector(SchedulerClient, LoadPlanning, CacheResets):
    """Scheduler-side state and decisions. Owns no bytes; one instance per engine."""

    def __init__(
        self,
        cfg: MaruConnectorConfig,
        keyer: ChunkKeyer,
        block_size: int,
        tp_size: int = 1,
        client_factory: Any = None,
        local_prefix_cache: bool = True,
        hold_offers: bool = False,
        pin_at_offer: bool = False,
        hook_times: HookTimes | None = None,
        scopes: RequestScopes | None = None,
    ) -> None:
        """``local_prefix_cache``: whether vLLM's own prefix cache is on (async loads of the same
        chunks are shared only through it). ``hold_offers``: pin what is offered until the workers
        placed it (``OfferPins``); needs the workers' per-step report (vLLM's
        ``build_connector_worker_meta``), so the connector decides. ``pin_at_offer``: pin each
        offer before making it (where vLLM cannot recompute a failed same-step load), not once a
        step for all loads. ``hook_times``: where the parts of its hooks are counted (the connector's).
        ``scopes``: what keys a request beyond its tokens (its salt, its LoRA adapter's files)."""
        self.hook_times = hook_times if hook_times is not None else hook_times_for(cfg.log_timing)
        self.cfg = cfg
        # maru_store_yield_to_prefill_ms: the workers' gate reads each step's ``prefill``
        self._gated = cfg.async_store and cfg.store_yield_to_prefill_ms > 0
        self.block_size = block_size
        self.chunk = cfg.kv_chunk_tokens
        self._tp_size = tp_size
        self._use_keys(keyer)
        self._client_factory = client_factory
        self._client: Any = None
        self._reported_path: str | None = None  # the EXISTS path last reported to the server
        self._next_connect = 0.0
        self.scopes = scopes if scopes is not None else RequestScopes()
        self._skip_notes: list[str] = []  # kinds of requests left to vLLM (``RequestScopes``: reported)
        self._share_timeout_note: str | None = None  # set at the first timeout (``maru doctor``)
        self._reqs: dict[str, RequestState] = {}
        # The loads vLLM accepted since the last plan (request, first and end token): if planning
        # fails, each is planned to fail, never left out (``_failed_plan``).
        self._offered: list[tuple[RequestState, int, int]] = []
        # Accepted loads to plan to fail at the next plan (``CacheResets``: pending at a reset, or
        # accepted by a request the reset froze).
        self._doomed: list[tuple[RequestState, int, int]] = []
        # Stores and loads of the last steps, to un-plan stores when their step's load failed.
        self._recent: collections.deque[list[tuple[str, set[int], list[int], bool]]] = collections.deque(
            maxlen=4
        )
        self.stats = SchedulerStats()
        self.pins = OfferPins(tp_size) if hold_offers and cfg.enable_load else None
        self.pin_at_offer = pin_at_offer
        # maru_async_load: the loads in flight (admitted, not yet in finished_recving).
        self._admission = LoadAdmission(
            cfg.max_inflight_loads, cfg.max_inflight_load_chunks, self.chunk, share=local_prefix_cache
        )
        self._waits = SharedWaits()
        # maru_async_store: finished requests whose free vLLM delays until finished_sending.
        self._delayed: set[str] = set()
        # A slower path (announced once, reported to the server for `maru doctor`): without vLLM's
        # prefix cache, requests arriving together with one prefix each load their own copy.
        self._unshared: str | None = None
        if cfg.async_load and cfg.enable_load and not local_prefix_cache:
            self._unshared = (
                "async loads are not shared: vLLM's prefix cache is off (enable_prefix_caching=False), "
                "so requests arriving together with one prefix each load their own copy (bus time and "
                "KV blocks once per request). Fix: turn vLLM's prefix caching on"
            )
            logger.warning("Maru: %s", self._unshared)

    def _use_keys(self, keyer: ChunkKeyer) -> None:
        """Key every request from now on with ``keyer``; what was remembered under other keys (keys
        by vLLM's block hash, the guesses of vLLM's own hit) starts empty."""
        self.keyer = keyer
        self._prober = PrefixProbe(keyer, self.chunk, self.block_size, self._tp_size)
        self._key_cache = ChunkKeyCache(keyer, self.block_size)  # keys by vLLM's block hashes
        self.recent_keys = RecentKeys()  # a guess of vLLM's own hit at a request's arrival
        # ... to the block, from finished requests (a chunk's last blocks and each turn's last)
        self.recent_blocks = RecentBlocks(self.block_size, stride=max(1, self.chunk // self.block_size))

    @property
    def inflight_loads(self) -> set[str]:
        return self._admission.ids()

    @property
    def load_sharing(self) -> str:
        """Whether async loads of one prefix arriving together are loaded once (``maru stats``)."""
        if not (self.cfg.async_load and self.cfg.enable_load):
            return "n/a (maru_async_load off)"
        return "off (vLLM's prefix cache is off)" if self._unshared else "on"

    @property
    def delayed_frees(self) -> set[str]:
        """Finished requests whose blocks vLLM holds until the worker reports their stores drained."""
        return set(self._delayed)

    # ------------------------------------------------------------------ requests
    def _scope(self, request: Any) -> RequestScope | None:
        """The request's scope (salt, adapter, multimodal inputs); None where Maru's keys do not
        cover it. Such a request is left to vLLM, announced once per kind in the log and reported
        to the server (``maru doctor``: these requests recompute)."""
        scope = self.scopes.of(request)
        if changed := self.scopes.adapters.take_changed():
            self._stop_changed_adapters(changed)
        if not isinstance(scope, Skipped):
            return scope
        note = scope.note
        if scope.announce and note not in self._skip_notes:
            self._skip_notes.append(note)
            logger.warning("Maru: %s", note)
            self._reported_path = None  # report again, with it
            try:
                if self._get_client() is not None:
                    self._report_path()
            except Exception:  # informative only: never raise into vLLM's scheduler
                logger.exception("Maru: reporting a kind of request Maru leaves to vLLM failed")
        return None

    def _state(self, request: Any) -> RequestState | None:
        """The request's state, made at its first sight; None where Maru leaves it to vLLM (not
        eligible, or alive at a cache reset)."""
        st = self._reqs.get(request.request_id)
        if st is not None:
            return None if st.frozen else st
        scope = self._scope(request)
        if scope is None:
            return None
        self._wake_for_pins()  # before the keys and the probe: a pin may follow them
        # vLLM's own list, not a copy (``RequestState.prompt``: read up to ``prompt_len`` only).
        ids = request.prompt_token_ids
        prompt = ids if type(ids) is list else list(ids)
        st = RequestState(
            req_id=request.request_id,
            prompt=prompt,
            prompt_len=len(prompt),
            keys=self._keys(request, prompt, scope),
            adapter=scope.adapter,
        )
        usable = self._usable(len(prompt))
        n_full = len(st.keys.full)
        own = usable - n_full * self.chunk
        if (plain := st.keys.plain_tokens_from(n_full * self.chunk)) is not None:
            own = min(own, plain // self.block_size * self.block_size)  # a tail never reaches an image
        if self.cfg.store_partial_tail and own > 0:
            tail = prompt[n_full * self.chunk : n_full * self.chunk + own]
            st.own_tail = (own, self.keyer.tail_key(st.keys.parent(n_full), tail))
        self._reqs[request.request_id] = st
        return st

    @timed_step("keys", "get_num_new_matched_tokens")
    def _keys(self, request: Any, prompt: list[int], scope: RequestScope) -> PromptKeys:
        kc = self._key_cache
        keys = kc.prompt_keys(
            prompt,
            getattr(request, "block_hashes", None),
            int(request.num_tokens),
            salt=scope.salt,  # vLLM's per-request isolation
            adapter=scope.adapter,  # a LoRA adapter's files
            media=scope.media,  # multimodal inputs, by vLLM's hash of each
        )
        self.stats.keys_remembered, self.stats.keys_hashed = kc.hits, kc.hashed
        return keys

    def _usable(self, prompt_len: int) -> int:
        return self._prober.usable(prompt_len)

    @timed_step("probe", "get_num_new_matched_tokens")
    def _probe(self, st: RequestState, local_computed: int) -> None:
        """Which of the request's chunks and block-aligned tails the pool holds (``PrefixProbe``);
        the full chunks vLLM's own hit covers (``local_computed`` tokens) are not asked about."""
        n_full = len(st.keys.full)
        client = self._get_client()
        self.stats.requests_probed += 1
        found = None
        st.probed_local = local_computed
        if client is not None:
            try:
                found = self._prober.ask(
                    client, st.prompt_tokens(), st.keys, local=local_computed, own_tail=st.own_tail
                )
                self._report_path()
            except MaruError as e:
                self.stats.probe_failures += 1
                self._drop_client(e)
        if found is None:
            # Unknown: offer nothing, and let the worker try to store (the server answers
            # "present" for chunks that were there after all).
            st.present = [False] * n_full
            st.tail_hits = {}
            st.own_tail_present = False
            return
        st.present = found.present
        st.tail_hits = found.tail_hits
        st.own_tail_present = (
            st.own_tail is not None and st.tail_hits.get(n_full, (0, ""))[0] >= st.own_tail[0]
        )

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` vLLM can take from Maru (block-aligned).

        Synchronous by default. With ``maru_async_load`` a hit is offered asynchronously
        (``(n, True)``: vLLM parks the request until the worker reports it loaded), and when the
        window is full (``maru_max_inflight_loads`` loads or ``maru_max_inflight_load_chunks``
        chunks already in flight) the answer is ``(None, False)``:
        vLLM skips the request for this step and asks again next step, while other requests run.
        Waiting for a slot is chosen over offering 0, because offering 0 would make vLLM compute
        the whole prefix now, which costs far more than the few steps a load slot takes to free.
        The answer is ``(None, False)`` too when the chunk the request needs next is already being
        loaded for another request (``LoadAdmission.in_flight``): it waits for vLLM's prefix cache
        to hold it rather than load a second copy over the same bus.
        """
        try:
            if not (self.cfg.enable_load or self.cfg.enable_store):
                return 0, False
            self._rekey_if_fresh(request.request_id, num_computed_tokens)
            st = self._state(request)
            if st is None:
                return 0, False
            if st.present is not None and num_computed_tokens < st.probed_local:
                st.present = None  # vLLM's own hit shrank: the chunks it no longer covers were not asked
            if st.present is None:
                self._probe(st, num_computed_tokens)
            st.local_computed = num_computed_tokens
            if not self.cfg.enable_load or st.async_load_failed:
                # After a failed async load vLLM may match the request again from scratch; offering
                # the same chunks again could fail the same way for ever, so it is computed.
                return 0, False
            assert st.present is not None
            # The run of present chunks from where vLLM's own hit ends (the chunks before it are
            # vLLM's: whether the pool holds them does not matter).
            hits = min(num_computed_tokens // self.chunk, len(st.present))
            while hits < len(st.present) and st.present[hits]:
                hits += 1
            tail = st.tail_hits.get(hits)
            end = hits * self.chunk + (tail[0] if tail else 0)
            end = min(end, self._usable(st.prompt_len), self._usable(request.num_tokens))
            end -= end % self.block_size
            st.match = (hits, tail)
            n = end - num_computed_tokens
            if n <= 0:
                return 0, False
            if not self.cfg.async_load:
                return self._held_offer(st, num_computed_tokens, end), False
            if n < self.cfg.min_async_load():  # parking it a step would cost more than computing it
                self.stats.async_hits_computed += 1
                self._drop_pins(st.req_id)
                return 0, False
            if not self._admission.in_flight(self._key_at(st, num_computed_tokens)):
                self._waits.end(st.req_id)  # nothing to wait for: a later wait starts its own clock
            elif self._may_wait(st.req_id):
                self.stats.async_loads_shared += 1
                return None, False
            if self._admission.window_full(n):
                self.stats.async_loads_deferred += 1
                return None, False
            n = self._held_offer(st, num_computed_tokens, end)
            if n < self.cfg.min_async_load():  # cut short by a chunk gone since the probe
                self.stats.async_hits_computed += 1
                self._drop_pins(st.req_id)
                return 0, False
            return n, True
        except Exception:  # a bug here must not take the engine down: compute instead
            logger.exception("Maru: matching request %s failed; vLLM computes it", request.request_id)
            return 0, False

    def _may_wait(self, req_id: str) -> bool:
        """Whether ``req_id`` may keep waiting for another request's load (``SharedWaits``). The
        first wait that runs out is logged and reported to the server (``maru doctor`` shows it)."""
        if self._waits.may_wait(req_id):
            return True
        self.stats.async_share_timeouts = self._waits.timeouts
        if self._waits.timeouts and self._share_timeout_note is None:
            self._share_timeout_note = (
                f"a request waited {self._waits.waited(req_id):.1f} s for another request's async load "
                "of the same chunks, whose completion never came; it loaded its own copy (served "
                "correctly, more bus time). Fix: look in this vLLM's log for Maru load errors and "
                "report it; async_share_timeouts counts them"
            )
            logger.warning("Maru: %s", self._share_timeout_note)
            self._reported_path = None  # report again, with this
            self._report_path()
        return False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        try:
            st.block_ids = list(blocks.get_block_ids()[0])
        except Exception:
            pass
        if num_external_tokens <= 0:
            self._drop_pins(st.req_id)  # vLLM took none of the offer
        elif st.frozen:  # offered before the reset (vLLM 0.34 may defer this call): fail it
            self._doomed.append((st, st.local_computed, st.local_computed + num_external_tokens))
        else:
            st.pending_load = (st.local_computed, st.local_computed + num_external_tokens)
            self._offered.append((st, *st.pending_load))  # until the step's plan holds its load
            if self.cfg.async_load:
                begin, end = st.pending_load
                self._admission.admit(st.req_id, num_external_tokens, self._keys_between(st, begin, end))
                self._waits.end(st.req_id)
            self.stats.requests_hit += 1
            self.stats.tokens_offered += num_external_tokens

    def _plan_stores(
        self, st: RequestState, computed: int, scheduled: int
    ) -> tuple[list[ChunkRef], list[int], bool]:
        if not self.cfg.enable_store or st.present is None or st.frozen:
            return [], [], False
        C = self.chunk
        end = min(computed + scheduled, st.prompt_len)
        chunks: list[ChunkRef] = []
        planned: list[int] = []
        for i in range(computed // C, end // C):
            if (i + 1) * C <= computed or st.present[i] or i in st.planned:
                continue
            chunks.append(ChunkRef(st.keys.full[i], i * C, C))
            st.planned.add(i)
            planned.append(i)
        tail_now = False
        if st.own_tail is not None and not st.own_tail_present and not st.tail_planned:
            s = len(st.keys.full) * C
            if computed < s + st.own_tail[0] <= end:
                chunks.append(ChunkRef(st.own_tail[1], s, st.own_tail[0]))
                st.tail_planned = tail_now = True
        self.stats.chunks_planned += len(planned)
        self.stats.tails_planned += int(tail_now)
        self.recent_keys.note(c.key for c in chunks)  # computed in vLLM's cache this step
        return chunks, planned, tail_now

    def build_connector_meta(self, so: Any) -> MaruConnectorMetadata:
        meta = MaruConnectorMetadata()
        record: list[tuple[str, set[int], list[int], bool]] = []
        try:
            if self.scopes.adapters.pinned:  # LoRA: an adapter's files changed under live requests?
                live = {st.adapter for st in self._reqs.values() if st.adapter is not None and not st.frozen}
                self.scopes.adapters.recheck(live)
                if changed := self.scopes.adapters.take_changed():
                    self._stop_changed_adapters(changed)
            self._pin_step_loads()  # one round trip for the step's loads (not at the offer)
            steps: list[tuple[RequestState, int]] = []
            for new in so.scheduled_new_reqs:
                st = self._reqs.get(new.req_id)
                if st is None:
                    continue
                st.block_ids = list(new.block_ids[0])
                steps.append((st, new.num_computed_tokens))
            cached = so.scheduled_cached_reqs
            # vLLM 0.34 sends a resumed request in full among the new ones (no such field).
            resumed = getattr(cached, "resumed_req_ids", None) or ()
            for i, req_id in enumerate(cached.req_ids):
                st = self._reqs.get(req_id)
                if st is None:
                    continue
                nb = cached.new_block_ids[i]
                if req_id in resumed:
                    st.block_ids = list(nb[0]) if nb is not None else []
                elif st.pending_load is None and cached.num_computed_tokens[i] >= st.prompt_len:
                    # Past its prompt (decoding) with no load due: nothing left to load or store, so
                    # its block table is not followed any more (a resume brings the whole table).
                    continue
                elif nb is not None:
                    st.block_ids.extend(nb[0])
                steps.append((st, cached.num_computed_tokens[i]))
            for st, computed in steps:
                load_blocks: set[int] = set()
                if st.pending_load is not None:
                    lt = self._load_transfer(st)
                    if lt is not None and lt.chunks:
                        meta.loads.append(lt)
                        load_blocks = lt.placed_block_ids(self.block_size)
                scheduled = so.num_scheduled_tokens.get(st.req_id, 0)
                chunks, planned, tail_now = self._plan_stores(st, computed, scheduled)
                if chunks:
                    meta.stores.append(RequestTransfer(st.req_id, tuple(st.block_ids), tuple(chunks)))
                if chunks or load_blocks:
                    blocks = load_blocks | set(st.block_ids[: (computed + scheduled) // self.block_size + 1])
                    record.append((st.req_id, blocks, planned, tail_now))
            scheduled = {st.req_id for st, _ in steps}
            if self.cfg.async_load:
                self._plan_async_loads(meta, scheduled)
            for req_id in so.preempted_req_ids or ():
                st = self._reqs.get(req_id)
                # (vLLM never resumes a request in the step that preempted it; if it ever did, the
                # block table just built is the live one and must stay.)
                if st is not None and req_id not in scheduled:
                    self.stats.requests_preempted += 1
                    # Its blocks are gone; on resume it is matched again (what we stored since
                    # is now loadable) and its block table starts over.
                    st.present = None
                    st.pending_load = None
                    st.block_ids = []
            if self._doomed:
                self._failing(self._doomed, meta)
                self._doomed = []
        except Exception:  # never raise into vLLM's scheduler
            logger.exception(
                "Maru: planning this step's loads and stores failed; the %d loads vLLM accepted this "
                "step are failed (vLLM recomputes them), nothing is stored",
                len(self._offered),
            )
            for req_id, _, planned, tail_now in record:  # stores planned, then dropped: plan again
                st = self._reqs.get(req_id)
                if st is not None:
                    st.planned.difference_update(planned)
                    st.tail_planned = st.tail_planned and not tail_now
            if self.pins is not None:  # loads handed their pins, then lost with the plan
                for lt in (*meta.loads, *meta.async_loads):
                    if lt.ticket:
                        self.pins.take_back(lt.ticket)
            meta = self._failed_plan()
            record = []
        self._offered = []
        self._recent.append(record)
        if self.pins is not None:
            self.pins.flush(self._client)  # the sets dropped since the last step: one UNPIN
        self._admission.settle()
        self._track_sending(meta, set(getattr(so, "preempted_req_ids", None) or ()))
        if self.cfg.log_timing or self._gated:  # the step clock's kind; maru_store_yield_to_prefill_ms
            meta.prefill = prefill_step(so)
        if self.cfg.log_timing:  # what the worker's step clock files the forward under
            meta.step_tokens = sum((getattr(so, "num_scheduled_tokens", None) or {}).values())
            meta.scheduled_at = time.monotonic()
            meta.scheduled_cpu = cpu_stamp()
            if meta.prefill and thread_census.enabled():
                meta.scheduled_threads = thread_census.snapshot()
        return meta

    def _track_sending(self, meta: MaruConnectorMetadata, preempted: set[str]) -> None:
        """Mark the requests whose free the write-behind store delays, exactly as the worker does.

        The worker owes a ``finished_sending`` to every request named in a step's stores, and
        forgets a request when it is preempted (its blocks are freed by vLLM then, after the
        worker's preemption barrier). The same order here: preemptions first, then this step's
        stores. The preempted ids travel even in an empty plan: the barrier must run.
        """
        meta.preempted_req_ids = preempted
        if not self.cfg.async_store:
            return
        for req_id in preempted:
            st = self._reqs.get(req_id)
            if st is not None:
                st.sending = False
        for rt in meta.stores:
            st = self._reqs.get(rt.req_id)
            if st is not None:
                st.sending = True

    def update_connector_output(self, output: Any) -> None:
        """Free admission slots of finished async loads; un-plan the stores of steps whose load failed."""
        self._workers_done(getattr(output, "kv_connector_worker_meta", None))
        invalid = getattr(output, "invalid_block_ids", None) or set()
        for req_id in getattr(output, "finished_sending", None) or ():
            if req_id in self._delayed:
                self._delayed.discard(req_id)
                self.stats.delayed_frees_released += 1
        for req_id in getattr(output, "finished_recving", None) or ():
            if self._admission.finish(req_id):
                self.stats.async_loads_finished += 1
            st = self._reqs.get(req_id)
            if st is not None and st.async_blocks & invalid and not st.frozen:
                # Failed (vLLM reads the blocks and the request in the same output). Probe again so
                # the recompute stores what is missing; never offer this request a load again.
                st.async_load_failed = True
                try:
                    self._probe(st, 0)  # rare: ask about every chunk
                except Exception:  # a lost probe only costs stores: nothing is planned for it
                    logger.exception("Maru: probing request %s again failed", req_id)
                    st.present = None
            if st is not None:
                st.async_blocks = set()
        if not invalid:
            return
        self.stats.load_failures_reported += 1
        reprobe: dict[str, RequestState] = {}
        for record in self._recent:
            for req_id, blocks, planned, tail_now in record:
                st = self._reqs.get(req_id)
                if st is None or not (blocks & invalid):
                    continue
                st.planned.difference_update(planned)
                if tail_now:
                    st.tail_planned = False
                reprobe[req_id] = st
        for req_id, st in reprobe.items():
            if st.frozen:
                continue  # never stored again: nothing to probe for
            # What was found present is not any more (that is why the load failed): probe again,
            # so the recompute stores the missing chunks instead of leaving a hole for everyone.
            try:
                self._probe(st, 0)
            except Exception:
                logger.exception("Maru: probing request %s again failed", req_id)

    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free_blocks, None)``: delayed exactly for requests with a write-behind store planned
        since their last preemption; the worker reports each of them in ``finished_sending``
        (whatever became of the store: drained, failed, dropped, connector off), on every rank.
        vLLM calls this for finished and aborted requests, never for preempted ones."""
        st = self._reqs.pop(request.request_id, None)
        if st is None or not st.frozen:  # a frozen one's blocks may hold KV from before a reset
            self.recent_blocks.note(request)  # its blocks stay in vLLM's prefix cache: a later guess
        self._drop_pins(request.request_id)  # pins handed over with a load wait for the workers
        # An aborted request's load may never be reported: nobody may wait for its chunks.
        self._admission.finish(request.request_id)
        self._waits.end(request.request_id)
        if st is not None and st.sending:
            self._delayed.add(st.req_id)
            self.stats.delayed_frees += 1
            return True, None
        return False, None

    def shutdown(self) -> None:
        if self.pins is not None:
            self.pins.close(self._client)
        client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:
                pass
