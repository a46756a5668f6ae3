"""The storing cost on the API workload, measured round by round against a plain instance.

Why: on the shared device hosts the same eager forward's CPU time moves by up to 2x from one
second to the next (``bench/launch_drift.py``, forty-ninth pass: 9.8 to 22.1 ms for one fixed
forward, nothing else running), while the instances of ``api_workload.run_api`` take turns a whole
pass (3 rounds, a few seconds) at a time. A storing cost of a few percent cannot show through that.
Here the instances take turns a *round* at a time (16 concurrent requests, ~0.4 s), in an order
rotated every round, and each round of the storing instance is compared with the plain instance's
round next to it: the median of those paired ratios is the storing cost, and their quartiles say how
far the host moved between neighbours.

Every instance sends the same requests (``api_workload.conversation`` does not depend on earlier
answers), each repetition under a new system prompt. After every instance's round the harness waits
``SETTLE_S`` (each instance alike): a write-behind store still draining belongs to its own instance,
not to the next one's round.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.api_workload import conversation, pct
from bench.vllm_harness import ApiServer, log, random_prompt, stream_ttft

SETTLE_S = 0.6  # after each instance's round: its write-behind stores publish (~30 ms a batch)
LABELS = {
    "none": "cold, no connector",
    "store": "cold, Maru storing (default)",
    "store-idle": "cold, connector attached, Maru off",
}


def run_round(port: int, setup: Any, rnd: int, system: list[int]) -> list[dict[str, Any]]:
    """Round ``rnd`` of every user at once on one instance; a record per request."""
    prompts = [conversation(setup, u, rnd, system) for u in range(setup.users)]
    with ThreadPoolExecutor(max_workers=setup.users) as ex:
        return list(ex.map(lambda p: stream_ttft(port, p, setup.api_max_tokens), prompts))


def run_store_ab(servers: dict[str, ApiServer], setup: Any, res: dict, reps: int) -> None:
    """``reps`` repetitions x ``setup.rounds`` rounds, the instances taking turns each round;
    ``res["api"]["store_ab"]``: per instance its rounds' mean TTFT and answer time, and per
    instance other than ``none`` the paired ratios against ``none``'s neighbouring round."""
    keys = [k for k in LABELS if k in servers]
    for i, k in enumerate(keys):  # what a process pays once is not a round's TTFT
        servers[k].wait_ready(timeout=600)
        stream_ttft(servers[k].port, random_prompt(setup.warmup_tokens, 777_000 + i, setup.model.vocab), 2)
    rounds: dict[str, list[dict[str, float]]] = {k: [] for k in keys}
    turn = 0
    for rep in range(reps):
        system = random_prompt(setup.system_tokens, 9_100 + rep, setup.model.vocab)
        for rnd in range(setup.rounds):
            order = keys[turn % len(keys) :] + keys[: turn % len(keys)]
            turn += 1
            for k in order:
                t0 = time.perf_counter()
                recs = run_round(servers[k].port, setup, rnd, system)
                wall = time.perf_counter() - t0
                rounds[k].append({
                    "rep": rep, "round": rnd, "wall_s": wall,
                    "ttft_mean_s": statistics.mean(r["ttft"] for r in recs),
                    "ttft_p50_s": pct([r["ttft"] for r in recs], 0.5),
                    "total_mean_s": statistics.mean(r.get("total", r["ttft"]) for r in recs),
                })  # fmt: skip
                time.sleep(SETTLE_S)
    out: dict[str, Any] = {"rounds": rounds, "reps": reps, "settle_s": SETTLE_S, "summary": {}}
    base = rounds.get("none", [])
    for k in keys:
        rs = rounds[k]
        row: dict[str, Any] = {
            "label": LABELS[k],
            "ttft_mean_ms": statistics.mean(r["ttft_mean_s"] for r in rs) * 1e3,
            "ttft_median_round_ms": statistics.median(r["ttft_mean_s"] for r in rs) * 1e3,
            "total_mean_ms": statistics.mean(r["total_mean_s"] for r in rs) * 1e3,
        }
        if k != "none" and len(base) == len(rs):
            ttft = sorted(a["ttft_mean_s"] / b["ttft_mean_s"] for a, b in zip(rs, base, strict=True))
            total = sorted(a["total_mean_s"] / b["total_mean_s"] for a, b in zip(rs, base, strict=True))
            row.update(
                pairs=len(ttft),
                ttft_ratio_median=statistics.median(ttft),
                ttft_ratio_q1=pct(ttft, 0.25),
                ttft_ratio_q3=pct(ttft, 0.75),
                total_ratio_median=statistics.median(total),
                wins=sum(1 for x in ttft if x <= 1.0),
            )
        out["summary"][k] = row
    res["api"]["store_ab"] = out
    log(markdown(out))


def markdown(out: dict[str, Any]) -> str:
    """The table: per instance, its rounds' TTFT and answer time, and the paired ratios."""
    lines = [
        f"Storing cost, round by round ({out['reps']} repetitions; instances take turns each round, "
        f"order rotated; {out['settle_s']} s after every round):",
        "",
        "| instance | rounds | TTFT, mean of rounds | median round | whole answer, mean | TTFT / plain's "
        "neighbouring round: median (quartiles) | rounds at or under plain | whole answer / plain: median |",
        "|---|---:|---:|---:|---:|---|---:|---:|",
    ]
    for k, row in out["summary"].items():
        n = len(out["rounds"][k])
        ratio = (
            f"{row['ttft_ratio_median']:.3f} ({row['ttft_ratio_q1']:.3f}-{row['ttft_ratio_q3']:.3f})"
            if "pairs" in row
            else "-"
        )
        wins = f"{row['wins']} of {row['pairs']}" if "pairs" in row else "-"
        total = f"{row['total_ratio_median']:.3f}" if "pairs" in row else "-"
        lines.append(
            f"| {row['label']} | {n} | {row['ttft_mean_ms']:.1f} ms | {row['ttft_median_round_ms']:.1f} ms | "
            f"{row['total_mean_ms']:.1f} ms | {ratio} | {wins} | {total} |"
        )
    return "\n".join(lines)
