"""The connector's scheduler side (offers and store plans), step by step, against a real server.

vLLM's scheduler is replaced by the minimal objects it hands the connector (requests with token
ids, block lists, per-step scheduled/computed counts), so each rule can be driven exactly: the
end-to-end tests with real vLLM are in test_vllm_e2e.py.
"""

from __future__ import annotations

import os
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import ChunkKeyer
from maru.vllm.scheduler import MaruSchedulerConnector
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server
from tests.vllm.helpers import (
    BS,
    C,
    CountingClient,
    as_v034,
    blocks_obj,
    cached_out,
    empty_out,
    make_sched,
    new_out,
    publish,
    req,
    stored_keys_of,
    stored_then_asked,
    tokens,
)

server = module_server("sched", pool_size="16M")


def test_nothing_stored_offers_nothing_with_one_exists_round_trip(server, keyer, client) -> None:
    s = make_sched(server, keyer, client)
    r = req("a", tokens(300))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)  # asked again: no new round trip
    assert client.exists_calls == 1


def test_offers_full_chunks_plus_the_stored_tail_and_never_the_last_token(server, keyer, client) -> None:
    s = make_sched(server, keyer, client)
    toks = tokens(300)
    full, tail = stored_keys_of(s, toks)
    assert len(full) == 4 and tail is not None and tail.endswith(".t32")  # 4*64 + 32 = 288 = align(299)
    publish(server, full + [tail])
    assert s.get_num_new_matched_tokens(req("a", toks), 0) == (288, False)
    # vLLM already has the first two blocks: offer the rest only.
    assert s.get_num_new_matched_tokens(req("b", toks), 64) == (224, False)


def test_chunks_vllm_holds_itself_are_not_asked_about(server, keyer, client) -> None:
    toks = tokens(300, seed=60)
    s = make_sched(server, keyer, client)
    full, tail = stored_keys_of(s, toks)
    publish(server, full + [tail])
    # vLLM's own hit covers three chunks: chunk 3 and the tails after it are asked, not chunks 0-2.
    assert s.get_num_new_matched_tokens(req("a", toks), 3 * C) == (288 - 3 * C, False)
    skipping = client.keys_asked
    client.keys_asked = 0
    assert s.get_num_new_matched_tokens(req("b", toks), 0) == (288, False)
    assert skipping == client.keys_asked - 3  # the same probe from chunk 0 asks three keys more


def test_a_prompt_vllm_holds_up_to_its_last_usable_block_asks_nothing(server, keyer, client) -> None:
    toks = tokens(300, seed=62)
    s = make_sched(server, keyer, client)
    full, tail = stored_keys_of(s, toks)
    publish(server, full + [tail])
    assert s.get_num_new_matched_tokens(req("a", toks), 288) == (0, False)  # 288: all vLLM may take
    assert client.exists_calls == 0
    assert s.get_num_new_matched_tokens(req("b", toks), 256) == (32, False)  # only the tail is asked
    assert client.keys_asked == 1


def test_when_vllms_own_hit_shrinks_the_chunks_it_no_longer_covers_are_asked(server, keyer, client) -> None:
    toks = tokens(300, seed=61)
    s = make_sched(server, keyer, client)
    full, tail = stored_keys_of(s, toks)
    publish(server, full[3:] + [tail])  # chunks 0-2 are nowhere but in vLLM's own cache
    r = req("a", toks)
    assert s.get_num_new_matched_tokens(r, 3 * C) == (288 - 3 * C, False)
    calls = client.exists_calls
    # A step later vLLM holds only chunk 0 (its cache evicted the rest): chunk 1 is in no pool,
    # so nothing can be offered; an offer of chunks 1-3 would be a load that must fail.
    assert s.get_num_new_matched_tokens(r, C) == (0, False)
    assert client.exists_calls > calls
    calls = client.exists_calls
    assert s.get_num_new_matched_tokens(r, 3 * C) == (288 - 3 * C, False)  # covered again: chunk 3 loads
    assert client.exists_calls == calls  # from what the last probe found
    assert s._reqs["a"].present == [True, False, False, True]


def test_prompt_of_whole_chunks_offers_all_but_the_last_block(server, keyer, client) -> None:
    s = make_sched(server, keyer, client)
    toks = tokens(256, seed=1)
    full, tail = stored_keys_of(s, toks)
    assert tail is None  # the last full chunk covers everything vLLM may take
    publish(server, full)
    r = req("a", toks)
    assert s.get_num_new_matched_tokens(r, 0) == (224, False)  # align_down(255, 32)
    s.update_state_after_alloc(r, blocks_obj(list(range(8))), 224)
    meta = s.build_connector_meta(new_out("a", list(range(8)), 224, 32))
    (load,) = meta.loads
    assert [c.key for c in load.chunks] == full
    assert load.chunks[-1].placed() == (0, 32)  # the last chunk is loaded, only its first block placed
    assert load.num_placed_tokens() == 224
    assert not meta.stores  # every chunk is in Maru already


def test_partial_prefix_offers_exactly_the_shared_chunks(server, keyer, client) -> None:
    s = make_sched(server, keyer, client)
    a = tokens(300, seed=2)
    full, tail = stored_keys_of(s, a)
    publish(server, full + [tail])
    b = a[: 2 * C] + tokens(172, seed=3)
    assert s.get_num_new_matched_tokens(req("b", b), 0) == (2 * C, False)


