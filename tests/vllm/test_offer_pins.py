"""What the scheduler side offers is pinned until every worker placed it (``maru.vllm.offer_pins``).

Real server and shared-memory pool, the scheduler side with its own client, the worker connector
over CPU caches (block size 32 != 2 KV heads) with a client that counts its LOOKUP round trips.
A load of held chunks must place the same bytes as the source cache wrote, without a lookup; the
pins must hold against eviction pressure and go only after the workers reported the ticket. Both
ways of pinning: once a step for the step's loads (the default), and at each offer
(``pin_at_offer``, where vLLM cannot recompute a failed same-step load).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.kv_ops.testing import CacheCase, naive_token
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import ChunkKeyer, KeySpace
from maru.vllm.metadata import MaruWorkerMeta
from maru.vllm.offer_pins import STALE_S, OfferPins
from maru.vllm.scheduler import MaruSchedulerConnector
from tests.helpers import reported_slow
from tests.pool_fixtures import module_server, stop_worker
from tests.transfer.helpers import CountingPins, bits_equal, case, counting_worker, until_finished
from tests.vllm.helpers import BS, C, blocks_obj, empty_out, new_out, req, tokens

pytest.importorskip("vllm")

from maru.vllm.worker import MaruWorkerConnector  # noqa: E402

server = module_server("offer-pins", pool_size="16M")
HEADS, HEAD = 2, 32
_spaces = iter(range(10**6))


def _keyer() -> ChunkKeyer:
    return ChunkKeyer(KeySpace(f"pins-model-{next(_spaces)}", "", "float32", 3, HEADS, HEAD, C))


def _cache(seed: int, blocks: int = 12) -> CacheCase:
    return case(
        "blocks_first", "HND", seed, block_size=BS, num_kv_heads=HEADS, head_size=HEAD, num_blocks=blocks
    )


def _sched(
    srv: Any, keyer: ChunkKeyer, at_offer: bool = False, **cfg: Any
) -> tuple[MaruSchedulerConnector, MaruHandler]:
    client = MaruHandler(srv.url, timeout_s=5)
    conf = MaruConnectorConfig(server_url=srv.url, kv_chunk_tokens=C, **cfg)
    sched = MaruSchedulerConnector(
        conf, keyer, BS, client_factory=lambda: client, hold_offers=True, pin_at_offer=at_offer
    )
    if at_offer:  # offers wait for every worker's word that it can load: one worker, ready
        sched.update_connector_output(_out(MaruWorkerMeta(ready=1)))
    return sched, client


def _out(meta: MaruWorkerMeta) -> SimpleNamespace:
    return SimpleNamespace(kv_connector_worker_meta=meta, invalid_block_ids=set())


def _worker(srv: Any, cache: CacheCase, **cfg: Any) -> tuple[MaruWorkerConnector, list[CountingPins]]:
    return counting_worker(srv, cache, block_size=BS, chunk=C, **cfg)


@contextlib.contextmanager
def _instance(
    srv: Any, keyer: ChunkKeyer, seed: int, at_offer: bool = False, blocks: int = 12, **cfg: Any
) -> Iterator[tuple[MaruSchedulerConnector, MaruHandler, MaruWorkerConnector, list[CountingPins], CacheCase]]:
    """One instance: its scheduler side (and that side's client), its worker over a random cache
    from ``seed`` (and the worker's counting clients), closed on exit."""
    s, client = _sched(srv, keyer, at_offer=at_offer, **cfg)
    cache = _cache(seed=seed, blocks=blocks)
    w, clients = _worker(srv, cache, **cfg)
    try:
        yield s, client, w, clients, cache
    finally:
        stop_worker(w)
        s.shutdown()
        client.close()


def _store_prompt(
    srv: Any, keyer: ChunkKeyer, toks: list[int], blocks: list[int], present: int = 0
) -> CacheCase:
    """Instance A computes ``toks`` into ``blocks`` of a random cache and stores its chunks and tail
    (those of the ``present`` leading tokens the pool holds already stay as they are)."""
    with _instance(srv, keyer, len(toks) + present) as (s, client, w, _, src):
        r = req("src", toks)
        assert s.get_num_new_matched_tokens(r, 0)[0] == present
        s.update_state_after_alloc(r, blocks_obj(blocks), 0)
        meta = s.build_connector_meta(new_out("src", blocks, 0, len(toks)))
        assert meta.stores
        w.wait_for_save(meta)
        w.flush_stores()
    return src


def _same_tokens(src: CacheCase, sb: list[int], dst: CacheCase, db: list[int], n: int) -> bool:
    for t in range(n):
        s1, s2 = sb[t // BS] * BS + t % BS, db[t // BS] * BS + t % BS
        for layer in range(3):
            for kv in (0, 1):
                if not bits_equal(naive_token(dst, layer, kv, s2), naive_token(src, layer, kv, s1)):
                    return False
    return True


def _pinned(client: MaruHandler) -> int:
    # Asked on the scheduler's own connection: its unpins (sent without waiting) come first.
    return int(client.usage()["pinned"])


SRC_BLOCKS = list(range(10))
DST_BLOCKS = [11, 3, 7, 0, 9, 2, 8, 1, 6, 4]


@pytest.mark.parametrize("mode", ["sync", "sync-pinned-at-offer", "layer-overlap", "async"])
def test_a_held_load_places_the_source_bytes_without_a_lookup_and_its_pins_go_after_the_report(
    server: Any, mode: str
) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=41)
    src = _store_prompt(server, keyer, toks, SRC_BLOCKS)
    cfg: dict[str, Any] = {
        "layer-overlap": {"overlap_load_with_compute": True},
        "async": {"async_load": True, "async_min_load_tokens": 0},
    }.get(mode, {})
    at_offer = mode == "sync-pinned-at-offer"
    with _instance(server, keyer, 99, at_offer=at_offer, **cfg) as (s, client, w, clients, dst):
        r = req("b", toks)
        # Four chunks and the 32-token tail (288 = all but the last token, block-aligned).
        assert s.get_num_new_matched_tokens(r, 0) == (288, mode == "async")
        assert _pinned(client) == (5 if at_offer else 0)  # at the offer, before vLLM allocates
        s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 288)
        so = empty_out() if mode == "async" else new_out("b", DST_BLOCKS, 288, 12)
        meta = s.build_connector_meta(so)
        assert _pinned(client) == 5  # else with the step's plan, in one round trip for all its loads
        (load,) = meta.async_loads if mode == "async" else meta.loads
        assert load.ticket and len(load.held) == 5
        w.start_load_kv(meta)
        if mode == "async":
            until_finished(w, {"b"})
        else:
            for name in w.layer_names:  # the forward: a wait before each attention layer
                w.wait_for_layer_load(name)
            w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == set()
        assert _same_tokens(src, SRC_BLOCKS, dst, DST_BLOCKS, 288)
        assert sum(c.lookups for c in clients) == 0  # no lookup round trip on the worker
        wm = w.build_worker_meta()
        assert wm is not None and wm.done == {load.ticket: 1}
        assert w.build_worker_meta() is None  # reported once
        assert _pinned(client) == 5  # nothing released before the report reaches the scheduler
        s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=wm, invalid_block_ids=set()))
        assert _pinned(client) == 0
        assert s.pins is not None and s.pins.snapshot()["released"] == 1


