"""Real vLLM with MaruKVConnector: TTFT cold, cold while storing, warm from Maru, vLLM's own prefix hit.

    python3 bench/gpu_vllm_e2e.py [--out DIR]          # H200: Llama-3-8B KV geometry, ~6 minutes
    python bench/gpu_vllm_e2e.py --tiny [--out DIR]    # vLLM's CPU build, tiny model (harness check)

One ``maru server`` (pool in /dev/shm) and every vLLM instance in its own process, all started at
once (start-up overlaps) and then measured one after the other (an idle in-process engine uses
no GPU time). The model is generated locally (``bench/vllm_harness.py``). Maru is used only
through vLLM's kv-transfer config.

Offline engines (``vllm.LLM``, eager, block 16, chunked prefill of 16384 tokens), per workload
and repetition (fresh random prompts, the same for every engine):

- ``none`` (no connector): cold TTFT, then the same prompts again: vLLM's own prefix-cache hit.
- ``sync`` / ``async`` / ``overlap`` (Maru; store sync / write-behind / write-behind; load
  sync / ``maru_async_load`` / ``maru_overlap_load_with_compute``): cold TTFT while storing;
  then vLLM's prefix cache is reset (which also waits for write-behind stores to publish) and
  the same prompts run again: warm from Maru. Each engine has its own ``maru_namespace``, so
  each stores for itself. ``sync`` and ``overlap`` run vLLM's V1 model runner (``ENGINE_ENV``).
- ``default`` (Maru, the default configuration, vLLM's default V2 runner: on a GPU its loads go
  layer by layer, offers pinned at each offer): the same, in the column "default (V2)".

TTFT is the wall time of ``LLM.generate(prompts, max_tokens=1)`` for the whole batch (all
prompts submitted together). Load GB/s is the worker's ``bytes_loaded / load_seconds`` over the
warm runs, shown against pinned host-to-device bandwidth measured in the same process; none for
the layer-overlap load, which runs under the forward (no transfer time of its own to divide by).
"Outputs" compares each warm first token (greedy) with vLLM's own prefix hit of the same
prompts in the ``none`` engine (see ``vllm_harness.same_greedy``).

Multi-round (``bench/api_workload.py``; ``python -m vllm.entrypoints.openai.api_server``, vLLM's
default multi-process mode): U users x R rounds sharing an S-token system prompt, a round's
requests sent together, streaming; TTFT p50/p95 over all requests and vLLM's own TTFT / queue /
prefill means. Instances: ``api-none`` (cold, then the same requests again: vLLM's own hits),
``api-store`` (cold, Maru storing) and ``api-load`` (a new instance loading that pass from Maru),
plus ``api-load-<mode>`` per ``--api-loads`` mode, ``api-store-<variant>`` per ``--api-stores``
variant (``probe``: the connector without stores or hits), and with ``--api-pair`` two pairs of
instances that users alternate between every round (without a connector / sharing through Maru).
Every server answers one warm-up prompt first; ``--api-reps`` repetitions (3 on the GPU) take
turns, each with its own system prompt, and the table shows each repetition's p50 beside the
pooled figures.

A/B of two versions of maru in one pass: with ``MARU_BENCH_ALT_TREE`` set to a directory holding
another ``maru/`` (e.g. ``git archive <commit> maru | tar -x -C .ab/old``), the offline engine
``alt`` and the API variant ``--api-stores alt`` run the default configuration from that tree (its
directory first on the instance's PYTHONPATH and as its working directory), beside this tree's.

Writes ``gpu_vllm_e2e.json`` (every sample), ``gpu_vllm_e2e.md`` (the tables) and
``gpu_vllm_e2e.png`` (when matplotlib is there) to ``--out``; engine logs to ``--log-dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.api_workload import (  # noqa: E402
    API_LOADS,
    API_STORES,
    api_instances,
    check_load_mode,
    check_store_variant,
    gpu_memory_shortfall,
    run_api,
    store_env,
    store_variant,
)  # noqa: E402
from bench.store_ab import SETTLE_S, run_store_ab  # noqa: E402
from bench.vllm_harness import (  # noqa: E402
    GPU_MODEL,
    SERVER_TIMINGS,
    TINY_MODEL,
    ApiServer,
    Engine,
    ModelSpec,
    delta,
    host_facts,
    log,
    make_model,
    maru_kv_config,
    random_prompt,
    same_greedy,
)

GiB = 1 << 30


@dataclass(frozen=True)
class Workload:
    name: str
    batch: int
    tokens: int


@dataclass(frozen=True)
class Setup:
    """Everything that differs between the H200 run and the CPU harness check."""

    model: ModelSpec
    workloads: tuple[Workload, ...]
    reps: int
    block_size: int
    batched_tokens: int
    kv_cache_bytes: int
    api_kv_cache_bytes: int
    gpu_mem_util: float | None
    chunk_tokens: int
    users: int
    rounds: int
    system_tokens: int
    turn_tokens: int
    api_max_tokens: int
    warmup_tokens: int
    api_reps: int = 1


GPU_SETUP = Setup(
    model=GPU_MODEL,
    workloads=(
        Workload("1x4k", 1, 4096),
        Workload("1x16k", 1, 16384),
        Workload("1x32k", 1, 32768),
        Workload("8x4k", 8, 4096),
        Workload("4x16k", 4, 16384),
    ),
    reps=3,
    block_size=16,
    batched_tokens=16384,
    kv_cache_bytes=10 * GiB,
    api_kv_cache_bytes=4 * GiB,
    gpu_mem_util=0.1,  # only vLLM's start-up check; kv_cache_memory_bytes sizes the cache
    chunk_tokens=256,
    users=16,
    rounds=3,
    system_tokens=2048,
    turn_tokens=128,
    api_max_tokens=16,
    warmup_tokens=1024,
    api_reps=3,
)
TINY_SETUP = Setup(
    model=TINY_MODEL,
    workloads=(Workload("1x512", 1, 512), Workload("1x1k", 1, 1024), Workload("4x512", 4, 512)),
    reps=1,
    block_size=32,
    batched_tokens=2048,
    kv_cache_bytes=128 << 20,
    api_kv_cache_bytes=64 << 20,
    gpu_mem_util=None,
    chunk_tokens=64,
    users=3,
    rounds=2,
    system_tokens=128,
    turn_tokens=32,
    api_max_tokens=4,
    warmup_tokens=128,
)

# Offline engines: name -> Maru extra config (None: no connector).
OFFLINE: dict[str, dict[str, Any] | None] = {
    "none": None,
    "sync": {"maru_overlap_load_with_compute": False},
    "async": {"maru_async_store": True, "maru_async_load": True},
    "overlap": {"maru_async_store": True, "maru_overlap_load_with_compute": True},
    # What a user gets: vLLM's default (V2) runner, the default configuration (since 2026-12-03 its
    # loads go layer by layer on a GPU, offers pinned at each offer).
    "default": {},
    # The write-behind store queued all at once (before kv_ops.paced_store): what pacing is worth.
    "unpaced": {"maru_async_store": True, "maru_paced_store": False},
    # The "async" engine run from another checkout of maru ($MARU_BENCH_ALT_TREE): an A/B of versions.
    "alt": {"maru_async_store": True, "maru_async_load": True},
}
# Same-step loads (sync, layer overlap) run on vLLM's V1 model runner: on the V2 runner (vLLM's
# default on GPUs) the connector replaces them by asynchronous loads (vLLM #49250, docs/vllm.md), so
# the "async" engine is also what the default configuration runs there.
ENGINE_ENV = {
    "sync": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    "overlap": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    "overlap-copied": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    "overlap-at-step": {"VLLM_USE_V2_MODEL_RUNNER": "0"},
    **{
        f"programs-{n}": {"MARU_DIRECT_PROGRAMS": "0" if n == "a-tile" else n}
        for n in ("a-tile", "528", "264", "66")
    },
}
STORE_MODE = {
    "sync": "sync store",
    "async": "write-behind",
    "overlap": "write-behind",
    "default": "write-behind",
    "unpaced": "write-behind, not paced",
}
LOAD_MODE = {
    "sync": "sync load",
    "async": "async load",
    "overlap": "layer overlap",
    "default": "default (V2)",
}


def waited_bytes(load: dict) -> float:
    """Bytes of the loads a step waited for: layer loads run under the forward, with no transfer
    time of their own (a GB/s over their host time would exceed the bus)."""
    return load.get("bytes_loaded", 0) - load.get("bytes_loaded_under_forward", 0)


def pinned_h2d_gbps() -> float | None:
    """Pinned host-to-device copy bandwidth (1 GiB, best of 5), or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    src = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, GiB / (time.perf_counter() - t) / 1e9)
    del src, dst
    torch.cuda.empty_cache()
    return best


