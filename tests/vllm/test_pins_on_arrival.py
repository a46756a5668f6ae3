"""Offer pins posted when a request arrives (vLLM's ``on_new_request``; ``OfferPins.prefetch``).

Real server and pool, the scheduler side with its own client, the worker over CPU caches (block
size 32 != 2 KV heads). A request announced at arrival must be offered, loaded and released exactly
as one pinned at its offer, with no round trip waited for at the offer; requests arriving together
must have their posts in flight together; a request gone before its post is read, a chunk gone
before the post reached the server, and a post that failed must each leave the right pins and no
others.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from maru.vllm.metadata import MaruWorkerMeta
from tests.vllm.helpers import BS, C, blocks_obj, empty_out, new_out, req, tokens
from tests.vllm.test_offer_pins import (
    DST_BLOCKS,
    SRC_BLOCKS,
    _instance,
    _keyer,
    _out,
    _pinned,
    _same_tokens,
    _sched,
    _store_prompt,
)
from tests.vllm.test_offer_pins import server as server  # noqa: F401 - the module's fixture

pytest.importorskip("vllm")


@contextlib.contextmanager
def _scheduler(server: Any, keyer: Any, **cfg: Any) -> Iterator[tuple[Any, Any]]:
    """A scheduler side pinning at each offer (vLLM's V2 runner) and its client, closed on exit."""
    s, client = _sched(server, keyer, at_offer=True, **cfg)
    try:
        yield s, client
    finally:
        s.shutdown()
        client.close()


def _until_unpinned(s: Any, client: Any) -> None:
    deadline = time.monotonic() + 10
    while _pinned(client):
        assert time.monotonic() < deadline, "posted pins of a request that went were never released"
        s.pins.flush(client)
        time.sleep(0.02)


@pytest.mark.parametrize("at_offer", [False, True])
def test_a_request_pinned_at_arrival_is_offered_and_loaded_with_no_round_trip_waited_for(
    server: Any, at_offer: bool
) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=61)
    src = _store_prompt(server, keyer, toks, SRC_BLOCKS)
    # log_timing: the hooks' parts are timed (the arrival's probe is read from them below).
    with _instance(server, keyer, 97, at_offer=at_offer, log_timing=True) as (s, client, w, clients, dst):
        r = req("b", toks)
        s.on_new_request(r)
        assert s.pins is not None
        stats = s.pins.stats
        # Posted only where offers are pinned one at a time (V2): 4 chunks and the tail. Where a
        # step's loads share one round trip (V1), nothing is posted.
        assert (stats.pin_posts, stats.pins_posted) == ((1, 5) if at_offer else (0, 0))
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)
        s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 288)
        meta = s.build_connector_meta(new_out("b", DST_BLOCKS, 288, 12))
        assert stats.pin_trips == (0 if at_offer else 1)  # none waited for at the offer (V2)
        assert _pinned(client) == 5
        (load,) = meta.loads
        assert load.ticket and len(load.held) == 5
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        assert w.get_block_ids_with_load_errors() == set()
        assert _same_tokens(src, SRC_BLOCKS, dst, DST_BLOCKS, 288)
        assert sum(c.lookups for c in clients) == 0
        wm = w.build_worker_meta()
        assert wm is not None
        s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=wm, invalid_block_ids=set()))
        assert _pinned(client) == 0
        parts = s.hook_times.as_dict()  # the arrival's keys and probe count in its own hook
        if at_offer:
            assert parts["on_new_request/probe"]["calls"] == 1
            assert parts["on_new_request/post_pins"]["calls"] == 1
            assert "get_num_new_matched_tokens/probe" not in parts
        else:
            assert "on_new_request/probe" not in parts and s.offer_pins_mode.startswith("per step")