@pytest.mark.parametrize("at_offer", [False, True])
def test_a_planned_load_survives_eviction_pressure_that_evicts_what_is_not_pinned(
    server: Any, at_offer: bool
) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=42)
    src = _store_prompt(server, keyer, toks, SRC_BLOCKS)
    other = tokens(300, seed=43)
    _store_prompt(server, keyer, other, SRC_BLOCKS)  # the same size, never offered: evictable
    with _instance(server, keyer, 98, at_offer=at_offer) as (s, client, w, _, dst):
        r = req("b", toks)
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)
        meta = None
        if not at_offer:  # pinned with the step's plan: the pressure comes before the worker's load
            s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 288)
            meta = s.build_connector_meta(new_out("b", DST_BLOCKS, 288, 12))
        # Fill the pool: the server evicts every unpinned entry it needs to.
        with MaruHandler(server.url, timeout_s=5) as filler:
            free = int(filler.usage()["data_size"])
            objs = []
            for _ in range(64):
                try:
                    objs += filler.batch_alloc([free // 64])
                except Exception:
                    break
            full_o = s.keyer.prompt_keys(other).full
            assert not any(filler.exists(full_o))  # the other prompt was evicted ...
            filler.abort(objs)
        if meta is None:
            s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 288)
            meta = s.build_connector_meta(new_out("b", DST_BLOCKS, 288, 12))
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == set()  # ... the offered one loads whole
        assert _same_tokens(src, SRC_BLOCKS, dst, DST_BLOCKS, 288)


@pytest.mark.parametrize("gone", ["chunk 2", "its own tail"])
def test_a_chunk_gone_between_probe_and_offer_cuts_the_offer_and_is_stored_again(
    server: Any, gone: str
) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=44)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    s, client = _sched(server, keyer, at_offer=True)
    try:
        r = req("b", toks)
        st = s._state(r)
        s._probe(st, 0)  # what the probe found: four chunks and the tail
        assert st.present == [True] * 4 and st.own_tail is not None and st.own_tail_present
        key, offer = (st.keys.full[2], 128) if gone == "chunk 2" else (st.own_tail[1], 256)
        client.delete([key])  # evicted before vLLM asks
        assert s.get_num_new_matched_tokens(r, 0) == (offer, False)  # the chunks before it only
        # What was pinned past the cut (chunk 3 and the tail) was released again.
        assert _pinned(client) == offer // C
        s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), offer)
        meta = s.build_connector_meta(new_out("b", DST_BLOCKS, offer, 300 - offer))
        assert [c.key for c in meta.loads[0].chunks] == st.keys.full[: offer // C]
        assert key in [c.key for rt in meta.stores for c in rt.chunks]  # refilled when computed
    finally:
        s.shutdown()
        client.close()


def test_pins_of_an_offer_never_handed_over_go_with_the_request(server: Any) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=45)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    s, client = _sched(server, keyer, at_offer=True)
    try:
        r = req("b", toks)
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)  # asked again: the same pins
        assert s.pins is not None and s.pins.stats.pin_trips == 1
        assert _pinned(client) == 5
        s.request_finished(r, [])  # aborted while waiting for blocks
        s.build_connector_meta(empty_out())
        assert _pinned(client) == 0
        # vLLM took none of an offer: released too.
        r2 = req("c", toks)
        assert s.get_num_new_matched_tokens(r2, 0) == (288, False)
        s.update_state_after_alloc(r2, blocks_obj(DST_BLOCKS), 0)
        s.build_connector_meta(empty_out())
        assert _pinned(client) == 0
    finally:
        s.shutdown()
        client.close()


