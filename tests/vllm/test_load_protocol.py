"""Which load protocol the connector uses on which vLLM model runner (vLLM issue #49250).

vLLM's V2 model runner cannot recompute a failed load of a request it is already running (the
device keeps the request's old position). With offer pins (the default) no eviction can fail a
load, so same-step loads stay, and vLLM is told to end a request whose load still failed with an
error (``kv_load_failure_policy=fail``) rather than recompute on KV never placed. Without offer
pins, or when the runner is unknown, every load goes through vLLM's asynchronous protocol: the
request waits until its load is done or failed and is then added to the runner afresh. The facade
is built here on the parts of a vLLM config it reads, against a real server; what the scheduler
side then offers and plans is checked step by step.
"""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import pytest

from maru.vllm.config import MaruConnectorConfig
from tests.helpers import ServerProcess, flat, maru, reported_slow
from tests.pool_fixtures import module_server
from tests.transfer.helpers import case
from tests.vllm.helpers import (
    BS,
    C,
    blocks_obj,
    empty_out,
    new_out,
    publish,
    req,
    stored_keys_of,
    tokens,
    vllm_config,
)

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from maru.vllm.connector import MaruKVConnector  # noqa: E402
from maru.vllm.engine_config import same_step_load_failures_unrecoverable  # noqa: E402

server = module_server("protocol", pool_size="16M")


def scheduler_side(server: ServerProcess, v2: Any, **extra: Any) -> MaruKVConnector:
    return MaruKVConnector(vllm_config(server.url, v2, **extra), KVConnectorRole.SCHEDULER)


def worker_side(server: ServerProcess, v2: Any, **extra: Any) -> MaruKVConnector:
    """The worker side over CPU caches of the config's geometry, connected (it reports its paths)."""
    cfg = vllm_config(server.url, v2, **extra)
    cfg.compilation_config = SimpleNamespace(static_forward_context={})
    conn = MaruKVConnector(cfg, KVConnectorRole.WORKER)
    cache = case(
        "kv_first", "NHD", 5, num_blocks=8, block_size=BS, num_kv_heads=2, head_size=32, num_layers=2
    )
    conn.register_kv_caches({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(cache.caches)})
    return conn


def offer_of_a_stored_prompt(server: ServerProcess, conn: MaruKVConnector, seed: int) -> tuple[Any, Any]:
    s = conn.maru_scheduler
    assert s is not None
    toks = tokens(300, seed=seed)
    full, tail = stored_keys_of(s, toks)
    publish(server, full + [tail])
    r = req("a", toks)
    return r, conn.get_num_new_matched_tokens(r, 0)


def test_on_the_v2_model_runner_offer_pins_keep_same_step_loads_and_failures_end_the_request(server) -> None:
    vc = vllm_config(server.url, True, maru_log_timing=True)  # the hooks' parts timed (read below)
    conn = MaruKVConnector(vc, KVConnectorRole.SCHEDULER)
    assert not conn.maru_config.async_load and conn.maru_stats()["fallbacks"] == []
    said = conn.maru_stats()["load_failures_fail"]
    assert "vLLM issue #49250" in said and "VLLM_USE_V2_MODEL_RUNNER=0" in said
    assert vc.kv_transfer_config.kv_load_failure_policy == "fail"  # an error, never KV not placed
    # Offers wait for the worker's word that it can load (each step's MaruWorkerMeta).
    worker = worker_side(server, True)
    said = worker.build_connector_worker_meta()
    worker.shutdown()
    assert said is not None and (said.ready, said.unready) == (1, 0)
    conn.update_connector_output(SimpleNamespace(kv_connector_worker_meta=said, invalid_block_ids=set()))
    r, offer = offer_of_a_stored_prompt(server, conn, seed=30)
    assert offer == (288, False)
    conn.update_state_after_alloc(r, blocks_obj(list(range(10))), 288)
    (load,) = conn.build_connector_meta(new_out("a", list(range(10)), 288, 12)).loads
    assert load.ticket and len(load.held) == 5  # pinned from the offer on: no eviction can fail it
    parts = conn.maru_stats()["hook_ms"]
    assert parts["get_num_new_matched_tokens/pin"]["calls"] == 1  # the offer's round trip, timed
    sched = conn.maru_scheduler
    assert sched is not None and sched.stats.server_wakes >= 1  # posted before a probe whose pin follows
    assert "build_connector_meta/pin" not in parts  # none again for the step
    # Its cost (a round trip per request with a hit) is a slow path `maru doctor` shows, with the fix.
    [slow] = [v for v in reported_slow(server).values() if any("per request with a hit" in n for n in v)]
    assert len(slow) == 1 and "VLLM_USE_V2_MODEL_RUNNER=0" in slow[0]
    conn.shutdown()
    # The V1 runner (or none) recomputes a failed load: the policy stays "recompute".
    vc1 = vllm_config(server.url, False)
    conn = MaruKVConnector(vc1, KVConnectorRole.SCHEDULER)
    assert vc1.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert conn.maru_stats()["load_failures_fail"] == ""
    conn.shutdown()


