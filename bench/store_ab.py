"""The API workload's costs measured round by round: storing against a plain instance, a warm load
against vLLM's own prefix hit.

Why: on the shared device hosts the same eager forward's CPU time moves by up to 1.6x between
two-second windows (``bench/launch_drift.py --pace-trace``, forty-ninth pass, H200: window medians
9.3-15.2 ms for one fixed forward, nothing else running), while the instances of
``api_workload.run_api`` take turns a whole pass (3 rounds, a few seconds) at a time. A cost of a
few percent cannot show through that. Here the instances take turns a *round* at a time (16
concurrent requests, ~0.4 s), in an order rotated every round, and each instance's round is
compared with its reference's round next to it: the median of those paired ratios is the cost,
their quartiles say how far the host moved between neighbours.

Each round runs in two turns. The cold turn: ``none`` (no connector), ``store`` (Maru storing,
the default configuration) and the ``store-<variant>`` instances, each computing the round. The
warm turn, after it: ``none`` again (every token is in its own prefix cache: vLLM's own hit,
recorded as ``hit``), ``load`` (a Maru instance that never computed this repetition's system
prompt: it loads what ``store`` stored) and the ``load-<mode>`` instances. Ratios: cold instances
against ``none``, warm ones against ``hit`` (and ``load`` against ``none`` as well).

Every instance sends the same requests (``api_workload.conversation`` does not depend on earlier
answers), each repetition under a new system prompt. After every instance's round the harness waits
``SETTLE_S`` (each instance alike): a write-behind store still draining belongs to its own instance,
not to the next one's round, and a warm instance finds the round's stores published.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from bench.api_workload import conversation, loaded_tokens_in_log, pct, store_label
from bench.vllm_harness import ApiServer, log, random_prompt, server_metrics, stream_ttft, timing_means

SETTLE_S = 0.6  # after each instance's round: its write-behind stores publish (~30 ms a batch)
LABELS = {
    "none": "cold, no connector",
    "store": "cold, Maru storing (default)",
    "hit": "vLLM's own prefix hit (the plain instance again)",
    "load": "warm from Maru (default)",
}


def label(key: str) -> str:
    """An instance's row label: the store variants' are ``api_workload``'s."""
    if key in LABELS:
        return LABELS[key]
    if key.startswith("load-alt-"):
        return f"warm from Maru (default), tree .ab/{key.removeprefix('load-alt-')}"
    if key.startswith("load-"):
        return f"warm from Maru, {key.removeprefix('load-')} load"
    return store_label(key.removeprefix("store-"))


def turns(servers: Sequence[str]) -> tuple[list[str], list[str]]:
    """The cold turn's keys and the warm turn's (``hit`` is the plain instance run again)."""
    cold = ["none", "store"] + sorted(k for k in servers if k.startswith("store-"))
    warm = (["hit"] if "none" in servers else []) + sorted(
        k for k in servers if k == "load" or k.startswith("load-")
    )
    return [k for k in cold if k in servers], warm