@pytest.mark.parametrize("at_offer", [False, True])
def test_pins_handed_to_a_load_of_a_lost_plan_go_at_once(
    server: Any, monkeypatch: Any, at_offer: bool
) -> None:
    """A step whose planning raised after a load took its pins: the load goes to the workers failing
    (``_failed_plan``), no worker reports its ticket, so its pins go with the lost plan, not after
    ``STALE_S``."""
    keyer = _keyer()
    toks = tokens(300, seed=46)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    s, client = _sched(server, keyer, at_offer=at_offer)
    try:
        r = req("a", toks)
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)
        s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 288)

        def broken(*a: Any, **k: Any) -> Any:
            raise RuntimeError("a bug after the load was planned")

        monkeypatch.setattr(s, "_plan_stores", broken)
        meta = s.build_connector_meta(new_out("a", DST_BLOCKS, 288, 12))
        (lt,) = meta.loads
        assert [c.key for c in lt.chunks] == [""] and not lt.ticket  # failing, no pins with it
        assert s.pins is not None and s.pins.stats.handed_now == 0
        assert _pinned(client) == 0
    finally:
        s.shutdown()
        client.close()


def test_a_chunk_gone_before_the_step_is_pinned_fails_only_that_load_and_releases_every_pin(
    server: Any,
) -> None:
    keyer = _keyer()
    toks, other = tokens(300, seed=46), tokens(300, seed=47)
    src = _store_prompt(server, keyer, toks, SRC_BLOCKS)
    src2 = _store_prompt(server, keyer, other, SRC_BLOCKS)
    with _instance(server, keyer, 97) as (s, client, w, clients, dst):
        ra, rb = req("a", toks), req("b", other)
        assert s.get_num_new_matched_tokens(ra, 0) == (288, False)
        assert s.get_num_new_matched_tokens(rb, 0) == (288, False)
        client.delete([s._reqs["a"].keys.full[1]])  # evicted after the offer, before the step
        # a's table is b's blocks in another order: a placed nothing (all or nothing per request),
        # or b's bytes would not all be b's.
        blocks_b = [5, 10, 11, 6, 4, 2, 8, 1, 3]
        blocks_a = list(reversed(blocks_b))
        s.update_state_after_alloc(ra, blocks_obj(blocks_a + [7]), 288)
        s.update_state_after_alloc(rb, blocks_obj(blocks_b + [7]), 288)
        so = new_out("a", blocks_a + [7], 288, 12)
        so.scheduled_new_reqs += new_out("b", blocks_b + [7], 288, 12).scheduled_new_reqs
        so.num_scheduled_tokens["b"] = 12
        meta = s.build_connector_meta(so)
        assert s.pins is not None and s.pins.stats.pin_trips == 1  # both loads in one round trip
        held = {lt.req_id: len(lt.held) for lt in meta.loads}
        assert held == {"a": 4, "b": 5}
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        # a's missing chunk was looked up by the worker (the only lookup), found gone: a is
        # recomputed; b loaded whole from its pins.
        assert sum(c.lookups for c in clients) == 1
        assert w.get_block_ids_with_load_errors() == set(meta.loads[0].placed_block_ids(BS))
        assert _same_tokens(src2, SRC_BLOCKS, dst, blocks_b + [7], 288)
        wm = w.build_worker_meta()
        assert wm is not None and len(wm.done) == 2
        s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=wm, invalid_block_ids=set()))
        assert _pinned(client) == 0
        del src


