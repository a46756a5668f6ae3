"""vLLM's reset of the connector's cache (``reset_cache``: weight updates, sleeps, explicit resets).

After a reset the engine may run other weights: it must never offer what was stored before (that
KV would be another model's), never store a request alive across the reset (its KV may be mixed),
and what it stores afterwards must be invisible to an instance that did not reset, while the
others keep loading what they stored. Driven step by step against a real server, as
test_vllm_scheduler.py; real vLLM does the same in tests/e2e/test_vllm_isolation_e2e.py.
"""

from __future__ import annotations

import dataclasses
import logging
from types import SimpleNamespace

from maru.vllm.connector import MaruKVConnector
from maru.vllm.keys import ChunkKeyer
from tests.pool_fixtures import module_server
from tests.vllm.helpers import (
    C,
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

server = module_server("reset", pool_size="16M")


def stored_keys(sched, rid: str, toks: list[int], blocks: list[int]) -> list[str]:
    """The keys ``sched`` plans to store for a cold request of ``toks`` computed in one step."""
    r = req(rid, toks)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    sched.update_state_after_alloc(r, blocks_obj(blocks), 0)
    meta = sched.build_connector_meta(new_out(rid, blocks, 0, len(toks)))
    return [c.key for rt in meta.stores for c in rt.chunks]


def test_after_a_reset_nothing_stored_before_is_offered_and_new_stores_use_the_new_epochs_keys(
    server, keyer, client
) -> None:
    s = make_sched(server, keyer, client)
    before, full, tail, offer = stored_then_asked(server, s, seed=1, rid="before")
    assert offer == (288, False)
    toks = before.prompt_token_ids

    assert s.reset_cache() is True
    epoch = s.keyer.space.epoch
    assert epoch and s.keyer.space == dataclasses.replace(keyer.space, epoch=epoch)
    # The same prompt on this engine: nothing offered, every chunk and the tail stored again, under
    # the keys of the new epoch (computed independently here), none of them an old one.
    new = stored_keys(s, "after", toks, list(range(10)))
    ref = ChunkKeyer(dataclasses.replace(keyer.space, epoch=epoch))
    expected = ref.prompt_keys(toks).full
    assert new[: len(expected)] == expected and len(new) == len(full) + 1
    assert not set(new) & set(full + [tail])

    # An instance that did not reset still loads what it stored: those bytes are its weights' KV.
    other = make_sched(server, keyer, client)
    assert other.get_num_new_matched_tokens(req("other", toks), 0) == (288, False)
    # Once the new epoch's stores are in the pool, this engine loads them (it shares with itself).
    publish(server, new)
    assert s.get_num_new_matched_tokens(req("again", toks), 0) == (288, False)
    # ... and the instance that did not reset never sees them: its offer stays on its own keys.
    other_keys = other._reqs["other"].keys.full
    assert other_keys == full


def test_a_request_alive_at_the_reset_is_never_loaded_for_nor_stored_and_its_frees_stay_owed(
    server, keyer, client
) -> None:
    s = make_sched(server, keyer, client)  # write-behind (maru_async_store) is the default
    toks = tokens(300, seed=2)
    full, tail = stored_keys_of(s, toks)
    a = req("a", toks)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, blocks_obj([0, 1, 2, 3]), 0)
    meta = s.build_connector_meta(new_out("a", [0, 1, 2, 3], 0, 128))
    assert [c.key for rt in meta.stores for c in rt.chunks] == full[:2]

    s.reset_cache()
    assert s.stats.requests_frozen == 1
    # vLLM keeps running it: its next chunks hold KV computed on top of the old weights' KV.
    meta = s.build_connector_meta(cached_out("a", [4, 5, 6, 7, 8, 9], 128, 172))
    assert not meta.stores and not meta.loads
    # Its store of the first step is still owed a finished_sending: its free stays delayed.
    assert s.request_finished(a, []) == (True, None)

    # Requests alive at the reset, which preempted them. One comes back on a hit in vLLM's own
    # cache (a reset of vLLM's that failed kept the old KV): computed, never asked about, never
    # stored, even with every chunk present under the old keys.
    b, c = req("b", toks), req("c", toks)
    assert s.get_num_new_matched_tokens(b, 0) == (0, False)  # before: nothing stored yet
    assert s.get_num_new_matched_tokens(c, 0) == (0, False)
    publish(server, full + [tail])
    s.reset_cache()
    s.build_connector_meta(cached_out("x", None, 0, 0, preempted={"b", "c"}))
    calls = client.exists_calls
    assert s.get_num_new_matched_tokens(b, C) == (0, False)
    assert client.exists_calls == calls
    s.update_state_after_alloc(b, blocks_obj(list(range(10))), 0)
    meta = s.build_connector_meta(cached_out("b", list(range(10)), C, 300 - C, resumed=True))
    assert not meta.stores and not meta.loads
    assert s.request_finished(b, []) == (False, None)  # preempted: its earlier stores were dropped
    # The other comes back with nothing computed: all it holds is computed from now on, so it is
    # keyed afresh under the new epoch (nothing stored before offered; stored under new keys).
    assert s.get_num_new_matched_tokens(c, 0) == (0, False)
    assert s.stats.requests_rekeyed == 1 and client.exists_calls > calls
    s.update_state_after_alloc(c, blocks_obj(list(range(10))), 0)
    meta = s.build_connector_meta(cached_out("c", list(range(10)), 0, 300, resumed=True))
    keys = [ch.key for rt in meta.stores for ch in rt.chunks]
    assert keys[:4] == ChunkKeyer(s.keyer.space).prompt_keys(toks).full and not set(keys) & set(full + [tail])