def test_on_the_v2_runner_the_workers_word_at_engine_start_lets_the_first_request_load(server) -> None:
    """vLLM collects each worker's handshake metadata after it registered its KV caches and hands
    them to the scheduler side before the first request (``EngineCore``): the first request's hit
    is offered without waiting for a step's report. A worker that cannot load keeps offers withheld."""
    worker = worker_side(server, True)
    said = worker.get_handshake_metadata()
    assert said is not None and (said.ready, said.unready) == (1, 0)
    conn = scheduler_side(server, True)
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): said})  # vLLM's entry point, as EngineCore calls it
    r, offer = offer_of_a_stored_prompt(server, conn, seed=31)
    assert offer == (288, False)  # the first request, no step run yet
    conn.shutdown()
    assert worker._worker is not None
    worker._worker._lost("a test: the server went away")
    conn = scheduler_side(server, True)
    conn.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})
    _, offer = offer_of_a_stored_prompt(server, conn, seed=32)
    assert offer == (0, False)  # computed: a same-step load there would end the request
    assert conn.maru_scheduler is not None and conn.maru_scheduler.stats.offers_withheld == 1
    conn.shutdown()
    worker.shutdown()
    w1 = worker_side(server, False)  # the V1 runner recomputes a failed load: nothing to say
    assert w1.get_handshake_metadata() is None
    w1.shutdown()


def test_on_the_v2_model_runner_without_offer_pins_a_synchronous_connector_loads_while_the_request_waits(
    server,
) -> None:
    conn = scheduler_side(server, True, maru_hold_offers=False)
    assert conn.maru_config.async_load and not conn.maru_config.overlap_load_with_compute
    [fallback] = conn.maru_stats()["fallbacks"]  # the replacement is not only a log line
    assert "vLLM issue #49250" in fallback and "VLLM_USE_V2_MODEL_RUNNER=0" in fallback
    # ... and it says what it costs: shorter hits are computed (the async minimum, here a chunk).
    assert f"fewer than {conn.maru_config.min_async_load()} tokens" in fallback
    r, offer = offer_of_a_stored_prompt(server, conn, seed=31)
    assert offer == (288, True)  # vLLM parks the request until the load is done or failed
    conn.update_state_after_alloc(r, blocks_obj(list(range(10))), 288)
    meta = conn.build_connector_meta(empty_out())
    # The load runs while the request is not in the runner: no same-step load to fail.
    assert not meta.loads and [lt.req_id for lt in meta.async_loads] == ["a"]


def test_on_the_v1_model_runner_synchronous_loads_stay_in_the_step_that_computes(server) -> None:
    # None: no such attribute, in a vLLM that has the V1 runner (before the V2 one came).
    for v2 in (False, None):
        conn = scheduler_side(server, v2)
        assert not conn.maru_config.async_load and conn.maru_stats()["fallbacks"] == []
        _, offer = offer_of_a_stored_prompt(server, conn, seed=32)
        assert offer == (288, False)


