"""The multi-round API workload of ``bench/gpu_vllm_e2e.py``: its instances, passes and TTFT table rows.

U users x R rounds sharing an S-token system prompt; round r of a user extends round r-1 by a
synthetic answer and a new question; a round's requests are sent together, streaming. Every
instance is vLLM's OpenAI API server in its own process (``vllm_harness.ApiServer``).

Instances (a key each; ``api_instances`` builds their Maru configs):

- ``none``: no connector. Pass 1 is cold (vLLM's own prefix cache within the pass), pass 2 sends
  the same requests again (all local hits).
- ``store``: cold, Maru storing (write-behind, the default); ``load``: a new instance running the
  same pass, loading from Maru (the default configuration); ``load-<mode>``: one per load mode.
- ``store-<variant>``: cold, one per store variant, each under a namespace of its own so that it
  stores the whole pass afresh; ``store-probe`` stores nothing and finds nothing (the connector's
  scheduler-side cost alone); ``store-none`` is a second instance without a connector (the spread
  between two identical instances); ``store-alt-<name>`` runs the patched ``maru/`` in
  ``.ab/<name>`` (a diagnosis: what part of the store costs what).

Each repetition runs the cold passes in an order rotated by one (position effects, e.g. an
instance whose stores still drain while the next one runs, spread over every variant), then the
passes that need one of them first (vLLM's own hit, the warm loads).
- ``pair-none-a``/``-b`` and ``pair-maru-a``/``-b``: two instances each, every user moving to the
  other instance every round (a router without session affinity): a user's history is always on
  the instance it is not sent to. Without a connector the new instance recomputes it; with Maru
  it loads what the other one stored. This is the case Maru exists for; the single-instance passes
  above mostly hit vLLM's own cache after each round's first request.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.vllm_harness import (
    SERVER_COUNTERS,
    SERVER_TIMINGS,
    ApiServer,
    log,
    maru_kv_config,
    random_prompt,
    server_metrics,
    stream_ttft,
    timing_means,
)

# Warm API instances: load mode -> Maru extra config (each a fresh instance loading the same pass
# from Maru; "default" is the configuration a user gets, async loads on vLLM's V2 runner).
API_LOADS: dict[str, dict[str, Any]] = {
    # Since 2026-12-03 the default loads layer by layer on GPU caches (maru_overlap_load_with_compute
    # unset), on vLLM's V2 runner with offers pinned at each offer.
    "default": {},
    "sync": {"maru_overlap_load_with_compute": False},  # on the V1 runner (ENGINE_ENV)
    # The whole load before the forward on the V2 runner: the default until 2026-12-03.
    "sync-v2": {"maru_overlap_load_with_compute": False},
    "async": {"maru_async_load": True},
    "overlap": {"maru_overlap_load_with_compute": True},  # on the V1 runner: pins once a step
    "overlap-v2": {"maru_overlap_load_with_compute": True},  # set explicitly: the default's load
    # The layer load through the copy engines (kv_ops.layer_copies): on the default (V2) runner,
    # and with "overlap" on the V1 runner (ENGINE_ENV).
    "copied": {"maru_layer_path": "copied"},
    "overlap-copied": {"maru_overlap_load_with_compute": True, "maru_layer_path": "copied"},
    # Pins taken the way they were before 2026-12-03's arrival pins (maru_pin_on_arrival off): a
    # round trip waited for at each offer (V2 runner) or once a step (V1, with "overlap").
    "at-offer": {"maru_pin_on_arrival": False},
    "overlap-at-step": {"maru_overlap_load_with_compute": True, "maru_pin_on_arrival": False},
    # The default configuration with the direct layer kernel's grid set through MARU_DIRECT_PROGRAMS
    # (gpu_vllm_e2e.ENGINE_ENV; TuneParams.direct_programs): a program a token tile (the default
    # before 2026-12-03's thirty-eighth pass), or at most N over both planes (default: one an SM).
    **{f"programs-{n}": {} for n in ("a-tile", "528", "264", "66")},
    # Each step's layer load issued when the step is planned (maru.vllm.early_loads): set
    # explicitly; the default since 2026-12-06 (where it applies), so "default" runs it too.
    "early": {"maru_early_load": True},
    # The layer load issued at the forward (start_load_kv): the default until 2026-12-06.
    "at-forward": {"maru_early_load": False},
}

# Extra cold API instances: store variant -> Maru extra config. Each gets a namespace of its own, so
# each stores the whole pass afresh (with the shared one a later instance would find it all present).
# "probe" stores nothing and finds nothing: the connector's scheduler-side cost alone.
API_STORES: dict[str, dict[str, Any] | None] = {
    "sync": {"maru_async_store": False},
    "unpaced": {"maru_async_store": True, "maru_paced_store": False},
    "probe": {"maru_enable_store": False},
    # Stores without the load side (no keys or probe at a request's arrival or offer, no pins): what
    # a cold storing instance pays for being able to load, against the default storing instance.
    "storeonly": {"maru_enable_load": False},
    # The write-behind drain in a helper process (maru_store_helper): vLLM's interpreter rid of it.
    "helper": {"maru_store_helper": True},
    # The helper with the copy engine not yielded between chunks: no short kernels of the helper's
    # own CUDA context between its copies (two processes' kernels share the GPU by time slices).
    "helper-unpaced": {"maru_store_helper": True, "maru_paced_store": False},
    # Each write-behind batch drained at once, not held for a step without prefill (the default holds
    # it at most 250 ms: a burst's stores then run beside its decode steps; sixty-second pass).
    "noyield": {"maru_store_yield_to_prefill_ms": 0},
    # The connector attached with loads and stores off: what vLLM's connector plumbing costs alone.
    "idle": {"maru_enable_store": False, "maru_enable_load": False},
    # A second instance without a connector: the spread between two identical instances.
    "none": None,
    # The default configuration, run from another checkout of maru (an A/B of two versions in one
    # pass, taking turns): its path in $MARU_BENCH_ALT_TREE, put first on the instance's PYTHONPATH.
    "alt": {"maru_async_store": True},
}
STORE_LABELS = {
    "probe": "cold, Maru probing only",
    "storeonly": "cold, Maru storing, loads off",
    "helper": "cold, Maru storing, drain in a helper process",
    "helper-unpaced": "cold, Maru storing, drain in a helper process, not paced",
    "noyield": "cold, Maru storing, drained at once (no yield to prefill)",
    "idle": "cold, connector attached, Maru off",
    "alt": "cold, Maru storing (write-behind), $MARU_BENCH_ALT_TREE",
    "none": "cold, no connector (a second instance)",
}


def load_variant(mode: str) -> dict[str, Any]:
    """The Maru extra config of the warm instance of load mode ``mode`` (``alt-<name>``: the default
    configuration run from the tree ``.ab/<name>``, as a store's ``alt-<name>``)."""
    return API_LOADS["default" if mode.startswith("alt-") else mode]


def check_load_mode(mode: str) -> str:
    """argparse type of ``--api-loads``: a key of API_LOADS, or ``alt-<name>`` (the tree .ab/<name>)."""
    if mode not in API_LOADS and not mode.startswith("alt-"):
        raise ValueError(f"unknown load mode {mode!r}: one of {', '.join(API_LOADS)} or alt-<name>")
    return mode


def store_variant(variant: str) -> dict[str, Any] | None:
    """The Maru extra config of the ``store-<variant>`` instance (``alt-<name>``: as ``alt``, with
    the keys of the tree's ``kv.json`` over it, ``tree_kv``; None: no connector)."""
    if variant.startswith("alt-"):
        return {**API_STORES["alt"], **tree_kv(AB_DIR / variant[4:])}  # type: ignore[dict-item]
    return API_STORES[variant]


AB_DIR = Path(__file__).resolve().parent.parent / ".ab"


def tree_kv(tree: Path) -> dict[str, Any]:
    """The Maru config keys of an alt tree's ``kv.json`` (``bench/ab_tree.py --kv``); {} without one."""
    from bench.ab_tree import KV_FILE

    path = tree / KV_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def store_label(variant: str) -> str:
    if variant.startswith("alt-"):
        return f"cold, Maru storing (write-behind), tree .ab/{variant[4:]}"
    return STORE_LABELS.get(variant, f"cold, Maru storing ({variant})")


def check_store_variant(variant: str) -> str:
    """argparse type of ``--api-stores``: a key of API_STORES, or ``alt-<name>`` (the tree .ab/<name>)."""
    if variant not in API_STORES and not variant.startswith("alt-"):
        raise ValueError(f"unknown store variant {variant!r}: one of {', '.join(API_STORES)} or alt-<name>")
    return variant


def store_env(variant: str) -> dict[str, str] | None:
    """Extra environment of the ``store-<variant>`` instance: ``alt`` runs the tree in
    $MARU_BENCH_ALT_TREE, ``alt-<name>`` the tree in ``.ab/<name>`` (each a directory holding another
    ``maru/``, e.g. a patched copy for a diagnosis), first on its PYTHONPATH."""
    if variant == "alt":
        tree = os.environ.get("MARU_BENCH_ALT_TREE")
    elif variant.startswith("alt-"):
        tree = str(AB_DIR / variant[4:])
    else:
        return None
    if not tree or not os.path.isdir(os.path.join(tree, "maru")):
        raise SystemExit(f"--api-stores {variant} needs another maru/ in {tree or '$MARU_BENCH_ALT_TREE'}")
    return {"MARU_BENCH_ALT_TREE_USED": os.path.abspath(tree)}  # the harness puts it first on PYTHONPATH


# Two-instance passes: key -> table label (servers "<key>-a" and "<key>-b").
PAIRS = {
    "pair-none": "2 instances, users alternate, no connector",
    "pair-maru": "2 instances, users alternate, sharing through Maru",
}


def api_load_key(mode: str) -> str:
    """Server key of the warm API instance of a load mode ("load" for the default one); a key
    "load-<mode>" picks up the mode's environment (the V1 runner for sync and overlap)."""
    return "load" if mode == "default" else f"load-{mode}"


def api_instances(
    extra: Callable[[str, dict[str, Any]], dict[str, Any]],
    loads: Sequence[str],
    stores: Sequence[str],
    pair: bool,
) -> dict[str, dict | None]:
    """Server key -> vLLM kv-transfer config (None: no connector). ``extra(namespace, config)``
    makes a Maru extra config for a namespace (``gpu_vllm_e2e.maru_extra``)."""
    out: dict[str, dict | None] = {
        "none": None,
        "store": maru_kv_config(extra("api", {"maru_async_store": True})),
        **{api_load_key(m): maru_kv_config(extra("api", load_variant(m))) for m in loads},
        **{f"store-{v}": _store_config(extra, v) for v in stores},
    }
    if pair:
        for side in ("a", "b"):
            out[f"pair-none-{side}"] = None
            out[f"pair-maru-{side}"] = maru_kv_config(extra("api-pair", {}))
    return out


def _store_config(extra: Callable[[str, dict[str, Any]], dict[str, Any]], variant: str) -> dict | None:
    cfg = store_variant(variant)
    return None if cfg is None else maru_kv_config(extra(f"api-{variant}", cfg))


# What a vLLM process needs beyond its weights and KV cache (CUDA context, activations, CUDA graphs):
# 7.0-10.5 GiB a process was seen for 6 GiB of weights and 4 GiB of KV (twenty-ninth pass, H100).
PROCESS_OVERHEAD_BYTES = 3 << 29  # 1.5 GiB
# A store helper process (maru_store_helper): its CUDA context (610 MiB seen on the H100, fifty-eighth
# pass) and its paced lane's two chunk-sized staging slots.
HELPER_OVERHEAD_BYTES = 1 << 30


def gpu_memory_shortfall(
    free_bytes: int, weight_bytes: int, kv_bytes: Sequence[int], helpers: int = 0
) -> str | None:
    """Why the processes whose KV caches are ``kv_bytes`` (all started at once, each with
    ``weight_bytes`` of weights) and ``helpers`` store helper processes would not fit
    ``free_bytes`` of GPU memory; None if they fit.

    The bench starts every engine and API server together (their start-ups overlap); on a card
    too small for all of them the last ones die at start with CUDA out of memory, which reads
    like a failure of what they measure."""
    need = (
        sum(weight_bytes + kv + PROCESS_OVERHEAD_BYTES for kv in kv_bytes) + helpers * HELPER_OVERHEAD_BYTES
    )
    if need <= free_bytes:
        return None
    gib = 1 << 30
    with_helpers = f" and {helpers} store helper processes" if helpers else ""
    return (
        f"{len(kv_bytes)} vLLM processes{with_helpers} at once need about {need / gib:.0f} GiB of GPU memory "
        f"(weights {weight_bytes / gib:.1f} GiB, KV caches and {PROCESS_OVERHEAD_BYTES / gib:.1f} GiB of "
        f"overhead each{f', {HELPER_OVERHEAD_BYTES / gib:.0f} GiB a helper' if helpers else ''}); the card has {free_bytes / gib:.0f} GiB free. Run fewer at once (leave out --api-pair, "
        "--api-stores variants or --api-loads modes, or run the offline --engines apart with --no-api) "
        "or use a card with more memory"
    )


def conversation(setup: Any, user: int, rnd: int, system: list[int]) -> list[int]:
    """User ``user``'s prompt in round ``rnd``: system prompt, then questions and synthetic answers."""
    p = list(system)
    for r in range(rnd + 1):
        p += random_prompt(setup.turn_tokens, 10_000 + 100 * user + 2 * r, setup.model.vocab)
        if r < rnd:
            p += random_prompt(setup.turn_tokens, 10_001 + 100 * user + 2 * r, setup.model.vocab)
    return p


def pair_instance(user: int, rnd: int) -> int:
    """Which of two instances serves ``user`` in round ``rnd``: every user moves to the other one
    each round, so its history (the previous round's prompt) is on the instance it is not sent to."""
    return (user + rnd) % 2


def api_pass(ports: Sequence[int], setup: Any, system: list[int]) -> list[dict[str, Any]]:
    """All rounds, each round's requests concurrently, on one instance (one port) or alternating
    between two (``pair_instance``); one record per request."""
    recs = []
    with ThreadPoolExecutor(max_workers=setup.users) as ex:
        for rnd in range(setup.rounds):
            ps = [conversation(setup, u, rnd, system) for u in range(setup.users)]
            where = [pair_instance(u, rnd) % len(ports) for u in range(setup.users)]
            jobs = [(ports[i], p) for i, p in zip(where, ps, strict=True)]
            for u, r in enumerate(ex.map(lambda j: stream_ttft(j[0], j[1], setup.api_max_tokens), jobs)):
                recs.append({"round": rnd, "user": u, "instance": where[u], "prompt_tokens": len(ps[u]), **r})
    return recs


def loaded_tokens_in_log(path: Path) -> int:
    pat = re.compile(r"Maru timing: load \d+ req (\d+) tokens")
    try:
        return sum(int(m.group(1)) for m in pat.finditer(path.read_text(errors="replace")))
    except OSError:
        return 0


_SCHED_LINE = "(scheduler, so far):"
# One hook's entry; the CPU part is absent from lines written before the CPU split.
_PROBE_HOOK = re.compile(
    r"get_num_new_matched_tokens (\d+) calls ([\d.]+) ms(?: \(\d+ us each, (\d+) on CPU(?:, longest [\d.]+ ms)?\))?"
)
_PIN_TRIPS = re.compile(r"offer pins: \d+ round trips, ([\d.]+) ms")
_REPLIES = re.compile(r"replies: (\d+) read while polling \(spin \d+ us\), (\d+) blocked past it")
# The hook's parts (``timed_part``): where its time went.
_PROBE_PART = re.compile(r"get_num_new_matched_tokens/(\w+) \d+ calls ([\d.]+) ms")
# The request's arrival (``on_new_request``: its keys, probe and posted pins, before it is scheduled).
_ARRIVAL_HOOK = re.compile(r"on_new_request (\d+) calls ([\d.]+) ms")
_ARRIVAL_PART = re.compile(r"on_new_request/(\w+) \d+ calls ([\d.]+) ms")


@dataclass(frozen=True)
class SchedulerLine:
    """The scheduler's last periodic hook-time line of an engine log, per ``get_num_new_matched_tokens``
    call (us): wall, its thread's CPU, the offer pins' round trips; and (replies read while polling,
    waits that blocked past it); ``parts``: the wall time of the hook's parts (prompt keys, probe,
    offer pin), per hook call. Each None (or empty) where the line predates it. ``arrival_us``: the
    time of vLLM's ``on_new_request`` hook (keys, probe and pins posted at arrival) per
    ``get_num_new_matched_tokens`` call, not in ``wall_us``; its parts are in ``parts`` as
    ``arrival <part>``."""

    wall_us: float
    cpu_us: float | None
    pin_trip_us: float | None
    replies: tuple[int, int] | None
    parts: dict[str, float] = field(default_factory=dict)
    arrival_us: float = 0.0


def scheduler_line(path: Path) -> SchedulerLine | None:
    """``SchedulerLine`` of the log at ``path``; None without such a line (or without a probe)."""
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if _SCHED_LINE in ln]
    except OSError:
        return None
    m = _PROBE_HOOK.search(lines[-1]) if lines else None
    if m is None or not int(m.group(1)):
        return None
    calls = int(m.group(1))
    trips = _PIN_TRIPS.search(lines[-1])
    replies = _REPLIES.search(lines[-1])
    arrival = _ARRIVAL_HOOK.search(lines[-1])
    parts = {name: float(ms) * 1e3 / calls for name, ms in _PROBE_PART.findall(lines[-1])}
    parts.update({f"arrival {n}": float(ms) * 1e3 / calls for n, ms in _ARRIVAL_PART.findall(lines[-1])})
    return SchedulerLine(
        wall_us=float(m.group(2)) * 1e3 / calls,
        cpu_us=float(m.group(3)) if m.group(3) else None,
        pin_trip_us=float(trips.group(1)) * 1e3 / calls if trips else None,
        replies=(int(replies.group(1)), int(replies.group(2))) if replies else None,
        parts=parts,
        arrival_us=float(arrival.group(2)) * 1e3 / calls if arrival else 0.0,
    )


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def _scrape(servers: Sequence[ApiServer]) -> tuple[dict[str, tuple[float, float]], dict[str, float]]:
    """vLLM's timing histograms (sum, count) and token counters, each added over ``servers``."""
    timings: dict[str, tuple[float, float]] = {}
    counts = dict.fromkeys(SERVER_COUNTERS, 0.0)
    for srv in servers:
        t, c = server_metrics(srv.port)
        for k, (s, n) in t.items():
            s0, n0 = timings.get(k, (0.0, 0.0))
            timings[k] = (s0 + s, n0 + n)
        for k, v in c.items():
            counts[k] += v
    return timings, counts