def test_a_prompt_extending_a_stored_one_reuses_its_tail_only_if_the_tokens_match(
    server, keyer, client
) -> None:
    s = make_sched(server, keyer, client)
    a = tokens(300, seed=4)
    full, tail = stored_keys_of(s, a)
    publish(server, full + [tail])
    longer = a + tokens(200, seed=5)  # a's tail tokens 256..287 are also tokens 256..287 of longer
    calls = client.exists_calls
    assert s.get_num_new_matched_tokens(req("l", longer), 0) == (288, False)
    # The hit ends at chunk 4 of longer's 7: its tails there take a second round trip.
    assert client.exists_calls == calls + 2
    different = a[:280] + tokens(220, seed=6)  # diverges inside the tail
    assert s.get_num_new_matched_tokens(req("d", different), 0) == (256, False)
    again = s.get_num_new_matched_tokens(req("a2", a), 0)
    assert again == (288, False) and client.exists_calls == calls + 5  # the same prompt: one trip


def test_chunked_prefill_plans_every_full_chunk_exactly_once_and_the_tail_at_the_end(
    server, keyer, client
) -> None:
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=7)
    full, tail = stored_keys_of(s, toks)
    r = req("a", toks)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, blocks_obj([0, 1, 2, 3]), 0)
    planned: list[list[str]] = []
    meta = s.build_connector_meta(new_out("a", [0, 1, 2, 3], 0, 100))
    planned.append([c.key for rt in meta.stores for c in rt.chunks])
    for computed, new_blocks, n in [
        (100, [4, 5, 6], 100),
        (200, [7, 8, 9], 100),
        (300, [], 1),
        (301, None, 1),
    ]:
        meta = s.build_connector_meta(cached_out("a", new_blocks, computed, n))
        planned.append([c.key for rt in meta.stores for c in rt.chunks])
        for rt in meta.stores:
            assert list(rt.block_ids) == list(range(10))[: len(rt.block_ids)]
    assert planned == [[full[0]], [full[1], full[2]], [full[3], tail], [], []]


def test_a_prompt_vllm_extends_in_place_keeps_the_state_of_the_prompt_it_was_made_for(
    server, keyer, client, caplog: pytest.LogCaptureFixture
) -> None:
    """The state keeps vLLM's prompt list, not a copy. vLLM 0.32+ appends a streaming session's
    next input to that list in place: the state goes on with the prompt it was made for (its
    keys, its stores, its probes), exactly as with a copy, and never reads past it."""
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=11)
    full, tail = stored_keys_of(s, toks)
    r = req("a", list(toks))
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    st = s._reqs["a"]
    assert st.prompt is r.prompt_token_ids and st.prompt_len == 300  # no copy
    s.update_state_after_alloc(r, blocks_obj([0, 1, 2, 3]), 0)
    meta = s.build_connector_meta(new_out("a", [0, 1, 2, 3], 0, 100))
    planned = [c.key for rt in meta.stores for c in rt.chunks]
    r.prompt_token_ids.extend(tokens(200, seed=12))  # a streaming session's next input: 500 tokens
    r.num_tokens = 500
    with caplog.at_level("ERROR", logger="maru"):
        for computed, new_blocks, n in [(100, [4, 5, 6, 7, 8, 9], 300), (400, [10, 11, 12, 13], 100)]:
            meta = s.build_connector_meta(cached_out("a", new_blocks, computed, n))
            planned += [c.key for rt in meta.stores for c in rt.chunks]
    assert not [r for r in caplog.records if "planning this step" in r.getMessage()]  # no step failed
    assert planned == full + [tail]  # the first prompt's chunks and tail, once each, nothing past it
    assert st.prompt_tokens() == toks and st.prompt_len == 300
    # Probed again (as after a preemption): the first prompt's chunks, found now.
    publish(server, full + [tail])
    st.present = None
    assert s.get_num_new_matched_tokens(r, 0) == (288, False)


def test_preempted_request_is_probed_again_and_does_not_store_twice(server, keyer, client) -> None:
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=8)
    full, _ = stored_keys_of(s, toks)
    r = req("a", toks)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, blocks_obj([0, 1, 2, 3]), 0)
    meta = s.build_connector_meta(new_out("a", [0, 1, 2, 3], 0, 128))
    assert [c.key for rt in meta.stores for c in rt.chunks] == full[:2]
    publish(server, full[:2])  # what the worker did in that step
    s.build_connector_meta(cached_out("x", None, 0, 0, preempted={"a"}))
    # Resumed: matched again (two more exists: the chunks, then the tails after the last hit one,
    # chunk 2 of 4), loads the two stored chunks, stores only what is new.
    assert s.get_num_new_matched_tokens(r, 0) == (128, False)
    assert client.exists_calls == 3
    s.update_state_after_alloc(r, blocks_obj([7, 6, 5, 4, 3, 2, 1, 0, 8, 9]), 128)
    meta = s.build_connector_meta(cached_out("a", [7, 6, 5, 4, 3, 2, 1, 0, 8, 9], 128, 172, resumed=True))
    assert [c.key for c in meta.loads[0].chunks] == full[:2]
    assert meta.loads[0].block_ids[:4] == (7, 6, 5, 4)
    assert [c.key for rt in meta.stores for c in rt.chunks][:2] == full[2:]