def test_requests_arriving_together_have_their_posts_in_flight_together_and_share_their_head(
    server: Any,
) -> None:
    keyer = _keyer()
    head = tokens(3 * C, seed=62)
    prompts = [head + tokens(100, seed=63 + i) for i in range(3)]
    _store_prompt(server, keyer, prompts[0], SRC_BLOCKS)
    for p in prompts[1:]:
        _store_prompt(server, keyer, p, SRC_BLOCKS, present=len(head))
    with _scheduler(server, keyer) as (s, client):
        reqs = [req(f"r{i}", p) for i, p in enumerate(prompts)]
        for r in reqs:  # all arrive before the first is scheduled
            s.on_new_request(r)
        assert s.pins is not None
        stats = s.pins.stats
        # The head's 3 keys are posted once (the first request's post, sent at once: nothing was in
        # flight); the others wait for it, and their own keys are queued for one post together.
        assert stats.pin_posts == 1 and stats.pins_posted == 5
        assert s.pins.snapshot()["posts_unread"] == 1 and s.pins.snapshot()["posts_queued"] == 2
        offer = (len(prompts[0]) - 1) // BS * BS
        for r in reqs:  # the first offer sends the queue (the others' reply comes meanwhile)
            assert s.get_num_new_matched_tokens(r, 0) == (offer, False)
        assert stats.pin_posts == 2 and stats.pins_posted == 5 + 2 + 2
        assert stats.pin_trips == 0 and stats.posts_failed == 0
        # The first offer read the first post, the second the shared one (the third's too).
        assert stats.post_reads == 2 and stats.post_read_ms > 0
        # (How many offers found their reply still on its way is timing: bench/, not asserted.)
        assert s.pins.snapshot()["posts_unread"] == 0
        assert _pinned(client) == 3 + 2 * 3  # every key once
        held = [
            s.pins.hand_over(r.request_id, s._keys_between(s._reqs[r.request_id], 0, offer)) for r in reqs
        ]
        heads = [{h.key: h for h in hs[0][:3]} for hs in held]
        assert heads[0] == heads[1] == heads[2]  # one pin, one location, for the shared head
        s.update_connector_output(_out(MaruWorkerMeta({t: 1 for _, t in held}, ready=1)))
        assert _pinned(client) == 0


def _burst(server: Any, keyer: Any, n: int, seed: int) -> tuple[list[list[int]], int]:
    """``n`` prompts sharing a 3-chunk head, each with a tail of its own, all stored; the offer each
    gets (every usable token)."""
    head = tokens(3 * C, seed=seed)
    prompts = [head + tokens(100, seed=seed + 1 + i) for i in range(n)]
    _store_prompt(server, keyer, prompts[0], SRC_BLOCKS)
    for p in prompts[1:]:
        _store_prompt(server, keyer, p, SRC_BLOCKS, present=len(head))
    return prompts, (len(prompts[0]) - 1) // BS * BS


def test_a_burst_of_arrivals_shares_a_few_posts_and_every_request_is_offered_and_released(
    server: Any, monkeypatch: Any
) -> None:
    from maru.vllm import load_plan
    from maru.vllm.offer_pins import POST_BATCH

    monkeypatch.setattr(load_plan, "WAKE_GAP_S", 0.0)  # a wake-up allowed before every arrival
    keyer = _keyer()
    n = POST_BATCH + 2
    prompts, offer = _burst(server, keyer, n, seed=130)
    with _scheduler(server, keyer) as (s, client):
        assert s.connect_now()  # as at engine start
        reqs = [req(f"r{i}", p) for i, p in enumerate(prompts)]
        for r in reqs:
            s.on_new_request(r)
        assert s.pins is not None
        # Only the first arrival wakes the server: the later ones find a post in flight or queued.
        assert s.stats.server_wakes == 1
        stats = s.pins.stats
        # The first at once, the next POST_BATCH together when the batch filled, the last queued.
        assert (stats.pin_posts, stats.pins_posted) == (2, 5 + 2 * POST_BATCH)
        assert s.pins.snapshot()["posts_queued"] == 1
        for r in reqs:
            assert s.get_num_new_matched_tokens(r, 0) == (offer, False)
        assert (stats.pin_posts, stats.pins_posted) == (3, 5 + 2 * (n - 1))
        assert stats.pin_trips == 0 and stats.posts_failed == 0 and stats.offers_cut == 0
        assert _pinned(client) == 3 + 2 * n  # every key once, the head shared
        held = []
        for r in reqs:
            s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), offer)
            hs, ticket = s.pins.hand_over(r.request_id, s._keys_between(s._reqs[r.request_id], 0, offer))
            assert [h.key for h in hs] == list(s._keys_between(s._reqs[r.request_id], 0, offer))
            held.append(ticket)
        s.update_connector_output(_out(MaruWorkerMeta({t: 1 for t in held}, ready=1)))
        assert _pinned(client) == 0 and s.pins.snapshot()["pinned_now"] == 0