def test_a_request_the_reset_preempted_is_keyed_afresh_in_vllms_call_order(server, keyer, client) -> None:
    """vLLM preempts the running requests inside its reset and reports it in the next step's plan,
    after asking about them again: a request that stored (write-behind ``sending``) is asked with
    nothing computed before that plan says it was preempted. It is keyed afresh all the same, and
    stores its chunks under the new epoch; its free is delayed only for those new stores."""
    s = make_sched(server, keyer, client)
    toks = tokens(300, seed=6)
    a = req("a", toks)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)
    s.update_state_after_alloc(a, blocks_obj(list(range(10))), 0)
    old = [
        ch.key
        for rt in s.build_connector_meta(new_out("a", list(range(10)), 0, 300)).stores
        for ch in rt.chunks
    ]
    assert len(old) == 5 and s._reqs["a"].sending
    s.reset_cache()  # vLLM preempts "a" in its reset (reset_running_requests)
    assert s.get_num_new_matched_tokens(a, 0) == (0, False)  # asked before the plan that says so
    assert s.stats.requests_rekeyed == 1 and not s._reqs["a"].frozen
    s.update_state_after_alloc(a, blocks_obj(list(range(10, 20))), 0)
    meta = s.build_connector_meta(cached_out("a", list(range(10, 20)), 0, 300, resumed=True, preempted={"a"}))
    new = [ch.key for rt in meta.stores for ch in rt.chunks]
    assert new[:4] == ChunkKeyer(s.keyer.space).prompt_keys(toks).full and not set(new) & set(old)
    assert s.request_finished(a, []) == (True, None)  # the new stores are owed a finished_sending


def test_a_load_pending_at_the_reset_and_lost_with_the_next_plan_is_failed_once(
    server, keyer, client, monkeypatch
) -> None:
    s = make_sched(server, keyer, client, async_load=True, async_min_load_tokens=1)
    a, _, _, offer = stored_then_asked(server, s, seed=5, rid="a")
    assert offer == (288, True)
    s.update_state_after_alloc(a, blocks_obj(list(range(10))), 288)
    s.reset_cache()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in planning")

    monkeypatch.setattr(s, "_pin_step_loads", broken)
    meta = s.build_connector_meta(empty_out())
    assert [lt.req_id for lt in meta.async_loads] == ["a"]  # once: vLLM would crash on a second report


def test_a_load_pending_at_the_reset_or_accepted_after_it_is_planned_to_fail(server, keyer, client) -> None:
    """vLLM counts an accepted load's tokens as computed: a reset between the acceptance and the
    plan (vLLM 0.34 may defer ``update_state_after_alloc``) must neither drop the load (the model
    would run on blocks never written) nor load the old epoch's KV: it goes out failing."""
    s = make_sched(server, keyer, client, async_load=True, async_min_load_tokens=1)
    a, _, _, offer = stored_then_asked(server, s, seed=3, rid="a")
    b, _, _, offer_b = stored_then_asked(server, s, seed=4, rid="b")
    assert offer == offer_b == (288, True)
    s.update_state_after_alloc(a, blocks_obj(list(range(10))), 288)  # accepted: pending
    s.reset_cache()
    s.update_state_after_alloc(b, blocks_obj(list(range(10, 20))), 288)  # accepted after it
    meta = s.build_connector_meta(empty_out())
    got = {lt.req_id: [(ch.key, ch.start, ch.num_tokens) for ch in lt.chunks] for lt in meta.async_loads}
    assert got == {"a": [("", 0, 288)], "b": [("", 0, 288)]} and not meta.loads
    assert s._doomed == [] and s._offered == []
    # The next step plans them no more (vLLM waits for their failures only once).
    assert not s.build_connector_meta(empty_out()).async_loads


def test_each_reset_is_a_new_epoch_said_once_and_counted(server, keyer, client, caplog) -> None:
    s = make_sched(server, keyer, client)
    epochs = []
    with caplog.at_level(logging.WARNING, logger="maru.vllm"):
        for _ in range(3):
            s.reset_cache()
            epochs.append(s.keyer.space.epoch)
    assert len(set(epochs)) == 3 and "" not in epochs
    said = [r.getMessage() for r in caplog.records if "reset its caches" in r.getMessage()]
    assert len(said) == 3 and all(e in m for e, m in zip(epochs, said, strict=True))
    assert s.stats.cache_resets == 3


def test_the_connector_reports_a_reset_that_failed_as_failed() -> None:
    class Broken:
        def reset_cache(self) -> bool:
            raise RuntimeError("boom")

    # vLLM reads False as "the reset failed" (and says so): never a silent success.
    assert MaruKVConnector.reset_cache(SimpleNamespace(_scheduler=Broken())) is False
    assert MaruKVConnector.reset_cache(SimpleNamespace(_scheduler=None)) is None  # the worker side