@pytest.mark.parametrize("v034", [False, True])
def test_a_decoding_request_plans_nothing_and_its_resume_uses_the_resumed_block_table(
    server, keyer, client, v034: bool
) -> None:
    """Past its prompt a request has nothing to load or store: its decode steps plan nothing (and
    its block table is not followed any more); preempted and resumed, it is planned again from the
    whole table vLLM hands over. ``v034``: as vLLM 0.34 shapes its steps (no ``resumed_req_ids``;
    a resumed request sent in full among the new ones): planned the same."""
    shaped = as_v034 if v034 else (lambda out: out)
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=12)
    full, tail = stored_keys_of(s, toks)
    r = req("a", toks)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, blocks_obj(list(range(10))), 0)
    meta = s.build_connector_meta(shaped(new_out("a", list(range(10)), 0, 300)))
    assert [c.key for rt in meta.stores for c in rt.chunks] == [*full, tail]
    for step, blocks in enumerate(([10], None, [11])):  # decode steps, new blocks now and then
        meta = s.build_connector_meta(shaped(cached_out("a", blocks, 300 + step, 1)))
        assert not meta.stores and not meta.loads
    publish(server, [*full, tail])  # what the worker did in the prompt's step
    s.build_connector_meta(shaped(cached_out("x", None, 0, 0, preempted={"a"})))
    # Resumed: matched again, its prompt loaded into the whole table vLLM hands over.
    assert s.get_num_new_matched_tokens(r, 0) == (288, False)
    table = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]
    s.update_state_after_alloc(r, blocks_obj(table), 288)
    resume = new_out("a", table, 288, 15) if v034 else cached_out("a", table, 0, 303, resumed=True)
    meta = s.build_connector_meta(shaped(resume))
    (lt,) = meta.loads
    assert list(lt.block_ids) == table  # the resumed table, not the old one with decode blocks
    assert [c.key for c in lt.chunks] == [*full, tail] and not meta.stores


@pytest.mark.parametrize("async_load", [False, True])
def test_a_step_whose_planning_fails_fails_every_load_vllm_accepted_instead_of_dropping_it(
    server, keyer, client, monkeypatch, async_load: bool
) -> None:
    """vLLM counts accepted offers as computed: a lost plan must not leave them unloaded (the model
    would run on blocks never written). Each is planned to fail, so vLLM recomputes it."""
    s = make_sched(server, keyer, client, async_load=async_load, async_min_load_tokens=1)
    r, _, _, offer = stored_then_asked(server, s, seed=14)
    assert offer == (288, async_load)
    s.update_state_after_alloc(r, blocks_obj(list(range(10))), 288)

    def broken(*a, **k):
        raise RuntimeError("a bug in planning")

    monkeypatch.setattr(s, "_pin_step_loads", broken)  # the first thing a plan does
    out = empty_out() if async_load else new_out("a", list(range(10)), 288, 12)
    meta = s.build_connector_meta(out)
    (lt,) = meta.async_loads if async_load else meta.loads
    assert not (meta.loads if async_load else meta.async_loads) and not meta.stores
    assert [(c.key, c.start, c.num_tokens) for c in lt.chunks] == [("", 0, 288)]
    assert lt.placed_block_ids(BS) == set(range(9))  # every block the offer covered is reported
    # The next step plans normally again: nothing of the failed step is left to fail.
    monkeypatch.undo()
    meta = s.build_connector_meta(empty_out())
    assert not meta.loads and not meta.async_loads


def test_a_salted_request_is_offered_only_what_was_stored_under_its_salt(server, keyer, client) -> None:
    """vLLM's ``cache_salt`` keeps tenants' prefix caches apart: so do their Maru keys."""
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=15)
    full, tail = stored_keys_of(s, toks)
    publish(server, full + [tail])

    def salted(rid: str, salt: str | None) -> SimpleNamespace:
        r = req(rid, toks)
        r.cache_salt = salt
        return r

    x = salted("x", "tenant-x")
    assert s.get_num_new_matched_tokens(x, 0) == (0, False)  # the same tokens, stored unsalted
    s.update_state_after_alloc(x, blocks_obj(list(range(10))), 0)
    meta = s.build_connector_meta(new_out("x", list(range(10)), 0, 300))
    keys = [c.key for rt in meta.stores for c in rt.chunks]
    assert keys[:4] == keyer.prompt_keys(toks, salt="tenant-x").full and len(keys) == 5
    assert not set(keys) & set(full + [tail])
    publish(server, keys)
    assert s.get_num_new_matched_tokens(salted("y", "tenant-x"), 0) == (288, False)
    assert s.get_num_new_matched_tokens(salted("z", "tenant-z"), 0) == (0, False)
    assert s.get_num_new_matched_tokens(salted("p", None), 0) == (288, False)
    # A prompt shorter than a chunk has only its tail: keyed from the salted root too.
    short = tokens(40, seed=16)
    plain_tail = stored_keys_of(s, short)[1]
    r = req("probe", short)
    r.cache_salt = "tenant-x"
    salted_tail = s._state(r).own_tail
    s._reqs.pop("probe")
    assert plain_tail is not None and salted_tail is not None and salted_tail[1] != plain_tail
    assert salted_tail[1] == keyer.tail_key(keyer.root_for("tenant-x"), short[:32])


def test_a_failed_load_replans_the_stores_of_that_step(server, keyer, client) -> None:
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=9)
    full, tail = stored_keys_of(s, toks)
    publish(server, full[:2])
    r = req("a", toks)
    assert s.get_num_new_matched_tokens(r, 0) == (128, False)
    blocks = list(range(10))
    s.update_state_after_alloc(r, blocks_obj(blocks), 128)
    meta = s.build_connector_meta(new_out("a", blocks, 128, 172))
    assert [c.key for rt in meta.stores for c in rt.chunks] == [full[2], full[3], tail]
    # The worker reports the loaded blocks as failed; vLLM rolls back to 0 and recomputes.
    s.update_connector_output(SimpleNamespace(invalid_block_ids={0, 1, 2, 3}))
    meta = s.build_connector_meta(cached_out("a", None, 0, 300))
    assert not meta.loads
    assert [c.key for rt in meta.stores for c in rt.chunks] == [full[2], full[3], tail]


def test_load_disabled_offers_nothing_but_still_stores(server, keyer, client) -> None:
    s = make_sched(server, keyer, client, enable_load=False)
    toks = tokens(200, seed=10)
    full, _ = stored_keys_of(s, toks)
    publish(server, full[:1])
    r = req("a", toks)
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    s.update_state_after_alloc(r, blocks_obj(list(range(7))), 0)
    meta = s.build_connector_meta(new_out("a", list(range(7)), 0, 200))
    assert [c.key for rt in meta.stores for c in rt.chunks][:2] == full[1:3]