def test_queued_arrivals_are_posted_at_the_next_step_even_with_no_offer(server: Any) -> None:
    keyer = _keyer()
    prompts, _ = _burst(server, keyer, 2, seed=140)
    with _scheduler(server, keyer) as (s, client):
        reqs = [req(f"r{i}", p) for i, p in enumerate(prompts)]
        for r in reqs:
            s.on_new_request(r)
        assert s.pins is not None and s.pins.snapshot()["posts_queued"] == 1
        s.build_connector_meta(empty_out())  # vLLM scheduled neither this step
        assert s.pins.stats.pin_posts == 2 and s.pins.snapshot()["posts_queued"] == 0
        for r in reqs:  # both abort: what their posts pinned goes back once read
            s.request_finished(r, [])
        s.build_connector_meta(empty_out())
        _until_unpinned(s, client)
        assert s.pins.snapshot()["pinned_now"] == 0


def test_a_queued_post_that_cannot_be_sent_leaves_its_requests_to_pin_at_their_offers(server: Any) -> None:
    keyer = _keyer()
    prompts, offer = _burst(server, keyer, 3, seed=150)
    with _scheduler(server, keyer) as (s, client):
        post = client.post_lookup
        calls: list[int] = []

        def second_not_sent(keys: list[str], **kw: Any) -> Any:
            calls.append(len(keys))
            return post(keys, **kw) if len(calls) == 1 else None  # disconnected at the second

        client.post_lookup = second_not_sent  # type: ignore[method-assign]
        reqs = [req(f"r{i}", p) for i, p in enumerate(prompts)]
        for r in reqs:
            s.on_new_request(r)
        assert s.pins is not None
        for r in reqs:
            assert s.get_num_new_matched_tokens(r, 0) == (offer, False)
        assert calls == [5, 4]  # the first request's keys, then the two others' tails together
        # The first read its post; the two others pinned their own tails at their offers (the
        # head: the first's pin, shared).
        assert s.pins.stats.pin_posts == 1 and s.pins.stats.pin_trips == 2
        assert not s.pins._awaiting and not s.pins._posting
        for r in reqs:
            s.request_finished(r, [])
        s.build_connector_meta(empty_out())
        _until_unpinned(s, client)


@pytest.mark.parametrize("how", ["finished before its offer", "none of its offer taken", "fully vLLM's"])
def test_a_request_that_loads_nothing_leaves_nothing_pinned(server: Any, how: str) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=66)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    with _scheduler(server, keyer) as (s, client):
        r = req("b", toks)
        s.on_new_request(r)
        if how == "finished before its offer":
            s.request_finished(r, [])  # aborted: possibly before its post's reply was read
        elif how == "none of its offer taken":
            assert s.get_num_new_matched_tokens(r, 0) == (288, False)
            s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 0)
        else:  # vLLM's own prefix cache covers all it could offer
            assert s.get_num_new_matched_tokens(r, 288) == (0, False)
            s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 0)
        s.build_connector_meta(empty_out())
        _until_unpinned(s, client)
        assert s.pins is not None and s.pins.snapshot()["pinned_now"] == 0