def pool_size(setup: Setup, api_namespaces: int = 1) -> int:
    """Room for the largest workload's KV (or the multi-round passes', if larger: their shared system
    prompt and every user's turns, each round's tail a chunk object of its own, once per namespace
    that stores them: the default one, the pair's, each storing variant's) and a quarter more,
    capped by what /dev/shm has free (80%).

    Each workload is stored and loaded back before the next one is stored, so older prompts can
    be evicted (least recently used first); the server's eviction count is reported. A smaller
    pool also registers with CUDA faster (about 1.8 GiB/s, in every engine).
    """
    largest = max(w.batch * w.tokens for w in setup.workloads)
    per_round = setup.turn_tokens + setup.api_max_tokens + setup.chunk_tokens
    api = (setup.system_tokens + setup.users * setup.rounds * per_round) * api_namespaces
    want = max(max(largest, api) * setup.model.kv_bytes_per_token() * 5 // 4 + GiB // 4, 256 << 20)
    free = shutil.disk_usage("/dev/shm").free
    return int(min(want, free * 0.8)) // (1 << 20) << 20


def engine_spec(setup: Setup, model: str, kv: dict | None, kv_bytes: int) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": model,
        "dtype": setup.model.dtype,
        "block_size": setup.block_size,
        "max_model_len": max(w.tokens for w in setup.workloads) + 256,
        "kv_cache_memory_bytes": kv_bytes,
        "max_num_batched_tokens": setup.batched_tokens,
        "gpu_memory_utilization": setup.gpu_mem_util,
    }
    if kv is not None:
        spec["kv_transfer_config"] = kv
    return spec