def test_unreachable_server_offers_nothing_and_warns_once(keyer, caplog: pytest.LogCaptureFixture) -> None:
    def refuse() -> Any:
        return MaruHandler("tcp://127.0.0.1:9", timeout_s=0.3)

    conf = MaruConnectorConfig(server_url="tcp://127.0.0.1:9", kv_chunk_tokens=C)
    s = MaruSchedulerConnector(conf, keyer, BS, client_factory=refuse)
    import logging

    with caplog.at_level(logging.WARNING, logger="maru.vllm"):
        for i in range(3):
            assert s.get_num_new_matched_tokens(req(f"r{i}", tokens(300, seed=i)), 0) == (0, False)
    warnings = [r for r in caplog.records if "cannot reach maru server" in r.getMessage()]
    assert len(warnings) == 1 and "maru server" in warnings[0].getMessage()
    assert not any(r.exc_info for r in caplog.records)


def test_async_load_offers_asynchronously_and_plans_the_load_of_the_parked_request(
    server, keyer, client
) -> None:
    s = make_sched(server, keyer, client, async_load=True)
    toks = tokens(300, seed=21)
    full, tail = stored_keys_of(s, toks)
    publish(server, full + [tail])
    r = req("a", toks)
    assert s.get_num_new_matched_tokens(r, 0) == (288, True)
    s.update_state_after_alloc(r, blocks_obj(list(range(10))), 288)
    # vLLM parks the request: it is not scheduled, yet its load must be in this step's metadata.
    meta = s.build_connector_meta(empty_out())
    assert not meta.loads and not meta.stores
    (load,) = meta.async_loads
    assert [c.key for c in load.chunks] == full + [tail]
    assert load.num_placed_tokens() == 288 and load.block_ids == tuple(range(10))
    assert s.inflight_loads == {"a"}
    assert not s.build_connector_meta(empty_out()).async_loads  # planned once
    # Loaded: vLLM schedules the rest as a new request with 288 computed tokens.
    s.update_connector_output(SimpleNamespace(finished_recving={"a"}, invalid_block_ids=set()))
    assert s.inflight_loads == set()
    meta = s.build_connector_meta(new_out("a", list(range(10)), 288, 12))
    assert not meta.loads and not meta.async_loads and not meta.stores


def test_async_load_admission_window_asks_again_later_instead_of_recomputing(server, keyer, client) -> None:
    s = make_sched(server, keyer, client, async_load=True, max_inflight_loads=2)
    # Three different prompts: the same one would wait for the first load instead (shared loads).
    prompts = {rid: tokens(300, seed=220 + i) for i, rid in enumerate("abc")}
    for toks in prompts.values():
        full, tail = stored_keys_of(s, toks)
        publish(server, full + [tail])
    for rid in ("a", "b"):
        assert s.get_num_new_matched_tokens(req(rid, prompts[rid]), 0) == (288, True)
        s.update_state_after_alloc(req(rid, prompts[rid]), blocks_obj(list(range(10))), 288)
    c = req("c", prompts["c"])
    assert s.get_num_new_matched_tokens(c, 0) == (None, False)  # window full: vLLM skips c this step
    assert s.stats.async_loads_deferred == 1
    s.update_connector_output(SimpleNamespace(finished_recving={"b"}, invalid_block_ids=set()))
    assert s.get_num_new_matched_tokens(c, 0) == (288, True)
    # A miss is never held back by the window.
    s.update_state_after_alloc(c, blocks_obj(list(range(10))), 288)
    assert s.get_num_new_matched_tokens(req("d", tokens(300, seed=23)), 0) == (0, False)


def test_a_short_async_hit_is_computed_and_the_threshold_is_configurable(server, keyer, client) -> None:
    """An asynchronous load parks its request a step: a hit shorter than ``async_min_load_tokens``
    (default: one chunk) beyond what vLLM holds is computed instead; sync loads are not affected."""
    toks = tokens(300, seed=25)
    s = make_sched(server, keyer, client, async_load=True)
    assert s.cfg.min_async_load() == s.cfg.kv_chunk_tokens
    full, tail = stored_keys_of(s, toks)
    publish(server, full + [tail])
    c = s.cfg.kv_chunk_tokens
    assert s.get_num_new_matched_tokens(req("a", toks), 0) == (288, True)  # 288 >= one chunk
    # vLLM holds all but the last 32 tokens locally: 32 < one chunk, so it computes them.
    assert s.get_num_new_matched_tokens(req("b", toks), 288 - 32) == (0, False)
    assert s.stats.async_hits_computed == 1
    assert s.get_num_new_matched_tokens(req("e", toks), 288 - c) == (c, True)  # exactly one chunk loads
    every = make_sched(server, keyer, client, async_load=True, async_min_load_tokens=0)
    assert every.get_num_new_matched_tokens(req("b2", toks), 288 - 32) == (32, True)
    sync = make_sched(server, keyer, client)
    assert sync.get_num_new_matched_tokens(req("b3", toks), 288 - 32) == (32, False)
    from maru.errors import ConfigError

    with pytest.raises(ConfigError, match="maru_async_min_load_tokens"):
        MaruConnectorConfig.from_extra_config({"maru_async_min_load_tokens": -1})
    assert MaruConnectorConfig.from_extra_config({"maru_async_min_load_tokens": "0"}).min_async_load() == 0