def test_a_worker_that_lost_its_connection_reconnects_at_once_for_a_held_load(server: Any) -> None:
    """After a lost connection the worker waits 10 s before reconnecting; a load the scheduler just
    pinned proves the server is up, so it reconnects at once and loads (a failed same-step load
    would end the request on vLLM's V2 runner)."""
    keyer = _keyer()
    toks = tokens(300, seed=49)
    src = _store_prompt(server, keyer, toks, SRC_BLOCKS)
    with _instance(server, keyer, 96) as (s, client, w, clients, dst):
        w._lost("a test: the server went away")
        assert w.engine is None and w._engine_or_why() == "maru server not reachable"  # backing off
        r = req("b", toks)
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)
        s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 288)
        meta = s.build_connector_meta(new_out("b", DST_BLOCKS, 288, 12))
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == set() and len(clients) == 2
        assert _same_tokens(src, SRC_BLOCKS, dst, DST_BLOCKS, 288)


def test_where_a_failed_load_ends_its_request_offers_wait_until_every_rank_can_load(
    server: Any, caplog: Any
) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=50)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    client = MaruHandler(server.url, timeout_s=5)
    conf = MaruConnectorConfig(server_url=server.url, kv_chunk_tokens=C)
    s = MaruSchedulerConnector(
        conf, keyer, BS, tp_size=1, client_factory=lambda: client, hold_offers=True, pin_at_offer=True
    )
    try:
        r = req("b", toks)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # no worker has said so yet
        s.update_connector_output(_out(MaruWorkerMeta(ready=1)))
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)
        s.request_finished(r, [])
        s.update_connector_output(_out(MaruWorkerMeta(unready=1)))  # e.g. lost its connection
        assert s.get_num_new_matched_tokens(req("c", toks), 0) == (0, False)
        assert s.stats.offers_withheld == 2 and _pinned(client) == 0
        with caplog.at_level("WARNING", logger="maru.vllm"):
            for i in range(70):
                s.get_num_new_matched_tokens(req(f"d{i}", toks), 0)
        [said] = [r.getMessage() for r in caplog.records if "computed instead of loaded" in r.getMessage()]
        assert "1 of 1 workers cannot load now" in said and "Fix:" in said
        # ... and `maru doctor` shows it: the scheduler reports it as a slow path.
        assert [n for v in reported_slow(server).values() for n in v if "computed instead of loaded" in n]
        # Two ranks: both must say so.
        assert s.pins is not None
        s.pins.tp_size = 2
        s.update_connector_output(_out(MaruWorkerMeta(ready=1).aggregate(MaruWorkerMeta(unready=1))))
        assert s.get_num_new_matched_tokens(req("e", toks), 0) == (0, False)
    finally:
        s.shutdown()


