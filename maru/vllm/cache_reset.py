"""The scheduler side's cache resets and the loads it must fail (mixed into ``MaruSchedulerConnector``).

vLLM resets its caches, and asks the connector to reset its one, around a weight update
(``LLM.reset_prefix_cache(reset_connector=True)``, ``sleep`` at level 1 or 2,
``pause_generation(clear_cache=True)``): what was stored before may then be KV of weights this
engine no longer runs. The pool is shared and other instances may still run those weights, so
nothing is deleted; the engine moves to a fresh key epoch instead (``reset_cache``).

A load vLLM accepted counts its tokens as computed: it must reach the workers, loaded or failed,
never be left out. So a load accepted by a request the reset froze, one pending at the reset, and
every load of a step whose planning raised go to the workers as a chunk under an impossible key,
which they fail (``FailingLoads``): vLLM recomputes those tokens, or ends the request where it
cannot (its V2 runner).

Invariants: a frozen request is never loaded for nor stored from again (``_state`` does not hand
it out, ``_plan_stores`` skips it); it is forgotten, and keyed afresh, only when vLLM asks about it
again with nothing of it computed (everything it holds from then on is computed after the reset);
its write-behind bookkeeping (``sending``, the delayed free) is kept until then.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Callable
from typing import Any

from maru.transfer.records import ChunkRef, RequestTransfer
from maru.vllm.keys import ChunkKeyer
from maru.vllm.metadata import MaruConnectorMetadata
from maru.vllm.scheduler_state import RequestState, SchedulerStats

logger = logging.getLogger("maru.vllm")

Accepted = tuple[RequestState, int, int]  # (request, first token, end token) of a load vLLM accepted


class CacheResets:
    """``reset_cache``, the re-keying of a frozen request, and the loads planned to fail."""

    # Set by MaruSchedulerConnector.__init__ (or its other mixins).
    cfg: Any
    keyer: ChunkKeyer
    block_size: int
    stats: SchedulerStats
    _reqs: dict[str, RequestState]
    _offered: list[Accepted]
    _doomed: list[Accepted]
    _reported_path: str | None
    _recent: Any  # deque of per-step records (req_id, blocks, planned chunks, tail planned)
    _admission: Any
    _waits: Any

    _use_keys: Callable[[ChunkKeyer], None]
    _drop_pins: Callable[[str], None]
    _report_path: Callable[[], None]

    def reset_cache(self) -> bool:
        """vLLM reset its caches and the connector's (see the module). From here on this engine:

        - keys under a fresh random epoch (``KeySpace.epoch``): it never offers what was stored
          before, and what it stores is found by itself only, never by an instance that did not
          reset with it (it would hold these weights' KV);
        - neither loads for nor stores from a request alive now (``RequestState.frozen``): vLLM
          may keep one running across the reset (when its own reset failed), its KV partly from
          before; a load pending for one is planned to fail.

        Keys remembered by vLLM's block hash are dropped (a block's hash is the same under new
        weights), and the guesses of vLLM's own hit. Returns True, as vLLM expects of a reset that
        took effect."""
        space = dataclasses.replace(self.keyer.space, epoch=secrets.token_hex(8))
        self._use_keys(ChunkKeyer(space))
        frozen = self._freeze(lambda st: True)
        self.stats.cache_resets += 1
        self._reported_path = None  # report again, with the epoch (``maru stats``)
        self._report_path()
        logger.warning(
            "Maru: vLLM reset its caches and the connector's (a weight update, a sleep or "
            "reset_prefix_cache(reset_connector=True)): this engine's keys move to epoch %s (%s...). It "
            "no longer loads anything stored before the reset, nor shares what it stores from now on "
            "with instances that did not reset with it; the %d requests alive now are computed and "
            "not stored until vLLM computes them afresh. Sharing with the others again needs a "
            "restart (every engine starts in one epoch per model).",
            space.epoch,
            space.prefix(),
            frozen,
        )
        return True

    def _freeze(self, which: Callable[[RequestState], bool]) -> int:
        """Freeze the live requests ``which`` picks: never loaded for nor stored from again; a load
        pending for one is planned to fail. Returns how many were frozen now."""
        frozen = 0
        for st in self._reqs.values():
            if st.frozen or not which(st):
                continue
            st.frozen = True
            frozen += 1
            if st.pending_load is not None:
                self._doomed.append((st, *st.pending_load))
                st.pending_load = None
            self._drop_pins(st.req_id)  # pins handed over with a load wait for the workers
        # A load accepted this step is now doomed, not also due to fail with a lost plan (twice).
        self._offered = [a for a in self._offered if not a[0].frozen]
        self.stats.requests_frozen += frozen
        return frozen

    def _stop_changed_adapters(self, adapters: list[bytes]) -> None:
        """Freeze the live requests of LoRA adapters whose files changed (``AdapterDigests``): vLLM
        may compute the rest of them with the other version."""
        for d in adapters:
            n = self._freeze(lambda st, d=d: st.adapter == d)  # type: ignore[misc]
            self.stats.adapters_changed += 1
            logger.warning("Maru: %d live requests of that adapter are computed by vLLM from now on", n)

    def _rekey_if_fresh(self, req_id: str, num_computed_tokens: int) -> None:
        """Forget a frozen request that vLLM asks about again with nothing of it computed (a request
        that waited through the reset, or one the reset preempted): all it will hold is computed
        from now on, so it is keyed afresh, under the new epoch. vLLM asks only about waiting
        requests: one that ran (its write-behind ``sending`` set) was preempted, and vLLM reports
        that preemption in this step's or an earlier step's plan, whose barrier drops its stores
        on the worker before this step's run: no delayed free is owed for it any more (a request
        vLLM asks about before that plan still has ``sending`` set here; the fresh state has not).
        One with an async load in flight, or a failing load still to be planned, stays frozen."""
        st = self._reqs.get(req_id)
        if st is None or not st.frozen or num_computed_tokens or st.async_blocks:
            return
        if any(a[0] is st for a in self._doomed):
            return  # its failing load is still to be planned
        del self._reqs[req_id]
        self._admission.finish(req_id)
        self._waits.end(req_id)
        for record in self._recent:  # the old state's stores and loads: not the new state's
            record[:] = [r for r in record if r[0] != req_id]
        self.stats.requests_rekeyed += 1

    def _failing(self, accepted: list[Accepted], meta: MaruConnectorMetadata) -> int:
        """Add to ``meta`` a load the workers fail for each accepted load of a live request (a chunk
        under an impossible key, placing the accepted tokens: their blocks are reported failed, so
        vLLM recomputes them). Returns how many."""
        n, seen = 0, set()
        for st, begin, end in accepted:
            if self._reqs.get(st.req_id) is not st or st.req_id in seen:
                continue  # finished (or forgotten) since: vLLM no longer waits for it; or listed twice
            seen.add(st.req_id)
            lt = RequestTransfer(st.req_id, tuple(st.block_ids), (ChunkRef("", begin, end - begin),))
            st.pending_load = None
            self._drop_pins(st.req_id)  # what the offer pinned is not read
            if self.cfg.async_load:
                meta.async_loads.append(lt)
                st.async_blocks = lt.placed_block_ids(self.block_size)
            else:
                meta.loads.append(lt)
            n += 1
        return n

    def _failed_plan(self) -> MaruConnectorMetadata:
        """The plan of a step whose planning raised: every load vLLM accepted this step, and every
        one already due to fail, planned to fail (``_failing``). Nothing is stored. Never raises: if
        even that fails, the bare failing loads, built with nothing else."""
        meta = MaruConnectorMetadata()
        accepted, self._doomed = self._offered + self._doomed, []
        try:
            self._failing(accepted, meta)
        except Exception:
            logger.exception("Maru: planning the failed step's loads to fail failed; bare failing loads")
            meta = MaruConnectorMetadata()
            for st, begin, end in accepted:
                lt = RequestTransfer(st.req_id, tuple(st.block_ids), (ChunkRef("", begin, end - begin),))
                (meta.async_loads if self.cfg.async_load else meta.loads).append(lt)
        return meta