def test_async_load_window_counts_chunks_and_always_admits_into_an_empty_window(
    server, keyer, client
) -> None:
    # 288 tokens offered = two chunks touched (+1 for a load starting inside a chunk): 3 each.
    s = make_sched(server, keyer, client, async_load=True, max_inflight_load_chunks=5)
    toks, other = tokens(300, seed=24), tokens(300, seed=240)
    for t in (toks, other):
        full, tail = stored_keys_of(s, t)
        publish(server, full + [tail])
    assert s.get_num_new_matched_tokens(req("a", toks), 0) == (288, True)
    s.update_state_after_alloc(req("a", toks), blocks_obj(list(range(10))), 288)
    b = req("b", other)
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # 3 + 3 chunks > 5
    s.update_connector_output(SimpleNamespace(finished_recving={"a"}, invalid_block_ids=set()))
    assert s.get_num_new_matched_tokens(b, 0) == (288, True)
    tiny = make_sched(server, keyer, client, async_load=True, max_inflight_load_chunks=1)
    assert tiny.get_num_new_matched_tokens(req("big", toks), 0) == (288, True)  # larger than the window


def test_a_chunk_already_being_loaded_is_waited_for_not_loaded_again(server, keyer, client) -> None:
    """Requests that arrive together with one prefix load it once: vLLM caches an async load's
    blocks only when it is reported, so until then the others are told to ask again later."""
    s = make_sched(server, keyer, client, async_load=True, async_min_load_tokens=0)  # tails load too
    toks = tokens(300, seed=26)
    branch = toks[:128] + tokens(172, seed=27)  # the same first two chunks, then its own
    unrelated = tokens(300, seed=28)
    for t in (toks, branch, unrelated):
        full, tail = stored_keys_of(s, t)
        publish(server, full + [tail])
    assert s.get_num_new_matched_tokens(req("a", toks), 0) == (288, True)
    s.update_state_after_alloc(req("a", toks), blocks_obj(list(range(10))), 288)
    b, c = req("b", toks), req("c", branch)
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # chunk 0 is on its way for "a"
    assert s.get_num_new_matched_tokens(c, 0) == (None, False)
    # vLLM holds the first four chunks already (an earlier request): "b" needs a's tail next.
    assert s.get_num_new_matched_tokens(req("b2", toks), 256) == (None, False)
    assert s.stats.async_loads_shared == 3 and s.stats.async_loads_deferred == 0
    assert s.get_num_new_matched_tokens(req("u", unrelated), 0) == (288, True)  # nothing shared: loads
    assert s.inflight_loads == {"a"}
    s.update_connector_output(SimpleNamespace(finished_recving={"a"}, invalid_block_ids=set()))
    assert s.inflight_loads == set()
    # vLLM caches a's blocks when its next scheduling pass reaches "a": until that pass ends, a
    # request asked before "a" (vLLM has not cached them yet) still waits.
    assert s.get_num_new_matched_tokens(b, 0) == (None, False)
    s.build_connector_meta(empty_out())
    # Loaded and in vLLM's prefix cache: "b" takes all of it from there, "c" loads only its own part.
    assert s.get_num_new_matched_tokens(b, 288) == (0, False)
    assert s.get_num_new_matched_tokens(c, 128) == (160, True)
    # Evicted from vLLM's cache before "b" came back: nothing is in flight any more, so it loads.
    assert s.get_num_new_matched_tokens(b, 0) == (288, True)


def test_a_failed_shared_load_frees_its_chunks_and_without_vllms_prefix_cache_nothing_waits(
    server, keyer, client
) -> None:
    toks = tokens(300, seed=29)
    s = make_sched(server, keyer, client, async_load=True)
    full, tail = stored_keys_of(s, toks)
    publish(server, full + [tail])
    assert s.get_num_new_matched_tokens(req("a", toks), 0) == (288, True)
    s.update_state_after_alloc(req("a", toks), blocks_obj(list(range(10))), 288)
    s.build_connector_meta(empty_out())  # plans a's load
    assert s.get_num_new_matched_tokens(req("b", toks), 0) == (None, False)
    s.update_connector_output(SimpleNamespace(finished_recving={"a"}, invalid_block_ids={3}))
    s.build_connector_meta(empty_out())
    assert s.inflight_loads == set()
    assert s.get_num_new_matched_tokens(req("b", toks), 0) == (288, True)  # not held by the failure
    # Without vLLM's prefix cache a finished load leaves nothing to share: every hit loads its own.
    plain = make_sched(server, keyer, client, local_prefix_cache=False, async_load=True)
    for rid in ("x", "y"):
        assert plain.get_num_new_matched_tokens(req(rid, toks), 0) == (288, True)
        plain.update_state_after_alloc(req(rid, toks), blocks_obj(list(range(10))), 288)
    assert plain.inflight_loads == {"x", "y"} and plain.stats.async_loads_shared == 0