def test_a_vllm_with_only_the_v2_runner_and_no_flag_gets_the_v2_protocol_and_no_advice_to_use_v1(
    server, monkeypatch
) -> None:
    # vLLM 0.34 removed the V1 runner and ``use_v2_model_runner`` with it (and refuses to start with
    # VLLM_USE_V2_MODEL_RUNNER=0): a missing flag there must not read as the V1 runner.
    from maru.vllm import model_runner

    monkeypatch.setattr(model_runner, "has_v1_runner", lambda: False)
    vc = vllm_config(server.url, None)
    assert not hasattr(vc, "use_v2_model_runner")
    assert "only one" in (same_step_load_failures_unrecoverable(vc) or "")
    conn = MaruKVConnector(vc, KVConnectorRole.SCHEDULER)
    try:
        said = conn.maru_stats()["load_failures_fail"]
        assert "vLLM issue #49250" in said and vc.kv_transfer_config.kv_load_failure_policy == "fail"
        assert "VLLM_USE_V2_MODEL_RUNNER" not in said and "maru_async_load=true" in said
    finally:
        conn.shutdown()
    switched = MaruConnectorConfig(kv_chunk_tokens=C).loading_before_the_request_runs("test")
    assert "VLLM_USE_V2_MODEL_RUNNER" not in switched.fallbacks[0]
    assert "maru_async_load=true" in switched.fallbacks[0]


def test_layer_overlap_and_an_unknown_runner_also_load_before_the_request_runs(server) -> None:
    conn = scheduler_side(server, True, maru_overlap_load_with_compute=True, maru_hold_offers=False)
    assert conn.maru_config.async_load and not conn.maru_config.overlap_load_with_compute

    def unknown() -> bool:
        raise RuntimeError("no platform")

    assert "could not tell" in (same_step_load_failures_unrecoverable(vllm_config("u", unknown)) or "")

    def inside() -> bool:  # the flag exists but reading it fails inside vLLM: not "no flag"
        raise AttributeError("platform has no device_config")

    assert "could not tell" in (same_step_load_failures_unrecoverable(vllm_config("u", inside)) or "")
    conn = scheduler_side(server, unknown)
    assert conn.maru_config.async_load
    _, offer = offer_of_a_stored_prompt(server, conn, seed=33)
    assert offer == (288, True)


def test_switching_protocol_keeps_every_other_setting_and_skips_configs_without_same_step_loads() -> None:
    base = MaruConnectorConfig(kv_chunk_tokens=C, max_inflight_loads=7, async_store=True)
    switched = base.loading_before_the_request_runs("test")
    assert (
        switched.async_load and {**switched.__dict__, "async_load": False, "fallbacks": ()} == base.__dict__
    )
    # The replacement is a fallback the worker reports (reason and fix), not only a log line.
    assert len(switched.fallbacks) == 1 and "test" in switched.fallbacks[0]
    assert "VLLM_USE_V2_MODEL_RUNNER=0" in switched.fallbacks[0]
    assert "maru_fallbacks" not in MaruConnectorConfig.valid_keys()  # not a setting
    already = MaruConnectorConfig(async_load=True)
    assert already.loading_before_the_request_runs("test") is already
    off = MaruConnectorConfig(enable_load=False)
    assert off.loading_before_the_request_runs("test") is off


def test_the_v2_runner_fallback_is_a_reported_slow_path_that_maru_doctor_shows(server) -> None:
    before = reported_slow(server)
    conn = worker_side(server, True, maru_hold_offers=False)
    try:
        [slow] = [v for k, v in reported_slow(server).items() if k not in before]
        assert len(slow) == 1 and "vLLM issue #49250" in slow[0], slow
        assert "VLLM_USE_V2_MODEL_RUNNER=0" in slow[0]
        p = maru("doctor", "--url", server.url, "--quick")
        out = flat(p.stdout)
        assert p.returncode == 0, p.stdout + p.stderr  # a slow path warns; it is not a failure
        assert "serving clients' data paths (optional) warn" in out, out
        # (Other tests' clients of this module's server may report slow paths of their own.)
        assert re.search(r"\(\d+ slow\)", out), out
        fixes = out.split("fix: ", 1)[1]  # every reporting client's slow paths, one a line
        assert "vllm-connector" in fixes and "VLLM_USE_V2_MODEL_RUNNER=0" in fixes
    finally:
        conn.shutdown()


