"""The round-by-round API benchmark's plan and arithmetic (bench/store_ab.py), without vLLM.

What a wrong plan would bias silently: a warm instance run before the round's store (it would find
nothing and read as slow), an instance always right after the same neighbour, a ratio paired with
the wrong round.
"""

from __future__ import annotations

import random
import statistics

import pytest

from bench import store_ab as sab

SERVERS = ["none", "store", "store-idle", "store-probe", "load", "load-async"]


def test_turns_put_the_plain_instance_first_and_its_hit_in_the_warm_turn() -> None:
    cold, warm = sab.turns(SERVERS)
    assert cold == ["none", "store", "store-idle", "store-probe"]
    assert warm == ["hit", "load", "load-async"]
    assert sab.turns(["none", "store"]) == (["none", "store"], ["hit"])


@pytest.mark.parametrize("reps,rounds", [(1, 3), (4, 3), (2, 1)])
def test_every_round_runs_each_instance_once_cold_turn_first(reps: int, rounds: int) -> None:
    cold, warm = sab.turns(SERVERS)
    plan = sab.schedule(cold, warm, reps, rounds)
    assert len(plan) == reps * rounds * (len(cold) + len(warm))
    for rep in range(reps):
        for rnd in range(rounds):
            keys = [k for r, n, k in plan if (r, n) == (rep, rnd)]
            assert sorted(keys) == sorted(cold + warm)
            assert max(keys.index(k) for k in cold) < min(keys.index(k) for k in warm)
    # The rounds run in order: repetition, then round.
    order = [(r, n) for r, n, _ in plan]
    assert order == sorted(order)


def test_each_instance_takes_each_place_of_its_turn() -> None:
    cold, warm = sab.turns(SERVERS)
    plan = sab.schedule(cold, warm, 4, 3)
    for keys in (cold, warm):
        places: dict[str, set[int]] = {k: set() for k in keys}
        for rep in range(4):
            for rnd in range(3):
                turn = [k for r, n, k in plan if (r, n) == (rep, rnd) and k in keys]
                for i, k in enumerate(turn):
                    places[k].add(i)
        assert all(p == set(range(len(keys))) for p in places.values()), places


