"""bench/ab_pool.py and the median's interval (bench/store_ab.py): several runs' paired rounds
pooled, against a brute-force reference on random rounds."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from bench import ab_pool
from bench.store_ab import PHASES, median_ci


def _run(rng: random.Random, keys: list[str], reps: int = 3, rounds: int = 3) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for k in keys:
        rows = []
        for rep in range(reps):
            for rnd in range(rounds):
                t = rng.uniform(0.05, 0.2)
                rows.append(
                    {"rep": rep, "round": rnd, "ttft_mean_s": t, "total_mean_s": 2 * t,
                     "engine_ms": {p: rng.uniform(0, 50) for p in PHASES}}
                )  # fmt: skip
        out[k] = rows
    return out


def test_the_median_s_interval_covers_the_true_median_and_is_repeatable() -> None:
    rng = random.Random(7)
    vals = [rng.uniform(1.0, 2.0) for _ in range(400)]
    lo, hi = median_ci(vals)
    assert lo <= statistics.median(vals) <= hi and lo < 1.5 < hi and hi - lo < 0.15
    assert median_ci(vals) == (lo, hi)  # a fixed seed: the same rounds give the same figures
    few = median_ci(vals[:20])
    assert few[1] - few[0] > hi - lo  # fewer rounds, a wider interval
    assert median_ci([1.25] * 9) == (1.25, 1.25)


def test_pooled_ratios_are_every_run_s_paired_rounds_together() -> None:
    rng = random.Random(11)
    keys = ["none", "store", "store-helper", "hit", "load"]
    runs = [_run(rng, keys), _run(rng, keys, reps=2)]
    runs[1]["store-helper"] = runs[1]["store-helper"][1:] + runs[1]["store-helper"][:1]  # does not pair
    rows = {(r["key"], r["ref"]): r for r in ab_pool.pool(runs)}
    want = [
        x["ttft_mean_s"] / y["ttft_mean_s"]
        for run in runs
        for x, y in zip(run["store"], run["none"], strict=True)
    ]
    row = rows[("store", "none")]
    assert row["median"] == pytest.approx(statistics.median(want)) and row["rounds"] == 9 + 6
    assert row["runs"] == row["of_runs"] == 2
    d = [
        x["engine_ms"]["prefill"] - y["engine_ms"]["prefill"]
        for run in runs
        for x, y in zip(run["store"], run["none"], strict=True)
    ]
    assert row["phase_deltas_ms"]["prefill"] == pytest.approx(statistics.median(d))
    helper = rows[("store-helper", "none")]
    assert (
        helper["runs"] == 1 and helper["of_runs"] == 2 and helper["rounds"] == 9
    )  # the shifted run left out
    assert ("store", "store-helper") in rows and ("load", "hit") in rows and ("load", "none") in rows
    table = ab_pool.markdown(ab_pool.pool(runs), 2)
    assert "1 of 2" in table and "the default storing instance over this one" in table


def test_a_run_without_a_round_by_round_ab_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "gpu_vllm_e2e.json"
    path.write_text(json.dumps({"api": {"passes": {}}}))
    with pytest.raises(SystemExit, match="gpu_vllm_e2e.json: no round-by-round A/B"):
        ab_pool.load_runs([str(path)])