def test_on_the_v1_runner_and_on_v2_with_offer_pins_the_worker_reports_no_slow_path(server) -> None:
    for v2 in (False, True):
        before = reported_slow(server)
        conn = worker_side(server, v2)
        try:
            assert [v for k, v in reported_slow(server).items() if k not in before] == [[]]
        finally:
            conn.shutdown()


def test_the_facade_counts_the_host_time_of_each_hook_it_serves(server, caplog) -> None:  # noqa: ANN001
    conn = scheduler_side(server, None, maru_log_timing=True)
    r, _ = offer_of_a_stored_prompt(server, conn, seed=37)
    conn.update_state_after_alloc(r, blocks_obj(list(range(10))), 288)
    conn.build_connector_meta(empty_out())
    conn.build_connector_meta(empty_out())
    stats = conn.maru_stats()["hook_ms"]
    hooks = {k: v for k, v in stats.items() if "/" not in k}
    assert {k: v["calls"] for k, v in hooks.items()} == {
        "get_num_new_matched_tokens": 1,
        "update_state_after_alloc": 1,
        "build_connector_meta": 2,
    }
    assert all(v["ms"] > 0 for v in hooks.values())
    # Where the hooks' time went: the probe inside the match, the step's pins inside the step.
    parts = {k: v for k, v in stats.items() if "/" in k}
    assert set(parts) == {
        "get_num_new_matched_tokens/keys",  # (the test's own store of the prompt hashed it too)
        "get_num_new_matched_tokens/probe",
        "build_connector_meta/pin",
    }
    assert parts["get_num_new_matched_tokens/probe"]["calls"] == 1
    assert parts["get_num_new_matched_tokens/probe"]["ms"] <= hooks["get_num_new_matched_tokens"]["ms"]
    assert parts["build_connector_meta/pin"]["calls"] == 1  # one round trip, in the first step only
    assert parts["build_connector_meta/pin"]["ms"] <= hooks["build_connector_meta"]["ms"]
    with caplog.at_level("INFO", logger="maru"):
        conn.shutdown()
    [line] = [r.getMessage() for r in caplog.records if "host time in vLLM's hooks" in r.getMessage()]
    assert "(scheduler)" in line and "build_connector_meta 2 calls" in line


def test_the_scheduler_sides_client_polls_for_replies_and_the_workers_blocks(server) -> None:
    """vLLM's scheduling thread keeps the GIL while a round trip is out (maru_scheduler_reply_spin_us);
    the worker's round trips run beside the forward and block as usual."""
    conn = scheduler_side(server, True, maru_scheduler_reply_spin_us=500)
    r, offer = offer_of_a_stored_prompt(server, conn, seed=41)  # connects; pins at the offer (V2)
    waits = conn.maru_stats()["reply_waits"]
    assert waits["spin_us"] == 500 and waits["replies_spun"] + waits["spun_out"] >= 1
    conn.shutdown()
    unset = scheduler_side(server, True)  # the default: as many us as this machine's cores allow
    offer_of_a_stored_prompt(server, unset, seed=43)
    assert unset.maru_stats()["reply_waits"]["spin_us"] == unset.maru_config.reply_spin_us()
    unset.shutdown()
    off = scheduler_side(server, True, maru_scheduler_reply_spin_us=0)
    offer_of_a_stored_prompt(server, off, seed=42)
    assert off.maru_stats()["reply_waits"] == {"spin_us": 0, "gil_kept": 1, "replies_spun": 0, "spun_out": 0}
    off.shutdown()
    worker = worker_side(server, True)
    assert worker.maru_worker is not None and worker.maru_worker._client.reply_waits["spin_us"] == 0
    worker.shutdown()


