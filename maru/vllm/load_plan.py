"""How the scheduler side plans loads: offers pinned until placed, the keys an offer covers, and
the ``RequestTransfer`` records the workers execute (``MaruSchedulerConnector`` mixes this in).

An offer is only ever made of chunks the scheduler side holds pinned (``OfferPins``) when offer
pins are on: a chunk the probe found but that is gone when pinned cuts the offer before it.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from maru.errors import MaruError
from maru.transfer.records import ChunkRef, RequestTransfer
from maru.vllm.hook_times import timed_part
from maru.vllm.metadata import MaruConnectorMetadata, MaruWorkerMeta
from maru.vllm.model_runner import or_v1_runner
from maru.vllm.offer_pins import OfferPins
from maru.vllm.recent_keys import RecentBlocks, RecentKeys
from maru.vllm.scheduler_state import RequestState, SchedulerStats

logger = logging.getLogger("maru.vllm")

WITHHELD_WARN = 64  # hits withheld (workers not ready) before the one warning
# A pin round trip to a server idle for longer than its polling (``maru server --spin-us``) waits
# for the server's thread to wake: 2.3-2.7 ms a step pin, ~0.95 ms an offer pin in a serving vLLM
# on an H200 host (thirty-third pass). A new request's keys and probe take a few hundred us on
# vLLM's thread first, so a wake-up posted before them hides most of that. At most one a WAKE_GAP_S.
WAKE_GAP_S = 0.001


class LoadPlanning:
    """The load-planning half of ``MaruSchedulerConnector`` (its state lives there)."""

    chunk: int
    block_size: int
    pins: OfferPins | None
    pin_at_offer: bool
    # pin_at_offer (a failed load ends its request): every rank said it can load (at engine start,
    # then after each step: MaruWorkerMeta); offers are withheld until then. The last word's
    # (ready, unready).
    _workers_ready: bool = False
    _readiness: tuple[int, int] = (0, 0)
    _withheld_note: str | None = None  # said once if offers stay withheld (``maru doctor``)
    recent_keys: RecentKeys  # set by MaruSchedulerConnector
    recent_blocks: RecentBlocks  # set by MaruSchedulerConnector
    running_hook: str | None = None  # the hook a shared helper's time is counted in (``timed_step``)
    _woken_at: float = 0.0  # perf_counter of the last wake-up posted (``_wake_for_pins``)
    _reported_path: str | None
    stats: SchedulerStats
    _reqs: dict[str, RequestState]
    _client: Any
    cfg: Any

    def _state(self, request: Any) -> RequestState | None:  # pragma: no cover - the scheduler's
        raise NotImplementedError

    def _probe(self, st: RequestState, local_computed: int) -> None:  # pragma: no cover
        raise NotImplementedError

    def _get_client(self) -> Any:  # pragma: no cover - MaruSchedulerConnector's
        raise NotImplementedError

    def _usable(self, prompt_len: int) -> int:  # pragma: no cover - MaruSchedulerConnector's
        raise NotImplementedError

    def _drop_client(self, why: Exception) -> None:  # pragma: no cover - MaruSchedulerConnector's
        raise NotImplementedError

    def _report_path(self) -> None:  # pragma: no cover - MaruSchedulerConnector's
        raise NotImplementedError

    # Seen once vLLM announced a request (``on_new_request``) and its pins were posted then.
    _arrivals: bool = False
    _posts_failing: bool = False  # what the last report said of ``OfferPins.failing_posts``

    @property
    def offer_pins_mode(self) -> str:
        """How loads are pinned before the worker runs them (``maru stats``, ``maru doctor``)."""
        if self.pins is None:
            return "off (the worker looks its loads up; an eviction in between is recomputed)"
        if self.pin_at_offer:
            how = "at each offer (a failed same-step load cannot be recomputed here)"
        else:
            how = "per step (one round trip for a step's loads)"
        if self._arrivals:
            return (
                "posted at each request's arrival, read at its offer (the round trips of requests "
                "arriving together overlap); what was not posted: at the offer"
            )
        return how.replace("at each offer (", "at each offer (a round trip per request with a hit: ")

    @property
    def at_offer_note(self) -> str | None:
        """The slower path of pins taken at the offer (for ``maru doctor``); None where none runs."""
        if self.pins is None or not self.pin_at_offer:
            return None
        if self._arrivals and not self.pins.failing_posts():
            return None
        if self._arrivals:
            why = (
                f"{self.pins.stats.posts_failed} of {self.pins.stats.pin_posts} lookups posted at "
                f"arrival failed (the first: {self.pins.post_failure}; check the server with "
                "`maru doctor` and its log)"
            )
        elif not self.cfg.pin_on_arrival:
            why = "pin_on_arrival is off (maru_pin_on_arrival)"
        else:
            why = "this vLLM has not announced a request's arrival (on_new_request) yet"
        return (
            "offers are pinned one lookup-and-pin round trip per request with a hit (none where "
            "another request holds every chunk of it pinned), on vLLM's scheduling thread (~0.5 ms "
            "a request on an H200 host): vLLM's V2 model runner cannot recompute a failed same-step "
            f"load, so no offer may be made of a chunk that is not pinned yet, and {why}. Fix: leave "
            "maru_pin_on_arrival on with a vLLM that calls on_new_request (0.26 and later)"
            + or_v1_runner(" (a step's loads then share one round trip)")
        )

    def _wake_for_pins(self) -> None:
        """Post a wake-up to the server (``client.wake``: a heartbeat not waited for) before a new
        request's keys and probe, where a pin round trip may follow them (offer pins on), at most
        once a ``WAKE_GAP_S``: the pin then finds the server polling instead of asleep. Not at an
        arrival while a post of the arrivals before it is in flight or queued (a burst): that post
        wakes the server, and a wake-up's own send and reply would cost vLLM's thread about what
        sharing the post saves."""
        if self.pins is None or self._client is None:
            return
        if self.running_hook == "on_new_request" and self.pins.posting and not self._posts_failing:
            return
        now = time.perf_counter()
        if now - self._woken_at < WAKE_GAP_S:
            return
        self._woken_at = now
        wake = getattr(self._client, "wake", None)
        if wake is not None and wake():
            self.stats.server_wakes += 1

    def _held_offer(self, st: RequestState, begin: int, end: int) -> int:
        """Pin the chunks of an offer of prompt tokens ``[begin, end)`` (``OfferPins``) where a
        failed same-step load cannot be recomputed (``pin_at_offer``); the tokens offered, cut to
        the chunks really held: one the probe found may be gone by now (evicted), and there an
        offer is never made of what is not pinned. Elsewhere ``end - begin`` (the step's loads are
        pinned together in ``build_connector_meta``: ``_pin_step_loads``)."""
        if self.pins is None or not self.pin_at_offer:
            return end - begin
        if not self._workers_ready:
            self._withhold()
            return 0
        client = self._get_client()
        keys = self._keys_between(st, begin, end)
        try:  # no client is needed where every key's pin is shared (``OfferPins``)
            held = self._hold(client, st.req_id, keys)
        except MaruError as e:
            self.stats.probe_failures += 1
            self._drop_pins(st.req_id)
            if client is not None:
                self._drop_client(e)
            return 0
        if held == len(keys):
            return end - begin
        # Chunk ``miss`` is gone: offer the chunks before it, and let a store refill it.
        miss = begin // self.chunk + held
        hits, tail = st.match
        if miss < hits and st.present is not None:
            st.present[miss] = False
        elif tail is not None and st.own_tail is not None and tail[1] == st.own_tail[1]:
            st.own_tail_present = False  # its own tail is gone: computed, it is stored again
        st.tail_hits.pop(min(miss, hits), None)
        st.match = (min(hits, miss), None)
        cut = max(begin, miss * self.chunk)
        if cut == begin:
            self._drop_pins(st.req_id)
        self.pins.flush(client)  # what was pinned past the cut (rare: an eviction since the probe)
        return cut - begin

    def _withhold(self) -> None:
        """A hit computed, not offered: not every worker reported it can load (where a failed load
        would end the request). Normal for the first step or two; said once if it lasts."""
        self.stats.offers_withheld += 1
        if self.stats.offers_withheld < WITHHELD_WARN or self._withheld_note is not None:
            return
        ready, unready = self._readiness
        self._withheld_note = (
            f"{self.stats.offers_withheld} prompt hits computed instead of loaded: "
            + (
                f"{unready} of {ready + unready} workers cannot load now"
                if ready + unready
                else "no worker has reported yet (a vLLM that never calls build_connector_worker_meta?)"
            )
            + ". Where a failed load ends its request (vLLM's V2 runner), Maru offers loads only while "
            "every worker can place them. Fix: see the workers' log for why one cannot (unsupported KV "
            f"layout, no server connection){or_v1_runner()}"
        )
        logger.warning("Maru: %s", self._withheld_note)
        self._reported_path = None  # report again, with this (``maru doctor``)
        self._report_path()

    @timed_part("get_num_new_matched_tokens/pin")
    def _hold(self, client: Any, req_id: str, keys: list[str]) -> int:
        return self.pins.hold(client, req_id, keys)  # type: ignore[union-attr]

    @timed_part("build_connector_meta/pin")
    def _hold_many(self, client: Any, wants: dict[str, list[str]]) -> None:
        self.pins.hold_many(client, wants)  # type: ignore[union-attr]

    def _pin_step_loads(self) -> None:
        """One lookup-and-pin round trip for every load this step plans whose request holds no
        pins yet (all of them unless pinned at the offer). A failure costs only the pins: the
        worker then looks the chunks up itself."""
        if self.pins is None:
            return
        wants = {}
        for st in self._reqs.values():
            if st.pending_load is not None:
                keys = self._keys_between(st, *st.pending_load)
                if not self.pins.holds_all(st.req_id, keys):  # pinned at the offer or at arrival
                    wants[st.req_id] = list(keys)
        client = self._client if wants else None
        if client is None:
            return
        try:
            self._hold_many(client, wants)
        except MaruError as e:
            for req_id in wants:
                self.pins.drop(req_id)
            self._drop_client(e)

    def on_new_request(self, request: Any) -> None:
        """vLLM's word that ``request`` arrived (``on_new_request``, on the scheduling thread, before
        it is scheduled): its keys and probe now, and the pins of what the probe found posted
        without waiting (``OfferPins.prefetch``), so its offer reads a reply already here. Requests
        arriving together then have their pin round trips in flight together. Never raises."""
        # Only where offers are pinned one at a time (vLLM's V2 runner). Where a step's loads are
        # pinned together (V1) that is one round trip a step already, and posting a lookup per
        # request costs more: 350 against 221 us of scheduler time a new request in real vLLM on
        # an H200 (bench/RESULTS.md, thirty-seventh pass), the step still waiting as long.
        if self.pins is None or not self.pin_at_offer or not self.cfg.pin_on_arrival:
            return
        if not self.cfg.enable_load or not self._workers_ready:
            return  # its offer would be withheld: nothing to pin for it
        self.running_hook = "on_new_request"  # its keys and probe are counted in this hook
        try:
            st = self._state(request)
            if st is None or st.present is not None:
                return
            # vLLM's own hit is not known yet: guessed from what this engine placed lately, and to
            # the block from the requests that finished lately (probed again at the offer if
            # vLLM's real hit is shorter; ``RecentKeys``, ``RecentBlocks``).
            guess = self.recent_keys.leading(st.keys.full) * self.chunk
            blocks = min(self.recent_blocks.leading_tokens(request), self._usable(st.prompt_len))
            guess = max(guess, blocks)
            self._probe(st, guess)
            client = self._client
            keys = [k for k in self._found_keys(st, guess // self.chunk) if k not in self.recent_keys]
            if keys and client is not None:
                self._prefetch(client, st.req_id, keys)
            failing = self.pins.failing_posts()  # type: ignore[union-attr]
            if not self._arrivals or failing != self._posts_failing:
                # The first arrival, or posts started or stopped failing: report the pins' way
                # again (``maru doctor``).
                self._arrivals, self._posts_failing = True, failing
                self._reported_path = None
                self._report_path()
        except Exception:  # never raise into vLLM: the offer pins it the usual way
            logger.exception("Maru: posting the pins of request %s failed", request.request_id)
        finally:
            self.running_hook = None

    @timed_part("on_new_request/post_pins")
    def _prefetch(self, client: Any, req_id: str, keys: list[str]) -> None:
        self.pins.prefetch(client, req_id, keys)  # type: ignore[union-attr]

    @staticmethod
    def _found_keys(st: RequestState, skip: int = 0) -> list[str]:
        """Every key the probe found past the first ``skip`` full chunks (taken as vLLM's own):
        full chunks, and the tails where a run of them ends (any of them may be offered,
        depending on where vLLM's own hit ends)."""
        assert st.present is not None
        keys = [k for k, here in zip(st.keys.full[skip:], st.present[skip:], strict=False) if here]
        return keys + [key for _, key in st.tail_hits.values()]

    def _drop_pins(self, req_id: str) -> None:
        if self.pins is not None:
            self.pins.drop(req_id)

    def _key_at(self, st: RequestState, token: int) -> str:
        """Key of the matched chunk (or tail) holding prompt token ``token`` ("" past the match)."""
        i = token // self.chunk
        hits, tail = st.match
        if i < hits:
            return st.keys.full[i]
        return tail[1] if tail is not None and i == hits else ""

    def _keys_between(self, st: RequestState, begin: int, end: int) -> tuple[str, ...]:
        """Keys of the matched chunks (and tail) a load of prompt tokens ``[begin, end)`` places."""
        return tuple(
            k
            for i in range(begin // self.chunk, -(-end // self.chunk))
            if (k := self._key_at(st, i * self.chunk))
        )

    def _load_transfer(self, st: RequestState) -> RequestTransfer | None:
        assert st.pending_load is not None
        begin, end = st.pending_load
        st.pending_load = None
        hits, tail = st.match
        C = self.chunk
        chunks: list[ChunkRef] = []
        for i in range(begin // C, min(hits, (end + C - 1) // C)):
            s = i * C
            chunks.append(ChunkRef(st.keys.full[i], s, C, max(0, begin - s), min(C, end - s)))
        if end > hits * C:
            if tail is None:  # cannot happen: the offer never exceeds the match
                logger.error("Maru: request %s load plan exceeds its match; not loading", st.req_id)
                return None
            s = hits * C
            chunks.append(ChunkRef(tail[1], s, tail[0], max(0, begin - s), min(tail[0], end - s)))
        self.recent_keys.note(c.key for c in chunks)  # in vLLM's cache after this load
        held, ticket = self.pins.hand_over(st.req_id, [c.key for c in chunks]) if self.pins else ((), "")
        return RequestTransfer(st.req_id, tuple(st.block_ids), tuple(chunks), held, ticket)

    def _plan_async_loads(self, meta: MaruConnectorMetadata, scheduled: set[str]) -> None:
        """Loads of requests vLLM parked in WAITING_FOR_REMOTE_KVS this step (not scheduled)."""
        for st in self._reqs.values():
            if st.pending_load is None or st.req_id in scheduled:
                continue
            begin, end = st.pending_load
            lt = self._load_transfer(st)
            if lt is None or not lt.chunks:
                # Cannot happen (the offer never exceeds the match). The request must still leave
                # the wait: a chunk under an impossible key makes the worker fail it, so vLLM
                # recomputes those tokens instead of waiting for ever.
                lt = RequestTransfer(st.req_id, tuple(st.block_ids), (ChunkRef("", begin, end - begin),))
            meta.async_loads.append(lt)
            st.async_blocks = lt.placed_block_ids(self.block_size)
            self.stats.async_loads_planned += 1

    def _workers_done(self, meta: Any) -> None:
        """Release the offer pins of the loads every worker reported done (``MaruWorkerMeta``)."""
        if self.pins is None:
            return
        if isinstance(meta, MaruWorkerMeta):
            self.pins.worker_done(meta.done)
            self._set_readiness(meta)
        self.pins.expire()
        self.pins.flush(self._client)

    def workers_at_start(self, metas: list[Any]) -> None:
        """The workers' word at engine start (vLLM's handshake metadata, collected after every
        worker registered its KV caches and connected): with every rank ready, offers are made
        from the first request on instead of after the first step's report."""
        merged = MaruWorkerMeta()
        for m in metas:
            if isinstance(m, MaruWorkerMeta):
                merged = merged.aggregate(m)
        self._set_readiness(merged)

    def _set_readiness(self, meta: MaruWorkerMeta) -> None:
        if self.pins is not None and (meta.ready or meta.unready):
            self._readiness = (meta.ready, meta.unready)
            self._workers_ready = meta.unready == 0 and meta.ready >= self.pins.tp_size