def test_a_chunk_gone_before_the_post_reached_the_server_cuts_the_offer(server: Any) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=67)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    with _scheduler(server, keyer) as (s, client):
        gone = s.keyer.prompt_keys(toks).full[2]
        post = client.post_lookup

        def evict_then_post(keys: list[str], **kw: Any) -> Any:
            client.delete([gone])  # evicted after the probe found it, before the pin
            return post(keys, **kw)

        client.post_lookup = evict_then_post  # type: ignore[method-assign]
        r = req("b", toks)
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (128, False)  # the two chunks before it
        assert _pinned(client) == 2  # what the post pinned past the cut went back
        s.update_state_after_alloc(r, blocks_obj(DST_BLOCKS), 128)
        meta = s.build_connector_meta(new_out("b", DST_BLOCKS, 128, 172))
        assert [c.key for c in meta.loads[0].chunks] == s.keyer.prompt_keys(toks).full[:2]
        assert gone in [c.key for rt in meta.stores for c in rt.chunks]  # refilled when computed


@pytest.mark.parametrize("failure", ["not sent", "lost"])
def test_a_post_that_fails_is_pinned_at_the_offer_instead(server: Any, failure: str) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=68)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    with _scheduler(server, keyer) as (s, client):
        post = client.post_lookup

        def failing(keys: list[str], **kw: Any) -> Any:
            if failure == "not sent":
                return None  # not connected at that moment
            lookup = post(keys, **kw)
            lookup.on_lost(0, {})  # its connection replaced before the reply was read
            return lookup

        client.post_lookup = failing  # type: ignore[method-assign]
        r = req("b", toks)
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)
        assert s.pins is not None
        assert s.pins.stats.pin_trips == 1  # the usual round trip at the offer
        assert s.pins.stats.posts_failed == (1 if failure == "lost" else 0)
        s.request_finished(r, [])
        s.build_connector_meta(empty_out())
        _until_unpinned(s, client)  # the lost post's late reply too: its pins went back


def test_posts_that_keep_failing_are_a_slow_path_maru_doctor_shows(server: Any, caplog: Any) -> None:
    from tests.helpers import reported_slow

    keyer = _keyer()
    toks = tokens(300, seed=74)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    with _scheduler(server, keyer) as (s, client):
        post = client.post_lookup

        def lost(keys: list[str], **kw: Any) -> Any:
            lookup = post(keys, **kw)
            lookup.on_lost(0, {})  # its connection replaced before the reply was read
            return lookup

        client.post_lookup = lost  # type: ignore[method-assign]
        for i in range(5):
            r = req(f"f{i}", toks)
            s.on_new_request(r)  # the fifth arrival sees the first four failed
            assert s.get_num_new_matched_tokens(r, 0) == (288, False)  # pinned at the offer: loads
            s.request_finished(r, [])
        assert s.pins is not None and s.pins.failing_posts()
        assert [m for m in caplog.messages if "posted at a request's arrival failed" in m]  # once
        slow = reported_slow(server)[client.client_id]
        assert [n for n in slow if "lookups posted at arrival failed" in n and "maru doctor" in n]
        client.post_lookup = post  # type: ignore[method-assign]
        for i in range(8):  # posts work again: the slow path goes once they are the majority
            r = req(f"g{i}", toks)
            s.on_new_request(r)
            assert s.get_num_new_matched_tokens(r, 0) == (288, False)
            s.request_finished(r, [])
        s.build_connector_meta(empty_out())
        assert not s.pins.failing_posts()
        assert not [n for n in reported_slow(server)[client.client_id] if "posted at arrival" in n]