def test_a_worker_says_whether_it_can_load_only_where_a_failed_load_ends_its_request(server: Any) -> None:
    dst = _cache(seed=95)
    w, _ = _worker(server, dst)
    try:
        assert w.build_worker_meta() is None  # nothing to say: vLLM recomputes a failed load
        w.cfg = dataclasses.replace(w.cfg, load_failures_fail="test")
        m = w.build_worker_meta()
        assert m is not None and (m.ready, m.unready) == (1, 0)
        w._lost("a test")  # backing off: it cannot load until it reconnects
        m = w.build_worker_meta()
        assert m is not None and (m.ready, m.unready) == (0, 1)
        w.disabled_reason = "unsupported KV-cache layout (a test)"
        m = w.build_worker_meta()
        assert m is not None and (m.ready, m.unready) == (0, 1)
    finally:
        w.disabled_reason = None
        stop_worker(w)


def test_a_handed_over_set_waits_for_every_rank_and_a_finished_request_does_not_release_it(
    server: Any,
) -> None:
    keys = [f"pins-tp/{i}" for i in range(3)]
    rank = [f"{k}@{r}" for k in keys for r in range(2)]
    with MaruHandler(server.url, timeout_s=5) as w:
        objs = w.batch_alloc([64] * len(rank))
        for o in objs:
            o.buf[:] = b"\1" * 64
        w.batch_store(rank, objs)
    with MaruHandler(server.url, timeout_s=5) as client:
        pins = OfferPins(tp_size=2)
        assert pins.hold(client, "r", keys) == 3
        assert _pinned(client) == 6
        held, ticket = pins.hand_over("r", keys[:2])
        assert sorted(h.key for h in held) == sorted(rank[:4])
        looked = client.batch_retrieve([h.key for h in held], pin=False, verify=False)
        assert [(h.offset, h.size, h.checksum) for h in held] == [
            (x.offset, x.size, x.checksum) for x in looked
        ]
        pins.drop("r")  # the request finished: its workers may still be reading
        pins.flush(client)
        assert _pinned(client) == 6
        merged = MaruWorkerMeta({ticket: 1}).aggregate(MaruWorkerMeta({ticket: 1, "other#1": 1}))
        pins.worker_done(MaruWorkerMeta({ticket: 1}).done)  # one rank of two
        pins.flush(client)
        assert _pinned(client) == 6
        pins.worker_done({ticket: merged.done[ticket] - 1})  # the second rank
        pins.flush(client)
        assert _pinned(client) == 0  # the third key rode along with the ticket