def maru_extra(url: str, setup: Setup, namespace: str, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "maru_server_url": url,
        "maru_kv_chunk_tokens": setup.chunk_tokens,
        "maru_namespace": namespace,
        "maru_log_timing": True,
        **extra,
    }


# ---------------------------------------------------------------------------------- offline runs
def run_offline(name: str, eng: Engine, setup: Setup, prompts: dict, res: dict) -> None:
    """Every workload on one engine; samples go to ``res['offline'][name]`` as they come."""
    maru = OFFLINE[name] is not None
    out: dict[str, Any] = res["offline"].setdefault(name, {"startup_s": eng.ready.get("startup_s")})
    warm = random_prompt(setup.warmup_tokens, 99, setup.model.vocab)
    eng.generate([warm])
    if maru:  # exercise this engine's load path once before timing it
        eng.settle()
        eng.generate([warm])
    eng.settle()
    for wl in setup.workloads:
        rows = out.setdefault(wl.name, [])
        for rep in range(setup.reps):
            ps = prompts[(wl.name, rep)]
            s: dict[str, Any] = {"rep": rep}
            if not maru:
                c = eng.generate(ps, logprobs=5)
                h = eng.generate(ps, logprobs=5)
                s.update(cold_s=c["seconds"], hit_s=h["seconds"], hit_cached=h["cached"])
                s.update(cold_out=[c["tokens"], c["logprobs"]], hit_out=[h["tokens"], h["logprobs"]])
                eng.settle()
                log(f"{name:8} {wl.name:6} rep {rep}: cold {c['seconds'] * 1e3:8.1f} ms  "
                    f"prefix hit {h['seconds'] * 1e3:7.1f} ms ({sum(h['cached'])} cached)")  # fmt: skip
            else:
                s0 = eng.stats()
                c = eng.generate(ps, logprobs=5)
                st = eng.settle()  # write-behind: waits until the stores are published
                s1 = eng.stats()
                w = eng.generate(ps, logprobs=5)
                s2 = eng.stats()
                # The same prompts again before the settle (which resets vLLM's prefix cache): this
                # engine's own prefix hit (its model runner, its connector probing), so warm - own
                # hit is what the load itself costs.
                own = eng.generate(ps)
                eng.settle()
                ld, sd = delta(s2, s1), delta(s1, s0)
                s.update(store_s=c["seconds"], warm_s=w["seconds"], warm_cached=w["cached"], settle=st)
                s.update(own_hit_s=own["seconds"], own_hit_cached=own["cached"])
                s.update(store_out=[c["tokens"], c["logprobs"]], warm_out=[w["tokens"], w["logprobs"]])
                s.update(load=ld, store=sd)
                gbps = waited_bytes(ld) / max(ld.get("load_seconds", 0), 1e-9) / 1e9
                log(f"{name:8} {wl.name:6} rep {rep}: cold+store {c['seconds'] * 1e3:8.1f} ms  "
                    f"warm {w['seconds'] * 1e3:7.1f} ms (own hit {own['seconds'] * 1e3:.1f} ms; "
                    f"{int(ld.get('tokens_loaded', 0))} tokens loaded, "
                    f"{gbps:.1f} GB/s, {int(ld.get('load_errors', 0))} errors; "
                    f"stored {int(sd.get('chunks_stored', 0))} chunks, settle {st['seconds'] * 1e3:.0f} ms)")  # fmt: skip
            rows.append(s)
    out["final_stats"] = eng.stats()