def _passes(servers: dict[str, ApiServer], rep: int = 0) -> list[tuple[str, str]]:
    """The passes of repetition ``rep``: the cold ones first, in an order rotated by ``rep`` (each
    cold instance takes each place in turn: no variant always follows the same one), then the
    passes that need one of them before (vLLM's own hit, the warm loads), then the pairs."""
    cold = [("none", "cold, no connector"), ("store", "cold, Maru storing (write-behind)")]
    cold += [(k, store_label(k[6:])) for k in servers if k.startswith("store-")]
    r = rep % len(cold)
    passes = cold[r:] + cold[:r]
    passes += [("none", "vLLM's own prefix hit"), ("load", "warm from Maru (new instance)")]
    passes += [(k, f"warm from Maru, {k.removeprefix('load-')} load (new instance)")
               for k in servers if k.startswith("load-")]  # fmt: skip
    return passes + list(PAIRS.items())


def run_api(servers: dict[str, ApiServer], setup: Any, res: dict, reps: int = 1) -> None:
    """``reps`` repetitions of every pass, interleaved (the instances take turns on the GPU within a
    repetition), each repetition with a system prompt of its own (no instance's own prefix cache
    carries one repetition into the next). Each server first answers one unrelated warm-up prompt:
    what a process pays once (kernels loaded, buffers made) is not a round's TTFT."""
    out = res["api"]
    live: dict[str, ApiServer] = {}
    for i, (key, srv) in enumerate(servers.items()):
        try:
            srv.wait_ready(timeout=600)  # with --api-graphs: torch.compile and graph capture first
            stream_ttft(srv.port, random_prompt(setup.warmup_tokens, 777_000 + i, setup.model.vocab), 2)
            live[key] = srv
        except Exception as e:
            out["errors"].append(f"{srv.name}: {e!r}")
            log(f"api {srv.name}: FAILED {e!r}")
    rows: dict[str, dict[str, Any]] = {}
    for rep in range(reps):
        system = random_prompt(setup.system_tokens, 5555 + rep, setup.model.vocab)
        for key, label in _passes(servers, rep):
            group = [live.get(f"{key}-a"), live.get(f"{key}-b")] if key in PAIRS else [live.get(key)]
            if None in group:
                continue
            srvs: list[ApiServer] = [s for s in group if s is not None]
            row = rows.setdefault(label, {"label": label, "server": key, "records": [], "tokens_loaded": 0})
            try:
                before = sum(loaded_tokens_in_log(s.log_path) for s in srvs)
                t0, c0 = _scrape(srvs)
                recs = api_pass([s.port for s in srvs], setup, system)
                t1, c1 = _scrape(srvs)
                means = timing_means(t1, t0)
                counts = row.setdefault("server_counts", dict.fromkeys(SERVER_COUNTERS, 0.0))
                for k, v in c1.items():  # prompt tokens by where they came from
                    counts[k] += v - c0[k]
                if key.startswith("store") or key == "pair-maru":
                    time.sleep(2.0)  # let the last write-behind stores publish before the next instance
                row["records"] += [{**r, "rep": rep} for r in recs]
                row["tokens_loaded"] += sum(loaded_tokens_in_log(s.log_path) for s in srvs) - before
                for k, v in means.items():  # per-request means of vLLM's own timings, by repetition
                    row.setdefault(f"server_{k}_s", []).append(v)
            except Exception as e:
                out["errors"].append(f"{label} (repetition {rep}): {e!r}")
                log(f"api {label} (repetition {rep}): FAILED {e!r}")
    for row in rows.values():
        key = row["server"]
        names = [f"{key}-a", f"{key}-b"] if key in PAIRS else [key]
        got = [v for n in names if n in live and (v := scheduler_line(live[n].log_path)) is not None]
        # A new request's scheduler time: at its arrival (on_new_request) and at its offer.
        row["sched_probe_us"] = statistics.mean(v.wall_us + v.arrival_us for v in got) if got else None
        # The same time split: the scheduling thread's own CPU, and the offer pins' round trips;
        # the rest of the wall time it sat waiting for the GIL (or for another round trip).
        cpu = [v.cpu_us for v in got if v.cpu_us is not None]
        trips = [v.pin_trip_us for v in got if v.pin_trip_us is not None]
        replies = [v.replies for v in got if v.replies is not None]
        row["sched_probe_cpu_us"] = statistics.mean(cpu) if cpu else None
        row["sched_pin_trip_us"] = statistics.mean(trips) if trips else None
        row["sched_replies"] = [sum(r[0] for r in replies), sum(r[1] for r in replies)] if replies else None
        names = sorted({n for v in got for n in v.parts})
        row["sched_parts_us"] = {n: statistics.mean(v.parts.get(n, 0.0) for v in got) for n in names}
        _finish_row(row)
        if row.get("n"):
            out["passes"].append(row)