def test_a_ticket_no_worker_reports_is_released_by_the_stale_guard(server: Any, caplog: Any) -> None:
    with MaruHandler(server.url, timeout_s=5) as w:
        (o,) = w.batch_alloc([64])
        o.buf[:] = b"\2" * 64
        w.batch_store(["pins-stale/0"], [o])
    with MaruHandler(server.url, timeout_s=5) as client:
        pins = OfferPins()
        assert pins.hold(client, "r", ["pins-stale/0"]) == 1
        _, ticket = pins.hand_over("r", ["pins-stale/0"])
        pins.expire()
        pins.flush(client)
        assert _pinned(client) == 1
        with caplog.at_level("WARNING", logger="maru.vllm"):
            pins.expire(now=10**9 + STALE_S)
        pins.flush(client)
        assert _pinned(client) == 0
        assert ticket in caplog.text and pins.snapshot()["stale"] == 1


def test_requests_sharing_a_prefix_pin_it_once_and_it_stays_pinned_until_the_last_lets_go(
    server: Any,
) -> None:
    """Three requests arrive together: a and b share a 3-chunk head, c is a's prompt again. The
    head is pinned once (a's round trip); b's trip asks for its own chunks only, c's offer is all
    shared (no trip). Each release keeps what another set still refers to."""
    keyer = _keyer()
    head = tokens(3 * C, seed=52)
    ta, tb = head + tokens(100, seed=53), head + tokens(100, seed=54)
    _store_prompt(server, keyer, ta, SRC_BLOCKS)
    _store_prompt(server, keyer, tb, SRC_BLOCKS, present=len(head))
    s, client = _sched(server, keyer, at_offer=True)
    try:
        offer = (len(ta) - 1) // BS * BS  # 3 head chunks, chunk 3 and a 32-token tail
        ra, rb, rc = req("a", ta), req("b", tb), req("c", ta)
        assert s.get_num_new_matched_tokens(ra, 0) == (offer, False)
        assert s.pins is not None and s.pins.stats.pin_trips == 1
        assert s.pins.snapshot()["pin_trip_ms"] > 0.0  # the round trip's wall time is counted
        assert s.get_num_new_matched_tokens(rb, 0) == (offer, False)
        assert s.pins.stats.pin_trips == 2 and s.pins.stats.pins_shared == 3  # b asked for 2 keys
        assert s.get_num_new_matched_tokens(rc, 0) == (offer, False)
        assert s.pins.stats.pin_trips == 2 and s.pins.stats.pins_shared == 8  # c: all of a's 5
        assert _pinned(client) == 7  # the head's 3, a's 2, b's 2: each once
        # Every set hands over the same locations for a shared key.
        keys_a = s._keys_between(s._reqs["a"], 0, offer)
        held_a, ticket_a = s.pins.hand_over("a", keys_a)
        held_c, ticket_c = s.pins.hand_over("c", keys_a)
        assert held_a == held_c and len(held_a) == 5 and ticket_a != ticket_c
        looked = client.batch_retrieve([h.key for h in held_a], pin=False, verify=False)
        assert [(h.offset, h.size, h.checksum) for h in held_a] == [
            (x.offset, x.size, x.checksum) for x in looked
        ]
        s.request_finished(rb, [])  # b never loaded: its own 2 go, the head stays (a, c read it)
        s.build_connector_meta(empty_out())
        assert _pinned(client) == 5
        s.update_connector_output(_out(MaruWorkerMeta({ticket_a: 1}, ready=1)))
        assert _pinned(client) == 5  # c's workers may still read every one of a's chunks
        s.update_connector_output(_out(MaruWorkerMeta({ticket_c: 1}, ready=1)))
        assert _pinned(client) == 0 and s.pins.snapshot()["pinned_now"] == 0
    finally:
        s.shutdown()
        client.close()