# -------------------------------------------------------------------------------- multi-round API
# -------------------------------------------------------------------------------------- summary
def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def compare_outputs(res: dict, name: str, wl: str) -> dict[str, int]:
    """Warm first tokens of engine ``name`` against vLLM's prefix hit (and cold) of the same prompts."""
    counts = {"identical": 0, "close": 0, "different": 0, "same_as_cold": 0, "n": 0}
    ref_rows = {r["rep"]: r for r in res["offline"].get("none", {}).get(wl, [])}
    for r in res["offline"].get(name, {}).get(wl, []):
        ref = ref_rows.get(r["rep"])
        if ref is None:
            continue
        (wt, wl_), (ht, hl), (ct, _) = r["warm_out"], ref["hit_out"], ref["cold_out"]
        for i in range(len(wt)):
            counts[same_greedy(wt[i], wl_[i], ht[i], hl[i])] += 1
            counts["same_as_cold"] += int(wt[i] == ct[i])
            counts["n"] += 1
    return counts


def summarize(res: dict, setup: Setup) -> dict[str, Any]:
    off, pinned = res["offline"], res.get("pinned_h2d_GBps")
    rows = []
    for wl in setup.workloads:
        none = off.get("none", {}).get(wl.name, [])
        row: dict[str, Any] = {"workload": wl.name, "tokens": wl.batch * wl.tokens}
        row["cold"] = med([r["cold_s"] for r in none])
        row["hit"] = med([r["hit_s"] for r in none])
        for store_mode in ("sync store", "write-behind", "write-behind, not paced"):
            xs = [
                r["store_s"]
                for n, m in STORE_MODE.items()
                if m == store_mode
                for r in off.get(n, {}).get(wl.name, [])
            ]
            row[store_mode] = med(xs)
        for n, mode in LOAD_MODE.items():
            rs = off.get(n, {}).get(wl.name, [])
            row[mode] = med([r["warm_s"] for r in rs])
            row[mode + " own hit"] = med([r["own_hit_s"] for r in rs if "own_hit_s" in r])
            loaded = [r["load"].get("tokens_loaded", 0) for r in rs]
            b = sum(waited_bytes(r["load"]) for r in rs)
            t = sum(r["load"].get("load_seconds", 0) for r in rs)
            row[mode + " tokens"] = min(loaded) if loaded else None
            row[mode + " errors"] = sum(r["load"].get("load_errors", 0) for r in rs)
            row[mode + " GBps"] = b / t / 1e9 if t and b else None  # None: layer loads (under the forward)
            row[mode + " outputs"] = compare_outputs(res, n, wl.name) if rs else None
        row["pinned"] = pinned
        rows.append(row)
    return {"rows": rows}


def fmt_ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def fmt_rel(x: float | None, base: float | None) -> str:
    return "" if x is None or not base else f" ({(x / base - 1) * 100:+.0f}%)"


def runner_label(environ: dict[str, str]) -> str:
    """Which vLLM model runner the instances run on, as the environment chose it (``ENGINE_ENV``
    may still put single engines on the V1 runner): the V2 runner forces asynchronous loads."""
    v = environ.get("VLLM_USE_V2_MODEL_RUNNER")
    if v is None:
        return "vLLM's default model runner"
    return (
        f"{'V2' if v.strip().lower() in ('1', 'true') else 'V1'} model runner (VLLM_USE_V2_MODEL_RUNNER={v})"
    )