def test_off_by_config_nothing_is_posted(server: Any) -> None:
    keyer = _keyer()
    toks = tokens(300, seed=69)
    _store_prompt(server, keyer, toks, SRC_BLOCKS)
    with _scheduler(server, keyer, pin_on_arrival=False) as (s, client):
        r = req("b", toks)
        s.on_new_request(r)
        assert s.pins is not None and s.pins.stats.pin_posts == 0 and _pinned(client) == 0
        assert s.get_num_new_matched_tokens(r, 0) == (288, False)
        assert s.pins.stats.pin_trips == 1


def test_through_the_connector_on_the_v2_runner_an_announced_request_is_no_slow_path(server: Any) -> None:
    """vLLM's ``on_new_request`` reaches the scheduler side; once it has, ``maru doctor`` no longer
    lists the pin-at-offer round trips as a slow path, and the pins' way says where they are taken."""
    from tests.helpers import reported_slow
    from tests.vllm.test_load_protocol import (
        KVConnectorRole,
        MaruKVConnector,
        publish,
        stored_keys_of,
        vllm_config,
        worker_side,
    )

    conn = MaruKVConnector(vllm_config(server.url, True), KVConnectorRole.SCHEDULER)
    try:
        worker = worker_side(server, True)
        said = worker.build_connector_worker_meta()
        worker.shutdown()
        conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=said, invalid_block_ids=set()))
        s = conn.maru_scheduler
        assert s is not None and "per request with a hit" in (s.at_offer_note or "")
        assert [n for n in reported_slow(server)[s._client.client_id] if "per request with a hit" in n]
        toks = tokens(300, seed=70)
        full, tail = stored_keys_of(s, toks)
        publish(server, full + [tail])
        r = req("a", toks)
        conn.on_new_request(r)
        assert conn.get_num_new_matched_tokens(r, 0) == (288, False)
        assert s.pins is not None and (s.pins.stats.pin_posts, s.pins.stats.pin_trips) == (1, 0)
        assert s.at_offer_note is None
        assert s.offer_pins_mode.startswith("posted at each request's arrival")
        slow = reported_slow(server)[s._client.client_id]  # what `maru doctor` shows for it
        assert not [n for n in slow if "per request with a hit" in n]
        hooks = conn.maru_stats()["hook_ms"]
        assert hooks["on_new_request"]["calls"] == 1
    finally:
        conn.shutdown()


def test_what_this_engine_placed_lately_is_neither_probed_nor_pinned_at_arrival(server: Any) -> None:
    """The chunks an engine loaded or stored lately are taken as vLLM's own hit at a request's
    arrival (``RecentKeys``): only the rest is probed and posted. A guess only: when vLLM's real
    hit is shorter, the offer probes again and pins the rest with a round trip of its own."""
    keyer = _keyer()
    p = tokens(300, seed=71)
    q = p[: 4 * C] + tokens(100, seed=72)  # P's four chunks, a fifth chunk of its own, a tail
    src = _store_prompt(server, keyer, p, SRC_BLOCKS)
    _store_prompt(server, keyer, q, list(range(12)), present=4 * C)
    with _instance(server, keyer, 96, at_offer=True, blocks=24, log_timing=True) as (s, client, w, _, dst):
        assert s.pins is not None
        stats = s.pins.stats
        r1 = req("p", p)
        s.on_new_request(r1)
        assert stats.pins_posted == 5  # nothing placed lately: every chunk found, and the tail
        assert s.get_num_new_matched_tokens(r1, 0) == (288, False)
        s.update_state_after_alloc(r1, blocks_obj(DST_BLOCKS), 288)
        meta = s.build_connector_meta(new_out("p", DST_BLOCKS, 288, 12))
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        assert _same_tokens(src, SRC_BLOCKS, dst, DST_BLOCKS, 288)
        s.update_connector_output(_out(w.build_worker_meta() or MaruWorkerMeta(ready=1)))
        assert _pinned(client) == 0
        # Q arrives: its first four chunks are P's, loaded just now. Only its fifth chunk and its
        # tail are probed and posted.
        probes = s.hook_times.as_dict()["on_new_request/probe"]["calls"]
        r2 = req("q", q)
        s.on_new_request(r2)
        assert stats.pins_posted == 5 + 2 and stats.pin_posts == 2
        assert s._reqs["q"].probed_local == 4 * C
        assert s.hook_times.as_dict()["on_new_request/probe"]["calls"] == probes + 1
        # vLLM's own hit is shorter than the guess (it evicted P's blocks): probed again at the
        # offer, the first four chunks pinned by a round trip of the offer's own.
        assert s.get_num_new_matched_tokens(r2, 0) == (352, False)
        assert stats.pin_trips == 1 and _pinned(client) == 6
        s.request_finished(r2, [])
        s.build_connector_meta(empty_out())
        _until_unpinned(s, client)
        # As guessed: vLLM holds the four chunks; no round trip at the offer.
        r3 = req("q2", q)
        s.on_new_request(r3)
        assert s.get_num_new_matched_tokens(r3, 4 * C) == (352 - 4 * C, False)
        assert stats.pin_trips == 1 and _pinned(client) == 2