def test_a_step_pins_a_key_its_loads_share_once_and_both_load_from_it(server: Any) -> None:
    """Once-a-step pinning (V1): two loads of one step sharing a head ask the server for each key
    once; both place the source bytes from the shared pins, with no worker lookup."""
    keyer = _keyer()
    head = tokens(3 * C, seed=55)
    ta, tb = head + tokens(100, seed=56), head + tokens(100, seed=57)
    src_a = _store_prompt(server, keyer, ta, SRC_BLOCKS)
    src_b = _store_prompt(server, keyer, tb, SRC_BLOCKS, present=len(head))  # b's own part only
    offer = (len(ta) - 1) // BS * BS
    with _instance(server, keyer, 94, blocks=20) as (s, client, w, clients, dst):
        ra, rb = req("a", ta), req("b", tb)
        assert s.get_num_new_matched_tokens(ra, 0) == (offer, False)
        assert s.get_num_new_matched_tokens(rb, 0) == (offer, False)
        blocks_a = [0, 2, 4, 6, 8, 10, 12, 14, 16, 18]  # 292 tokens: 10 blocks each
        blocks_b = [19, 17, 15, 13, 11, 9, 7, 5, 3, 1]
        s.update_state_after_alloc(ra, blocks_obj(blocks_a), offer)
        s.update_state_after_alloc(rb, blocks_obj(blocks_b), offer)
        so = new_out("a", blocks_a, offer, len(ta) - offer)
        so.scheduled_new_reqs += new_out("b", blocks_b, offer, len(tb) - offer).scheduled_new_reqs
        so.num_scheduled_tokens["b"] = len(tb) - offer
        meta = s.build_connector_meta(so)
        assert s.pins is not None and s.pins.stats.pin_trips == 1 and s.pins.stats.pins_shared == 3
        assert _pinned(client) == 7
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == set()
        assert sum(c.lookups for c in clients) == 0
        assert _same_tokens(src_a, SRC_BLOCKS, dst, blocks_a, offer)
        n = len(head)  # b's head is the head a stored, the rest b's own
        assert _same_tokens(src_a, SRC_BLOCKS, dst, blocks_b, n)
        assert _same_tokens(src_b, SRC_BLOCKS[n // BS :], dst, blocks_b[n // BS :], offer - n)
        wm = w.build_worker_meta()
        assert wm is not None and len(wm.done) == 2
        s.update_connector_output(_out(wm))
        assert _pinned(client) == 0


def test_shared_pins_lost_with_a_server_restart_are_pinned_anew_and_never_unpinned_by_old_holders(
    tmp_path: Any,
) -> None:
    """Two requests share the pins of three keys; the server restarts (the session and its pins go).
    A third request asks again (a new round trip, new pins); the first request's hand-over holds
    nothing (its worker looks the chunks up); dropping the second request lets go of the dead pins
    only, never the third request's live ones."""
    import time

    from maru.demo.server import ServerProcess

    keys = [f"pins-restart/{i}" for i in range(3)]
    with ServerProcess(tmp_path, pool_size="16M") as srv:
        client = MaruHandler(srv.url, timeout_s=2.0, heartbeat_interval_s=0.1)
        try:

            def store() -> None:
                objs = client.batch_alloc([64] * len(keys))
                for o in objs:
                    o.buf[:] = b"\3" * 64
                client.batch_store(keys, objs)

            store()
            pins = OfferPins()
            assert pins.hold(client, "r1", keys) == 3 and pins.hold(client, "r2", keys) == 3
            assert pins.stats.pin_trips == 1 and _pinned(client) == 3
            srv.restart()
            deadline = time.monotonic() + 10
            while pins._open["r1"][keys[0]].handle.valid:  # the heartbeat notices the new server
                assert time.monotonic() < deadline, "the client never noticed the restart"
                time.sleep(0.05)
            if not all(client.exists(keys)):
                store()  # the new server keeps no state here
            assert pins.hold(client, "r3", keys) == 3 and pins.stats.pin_trips == 2
            assert _pinned(client) == 3
            assert pins.hand_over("r1", keys) == ((), "")
            pins.drop("r2")
            pins.flush(client)
            assert _pinned(client) == 3  # r3's pins are live
            pins.drop("r3")
            pins.flush(client)
            assert _pinned(client) == 0 and pins.snapshot()["pinned_now"] == 0
        finally:
            client.close()