def markdown(res: dict, setup: Setup) -> str:
    summ = res["summary"]
    pinned = res.get("pinned_h2d_GBps")
    lines = [
        "| workload | cold, no connector | cold, Maru storing (sync) | cold, write-behind (paced) "
        "| cold, write-behind not paced | "
        + " | ".join(f"warm, {m}" for m in LOAD_MODE.values())
        + " | vLLM's own prefix hit "
        f"| that engine's own hit: {' / '.join(LOAD_MODE)} | tokens loaded | load GB/s {' / '.join(LOAD_MODE)}"
        + (f" (% of pinned {pinned:.1f})" if pinned else "")
        + " | outputs (identical+close / n) |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(LOAD_MODE) + "---:|---|---:|---:|---|",
    ]
    for r in summ["rows"]:
        gb = []
        for m in LOAD_MODE.values():
            g = r.get(m + " GBps")
            gb.append("-" if g is None else (f"{g:.1f} ({g / pinned * 100:.0f}%)" if pinned else f"{g:.2f}"))
        outs = []
        for m in LOAD_MODE.values():
            o = r.get(m + " outputs")
            outs.append("-" if not o else f"{o['identical'] + o['close']}/{o['n']}")
        errs = sum(r.get(m + " errors") or 0 for m in LOAD_MODE.values())
        lines.append(
            f"| {r['workload']} | {fmt_ms(r['cold'])} | {fmt_ms(r['sync store'])}{fmt_rel(r['sync store'], r['cold'])} "
            f"| {fmt_ms(r['write-behind'])}{fmt_rel(r['write-behind'], r['cold'])} "
            f"| {fmt_ms(r['write-behind, not paced'])}{fmt_rel(r['write-behind, not paced'], r['cold'])} "
            f"| {' | '.join(fmt_ms(r[m]) for m in LOAD_MODE.values())} "
            f"| {fmt_ms(r['hit'])} | {' / '.join(fmt_ms(r.get(m + ' own hit')) for m in LOAD_MODE.values())} "
            f"| {r.get('sync load tokens')}{f' ({errs} load errors)' if errs else ''} "
            f"| {' / '.join(gb)} | {' / '.join(outs)} |"
        )
    api = res["api"]["passes"]
    if api:
        lines += [
            "",
            f"Multi-round ({setup.users} users x {setup.rounds} rounds, {setup.system_tokens}-token system "
            f"prompt, {setup.turn_tokens}-token turns, OpenAI API server"
            f"{', CUDA graphs' if res['api'].get('graphs') else ', eager'}, streaming"
            f"{', ' + res['env']['runner'] if res.get('env', {}).get('runner') else ''}"
            f"{'; host: ' + res['env']['host'] if res.get('env', {}).get('host') else ''}):",
            "",
            "| instance | requests | TTFT p50 | TTFT p95 | mean | mean of each round | p50 of each repetition "
            "| vLLM's TTFT / queue / prefill, mean | the rest of the answer, mean | tokens loaded from Maru "
            "| prompt tokens: computed / vLLM's cache / Maru (vLLM's count); preemptions "
            "| Maru's scheduler host time per new request (wall; its thread's CPU, offer-pin round trips) |",
            "|---|---:|---:|---:|---:|---|---|---|---:|---:|---|---:|",
        ]
        for p in api:
            lines.append(
                f"| {p['label']} | {p['n']} | {fmt_ms(p['p50_s'])} | {fmt_ms(p['p95_s'])} "
                f"| {fmt_ms(p['mean_s'])} | {' / '.join(fmt_ms(x) for x in p.get('round_mean_s', []))} "
                f"| {' / '.join(fmt_ms(x) for x in p.get('rep_p50_s', []))} "
                f"| {' / '.join(fmt_ms(statistics.mean(p[f'server_{k}_s'])) if p.get(f'server_{k}_s') else '-' for k in SERVER_TIMINGS)} "
                f"| {fmt_ms(p.get('decode_s'))} | {p['tokens_loaded']} | {token_sources(p.get('server_counts'))} "
                f"| {sched_cell(p)} |"
            )
    return "\n".join(lines)