def _rounds(keys: list[str], n: int, seed: int) -> dict[str, list[dict[str, float]]]:
    rng = random.Random(seed)
    out: dict[str, list[dict[str, float]]] = {k: [] for k in keys}
    for i in range(n):
        for k in keys:
            t = rng.uniform(0.05, 0.2)
            out[k].append(
                {"rep": i // 3, "round": i % 3, "ttft_mean_s": t, "total_mean_s": t + rng.uniform(0.2, 0.5)}
            )
    return out


def test_paired_ratios_match_a_brute_force_reference() -> None:
    rounds = _rounds(["none", "store", "hit", "load"], 30, 7)
    got = sab.paired(rounds, "store", "none")
    assert got is not None
    ratios = [
        a["ttft_mean_s"] / b["ttft_mean_s"] for a, b in zip(rounds["store"], rounds["none"], strict=True)
    ]
    assert got["pairs"] == 30
    assert got["ttft_ratio_median"] == pytest.approx(statistics.median(ratios))
    assert got["at_or_under"] == sum(r <= 1.0 for r in ratios)
    ranked = sorted(ratios)  # quartiles by nearest rank: the 8th and the 23rd of 30
    assert (got["ttft_ratio_q1"], got["ttft_ratio_q3"]) == (ranked[7], ranked[22])
    totals = [
        a["total_mean_s"] / b["total_mean_s"] for a, b in zip(rounds["store"], rounds["none"], strict=True)
    ]
    assert got["total_ratio_median"] == pytest.approx(statistics.median(totals))


def test_a_shifted_round_does_not_pair() -> None:
    rounds = _rounds(["none", "store"], 6, 3)
    rounds["store"] = rounds["store"][1:] + rounds["store"][:1]  # the same count, other rounds
    assert sab.paired(rounds, "store", "none") is None
    rounds["store"] = rounds["store"][:5]
    assert sab.paired(rounds, "store", "none") is None


def test_summary_compares_warm_with_the_hit_and_cold_with_the_plain_instance() -> None:
    rounds = _rounds(["none", "store", "store-idle", "hit", "load"], 9, 11)
    s = sab.summarize(rounds)
    assert "vs" not in s["none"] and "vs" not in s["hit"]
    assert s["store"]["vs"]["against"] == "none" and s["store-idle"]["vs"]["against"] == "none"
    assert s["load"]["vs"]["against"] == "hit" and s["load"]["vs_cold"]["against"] == "none"
    want = statistics.median(
        a["ttft_mean_s"] / b["ttft_mean_s"] for a, b in zip(rounds["load"], rounds["hit"], strict=True)
    )
    assert s["load"]["vs"]["ttft_ratio_median"] == pytest.approx(want)
    table = sab.markdown({"reps": 3, "settle_s": 0.6, "rounds": rounds, "summary": s})
    rows = [ln for ln in table.splitlines() if ln.startswith("| ")]
    # The header, five instances, load's second row (against cold), store-idle's (the default storing
    # instance over it).
    assert len(rows) == 1 + 5 + 1 + 1
    assert sum("vLLM's own prefix hit" in r.split("|")[7] for r in rows) == 1  # load against the hit


def test_a_warm_alt_tree_pairs_with_the_hit_and_the_default_warm_instance_with_it() -> None:
    from bench.api_workload import check_load_mode, load_variant

    assert check_load_mode("alt-before") == "alt-before" and load_variant("alt-before") == load_variant(
        "default"
    )
    with pytest.raises(ValueError, match="unknown load mode"):
        check_load_mode("fast")
    rounds = _rounds(["none", "store", "hit", "load", "load-alt-before"], 9, 13)
    cold, warm = sab.turns(list(rounds))
    assert "load-alt-before" in warm
    s = sab.summarize(rounds)
    alt = s["load-alt-before"]
    assert alt["vs"]["against"] == "hit" and alt["label"].endswith("tree .ab/before")
    want = statistics.median(
        a["ttft_mean_s"] / b["ttft_mean_s"]
        for a, b in zip(rounds["load"], rounds["load-alt-before"], strict=True)
    )
    assert alt["vs_load"]["ttft_ratio_median"] == pytest.approx(want)  # this tree over the alt one
    table = sab.markdown({"reps": 3, "settle_s": 0.6, "rounds": rounds, "summary": s})
    assert sum("the default warm instance over this one" in ln for ln in table.splitlines()) == 1


def test_a_warm_load_mode_pairs_with_the_default_warm_instance_round_by_round() -> None:
    from bench.api_workload import check_load_mode, load_variant

    assert check_load_mode("early") == "early" and load_variant("early") == {"maru_early_load": True}
    rounds = _rounds(["none", "store", "hit", "load", "load-early"], 9, 17)
    s = sab.summarize(rounds)
    early = s["load-early"]
    assert early["vs"]["against"] == "hit" and early["label"] == "warm from Maru, early load"
    want = statistics.median(
        a["ttft_mean_s"] / b["ttft_mean_s"] for a, b in zip(rounds["load"], rounds["load-early"], strict=True)
    )
    assert early["vs_load"]["ttft_ratio_median"] == pytest.approx(want)


def test_a_store_variant_pairs_with_the_default_storing_instance_round_by_round() -> None:
    from bench.api_workload import check_store_variant, store_label, store_variant

    assert check_store_variant("unpaced") == "unpaced"
    assert store_variant("unpaced") == {"maru_async_store": True, "maru_paced_store": False}
    assert store_variant("helper") == {"maru_store_helper": True}
    assert store_label("helper") == "cold, Maru storing, drain in a helper process"
    rounds = _rounds(["none", "store", "store-unpaced", "hit", "load"], 9, 19)
    s = sab.summarize(rounds)
    v = s["store-unpaced"]
    assert v["vs"]["against"] == "none" and v["label"] == store_label("unpaced")
    want = statistics.median(
        a["ttft_mean_s"] / b["ttft_mean_s"]
        for a, b in zip(rounds["store"], rounds["store-unpaced"], strict=True)
    )
    assert v["vs_store"]["ttft_ratio_median"] == pytest.approx(want)
    assert "vs_store" not in s["store"]  # the default is not paired with itself
    table = sab.markdown({"reps": 3, "settle_s": 0.6, "rounds": rounds, "summary": s})
    assert sum("the default storing instance over this one" in ln for ln in table.splitlines()) == 1


def test_engine_phases_are_the_round_s_means_from_two_metric_reads() -> None:
    before = {"ttft": (1.0, 10.0), "queue": (0.2, 10.0), "prefill": (0.5, 10.0)}
    # 4 requests in between: 0.4 s of TTFT, 0.04 of queue, 0.2 of prefill
    after = {"ttft": (1.4, 14.0), "queue": (0.24, 14.0), "prefill": (0.7, 14.0)}
    got = sab.engine_phases(after, before)
    assert got == pytest.approx({"ttft": 100.0, "queue": 10.0, "prefill": 50.0, "rest": 40.0})
    assert sab.engine_phases(before, before) == {}  # no request counted in between
    assert sab.engine_phases({"ttft": (1.4, 14.0)}, {"ttft": (1.0, 10.0)}) == {}  # phases not exported


def _with_phases(rounds: dict[str, list[dict]], seed: int) -> None:
    rng = random.Random(seed)
    for rs in rounds.values():
        for r in rs:
            q, p, rest = rng.uniform(0, 5), rng.uniform(20, 60), rng.uniform(10, 40)
            r["engine_ms"] = {"ttft": q + p + rest, "queue": q, "prefill": p, "rest": rest}


def test_phase_deltas_are_medians_of_paired_round_differences() -> None:
    rounds = _rounds(["none", "store", "store-idle", "hit", "load"], 12, 23)
    _with_phases(rounds, 5)
    rounds["store"][3]["engine_ms"] = {}  # a round vLLM counted nothing in: left out of the pairs
    s = sab.summarize(rounds)
    d = s["store"]["vs"]["phase_deltas_ms"]
    pairs = [
        (a["engine_ms"], b["engine_ms"])
        for a, b in zip(rounds["store"], rounds["none"], strict=True)
        if a["engine_ms"]
    ]
    assert d["pairs"] == 11
    for p in sab.PHASES:
        assert d[p] == pytest.approx(statistics.median(a[p] - b[p] for a, b in pairs))
    idle = s["store-idle"]["vs_store"]["phase_deltas_ms"]  # the default storing instance over the variant
    want = statistics.median(
        a["engine_ms"]["queue"] - b["engine_ms"]["queue"]
        for a, b in zip(rounds["store"], rounds["store-idle"], strict=True)
        if a["engine_ms"]
    )
    assert idle["queue"] == pytest.approx(want)
    assert s["none"]["engine_ms"]["prefill"] == pytest.approx(
        statistics.mean(r["engine_ms"]["prefill"] for r in rounds["none"])
    )
    table = sab.markdown({"reps": 4, "settle_s": 0.25, "rounds": rounds, "summary": s})
    assert "Where a round's time went, by vLLM's own timings" in table
    phase_rows = table.split("Where a round's time went")[1].splitlines()
    assert sum(ln.startswith("| cold, Maru storing (default) |") for ln in phase_rows) == 1
    assert (
        sum(ln.startswith("| cold, connector attached, Maru off |") for ln in phase_rows) == 2
    )  # vs none, vs store


def test_rounds_without_phases_leave_the_table_without_them() -> None:
    rounds = _rounds(["none", "store"], 6, 29)
    s = sab.summarize(rounds)
    assert "engine_ms" not in s["store"] and "phase_deltas_ms" not in s["store"]["vs"]
    assert "vLLM's own timings" not in sab.markdown(
        {"reps": 2, "settle_s": 0.6, "rounds": rounds, "summary": s}
    )


@pytest.mark.parametrize("stop_at", [0, 7, 15, 22, 30, 59])
def test_an_interrupted_ab_reports_the_repetitions_every_instance_completed(
    monkeypatch: pytest.MonkeyPatch, stop_at: int
) -> None:
    from types import SimpleNamespace

    names = ["none", "store", "store-helper", "load"]
    servers = {k: SimpleNamespace(port=i, log_path=f"/nonexistent/{k}", wait_ready=lambda timeout: None)
               for i, k in enumerate(names)}  # fmt: skip
    setup = SimpleNamespace(rounds=3, warmup_tokens=4, system_tokens=4, model=SimpleNamespace(vocab=50))
    rng, calls = random.Random(stop_at), []

    def run_round(port: int, setup: object, rnd: int, system: list[int]) -> dict[str, float]:
        if len(calls) == stop_at:
            raise KeyboardInterrupt  # the pass's time budget (SIGINT) mid-schedule
        calls.append(port)
        t = rng.uniform(0.05, 0.15)
        return {"wall_s": t, "ttft_mean_s": t, "ttft_p50_s": t, "total_mean_s": 2 * t}

    monkeypatch.setattr(sab, "stream_ttft", lambda *a, **k: 0.0)
    monkeypatch.setattr(sab, "run_round", run_round)
    monkeypatch.setattr(sab, "loaded_tokens_in_log", lambda path: 0)
    monkeypatch.setattr(sab, "server_metrics", lambda port: ({}, {"external_hit": 0}))
    monkeypatch.setattr(sab, "engine_phases", lambda t1, t0: None)
    monkeypatch.setattr(sab, "log", lambda msg: None)
    res: dict = {"api": {}}
    with pytest.raises(KeyboardInterrupt):
        sab.run_store_ab(servers, setup, res, reps=4, settle_s=0.0)
    per_rep = (len(names) + 1) * setup.rounds  # a repetition's rounds, over every instance and the hit
    whole = stop_at // per_rep
    if whole == 0:
        assert "store_ab" not in res["api"]  # nothing that pairs: nothing reported
        return
    out = res["api"]["store_ab"]
    assert out["reps"] == whole
    for k, rows in out["rounds"].items():
        assert [(r["rep"], r["round"]) for r in rows] == [(p, q) for p in range(whole) for q in range(3)], k
    # Every variant pairs with its reference over all of those rounds.
    assert out["summary"]["store"]["vs"]["pairs"] == whole * 3