def test_data_path_options_are_validated_write_behind_by_default_and_exclusive() -> None:
    from maru.errors import ConfigError

    d = MaruConnectorConfig.from_extra_config({})
    assert d.data_path() == {
        "async_load": False,
        "max_inflight_loads": 64,
        "max_inflight_load_chunks": 256,
        "async_min_load_tokens": 256,  # one chunk by default
        "overlap_load_with_compute": "auto (on GPU caches)",
        "async_store": True,
        "paced_store": True,
        "store_helper": False,
        "layer_path": "auto",
        "early_load": "auto (where it applies)",
        "store_yield_to_prefill_ms": 250.0,
    }
    assert d.early_load is None and d.early_load_wanted  # on where it applies (maru.vllm.early_loads)
    early = MaruConnectorConfig.from_extra_config({"maru_early_load": "true"})
    assert early.data_path()["early_load"] is True and early.data_path_lines()[1].startswith(
        "maru_early_load:"
    )
    off = MaruConnectorConfig.from_extra_config({"maru_early_load": "false"})
    assert not off.early_load_wanted and off.data_path()["early_load"] is False
    assert not any(line.startswith("maru_early_load") for line in off.data_path_lines())
    # Layer by layer where the caches are on a GPU, unless set or loads are asynchronous.
    assert (d.layer_overlap(pipelined=True), d.layer_overlap(pipelined=False)) == (True, False)
    lines = d.data_path_lines()
    assert len(lines) == 3 and lines[0].startswith(
        "maru_overlap_load_with_compute (on GPU caches, the default)"
    )
    assert lines[1].startswith("maru_early_load (the default):")
    assert lines[2].startswith("maru_async_store:")
    assert "yields the copy engine between chunks (maru_paced_store)" in lines[2]
    unpaced = MaruConnectorConfig.from_extra_config({"maru_paced_store": "false"})
    assert not unpaced.paced_store and "maru_paced_store" not in unpaced.data_path_lines()[2]
    sync = MaruConnectorConfig.from_extra_config({"maru_overlap_load_with_compute": "false"})
    assert not sync.layer_overlap(pipelined=True) and sync.data_path()["overlap_load_with_compute"] is False
    assert len(sync.data_path_lines()) == 1  # no layer-by-layer load: no early load announced
    on = MaruConnectorConfig.from_extra_config({"maru_overlap_load_with_compute": "true"})
    assert on.layer_overlap(pipelined=False) and on.data_path_lines()[0].startswith(
        "maru_overlap_load_with_compute:"
    )
    off = d.without_write_behind("a test")
    assert not off.async_store and off.without_write_behind("again") is off
    assert not MaruConnectorConfig.from_extra_config({"maru_async_store": "false"}).async_store
    c = MaruConnectorConfig.from_extra_config(
        {"maru_async_load": "true", "maru_max_inflight_loads": "8", "maru_async_store": 1}
    )
    assert (c.async_load, c.max_inflight_loads, c.async_store) == (True, 8, True)
    assert len(c.data_path_lines()) == 2 and "8 loads and 256 chunks in flight" in c.data_path_lines()[0]
    assert not c.layer_overlap(pipelined=True) and c.data_path()["overlap_load_with_compute"] is False
    with pytest.raises(ConfigError, match="maru_max_inflight_loads"):
        MaruConnectorConfig.from_extra_config({"maru_max_inflight_loads": 0})
    with pytest.raises(ConfigError, match="maru_async_store"):
        MaruConnectorConfig.from_extra_config({"maru_async_store": "maybe"})
    with pytest.raises(ConfigError, match="exclude each other"):
        MaruConnectorConfig.from_extra_config(
            {"maru_async_load": True, "maru_overlap_load_with_compute": True}
        )
    # The GPU layer load's way (kv_ops.layer_copies): one of the engine's, else refused by name.
    assert MaruConnectorConfig.from_extra_config({"maru_layer_path": "copied"}).layer_path == "copied"
    with pytest.raises(ConfigError, match="maru_layer_path must be one of auto, copied, direct, staged"):
        MaruConnectorConfig.from_extra_config({"maru_layer_path": "fast"})


def test_a_failed_async_load_probes_again_offers_nothing_more_and_stores_the_missing_chunk(
    server, keyer, client
) -> None:
    s = make_sched(server, keyer, client, async_load=True)
    toks = tokens(300, seed=24)
    full, tail = stored_keys_of(s, toks)
    publish(server, full + [tail])
    r = req("a", toks)
    assert s.get_num_new_matched_tokens(r, 0) == (288, True)
    blocks = list(range(10))
    s.update_state_after_alloc(r, blocks_obj(blocks), 288)
    (load,) = s.build_connector_meta(empty_out()).async_loads
    with MaruHandler(server.url, timeout_s=2) as h:
        assert h.delete([full[3]]) == [True]  # evicted before the worker's lookup
    # The worker reports the request finished and all of its placed blocks invalid, in one output.
    s.update_connector_output(SimpleNamespace(finished_recving={"a"}, invalid_block_ids=set(blocks[:9])))
    assert s.inflight_loads == set()
    # vLLM freed the blocks (nothing valid) and matches the request again from scratch: no offer
    # (it could fail the same way for ever); the recompute stores exactly the chunk that is gone.
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    meta = s.build_connector_meta(new_out("a", blocks, 0, 300))
    assert not meta.loads and not meta.async_loads
    assert [c.key for rt in meta.stores for c in rt.chunks] == [full[3]]


def _scheduler_infos(url: str) -> list[dict[str, Any]]:
    with MaruHandler(url, timeout_s=2) as h:
        clients = h.stats()["clients"]
    return [c["info"] for c in clients if (c.get("info") or {}).get("role") == "vllm-scheduler"]


@pytest.mark.parametrize("index", [True, False])
def test_the_scheduler_reports_how_its_probes_reach_the_pool_to_the_server(
    tmp_path: Any, keyer: ChunkKeyer, index: bool
) -> None:
    extra = [] if index else ["--no-key-index"]
    with ServerProcess(tmp_path, pool_size="4M", extra_args=extra) as srv:
        h = MaruHandler(srv.url, timeout_s=2)
        try:
            conf = MaruConnectorConfig(server_url=srv.url, kv_chunk_tokens=C)
            s = MaruSchedulerConnector(conf, keyer, BS, client_factory=lambda: h)
            assert s.get_num_new_matched_tokens(req("r", tokens(300)), 0) == (0, False)
            (info,) = _scheduler_infos(srv.url)  # `maru stats` lists it; `maru doctor` checks it
            if index:
                assert info["paths"] == {
                    "exists": "key index",
                    "async_load_sharing": s.load_sharing,
                    "offer_pins": s.offer_pins_mode,
                    "reply_wait": "blocks (maru_scheduler_reply_spin_us 0, or fewer than 8 usable cores); sends and reads keep the GIL",
                    "key_epoch": "none (never reset)",
                }
                assert s.offer_pins_mode.startswith("off")  # hold_offers is the connector's to give
                assert info["slow"] == [] and s.load_sharing.startswith("n/a")
            else:
                assert info["paths"]["exists"].startswith("server round trip")
                (slow,) = info["slow"]
                assert "EXISTS are server round trips" in slow and "--no-key-index" in slow
                assert "maru doctor" in slow  # where the fix is
            assert s.probe_view()["probe_path"] == info["paths"]["exists"]
            # How its replies were waited for is in the view (this client blocks: no polling).
            assert s.probe_view()["reply_waits"] == h.reply_waits and h.reply_waits["spin_us"] == 0
            # A reset of the connector's cache (a weight update) is reported with its key epoch.
            s.reset_cache()
            (info,) = _scheduler_infos(srv.url)
            assert info["paths"]["key_epoch"] == s.keyer.space.epoch != ""
        finally:
            h.close()