def sched_cell(p: dict) -> str:
    """``wall us (CPU c, pin trips t)`` of the scheduler's probe per new request; '-' without it."""
    us = p.get("sched_probe_us")
    if us is None:
        return "-"
    parts = [f"CPU {c:.0f}" for c in [p.get("sched_probe_cpu_us")] if c is not None]
    parts += [f"pin trips {t:.0f}" for t in [p.get("sched_pin_trip_us")] if t is not None]
    parts += [
        f"{r[1]} of {r[0] + r[1]} replies blocked past the polling" for r in [p.get("sched_replies")] if r
    ]
    parts += [f"{n} {us:.0f}" for n, us in (p.get("sched_parts_us") or {}).items()]
    return f"{us:.0f} us" + (f" ({', '.join(parts)})" if parts else "")


def token_sources(c: dict[str, float] | None) -> str:
    """``computed / local hits / connector hits; preemptions`` of a pass's prompt tokens (vLLM's
    counters; '-' without them)."""
    if not c or not c.get("prompt"):
        return "-"
    computed = c["prompt"] - c["local_hit"] - c["external_hit"]
    return f"{computed:.0f} / {c['local_hit']:.0f} / {c['external_hit']:.0f}; {c['preempted']:.0f}"


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no matplotlib: the PNG plot is skipped (pip install matplotlib)")
        return False
    rows = res["summary"]["rows"]
    cols = [("cold", "cold, no connector"), ("sync store", "cold + Maru sync store"),
            ("write-behind", "cold + write-behind"), ("sync load", "warm, sync load"),
            ("async load", "warm, async load"), ("layer overlap", "warm, layer overlap"),
            ("default (V2)", "warm, default (V2)"),
            ("hit", "vLLM prefix hit")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(cols)
    for j, (k, label) in enumerate(cols):
        ys = [(r.get(k) or 0) * 1e3 for r in rows]
        ax.bar([i + j * width for i in range(len(rows))], ys, width, label=label)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [r["workload"] for r in rows])
    ax.set_ylabel("TTFT of the batch (ms)")
    ax.set_title(f"vLLM + MaruKVConnector, {res['env'].get('device', '?')}, {res['env'].get('model', '')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# ----------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="vLLM's CPU build, tiny model, small prompts")
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="h4-bench-"))
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--workloads", nargs="*", default=None, help="subset of workload names")
    # "unpaced" is not in the default set (GPU memory: every engine starts at once); the device pass
    # runs it on its own after the main run.
    ap.add_argument(
        "--engines", nargs="*", default=[n for n in OFFLINE if n != "unpaced"], choices=list(OFFLINE)
    )
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-api", action="store_true", help="skip the multi-round API-server workload")
    ap.add_argument("--api-reps", type=int, default=None, help="repetitions of the multi-round passes")
    ap.add_argument(
        "--api-loads", nargs="*", default=["default"], type=check_load_mode,
        help="load modes of the warm API instances (each a fresh instance; default: the default config): "
        f"{', '.join(API_LOADS)}, or alt-<name> (the default config from the maru/ in .ab/<name>)",
    )  # fmt: skip
    ap.add_argument(
        "--api-pair", action="store_true",
        help="two-instance passes: users alternate between two instances, without a connector and with Maru",
    )  # fmt: skip
    ap.add_argument(
        "--api-stores", nargs="*", default=[], type=check_store_variant,
        help="more cold API instances, one per store variant (each storing under a namespace of its own): "
        f"{', '.join(API_STORES)}, or alt-<name> (the maru/ in .ab/<name>)",
    )  # fmt: skip
    ap.add_argument(
        "--api-graphs", action="store_true",
        help="API servers with vLLM's default CUDA graphs and torch.compile (not --enforce-eager)",
    )  # fmt: skip
    ap.add_argument(
        "--api-gil-probe-ms", type=float, default=0.0,
        help="the API instances with a connector run maru_gil_probe_ms at this period: their timing line "
        "says how long a thread of the engine process waited for the GIL (0: no probe)",
    )  # fmt: skip
    ap.add_argument(
        "--api-untimed", action="store_true",
        help="the API instances without maru_log_timing (the default configuration as deployed: no step "
        "clock, no hook lines); tokens from Maru then read from vLLM's external prefix-cache hits",
    )  # fmt: skip
    ap.add_argument(
        "--api-store-ab", type=int, default=0, metavar="REPS",
        help="the API instances take turns a round at a time, REPS repetitions (bench/store_ab.py): "
        "storing against a plain instance, warm loads against vLLM's own hit, paired round by round",
    )  # fmt: skip
    ap.add_argument(
        "--api-settle-s", type=float, default=SETTLE_S, metavar="S",
        help=f"with --api-store-ab: seconds after every instance's round (default {SETTLE_S}; a write-behind "
        "store batch publishes in ~30 ms: 0.25 gives about twice the rounds a device second)",
    )  # fmt: skip
    a = ap.parse_args(argv)
    if not 0 <= a.api_settle_s <= 10:
        ap.error(f"--api-settle-s must be within [0, 10] s, got {a.api_settle_s}")
    if a.api_store_ab:
        a.api_pair = False  # the round-by-round pass: --api-loads and --api-stores as given, and the idle one
        a.api_stores = ["idle", *(v for v in a.api_stores if v != "idle")]

    setup = TINY_SETUP if a.tiny else GPU_SETUP
    if a.workloads:
        setup = Setup(
            **{**setup.__dict__, "workloads": tuple(w for w in setup.workloads if w.name in a.workloads)}
        )
    if a.reps:
        setup = Setup(**{**setup.__dict__, "reps": a.reps})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(a.log_dir or out / "logs")
    res: dict[str, Any] = {
        "env": {},
        "offline": {},
        "api": {"passes": [], "errors": [], "graphs": a.api_graphs},
        "errors": [],
    }
    res["setup"] = {
        k: (v if not isinstance(v, tuple) else [w.__dict__ for w in v]) for k, v in setup.__dict__.items()
    }
    res["setup"]["model"] = setup.model.__dict__

    import torch
    import vllm

    res["env"] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model": f"{setup.model.layers} layers, {setup.model.kv_heads} KV heads x {setup.model.head_size}, "
        f"{setup.model.dtype}, hidden {setup.model.hidden}",
        "runner": runner_label(dict(os.environ)),
        "host": host_facts(),
    }
    log(f"env: {res['env']}")
    res["pinned_h2d_GBps"] = pinned_h2d_gbps()
    log(f"pinned H2D: {res['pinned_h2d_GBps']}")
    t = time.perf_counter()
    model_dir = a.model_dir or str(Path(tempfile.gettempdir()) / f"h4-model-{'tiny' if a.tiny else 'l3kv'}")
    model = str(make_model(model_dir, setup.model))
    log(f"model at {model} ({time.perf_counter() - t:.1f} s)")

    from tests.helpers import ServerProcess, free_port

    storing = [
        v for v in a.api_stores if (c := store_variant(v)) is not None and c.get("maru_enable_store", True)
    ]
    psize = pool_size(setup, 0 if a.no_api else 1 + int(a.api_pair) + len(storing))
    srv = ServerProcess(logs, pool_size=psize, log_level="WARNING")
    srv.start()
    res["pool_bytes"] = psize
    log(f"maru server {srv.url}, pool {psize / GiB:.1f} GiB in /dev/shm")

    # Keys every API instance with a connector gets on top of its variant's.
    api_extra: dict[str, Any] = {"maru_gil_probe_ms": a.api_gil_probe_ms} if a.api_gil_probe_ms > 0 else {}
    if a.api_untimed:  # the timing's step clock and hook lines cost each step ~0.1-0.2 ms of host time
        api_extra["maru_log_timing"] = False
    api_specs = (
        {}
        if a.no_api
        else api_instances(
            lambda ns, extra: maru_extra(srv.url, setup, ns, {**api_extra, **extra}),
            a.api_loads,
            a.api_stores,
            a.api_pair,
        )
    )
    if torch.cuda.is_available():  # refused before anything starts, with what to leave out
        short = gpu_memory_shortfall(
            torch.cuda.mem_get_info()[0],
            (Path(model) / "model.safetensors").stat().st_size,
            [setup.kv_cache_bytes] * len(a.engines) + [setup.api_kv_cache_bytes] * len(api_specs),
            helpers=sum(bool((store_variant(v) or {}).get("maru_store_helper")) for v in a.api_stores),
        )
        if short is not None:
            srv.cleanup()
            raise SystemExit(f"gpu_vllm_e2e: {short}")
    engines: dict[str, Engine] = {}
    servers: dict[str, ApiServer] = {}
    prompts = {
        (w.name, rep): [
            random_prompt(w.tokens, 1000 * rep + 10 * i + w.tokens, setup.model.vocab) for i in range(w.batch)
        ]
        for w in setup.workloads
        for rep in range(setup.reps)
    }
    try:
        for name in a.engines:
            kv = (
                None
                if OFFLINE[name] is None
                else maru_kv_config(maru_extra(srv.url, setup, name, OFFLINE[name]))
            )
            spec = engine_spec(setup, model, kv, setup.kv_cache_bytes)
            env = ENGINE_ENV.get(name) or store_env(name)
            engines[name] = Engine(name, spec, logs / f"engine-{name}.log", env=env).start()
        if not a.no_api:
            for key, kv in api_specs.items():
                spec = engine_spec(setup, model, kv, setup.api_kv_cache_bytes)
                spec["max_model_len"] = setup.system_tokens + 2 * setup.rounds * setup.turn_tokens + 256
                spec["enforce_eager"] = not a.api_graphs
                env = ENGINE_ENV.get(key.removeprefix("load-")) or store_env(
                    key.removeprefix("load-").removeprefix("store-")  # alt-<name>: warm or cold
                )
                servers[key] = ApiServer(
                    f"api-{key}", spec, free_port(), logs / f"api-{key}.log", env=env
                ).start()
        for name, eng in engines.items():
            try:
                r = eng.wait_ready(timeout=600)
                log(f"engine {name} ready ({r['startup_s']:.1f} s)")
                run_offline(name, eng, setup, prompts, res)
            except Exception as e:
                res["errors"].append(f"engine {name}: {e!r}")
                log(f"engine {name}: FAILED {e!r}\n{traceback.format_exc()}")
            finally:
                eng.close()  # frees its GPU memory for what follows
            (out / "gpu_vllm_e2e.json").write_text(json.dumps(res, default=str))
        if servers and a.api_store_ab:
            run_store_ab(servers, setup, res, a.api_store_ab, a.api_settle_s)
        elif servers:
            run_api(servers, setup, res, a.api_reps or setup.api_reps)
        (out / "gpu_vllm_e2e.json").write_text(json.dumps(res, default=str))  # before the closes
    except KeyboardInterrupt:  # the pass's time budget ran out: report what was measured
        res["errors"].append("interrupted (time budget)")
        log("interrupted: summarizing what was measured")
        # Saved before the engines close: closing six API servers can outlast the call's limit,
        # and the A/B's rounds are then all that comes back (fifty-ninth pass, run e).
        (out / "gpu_vllm_e2e.json").write_text(json.dumps(res, default=str))
    finally:
        for e in engines.values():
            e.close()
        for s in servers.values():
            s.close()
        try:
            from maru.client import MaruHandler

            with MaruHandler(srv.url, timeout_s=5) as h:
                res["server_stats"] = h.stats()
        except Exception as e:
            res["server_stats"] = {"error": repr(e)}
        srv.cleanup()

    res["summary"] = summarize(res, setup)
    st = res.get("server_stats", {})
    evictions = st.get(
        "evictions", st.get("counters", {}).get("evictions") if isinstance(st.get("counters"), dict) else None
    )
    res["evictions"] = evictions
    md = markdown(res, setup)
    (out / "gpu_vllm_e2e.md").write_text(md + "\n")
    (out / "gpu_vllm_e2e.json").write_text(json.dumps(res, default=str))
    plot(res, out / "gpu_vllm_e2e.png")
    print()
    print(f"== {res['env']['device']}, vLLM {res['env']['vllm']}, model: {res['env']['model']}; "
          f"pool {psize / GiB:.1f} GiB, server evictions: {evictions}; errors: {res['errors'] + res['api']['errors']}")  # fmt: skip
    print(md)
    from maru.server.stats import service_us

    svc = service_us(st) if isinstance(st, dict) else {}
    if svc:  # with the clients' round trips (the API table), where a request's time goes
        print("maru server's time by op (requests, mean us): " + ", ".join(
            f"{op} {n} {us:.0f}" for op, (n, us) in sorted(svc.items(), key=lambda kv: -kv[1][0])))  # fmt: skip
    bad = [
        (r["workload"], m)
        for r in res["summary"]["rows"]
        for m in LOAD_MODE.values()
        if (r.get(m + " outputs") or {}).get("different")
    ]
    if bad:
        print(f"OUTPUTS DIFFER (wrong KV?) in: {bad}")
    return 1 if (bad or res["errors"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