def test_the_scheduler_side_connects_and_reports_at_engine_start_before_any_request(
    server: ServerProcess, tmp_path: Any
) -> None:
    """The handshake and the report of the scheduler's paths happen when vLLM builds the connector,
    not in the first request's probe: ``maru stats`` lists the scheduler before it served anything."""
    from maru.client import MaruHandler

    def schedulers() -> list[str]:
        with MaruHandler(server.url, timeout_s=2) as h:
            clients = h.stats()["clients"]
        return [c["client_id"] for c in clients if (c.get("info") or {}).get("role") == "vllm-scheduler"]

    before = set(schedulers())
    conn = scheduler_side(server, True)
    s = conn.maru_scheduler
    assert s is not None and s.probe_view()["probe_path"] == "key index"  # connected, no probe yet
    assert len(set(schedulers()) - before) == 1
    s.shutdown()
    # An unreachable server at start costs a warning, not the engine (the probe tries again later).
    with ServerProcess(tmp_path, pool_size="4M") as dead:
        url = dead.url
    down = scheduler_side(SimpleNamespace(url=url), True, maru_timeout_s=0.3)
    assert down.maru_scheduler is not None and down.maru_scheduler.probe_view() == {
        "probe_path": "no server connection"
    }


def test_a_plan_that_failed_makes_the_worker_report_every_accepted_loads_blocks_failed(
    server, monkeypatch
) -> None:
    """The scheduler side's plan of a step whose planning raised (``_failed_plan``) is carried out
    by a real worker: every block of the accepted load is reported failed, so vLLM recomputes it
    (never runs on blocks nobody wrote)."""
    conn = scheduler_side(server, False)
    worker = worker_side(server, False)
    try:
        r, offer = offer_of_a_stored_prompt(server, conn, seed=38)
        assert offer == (288, False)
        conn.update_state_after_alloc(r, blocks_obj(list(range(10))), 288)
        sched = conn.maru_scheduler
        assert sched is not None

        def broken() -> None:
            raise RuntimeError("a bug in planning")

        monkeypatch.setattr(sched, "_pin_step_loads", broken)
        meta = conn.build_connector_meta(new_out("a", list(range(10)), 288, 12))
        w = worker.maru_worker
        assert w is not None
        w.start_load_kv(meta)
        assert worker.get_block_ids_with_load_errors() == set(range(9))
        assert w.stats.load_errors == 1
    finally:
        worker.shutdown()
        conn.shutdown()


def test_under_vllms_sleep_mode_maru_runs_unless_told_not_to(server) -> None:
    """Maru runs under vLLM's sleep mode (its worker's device state made outside the KV-cache pool a
    sleep discards, ``maru.vllm.own_thread``: run on an H100); ``maru_allow_sleep_mode=false`` keeps
    it off there, said once and kept in its fallbacks (``maru_stats``)."""
    for extra, allowed in (({}, True), ({"maru_allow_sleep_mode": False}, False)):
        vc = vllm_config(server.url, False, **extra)
        vc.model_config.enable_sleep_mode = True
        conn = MaruKVConnector(vc, KVConnectorRole.SCHEDULER)
        try:
            cfg = conn.maru_config
            assert (cfg.enable_load, cfg.enable_store) == (allowed, allowed)
            said = [f for f in cfg.fallbacks if "sleep mode" in f]
            assert (
                (said == []) if allowed else ("maru_allow_sleep_mode=false" in said[0] and "Fix:" in said[0])
            )
        finally:
            conn.shutdown()


def test_only_a_sleep_mode_engines_worker_makes_its_device_state_on_a_thread_of_its_own(server) -> None:
    for sleep_mode in (False, True):
        vc = vllm_config(server.url, False)
        vc.model_config.enable_sleep_mode = sleep_mode
        vc.compilation_config = SimpleNamespace(static_forward_context={})
        conn = MaruKVConnector(vc, KVConnectorRole.WORKER)
        try:
            assert conn.maru_worker is not None and conn.maru_worker.sleep_mode is sleep_mode
        finally:
            conn.shutdown()