def test_a_scheduler_whose_round_trips_give_the_gil_up_reports_it_as_a_slow_path(
    tmp_path: Any, keyer: ChunkKeyer, monkeypatch: Any
) -> None:
    """Without the GIL-keeping libzmq calls (``maru.client.gil_io``; here turned off), the scheduler
    says so in its paths and as a slow path with the reason and the fix (``maru doctor``)."""
    from maru.client import gil_io

    monkeypatch.setenv("MARU_GIL_IO", "0")
    gil_io._load.cache_clear()
    try:
        with ServerProcess(tmp_path, pool_size="4M") as srv:
            with MaruHandler(srv.url, timeout_s=2) as h:
                conf = MaruConnectorConfig(server_url=srv.url, kv_chunk_tokens=C)
                s = MaruSchedulerConnector(conf, keyer, BS, client_factory=lambda: h)
                assert s.get_num_new_matched_tokens(req("r", tokens(300)), 0) == (0, False)
                (info,) = _scheduler_infos(srv.url)
                assert h.reply_waits["gil_kept"] == 0
    finally:
        gil_io._load.cache_clear()
    assert info["paths"]["reply_wait"].endswith("; sends and reads through pyzmq")
    (slow,) = info["slow"]
    assert slow.startswith("vLLM's scheduling thread gives the GIL up") and "MARU_GIL_IO=0" in slow
    assert "Fix: pyzmq from its PyPI wheel" in slow


def test_probing_through_the_key_index_offers_what_round_trips_offer(server, keyer, client) -> None:
    """With the key index the full chunks are asked first and the tails only where the hit ends
    (fewer keys); the offers must be the round-trip strategy's exactly."""
    base = tokens(300, seed=40)
    mid = base[: 2 * C] + tokens(172, seed=41)  # two chunks of base, then a stored tail of 32
    short = tokens(40, seed=42)  # a prompt ending inside chunk 0: its 32-token tail is stored
    cold_tail = short[:33] + tokens(200, seed=43)  # shares only that tail
    remote = make_sched(server, keyer, client)
    for t in (base, mid[: 2 * C + 33], short):
        full, tail = stored_keys_of(remote, t)
        publish(server, full + ([tail] if tail else []))
    local = MaruHandler(server.url, timeout_s=2)
    try:
        local.exists(["warm-up"])  # connected: the key index is mapped
        assert local.local_exists.path == "key index"
        s = make_sched(server, keyer, local)
        prompts = {"full": base, "mid": mid, "cold-tail": cold_tail, "miss": tokens(300, seed=44)}
        for name, toks in prompts.items():
            for computed in (0, BS):
                want = remote.get_num_new_matched_tokens(req(f"r-{name}-{computed}", toks), computed)
                got = s.get_num_new_matched_tokens(req(f"l-{name}-{computed}", toks), computed)
                assert got == want, (name, computed)
        offers = {n: remote.get_num_new_matched_tokens(req(f"x-{n}", t), 0)[0] for n, t in prompts.items()}
        assert offers == {"full": 288, "mid": 2 * C + 32, "cold-tail": 32, "miss": 0}
        assert local.local_exists.counts()["exists_remote"] == 0
    finally:
        local.close()