def test_a_storing_engine_does_not_pin_its_own_stores_at_arrival(server: Any) -> None:
    keyer = _keyer()
    p = tokens(300, seed=73)
    with _instance(server, keyer, 95, at_offer=True) as (s, client, w, _, _src):
        r = req("p", p)
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # nothing in the pool yet
        s.update_state_after_alloc(r, blocks_obj(SRC_BLOCKS), 0)
        meta = s.build_connector_meta(new_out("p", SRC_BLOCKS, 0, 300))
        assert meta.stores
        w.wait_for_save(meta)
        w.flush_stores()
        s.request_finished(r, [])
        # The same prompt again: its chunks and tail are this engine's own stores, in vLLM's cache.
        again = req("p2", p)
        s.on_new_request(again)
        assert s.pins is not None and s.pins.stats.pin_posts == 0 and _pinned(client) == 0
        assert s._reqs["p2"].probed_local == 4 * C


def _hashed(rid: str, toks: list[int]) -> Any:
    """``req`` with vLLM's block hashes (a chain over blocks of ``BS`` tokens)."""
    from tests.vllm.test_recent_keys import chain

    r = req(rid, toks)
    r.block_hashes = chain(toks, block=BS)
    return r


def test_a_next_turn_is_probed_from_the_last_full_block_of_the_turn_that_finished(server: Any) -> None:
    """``RecentBlocks``: a finished request's blocks guess vLLM's own hit of the next turn to the
    block (past the last whole chunk the engine stored), so the arrival probe asks about the new
    tokens' tails only. A guess: a shorter real hit is probed again at the offer."""
    keyer = _keyer()
    p = tokens(300, seed=83)  # 4 chunks of 64, 9 full blocks of 32 (288 tokens), 12 more tokens
    with _instance(server, keyer, 97, at_offer=True) as (s, client, w, _, _src):
        r = _hashed("p", p)
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        s.update_state_after_alloc(r, blocks_obj(SRC_BLOCKS), 0)
        meta = s.build_connector_meta(new_out("p", SRC_BLOCKS, 0, 300))
        w.wait_for_save(meta)
        w.flush_stores()
        s.request_finished(r, [])
        assert len(s.recent_blocks) == 5  # the last block of each of its 4 chunks, and of the turn
        q = p + tokens(40, seed=84)  # the next turn: 340 tokens, 5 chunks, 10 full blocks
        r2 = _hashed("q", q)
        probes_before = s.stats.requests_probed
        s.on_new_request(r2)
        assert s._reqs["q"].probed_local == 9 * BS  # not 4 * C = 256: the whole turn before
        assert s.pins is not None and s.pins.stats.pin_posts == 0 and _pinned(client) == 0
        # As guessed: no second probe at the offer, nothing to load past vLLM's own hit.
        assert s.get_num_new_matched_tokens(r2, 9 * BS) == (0, False)
        assert s.stats.requests_probed == probes_before + 1
        s.request_finished(r2, [])
        # vLLM's own hit shorter than the guess (it evicted the turn's last blocks): probed again
        # from there, and the pool's chunks past it offered.
        r3 = _hashed("q3", q)
        s.on_new_request(r3)
        assert s._reqs["q3"].probed_local == 10 * BS  # q finished: its 10 blocks are noted now
        assert s.get_num_new_matched_tokens(r3, 2 * C) == (288 - 2 * C, False)
        assert s._reqs["q3"].probed_local == 2 * C
        s.request_finished(r3, [])
        s.build_connector_meta(empty_out())
        _until_unpinned(s, client)


