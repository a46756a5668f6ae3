"""The API benchmark's plan (bench/api_workload.py): pass order by repetition and store variants.

No vLLM here: what is checked is which instances run in which order, which a wrong plan would
silently bias (a variant always measured right after the store that drains behind it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import api_workload as aw

SERVERS = dict.fromkeys(["none", "store", "load", "load-async", "store-idle", "store-probe"])


def _cold(rep: int) -> list[str]:
    return [label for key, label in aw._passes(SERVERS, rep) if label.startswith("cold")]  # type: ignore[arg-type]


def test_every_cold_instance_takes_every_place_over_the_repetitions() -> None:
    orders = [_cold(rep) for rep in range(4)]
    assert len({tuple(o) for o in orders}) == 4
    for place in range(4):
        assert len({o[place] for o in orders}) == 4  # each place held by a different instance
    assert all(sorted(o) == sorted(orders[0]) for o in orders)


@pytest.mark.parametrize("rep", range(4))
def test_the_passes_that_need_a_cold_one_come_after_it(rep: int) -> None:
    keys = [key for key, _ in aw._passes(SERVERS, rep)]  # type: ignore[arg-type]
    labels = [label for _, label in aw._passes(SERVERS, rep)]  # type: ignore[arg-type]
    assert labels.index("vLLM's own prefix hit") > labels.index("cold, no connector")
    assert keys.index("load") > keys.index("store")
    assert keys.index("load-async") > keys.index("store")


def test_alt_variants_name_a_tree_under_dot_ab(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert aw.check_store_variant("alt-nocopy") == "alt-nocopy"
    assert aw.store_variant("alt-nocopy") == aw.API_STORES["alt"]
    assert "tree .ab/nocopy" in aw.store_label("alt-nocopy")
    with pytest.raises(ValueError, match="unknown store variant"):
        aw.check_store_variant("nocopy")
    with pytest.raises(SystemExit, match=r"\.ab/no-such-tree-here"):
        aw.store_env("alt-no-such-tree-here")
    (tmp_path / "maru").mkdir()
    monkeypatch.setenv("MARU_BENCH_ALT_TREE", str(tmp_path))
    assert aw.store_env("alt") == {"MARU_BENCH_ALT_TREE_USED": str(tmp_path)}
    assert aw.store_env("probe") is None


def test_the_second_plain_instance_has_no_connector() -> None:
    specs = aw.api_instances(lambda ns, cfg: {"ns": ns, **cfg}, ["default"], ["none", "probe"], False)
    assert specs["none"] is None and specs["store-none"] is None
    assert specs["store-probe"] is not None and specs["store"] is not None


def test_a_pass_row_has_each_rounds_mean_and_each_repetitions_median() -> None:
    import random

    rng = random.Random(3)
    recs = [
        {"round": rnd, "rep": rep, "ttft": rng.uniform(0.01, 0.2), "text": "x"}
        for rep in range(3)
        for rnd in range(4)
        for _ in range(5)
    ]
    row = {"label": "cold", "records": recs, "tokens_loaded": 0}
    aw._finish_row(row)
    for rnd in range(4):
        mine = [r["ttft"] for r in recs if r["round"] == rnd]
        assert row["round_mean_s"][rnd] == pytest.approx(sum(mine) / len(mine))
    assert len(row["rep_p50_s"]) == 3 and row["n"] == len(recs)
    assert min(row["round_mean_s"]) <= row["mean_s"] <= max(row["round_mean_s"])


def test_the_runner_label_says_which_model_runner_the_environment_chose() -> None:
    from bench.gpu_vllm_e2e import runner_label

    assert runner_label({}) == "vLLM's default model runner"
    assert runner_label({"VLLM_USE_V2_MODEL_RUNNER": "0"}).startswith("V1 model runner")
    assert runner_label({"VLLM_USE_V2_MODEL_RUNNER": "1"}).startswith("V2 model runner")


def test_a_pass_whose_processes_do_not_fit_the_card_is_refused_with_what_to_leave_out() -> None:
    gib = 1 << 30
    # The twenty-ninth pass's first API call on an H100: 9 servers of 6 GiB weights + 4 GiB KV.
    why = aw.gpu_memory_shortfall(79 * gib, 6 * gib, [4 * gib] * 9)
    assert why is not None and "9 vLLM processes" in why and "--api-pair" in why and "79 GiB free" in why
    assert aw.gpu_memory_shortfall(140 * gib, 6 * gib, [4 * gib] * 9) is None  # an H200 holds them
    assert aw.gpu_memory_shortfall(79 * gib, 6 * gib, [4 * gib] * 6) is None  # the call that ran
    # The fifty-eighth pass's first A/B on an H100: 7 API servers, 3 of them with a store helper
    # process each (the last engine died at start, CUDA out of memory).
    why = aw.gpu_memory_shortfall(int(77.4 * gib), int(5.5 * gib), [4 * gib] * 7, helpers=3)
    assert why is not None and "3 store helper processes" in why
    assert aw.gpu_memory_shortfall(int(77.4 * gib), int(5.5 * gib), [4 * gib] * 6, helpers=2) is None


def test_an_alt_tree_runs_with_the_config_keys_of_its_kv_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench.ab_tree import write_kv

    monkeypatch.setattr(aw, "AB_DIR", tmp_path)
    tree = tmp_path / "helper-nodevice"
    tree.mkdir()
    assert aw.store_variant("alt-helper-nodevice") == aw.API_STORES["alt"]  # no kv.json: the default's
    write_kv(tree, '{"maru_store_helper": true, "maru_async_store": false}')
    assert aw.store_variant("alt-helper-nodevice") == {"maru_async_store": False, "maru_store_helper": True}
    write_kv(tree, None)  # made again without --kv: the file goes
    assert aw.store_variant("alt-helper-nodevice") == aw.API_STORES["alt"]
    for bad in ('["maru_store_helper"]', '{"store_helper": true}', "{"):
        with pytest.raises(ValueError):
            write_kv(tree, bad)
    assert not (tree / "kv.json").exists()


def test_scheduler_line_reads_the_last_periodic_line_old_and_new(tmp_path) -> None:
    log = tmp_path / "engine.log"
    head = "INFO [maru] Maru: host time in vLLM's hooks (scheduler, so far): "
    log.write_text(
        head
        + "get_num_new_matched_tokens 10 calls 9.0 ms (900 us each), build_connector_meta 3 calls 0.1 ms\n"
        "an unrelated line with get_num_new_matched_tokens 99 calls 1.0 ms\n"
    )
    assert aw.scheduler_line(log) == aw.SchedulerLine(900.0, None, None, None)  # before the CPU split
    with log.open("a") as f:
        f.write(
            head + "get_num_new_matched_tokens 20 calls 16.0 ms (800 us each, 250 on CPU), "
            "request_finished 2 calls 0.1 ms (50 us each, 40 on CPU); probes: key index (5 local, 0 "
            "remote); async loads planned 0, shared 0, window-deferred 0; offer pins: 16 round trips, "
            "4.0 ms (250 us each); replies: 30 read while polling (spin 500 us), 2 blocked past it\n"
        )
    # The last line; the trips' time per call; the replies polled and blocked.
    assert aw.scheduler_line(log) == aw.SchedulerLine(800.0, 250.0, 200.0, (30, 2))
    # The hook's parts, as HookTimes writes them: per hook call, whatever the part's own calls.
    from maru.vllm.hook_times import HookTimes

    h = HookTimes()
    for _ in range(4):
        h.add("get_num_new_matched_tokens", 0.001, 0.0005)
        h.add("get_num_new_matched_tokens/probe", 0.0002, 0.0002)
    h.add("get_num_new_matched_tokens/pin", 0.0004, 0.0001)  # one of the four pinned
    with log.open("a") as f:
        f.write(head + h.line() + "\n")
    got = aw.scheduler_line(log)
    assert got is not None and got.wall_us == 1000.0 and got.cpu_us == 500.0
    assert got.parts == {"probe": 200.0, "pin": 100.0} and got.arrival_us == 0.0
    # Pins posted at arrival: that hook's time and parts, per offer call too.
    h.add("on_new_request", 0.0008, 0.0004)
    h.add("on_new_request/post_pins", 0.0002, 0.0001)
    with log.open("a") as f:
        f.write(head + h.line() + "\n")
    got = aw.scheduler_line(log)
    assert got is not None and got.arrival_us == 200.0 and got.parts["arrival post_pins"] == 50.0
    assert aw.scheduler_line(tmp_path / "missing.log") is None


def test_the_offer_pins_part_of_the_timing_line_says_how_the_posted_pins_went() -> None:
    pytest.importorskip("vllm")
    from maru.vllm.connector import _pin_trips

    assert _pin_trips(None) == "off"
    plain = {"pin_trips": 4, "pin_trip_ms": 2.0}
    assert _pin_trips(plain) == "4 round trips, 2.0 ms (500 us each)"
    posted = {**plain, "pin_posts": 16, "pins_posted": 40, "post_waits": 3, "post_wait_ms": 0.6}
    said = _pin_trips(posted)
    assert said.endswith("16 posted at arrival (40 keys, 3 offers waited 0.6 ms, 0 failed)")
    m = aw._PIN_TRIPS.search(f"offer pins: {said}; replies: ...")  # the bench still reads the trips
    assert m is not None and float(m.group(1)) == 2.0
    read = {**posted, "post_reads": 16, "post_read_ms": 4.0, "post_read_cpu_ms": 3.2}
    assert _pin_trips(read).endswith("0 failed); replies read by 16 offers, 250 us each (200 on CPU)")