def test_a_wait_for_another_requests_load_is_bounded_and_ends_with_that_request(
    server, keyer, monkeypatch, caplog
) -> None:
    """If the load waited for is never reported (a case not seen), the waiter loads its own copy
    after ``SHARED_LOAD_WAIT_S``: counted once per wait, logged and reported to the server once;
    and an aborted request's chunks are released at once (its load may never be reported)."""
    import logging

    from maru.vllm import load_admission

    now = [100.0]
    monkeypatch.setattr(load_admission, "time", SimpleNamespace(monotonic=lambda: now[0]))  # its clock only
    bound = load_admission.SHARED_LOAD_WAIT_S
    toks = tokens(300, seed=45)
    h = MaruHandler(server.url, timeout_s=2)  # reports client info: what `maru doctor` reads
    try:
        s = make_sched(server, keyer, h, async_load=True)
        full, tail = stored_keys_of(s, toks)
        publish(server, full + [tail])
        a = req("a", toks)
        assert s.get_num_new_matched_tokens(a, 0) == (288, True)
        s.update_state_after_alloc(a, blocks_obj(list(range(10))), 288)
        b = req("b", toks)
        assert s.get_num_new_matched_tokens(b, 0) == (None, False)
        now[0] += bound / 2
        assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # still within the bound
        now[0] += bound
        with caplog.at_level(logging.WARNING, logger="maru.vllm"):
            assert s.get_num_new_matched_tokens(b, 0) == (288, True)  # gave up waiting: loads itself
        assert s.stats.async_share_timeouts == 1 and s.stats.async_loads_shared == 2
        assert sum("loaded its own copy" in r.getMessage() for r in caplog.records) == 1
        notes = [n for i in _scheduler_infos(server.url) for n in i["slow"] if "never came" in n]
        assert len(notes) == 1 and "Fix:" in notes[0]
        # A later wait of the same request (e.g. matched again after a preemption) has its own clock.
        s.update_state_after_alloc(b, blocks_obj(list(range(10))), 288)
        s.update_connector_output(SimpleNamespace(finished_recving={"b"}, invalid_block_ids=set()))
        now[0] += 10 * bound
        assert s.get_num_new_matched_tokens(b, 0) == (None, False)  # a's load is still in flight
        assert s.stats.async_share_timeouts == 1
    finally:
        h.close()
    # A wait that ran out while the window is full is deferred by the window, step after step,
    # without waiting (or counting a timeout) again.
    w = make_sched(server, keyer, CountingClient(server.url), async_load=True, max_inflight_loads=1)
    assert w.get_num_new_matched_tokens(req("a", toks), 0) == (288, True)
    w.update_state_after_alloc(req("a", toks), blocks_obj(list(range(10))), 288)
    assert w.get_num_new_matched_tokens(req("b", toks), 0) == (None, False)
    now[0] += 2 * bound
    for _ in range(3):
        assert w.get_num_new_matched_tokens(req("b", toks), 0) == (None, False)
    assert (w.stats.async_share_timeouts, w.stats.async_loads_shared, w.stats.async_loads_deferred) == (
        1,
        1,
        3,
    )
    # An aborted owner: vLLM calls request_finished; nobody waits for its chunks any more.
    s2 = make_sched(server, keyer, CountingClient(server.url), async_load=True)
    assert s2.get_num_new_matched_tokens(req("a", toks), 0) == (288, True)
    s2.update_state_after_alloc(req("a", toks), blocks_obj(list(range(10))), 288)
    assert s2.get_num_new_matched_tokens(req("c", toks), 0) == (None, False)
    s2.request_finished(req("a", toks), [])
    s2.build_connector_meta(empty_out())  # the pass in which vLLM would have cached a's blocks
    assert s2.inflight_loads == set()
    assert s2.get_num_new_matched_tokens(req("c", toks), 0) == (288, True)


def test_async_loads_without_vllms_prefix_cache_are_announced_as_a_slower_path(
    tmp_path: Any, keyer: ChunkKeyer, caplog: Any
) -> None:
    import logging

    with ServerProcess(tmp_path, pool_size="4M") as srv:
        h = MaruHandler(srv.url, timeout_s=2)
        try:
            conf = MaruConnectorConfig(server_url=srv.url, kv_chunk_tokens=C, async_load=True)
            with caplog.at_level(logging.WARNING, logger="maru.vllm"):
                s = MaruSchedulerConnector(
                    conf, keyer, BS, client_factory=lambda: h, local_prefix_cache=False
                )
                s.get_num_new_matched_tokens(req("r", tokens(300)), 0)
                s.get_num_new_matched_tokens(req("q", tokens(300, seed=3)), 0)
            warned = [r.getMessage() for r in caplog.records if "not shared" in r.getMessage()]
            assert len(warned) == 1 and "enable_prefix_caching" in warned[0]  # once, with the fix
            (info,) = _scheduler_infos(srv.url)  # `maru doctor` lists a client's slow paths
            assert info["paths"]["async_load_sharing"] == s.load_sharing == "off (vLLM's prefix cache is off)"
            assert any("prefix caching on" in line for line in info["slow"])
            on = MaruSchedulerConnector(conf, keyer, BS, client_factory=lambda: h)
            assert on.load_sharing == "on"
        finally:
            h.close()


def test_with_timing_on_the_plan_says_what_vllm_scheduled_for_the_step_clock(
    server, keyer, client, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MARU_THREAD_CENSUS", raising=False)
    timed = make_sched(server, keyer, client, log_timing=True)
    untimed = make_sched(server, keyer, client)
    for s in (timed, untimed):
        s.get_num_new_matched_tokens(req("a", tokens(300)), 0)
    prefill = new_out("a", list(range(5)), 0, 200)
    prefill.num_scheduled_tokens["b"] = 1  # a decoding request beside it
    t0 = time.monotonic()
    meta = timed.build_connector_meta(prefill)
    assert (meta.step_tokens, meta.prefill) == (201, True)
    assert t0 <= meta.scheduled_at <= time.monotonic()  # when it was planned, for the worker's clock
    assert meta.scheduled_cpu[:2] == (os.getpid(), threading.get_ident())  # where: this thread
    assert meta.scheduled_threads == {}  # the thread census is a diagnosis of its own
    monkeypatch.setenv("MARU_THREAD_CENSUS", "1")
    censused = timed.build_connector_meta(new_out("a", list(range(5)), 0, 200))
    assert threading.get_native_id() in censused.scheduled_threads  # a prefill step: censused
    decode = cached_out("a", None, 300, 1)
    decode.num_scheduled_tokens["b"] = 1
    assert (lambda m: (m.step_tokens, m.prefill))(timed.build_connector_meta(decode)) == (2, False)
    assert (lambda m: (m.step_tokens, m.prefill))(timed.build_connector_meta(empty_out())) == (0, False)
    # Off (the default), nothing is counted; whether the step has prefill is still said, for the
    # workers' hold of their stores (maru_store_yield_to_prefill_ms, on by default).
    meta = untimed.build_connector_meta(new_out("a", list(range(5)), 0, 200))
    assert (meta.step_tokens, meta.prefill, meta.scheduled_at, meta.scheduled_cpu) == (0, True, 0.0, ())
    ungated = make_sched(server, keyer, client, store_yield_to_prefill_ms=0)
    ungated.get_num_new_matched_tokens(req("a", tokens(300)), 0)
    assert not ungated.build_connector_meta(new_out("a", list(range(5)), 0, 200)).prefill