def schedule(cold: list[str], warm: list[str], reps: int, rounds: int) -> list[tuple[int, int, str]]:
    """(repetition, round, instance) in the order they run: each round the cold turn, then the warm
    turn, each turn's order rotated by one every round (no instance always follows the same one)."""
    out = []
    for turn in range(reps * rounds):
        for keys in (cold, warm):
            r = turn % len(keys) if keys else 0
            out += [(turn // rounds, turn % rounds, k) for k in keys[r:] + keys[:r]]
    return out


def reference(key: str) -> str | None:
    """What an instance's round is compared with: cold ones with the plain instance, warm ones with
    vLLM's own hit; the plain instance and the hit with nothing."""
    if key in ("none", "hit"):
        return None
    return "hit" if key == "load" or key.startswith("load-") else "none"


def ratios(
    rounds: dict[str, list[dict[str, Any]]], key: str, ref: str, field: str = "ttft_mean_s"
) -> list[float] | None:
    """``key``'s round over ``ref``'s, round by round (their rounds in the same order, one each a
    turn), for ``field``; None when the rounds do not pair."""
    a, b = rounds.get(key, []), rounds.get(ref, [])
    if not a or len(a) != len(b):
        return None
    if any((x["rep"], x["round"]) != (y["rep"], y["round"]) for x, y in zip(a, b, strict=True)):
        return None
    return [x[field] / y[field] for x, y in zip(a, b, strict=True)]


BOOTSTRAP = 2000  # resamples of a median's confidence interval


def median_ci(values: Sequence[float], resamples: int = BOOTSTRAP, seed: int = 1) -> tuple[float, float]:
    """The 95% percentile-bootstrap interval of the median of ``values`` (resampled with replacement,
    a fixed seed: the same figures for the same rounds)."""
    rng = random.Random(seed)
    vals = list(values)
    meds = sorted(statistics.median(rng.choices(vals, k=len(vals))) for _ in range(resamples))
    return meds[int(0.025 * resamples)], meds[min(int(0.975 * resamples), resamples - 1)]


def paired(rounds: dict[str, list[dict[str, Any]]], key: str, ref: str) -> dict[str, Any] | None:
    """Round by round ``key`` over ``ref`` (``ratios``): the median, its 95% bootstrap interval, the
    quartiles, how many rounds ``key`` was at or under ``ref``, for the mean TTFT of the round's
    requests, and the median ratio of the whole answers. None when the rounds do not pair."""
    r = ratios(rounds, key, ref)
    if r is None:
        return None
    ttft = sorted(r)
    total = ratios(rounds, key, ref, "total_mean_s") or []
    return {
        "against": ref,
        "pairs": len(ttft),
        "ttft_ratio_median": statistics.median(ttft),
        "ttft_ratio_ci95": list(median_ci(ttft)),
        "ttft_ratio_q1": pct(ttft, 0.25),
        "ttft_ratio_q3": pct(ttft, 0.75),
        "at_or_under": sum(1 for x in ttft if x <= 1.0),
        "total_ratio_median": statistics.median(total),
    }


def summarize(rounds: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per instance: its rounds' mean and median TTFT, its whole answers' mean, and the paired
    ratios against its reference (``reference``), ``load`` also against ``none``."""
    out: dict[str, dict[str, Any]] = {}
    for k, rs in rounds.items():
        if not rs:
            continue
        row: dict[str, Any] = {
            "label": label(k),
            "rounds": len(rs),
            "ttft_mean_ms": statistics.mean(r["ttft_mean_s"] for r in rs) * 1e3,
            "ttft_median_round_ms": statistics.median(r["ttft_mean_s"] for r in rs) * 1e3,
            "total_mean_ms": statistics.mean(r["total_mean_s"] for r in rs) * 1e3,
            "tokens_loaded": sum(r.get("tokens_loaded", 0) for r in rs),
            "external_hits": int(sum(r.get("external_hits", 0) for r in rs)),
        }
        with_phases = [r["engine_ms"] for r in rs if r.get("engine_ms")]
        if with_phases:
            row["engine_ms"] = {p: statistics.mean(e[p] for e in with_phases) for p in PHASES}
        ref = reference(k)
        pairs = {}
        if ref is not None:
            pairs["vs"] = (k, ref)
        if k == "load":
            pairs["vs_cold"] = (k, "none")
        if k.startswith("load-"):
            pairs["vs_load"] = ("load", k)  # the default warm instance over this one (another tree or mode)
        if k.startswith("store-"):
            pairs["vs_store"] = ("store", k)  # the default storing instance over this variant
        for name, (a, b) in pairs.items():
            if (p := paired(rounds, a, b)) is not None:
                if (d := phase_deltas(rounds, a, b)) is not None:
                    p["phase_deltas_ms"] = d
                row[name] = p
        out[k] = row
    return out


def run_round(port: int, setup: Any, rnd: int, system: list[int]) -> dict[str, float]:
    """Round ``rnd`` of every user at once on one instance: its requests' mean and median TTFT,
    their whole answers' mean, the round's wall time."""
    prompts = [conversation(setup, u, rnd, system) for u in range(setup.users)]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=setup.users) as ex:
        recs = list(ex.map(lambda p: stream_ttft(port, p, setup.api_max_tokens), prompts))
    return {
        "wall_s": time.perf_counter() - t0,
        "ttft_mean_s": statistics.mean(r["ttft"] for r in recs),
        "ttft_p50_s": pct([r["ttft"] for r in recs], 0.5),
        "total_mean_s": statistics.mean(r.get("total", r["ttft"]) for r in recs),
    }


# vLLM's own timings of a round's requests (from the same /metrics reads as the external hits),
# mean milliseconds a request: its TTFT from arrival in the API server, its wait in the scheduler's
# queue, scheduled to first token; ``rest`` is the TTFT less the two (the request's way into the
# engine core, and its first token's way back to the API server).
PHASES = ("ttft", "queue", "prefill", "rest")


def engine_phases(
    after: dict[str, tuple[float, float]], before: dict[str, tuple[float, float]]
) -> dict[str, float]:
    """The round's ``PHASES`` in ms (mean a request) between two ``server_metrics`` timing reads;
    empty when vLLM counted no request in between (or exports none of the three)."""
    m = timing_means(after, before)
    if not all(k in m for k in ("ttft", "queue", "prefill")):
        return {}
    out = {k: m[k] * 1e3 for k in ("ttft", "queue", "prefill")}
    out["rest"] = out["ttft"] - out["queue"] - out["prefill"]
    return out


def phase_deltas(rounds: dict[str, list[dict[str, Any]]], key: str, ref: str) -> dict[str, float] | None:
    """Per phase, the median of ``key``'s round minus ``ref``'s (ms), over the rounds both have
    phases for (paired as ``paired`` pairs them); None when they do not pair or none has phases."""
    a, b = rounds.get(key, []), rounds.get(ref, [])
    if not a or len(a) != len(b):
        return None
    if any((x["rep"], x["round"]) != (y["rep"], y["round"]) for x, y in zip(a, b, strict=True)):
        return None
    both = [
        (x["engine_ms"], y["engine_ms"])
        for x, y in zip(a, b, strict=True)
        if x.get("engine_ms") and y.get("engine_ms")
    ]
    if not both:
        return None
    out: dict[str, float] = {p: statistics.median(x[p] - y[p] for x, y in both) for p in PHASES}
    out["pairs"] = len(both)
    return out


def run_store_ab(
    servers: dict[str, ApiServer], setup: Any, res: dict, reps: int, settle_s: float = SETTLE_S
) -> None:
    """``reps`` repetitions x ``setup.rounds`` rounds, each round a cold turn then a warm turn, the
    order within each turn rotated every round; ``res["api"]["store_ab"]``. ``settle_s``: the wait
    after every instance's round (``SETTLE_S``; shorter: more rounds a device second, as long as
    the round's stores publish within it, which the warm instance's tokens from Maru show)."""
    cold, warm = turns(list(servers))
    for i, k in enumerate(servers):  # what a process pays once is not a round's TTFT
        servers[k].wait_ready(timeout=600)
        stream_ttft(servers[k].port, random_prompt(setup.warmup_tokens, 777_000 + i, setup.model.vocab), 2)
    rounds: dict[str, list[dict[str, Any]]] = {k: [] for k in cold + warm}
    try:
        _measure(servers, setup, rounds, cold, warm, reps, settle_s)
    except KeyboardInterrupt:  # the pass's time budget ran out: the repetitions every instance ran
        done = complete_reps(rounds, setup.rounds)
        log(
            f"store A/B interrupted: {done} of {reps} repetitions complete" + (", summarized" if done else "")
        )
        if done:
            _report(res, whole_reps(rounds, done), done, settle_s)
        raise
    _report(res, rounds, reps, settle_s)


def complete_reps(rounds: dict[str, list[dict[str, Any]]], rounds_per_rep: int) -> int:
    """How many leading repetitions every instance ran all ``rounds_per_rep`` rounds of (those
    pair round by round; a repetition cut off pairs only partly, so it is left out)."""
    done = 0
    while rounds and all(
        sum(1 for r in rows if r["rep"] == done) == rounds_per_rep for rows in rounds.values()
    ):
        done += 1
    return done


def whole_reps(rounds: dict[str, list[dict[str, Any]]], done: int) -> dict[str, list[dict[str, Any]]]:
    """Each instance's rounds of the first ``done`` repetitions."""
    return {k: [r for r in rows if r["rep"] < done] for k, rows in rounds.items()}


def _report(res: dict, rounds: dict[str, list[dict[str, Any]]], reps: int, settle_s: float) -> None:
    out = {"rounds": rounds, "reps": reps, "settle_s": settle_s, "summary": summarize(rounds)}
    res["api"]["store_ab"] = out
    log(markdown(out))


def _measure(
    servers: dict[str, ApiServer],
    setup: Any,
    rounds: dict[str, list[dict[str, Any]]],
    cold: list[str],
    warm: list[str],
    reps: int,
    settle_s: float,
) -> None:
    """Run the schedule, each round's row appended to ``rounds`` as it ends."""
    systems: dict[int, list[int]] = {}
    for rep, rnd, k in schedule(cold, warm, reps, setup.rounds):
        system = systems.setdefault(rep, random_prompt(setup.system_tokens, 9_100 + rep, setup.model.vocab))
        srv = servers["none" if k == "hit" else k]
        # Read right before and after this round: only this round's tokens, whatever else moves the
        # server's counters between its rounds. vLLM's external hits are what Maru offered and vLLM
        # took; with maru_log_timing off (--api-untimed) Maru writes no load lines, and they are the
        # only count that a warm round loaded.
        before, (times0, counts0) = loaded_tokens_in_log(srv.log_path), server_metrics(srv.port)
        row = {"rep": rep, "round": rnd, **run_round(srv.port, setup, rnd, system)}
        time.sleep(settle_s)  # (the load's timing line is written by then too)
        times1, counts1 = server_metrics(srv.port)
        row["tokens_loaded"] = loaded_tokens_in_log(srv.log_path) - before
        row["external_hits"] = counts1["external_hit"] - counts0["external_hit"]
        row["engine_ms"] = engine_phases(times1, times0)
        rounds[k].append(row)


def markdown(out: dict[str, Any]) -> str:
    """The table: per instance, its rounds' TTFT and answer time, and the paired ratios."""
    lines = [
        f"Round by round ({out['reps']} repetitions; each round a cold turn then a warm turn, the order "
        f"within a turn rotated every round; {out['settle_s']} s after every instance's round):",
        "",
        "| instance | rounds | tokens loaded from Maru (Maru's log / vLLM's external hits) | TTFT, mean of rounds | median round | whole answer, "
        "mean | against | TTFT / its round: median (quartiles) | median's 95% CI | rounds at or under | "
        "whole answer / its round: median |",
        "|---|---:|---:|---:|---:|---:|---|---|---|---:|---:|",
    ]
    for row in out["summary"].values():
        head = (
            f"| {row['label']} | {row['rounds']} | {row['tokens_loaded']} / {row.get('external_hits', '-')} | "
            f"{row['ttft_mean_ms']:.1f} ms | "
            f"{row['ttft_median_round_ms']:.1f} ms | {row['total_mean_ms']:.1f} ms |"
        )
        pairs = [row[k] for k in ("vs", "vs_cold") if k in row]
        if "vs_load" in row:  # the default warm instance over this one (another tree, or a load mode)
            pairs.append({**row["vs_load"], "against_label": "the default warm instance over this one"})
        if "vs_store" in row:  # the default storing instance over this variant
            pairs.append({**row["vs_store"], "against_label": "the default storing instance over this one"})
        if not pairs:
            lines.append(head + " - | - | - | - | - |")
        for p in pairs:
            ci = p.get("ttft_ratio_ci95")  # absent from runs saved before it was added
            lines.append(
                f"{head} {p.get('against_label') or label(p['against'])} | {p['ttft_ratio_median']:.3f} ({p['ttft_ratio_q1']:.3f}-"
                f"{p['ttft_ratio_q3']:.3f}) | {f'{ci[0]:.3f}-{ci[1]:.3f}' if ci else '-'} | "
                f"{p['at_or_under']} of {p['pairs']} | {p['total_ratio_median']:.3f} |"
            )
    phased = [r for r in out["summary"].values() if "engine_ms" in r]
    if phased:
        lines += [
            "",
            "Where a round's time went, by vLLM's own timings (mean ms a request: TTFT from arrival in "
            "the API server; queue: waiting to be scheduled; prefill: scheduled to first token; rest: "
            "the TTFT less both, the request's way into the engine core and its first token's way back). "
            "Against: the median of the paired rounds' differences, ms:",
            "",
            "| instance | TTFT | queue | prefill | rest | against | TTFT | queue | prefill | rest |",
            "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
        ]
        for row in phased:
            e = row["engine_ms"]
            head = f"| {row['label']} | " + " | ".join(f"{e[p]:.1f}" for p in PHASES) + " |"
            deltas = [
                (k, row[k])
                for k in ("vs", "vs_cold", "vs_load", "vs_store")
                if "phase_deltas_ms" in row.get(k, {})
            ]
            if not deltas:
                lines.append(head + " - | - | - | - | - |")
            for k, p in deltas:
                d = p["phase_deltas_ms"]
                who = {
                    "vs_load": "the default warm instance over this one",
                    "vs_store": "the default storing instance over this one",
                }.get(k) or label(p["against"])
                lines.append(f"{head} {who} | " + " | ".join(f"{d[q]:+.1f}" for q in PHASES) + " |")
    return "\n".join(lines)