def _finish_row(row: dict[str, Any]) -> None:
    """TTFT p50 / p95 / mean over every request of the pass, and each repetition's p50; logged."""
    recs = row["records"]
    if not recs:
        return
    ttft = [r["ttft"] for r in recs]
    per_rep = [pct([r["ttft"] for r in recs if r["rep"] == k], 0.5) for k in sorted({r["rep"] for r in recs})]
    # Each round's mean: round 0 is where a shared system prompt is new to an instance; later rounds
    # add one turn per user on top of what vLLM's own cache holds.
    per_round = [
        statistics.mean(r["ttft"] for r in recs if r["round"] == k)
        for k in sorted({r["round"] for r in recs})
    ]
    row.update(n=len(recs), p50_s=pct(ttft, 0.5), p95_s=pct(ttft, 0.95), mean_s=statistics.mean(ttft),
               rep_p50_s=per_rep, round_mean_s=per_round, texts=[r["text"] for r in recs])  # fmt: skip
    # After the first token: the rest of the answer (the same token count for every request,
    # ignore_eos), i.e. the decode steps, which a connector's cost to CUDA graphs shows in.
    if all("total" in r for r in recs):
        row["decode_s"] = statistics.mean(r["total"] - r["ttft"] for r in recs)
    server = " ".join(
        f"{k} {statistics.mean(row[f'server_{k}_s']) * 1e3:.1f}"
        for k in SERVER_TIMINGS
        if row.get(f"server_{k}_s")
    )
    log(f"api {row['label']:36} p50 {row['p50_s'] * 1e3:7.1f} ms  p95 {row['p95_s'] * 1e3:7.1f} ms  "
        f"(repetitions' p50 {' / '.join(f'{x * 1e3:.0f}' for x in per_rep)}; server means, ms: {server}; "
        f"after the first token {row.get('decode_s', 0.0) * 1e3:.1f} ms; "
        f"{row['tokens_loaded']} tokens loaded from Maru)")  # fmt: skip
