"""Pool the round-by-round A/Bs of several runs (``bench/store_ab.py``'s ``api.store_ab`` in each
run's ``gpu_vllm_e2e.json``): per instance against its reference, the paired rounds' TTFT ratios of
every run together, their median and its 95% bootstrap interval, and the median paired differences
of vLLM's own timings (ms a request).

Rounds pair within a run only (the same repetition and round, taking turns); a run where an
instance does not pair with its reference is left out of that row, said in the row's runs column.

Usage: python bench/ab_pool.py bench/results/gpu_vllm_e2e_pass58a_*.json bench/results/gpu_vllm_e2e_pass58b_*.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.store_ab import PHASES, label, median_ci, ratios, reference  # noqa: E402


def comparisons(keys: Sequence[str]) -> list[tuple[str, str]]:
    """(instance, reference) pairs to pool: each against its reference (``store_ab.reference``), a
    store variant's default storing instance over it, the warm instance against the cold one."""
    out = []
    for k in keys:
        if (ref := reference(k)) is not None:
            out.append((k, ref))
        if k.startswith("store-"):
            out.append(("store", k))
        if k == "load":
            out.append(("load", "none"))
    return out


def deltas(rounds: dict[str, list[dict[str, Any]]], key: str, ref: str) -> list[dict[str, float]]:
    """Per paired round with vLLM's timings on both sides, ``key``'s phases less ``ref``'s (ms)."""
    if ratios(rounds, key, ref) is None:
        return []
    return [
        {p: x["engine_ms"][p] - y["engine_ms"][p] for p in PHASES}
        for x, y in zip(rounds[key], rounds[ref], strict=True)
        if x.get("engine_ms") and y.get("engine_ms")
    ]


def pool(runs: Sequence[dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """One row per comparison found in any run: pooled ratios (median, CI, rounds, runs that paired)
    and pooled phase differences."""
    keys = sorted({k for r in runs for k in r})
    rows = []
    for key, ref in comparisons(keys):
        values: list[float] = []
        phases: list[dict[str, float]] = []
        paired = 0
        for rounds in runs:
            r = ratios(rounds, key, ref)
            if r is None:
                continue
            paired += 1
            values += r
            phases += deltas(rounds, key, ref)
        if not values:
            continue
        lo, hi = median_ci(values)
        rows.append(
            {
                "key": key,
                "ref": ref,
                "median": statistics.median(values),
                "ci95": (lo, hi),
                "rounds": len(values),
                "runs": paired,
                "of_runs": sum(1 for r in runs if key in r and ref in r),
                "phase_deltas_ms": {p: statistics.median(d[p] for d in phases) for p in PHASES}
                if phases
                else None,
            }
        )
    return rows


def markdown(rows: list[dict[str, Any]], runs: int) -> str:
    lines = [
        f"Pooled over {runs} runs (paired rounds' TTFT ratios; 95% CI of the median, "
        "percentile bootstrap; vLLM's timings: median paired differences, ms a request):",
        "",
        "| instance | against | median | 95% CI | rounds | runs | TTFT | queue | prefill | rest |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        d = r["phase_deltas_ms"]
        ph = " | ".join(f"{d[p]:+.1f}" for p in PHASES) if d else " | ".join("-" for _ in PHASES)
        if r["key"] == "store" and r["ref"].startswith("store-"):  # the default over a variant: its row
            who, against = label(r["ref"]), "the default storing instance over this one"
        else:
            who, against = label(r["key"]), label(r["ref"])
        lines.append(
            f"| {who} | {against} | {r['median']:.3f} | {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f} | "
            f"{r['rounds']} | {r['runs']} of {r['of_runs']} | {ph} |"
        )
    return "\n".join(lines)


def load_runs(paths: Sequence[str]) -> list[dict[str, list[dict[str, Any]]]]:
    runs = []
    for path in paths:
        with open(path) as f:
            ab = json.load(f).get("api", {}).get("store_ab")
        if not ab:
            raise SystemExit(f"{path}: no round-by-round A/B (api.store_ab) in it")
        runs.append(ab["rounds"])
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", help="gpu_vllm_e2e.json files of the runs")
    a = ap.parse_args()
    runs = load_runs(a.runs)
    print(markdown(pool(runs), len(runs)))


if __name__ == "__main__":
    main()