def test_a_stalled_server_holds_the_offer_one_client_timeout_not_one_per_post() -> None:
    from maru.errors import MaruTimeoutError
    from maru.vllm.offer_pins import OfferPins

    waited: list[float] = []

    class Unanswered:  # a posted lookup whose reply never comes: result waits its timeout out
        done = False

        def __init__(self, keys: list[str]) -> None:
            self.keys = keys

        def result(self, timeout_s: float) -> Any:
            waited.append(timeout_s)
            time.sleep(timeout_s)
            raise MaruTimeoutError("no reply")

        def abandon(self) -> None:
            pass

    client = SimpleNamespace(timeout_s=0.2, post_lookup=lambda keys, **kw: Unanswered(keys))
    pins = OfferPins()
    for i in range(3):
        assert pins.prefetch(client, f"r{i}", [f"k{i}"]) == 1
    pins._settle(["r0", "r1", "r2"], client)  # r0's post, then r1's and r2's together
    assert pins.stats.posts_failed == 2 and len(waited) == 2
    assert waited[0] == pytest.approx(0.2, abs=0.01) and sum(waited) <= 0.2 + 1e-6  # one timeout in all
    assert not pins._posts and not pins._awaiting  # their keys go the usual way


def test_a_queue_never_posts_more_keys_than_one_lookup_takes(monkeypatch: Any) -> None:
    from maru.vllm import offer_pins
    from maru.vllm.offer_pins import OfferPins

    monkeypatch.setattr(offer_pins, "MAX_BATCH", 5)
    sent: list[list[str]] = []

    class Posted:  # a reply that never comes: only what was sent matters here
        done = False

        def abandon(self) -> None:
            pass

    client = SimpleNamespace(
        timeout_s=0.1, post_lookup=lambda keys, **kw: sent.append(list(keys)) or Posted()
    )
    pins = OfferPins()
    pins.prefetch(client, "r0", ["a0"])  # nothing in flight: posted at once
    for i in range(1, 5):  # queued behind it: 2 keys each, at most 5 a lookup
        assert pins.prefetch(client, f"r{i}", [f"b{i}", f"c{i}"]) == 2
    assert [len(k) for k in sent] == [1, 4]  # r1 and r2's keys went when r3's would not fit
    assert pins.snapshot()["posts_queued"] == 2
    pins._send_queued(client)
    assert sent[-1] == ["b3", "c3", "b4", "c4"]
    assert sorted(k for keys in sent for k in keys) == sorted(
        ["a0"] + [f"{x}{i}" for i in range(1, 5) for x in "bc"]
    )
    pins.close(None)


def test_a_post_that_raises_leaves_no_queued_key_behind() -> None:
    from maru.vllm.offer_pins import OfferPins

    def broken(keys: list[str], **kw: Any) -> Any:
        raise ValueError("a bug below the post")

    client = SimpleNamespace(timeout_s=0.1, post_lookup=broken)
    pins = OfferPins()
    assert pins.prefetch(client, "r0", ["a", "b"]) == 0  # nothing in flight: sent at once, and failed
    assert not pins._posting and not pins._awaiting and not pins.posting
    pins._settle(["r0"], client)  # nothing to read: the offer pins its keys the usual way
    assert pins.stats.pin_posts == 0 and pins.snapshot()["posts_unread"] == 0
