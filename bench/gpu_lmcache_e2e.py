"""Real vLLM, side by side: cold; warm through LMCache + Maru; warm through Maru's own connector;
warm through LMCache's own local CPU backend. Same model, same prompts, one run.

    python3 bench/gpu_lmcache_e2e.py [--out DIR]         # H200: Llama-3-8B KV geometry
    python bench/gpu_lmcache_e2e.py --tiny [--out DIR]   # vLLM's CPU build, tiny model (harness check)

One ``maru server`` (pool in /dev/shm); every vLLM engine in its own process (``bench/vllm_harness.py``),
all started at once, then driven one after the other, each closed before the next runs:

- ``none``: no connector. Cold TTFT, then the same prompts again (vLLM's own prefix hit): the
  reference outputs.
- ``lmc-maru-A`` / ``lmc-maru-B``: vLLM's ``LMCacheConnectorV1`` with Maru as LMCache's storage
  plugin (``local_cpu: false``: nothing is kept in LMCache's own CPU tier, so B's hits come from
  the pool). A computes and stores (waiting after each batch until the pool holds still, so
  LMCache's buffer never overflows); B, a second instance, gets the same prompts: warm.
- ``maru-A`` / ``maru-B``: Maru's own ``MaruKVConnector`` (defaults: write-behind store, loads as
  vLLM's V2 runner needs). A stores, B loads.
- ``lmc-maru-B-nv``: B again (a third instance) with ``maru_verify_on_get: false``: what the CPU
  checksum check of every chunk read costs (Maru's own connector checks on the GPU).
- ``lmc-cpu``: LMCache with its own local CPU backend only (each instance its own): cold, then
  vLLM's prefix cache is reset and the same prompts run again, so the hit comes from LMCache's
  CPU tier of the same process.

TTFT is the wall time of ``LLM.generate(prompts, max_tokens=1)`` for the whole batch. Outputs:
each warm run's greedy tokens (8) against the ``none`` engine's (``vllm_harness.same_greedy``).
A row whose engine could not start says ``blocked: <why>``. Writes ``gpu_lmcache_e2e.json`` and
``gpu_lmcache_e2e.md`` (and a PNG with matplotlib) to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.vllm_harness import (  # noqa: E402
    GPU_MODEL,
    TINY_MODEL,
    Engine,
    ModelSpec,
    make_model,
    maru_kv_config,
    random_prompt,
    same_greedy,
    worker_counters,
)

GiB = 1 << 30
MAX_TOKENS = 8


@dataclass(frozen=True)
class Setup:
    model: ModelSpec
    workloads: tuple[tuple[str, int, int], ...]  # (name, batch, tokens)
    block_size: int
    chunk_tokens: int
    batched_tokens: int
    kv_cache_bytes: int
    gpu_mem_util: float | None
    lmcache_cpu_gb: float  # LMCache's own CPU tier (lmc-cpu): holds every prompt of the run
    lmcache_buffer_gb: float  # LMCache's CPU buffer in front of Maru (lmc-maru): one batch at a time
    reps: int


GPU_SETUP = Setup(
    GPU_MODEL, (("1x16k", 1, 16384), ("4x4k", 4, 4096)), 16, 256, 16384, 8 * GiB, 0.1, 10.0, 4.0, 2
)
TINY_SETUP = Setup(
    TINY_MODEL, (("1x1k", 1, 1024), ("2x512", 2, 512)), 32, 64, 2048, 128 << 20, None, 0.5, 0.25, 1
)

ROWS = (
    ("cold", "cold, no connector"),
    ("lmc-maru", "warm, LMCache + Maru (2nd instance)"),
    ("lmc-maru-nv", "same, checksums not checked"),
    ("maru", "warm, Maru's own connector (2nd instance)"),
    ("lmc-cpu", "warm, LMCache local CPU (same instance)"),
    ("hit", "vLLM's own prefix hit (same instance)"),
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def lmcache_yaml(path: Path, setup: Setup, maru_url: str | None, namespace: str, verify: bool = True) -> Path:
    """LMCache's config file: Maru as its storage plugin (``maru_url``) or its own local CPU tier."""
    cfg: dict[str, Any] = {
        "chunk_size": setup.chunk_tokens,
        # Deterministic chunk hashes across processes (Python's hash() is salted per process).
        "pre_caching_hash_algorithm": "sha256_cbor_64bit",
        "max_local_cpu_size": setup.lmcache_cpu_gb if maru_url is None else setup.lmcache_buffer_gb,
    }
    if maru_url is None:
        cfg["local_cpu"] = True
    else:
        cfg.update(
            local_cpu=False,
            storage_plugins=["maru"],
            extra_config={
                "storage_plugin.maru.module_path": "maru.lmcache",
                "storage_plugin.maru.class_name": "MaruStorageBackend",
                "maru_server_url": maru_url,
                "maru_namespace": namespace,
                "maru_verify_on_get": verify,
            },
        )
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return path


def lmcache_kv_config() -> dict[str, Any]:
    """vLLM's kv-transfer config for LMCache's connector. ``MARU_LMCACHE_NATIVE=1``: vLLM's own copy
    of LMCache's adapter (``use_native``), for when LMCache's adapter does not import beside this
    vLLM (bench/gpu_lmcache_pass.sh decides)."""
    kv: dict[str, Any] = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    if os.environ.get("MARU_LMCACHE_NATIVE") == "1":
        kv["kv_connector_extra_config"] = {"use_native": True}
    return kv


def engine_spec(setup: Setup, model: str, kv: dict | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": model,
        "dtype": setup.model.dtype,
        "block_size": setup.block_size,
        "max_model_len": max(t for _, _, t in setup.workloads) + 256,
        "kv_cache_memory_bytes": setup.kv_cache_bytes,
        "max_num_batched_tokens": setup.batched_tokens,
        "gpu_memory_utilization": setup.gpu_mem_util,
    }
    if kv is not None:
        spec["kv_transfer_config"] = kv
    return spec


def run_engine(eng: Engine, prompts: dict, mode: str, setup: Setup, after_each: Any = None) -> dict[str, Any]:
    """Per workload and rep: one run (``once``); or a run and the same prompts again, straight away
    (``hit``: vLLM's own prefix cache) or after resetting vLLM's prefix cache (``reset``: the hit
    can only come from the connector)."""
    out: dict[str, Any] = {"startup_s": eng.ready.get("startup_s")}
    warm = random_prompt(256, 99, setup.model.vocab)
    eng.generate([warm])  # first-call costs out of the way
    eng.settle()
    for (wl, rep), ps in prompts.items():
        first = eng.generate(ps, max_tokens=MAX_TOKENS, logprobs=5)
        rec: dict[str, Any] = {
            "rep": rep,
            "first_s": first["seconds"],
            "first_out": [first["tokens"], first["logprobs"]],
        }
        rec["first_cached"] = first["cached"]
        if mode != "hit":
            rec["settle_s"] = eng.settle()["seconds"]
        if after_each is not None:
            after_each()
        if mode != "once":
            again = eng.generate(ps, max_tokens=MAX_TOKENS, logprobs=5)
            rec.update(
                again_s=again["seconds"],
                again_out=[again["tokens"], again["logprobs"]],
                again_cached=again["cached"],
            )
            eng.settle()
        out.setdefault(wl, []).append(rec)
        log(f"{eng.name:11} {wl:6} rep {rep}: {first['seconds'] * 1e3:8.1f} ms (cached {first['cached']})"
            + (f", again {rec['again_s'] * 1e3:8.1f} ms (cached {rec['again_cached']})" if mode != "once" else ""))  # fmt: skip
    try:
        out["final_stats"] = eng.stats()
    except Exception as e:  # diagnostics only
        out["final_stats"] = {"error": repr(e)}
    return out


def greedy_match(runs: list[dict], key: str, ref_runs: list[dict], ref_key: str) -> dict[str, int]:
    counts = {"identical": 0, "close": 0, "different": 0, "n": 0}
    refs = {r["rep"]: r for r in ref_runs}
    for r in runs:
        ref = refs.get(r["rep"])
        if ref is None or key not in r:
            continue
        (t, lp), (rt, rlp) = r[key], ref[ref_key]
        for i in range(len(t)):
            counts[same_greedy(t[i], lp[i], rt[i], rlp[i])] += 1
            counts["n"] += 1
    return counts


def med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def summarize(res: dict, setup: Setup) -> list[dict[str, Any]]:
    e = res["engines"]
    rows = []
    for wl, batch, tokens in setup.workloads:
        none = e.get("none", {}).get(wl, [])
        cells: dict[str, Any] = {"workload": wl, "tokens": batch * tokens}
        sources = {
            "cold": (none, "first_s", "first_out"),
            "hit": (none, "again_s", "again_out"),
            "lmc-maru": (e.get("lmc-maru-B", {}).get(wl, []), "first_s", "first_out"),
            "lmc-maru-nv": (e.get("lmc-maru-B-nv", {}).get(wl, []), "first_s", "first_out"),
            "maru": (e.get("maru-B", {}).get(wl, []), "first_s", "first_out"),
            "lmc-cpu": (e.get("lmc-cpu", {}).get(wl, []), "again_s", "again_out"),
        }
        for col, (runs, tkey, okey) in sources.items():
            cells[col] = med([r[tkey] for r in runs if tkey in r])
            cells[col + " cached"] = min(
                (sum(r.get(tkey.replace("_s", "_cached"), [0])) for r in runs), default=None
            )
            cells[col + " outputs"] = (
                greedy_match(runs, okey, none, "first_out") if runs and col != "cold" else None
            )
        cells["store lmc-maru-A"] = med([r["first_s"] for r in e.get("lmc-maru-A", {}).get(wl, [])])
        cells["store maru-A"] = med([r["first_s"] for r in e.get("maru-A", {}).get(wl, [])])
        cells["store lmc-cpu"] = med([r["first_s"] for r in e.get("lmc-cpu", {}).get(wl, [])])
        rows.append(cells)
    return rows


def markdown(res: dict, setup: Setup) -> str:
    blocked = res.get("blocked", {})
    head = "| workload | " + " | ".join(label for _, label in ROWS) + " |"
    lines = [head, "|---|" + "---:|" * len(ROWS)]
    for r in res["summary"]:
        cells = []
        for col, _ in ROWS:
            engine = {"lmc-maru": "lmc-maru-B", "lmc-maru-nv": "lmc-maru-B-nv", "maru": "maru-B"}.get(
                col, col
            )
            engine = "none" if col in ("cold", "hit") else engine
            if engine in blocked and r.get(col) is None:
                cells.append("blocked")
                continue
            v = r.get(col)
            if v is None:
                cells.append("-")
                continue
            txt = f"{v * 1e3:.0f} ms"
            if col != "cold" and r.get("cold"):
                txt += f" ({r['cold'] / v:.1f}x)"
            o = r.get(col + " outputs")
            if o:
                txt += f", {o['identical'] + o['close']}/{o['n']} same"
            c = r.get(col + " cached")
            if col == "hit" and c is not None:
                txt += f", {c} tok cached"
            cells.append(txt)
        lines.append(f"| {r['workload']} | " + " | ".join(cells) + " |")
    lines += ["", "Cold prefill while storing (first instance): " + "; ".join(
        f"{r['workload']}: LMCache+Maru {fmt(r['store lmc-maru-A'])}, Maru {fmt(r['store maru-A'])}, "
        f"LMCache CPU {fmt(r['store lmc-cpu'])}" for r in res["summary"])]  # fmt: skip
    hits = {
        n: res["engines"].get(n, {}).get("lmcache_hit_tokens")
        for n in ("lmc-maru-B", "lmc-maru-B-nv", "lmc-cpu")
    }
    lines.append(f"LMCache hit tokens (its own log): {hits}")
    mstats = res["engines"].get("maru-B", {}).get("final_stats") or {}
    lines.append(f"Maru connector, tokens loaded by maru-B: {worker_counters(mstats).get('tokens_loaded')}")
    for name, why in blocked.items():
        lines.append(f"blocked: {name}: {why}")
    return "\n".join(lines)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.0f} ms"


def plot(res: dict, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = res["summary"]
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / len(ROWS)
    for j, (col, label) in enumerate(ROWS):
        ax.bar(
            [i + j * width for i in range(len(rows))],
            [(r.get(col) or 0) * 1e3 for r in rows],
            width,
            label=label,
        )
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))], [r["workload"] for r in rows])
    ax.set_ylabel("TTFT of the batch (ms)")
    ax.set_title(f"LMCache + Maru vs Maru's connector, {res['env'].get('device', '?')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def wait_pool_quiet(url: str, timeout_s: float = 60.0) -> dict[str, Any]:
    """Wait until the pool's entry count holds still with no open reservation (a first instance's
    queued puts are published) before that instance is closed; returns the last usage."""
    from maru.client import MaruHandler

    last: dict[str, Any] = {}
    with MaruHandler(url, timeout_s=5) as h:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            u = h.usage()
            if last and u["entries"] == last["entries"] and not u["reservations"]:
                return u
            last = u
            time.sleep(1.0)
    return last


def lmcache_init_failure(log_path: Path) -> str | None:
    """The first line of LMCache's own report that it failed to start in an engine, if any."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    for i, line in enumerate(lines):
        if "Failed to initialize LMCache" in line:
            errs = [x for x in lines[i : i + 40] if "Error" in x and "Traceback" not in x]
            return (errs[-1] if errs else line).strip()[:300]
    return None


def lmcache_hits_in_log(log_path: Path) -> int:
    """Tokens LMCache reported as hits ("LMCache hit tokens: N") in an engine's log."""
    import re

    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return 0
    return sum(int(m.group(1)) for m in re.finditer(r"LMCache hit tokens: (\d+)", text))


def lmcache_import_error() -> str | None:
    """Why LMCache's vLLM connector or Maru's backend cannot be imported here (None: both import)."""
    try:
        if os.environ.get("MARU_LMCACHE_NATIVE") == "1":
            from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_integration import vllm_v1_adapter  # noqa: F401
        else:
            from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl  # noqa: F401

        from maru.lmcache.backend import MaruStorageBackend  # noqa: F401
    except Exception:
        return traceback.format_exc()
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="lmc-bench-"))
    ap.add_argument("--log-dir", default=None)
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument(
        "--v1-runner",
        action="store_true",
        help="run the LMCache engines on vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0); "
        "LMCACHE_V1_RUNNER=1 in the environment does the same",
    )
    a = ap.parse_args(argv)
    setup = TINY_SETUP if a.tiny else GPU_SETUP
    v1_runner = a.v1_runner or os.environ.get("LMCACHE_V1_RUNNER") == "1"
    if a.reps:
        setup = Setup(**{**setup.__dict__, "reps": a.reps})
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(a.log_dir or out / "logs")
    logs.mkdir(parents=True, exist_ok=True)
    import torch
    import vllm

    res: dict[str, Any] = {"engines": {}, "blocked": {}, "errors": []}
    res["env"] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "model": f"{setup.model.layers} layers, {setup.model.kv_heads} KV heads x {setup.model.head_size}, {setup.model.dtype}",
        "lmcache_engines_runner": "V1 (VLLM_USE_V2_MODEL_RUNNER=0)" if v1_runner else "vLLM's default",
    }
    try:
        from importlib import metadata

        res["env"]["lmcache"] = metadata.version("lmcache")
    except Exception as e:
        res["env"]["lmcache"] = f"not installed ({e})"
    log(f"env: {res['env']}")
    why = lmcache_import_error()
    if why is not None:
        log(f"LMCache cannot be imported here:\n{why}")
        for name in ("lmc-maru-A", "lmc-maru-B", "lmc-maru-B-nv", "lmc-cpu"):
            res["blocked"][name] = why.strip().splitlines()[-1]
    model = str(
        make_model(Path(tempfile.gettempdir()) / f"h4-model-{'tiny' if a.tiny else 'l3kv'}", setup.model)
    )

    from tests.helpers import ServerProcess

    largest = max(b * t for _, b, t in setup.workloads) * setup.model.kv_bytes_per_token()
    # Both connectors' chunks of every rep, with room to spare, capped by what /dev/shm has free.
    import shutil

    want = max(5 * largest * setup.reps // 2 + GiB // 2, 256 << 20)
    psize = int(min(want, shutil.disk_usage("/dev/shm").free * 0.8)) // (1 << 20) << 20
    srv = ServerProcess(logs, pool_size=psize, log_level="WARNING").start()
    log(f"maru server {srv.url}, pool {psize / GiB:.1f} GiB")
    hashseed = {"PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false"}
    plans: dict[str, tuple[dict | None, dict[str, str], str]] = {
        "none": (None, {}, "hit"),
        "lmc-maru-A": (lmcache_kv_config(), {"LMCACHE_CONFIG_FILE": str(lmcache_yaml(logs / "lmc-maru.yaml", setup, srv.url, "bench"))}, "once"),
        "lmc-maru-B": (lmcache_kv_config(), {"LMCACHE_CONFIG_FILE": str(logs / "lmc-maru.yaml")}, "once"),
        "lmc-maru-B-nv": (lmcache_kv_config(), {"LMCACHE_CONFIG_FILE": str(lmcache_yaml(logs / "lmc-maru-nv.yaml", setup, srv.url, "bench", verify=False))}, "once"),
        "maru-A": (maru_kv_config({"maru_server_url": srv.url, "maru_kv_chunk_tokens": setup.chunk_tokens, "maru_namespace": "bench"}), {}, "once"),
        "maru-B": (maru_kv_config({"maru_server_url": srv.url, "maru_kv_chunk_tokens": setup.chunk_tokens, "maru_namespace": "bench"}), {}, "once"),
        "lmc-cpu": (lmcache_kv_config(), {"LMCACHE_CONFIG_FILE": str(lmcache_yaml(logs / "lmc-cpu.yaml", setup, None, ""))}, "reset"),
    }  # fmt: skip
    prompts = {
        (wl, rep): [random_prompt(t, 1000 * rep + 10 * i + t, setup.model.vocab) for i in range(b)]
        for wl, b, t in setup.workloads
        for rep in range(setup.reps)
    }
    engines: dict[str, Engine] = {}
    try:
        for name, (kv, env, _) in plans.items():
            if name in res["blocked"]:
                continue
            runner = {"VLLM_USE_V2_MODEL_RUNNER": "0"} if v1_runner and name.startswith("lmc") else {}
            engines[name] = Engine(
                name,
                engine_spec(setup, model, kv),
                logs / f"engine-{name}.log",
                env={**hashseed, **env, **runner},
            ).start()
        for name, eng in engines.items():
            try:
                eng.wait_ready(timeout=600)
                log(f"engine {name} ready ({eng.ready['startup_s']:.1f} s)")
                quiet = (lambda: wait_pool_quiet(srv.url)) if name.endswith("-A") else None
                res["engines"][name] = run_engine(eng, prompts, plans[name][2], setup, after_each=quiet)
                failed = lmcache_init_failure(eng.log_path)
                if failed:
                    res["blocked"][name] = f"LMCache did not initialise (the engine ran without it): {failed}"
                    log(f"engine {name}: {res['blocked'][name]}")
                res["engines"][name]["lmcache_hit_tokens"] = lmcache_hits_in_log(eng.log_path)
                if name.endswith("-A"):
                    u = wait_pool_quiet(srv.url)
                    log(f"pool after {name}: {u.get('entries')} entries")
            except Exception as e:
                res["errors"].append(f"engine {name}: {e!r}")
                res["blocked"].setdefault(name, repr(e).splitlines()[0][:300])
                log(f"engine {name}: FAILED {e!r}")
            finally:
                eng.close()
            (out / "gpu_lmcache_e2e.json").write_text(json.dumps(res, default=str))
    except KeyboardInterrupt:
        res["errors"].append("interrupted (time budget)")
        log("interrupted: summarizing what was measured")
    finally:
        for e in engines.values():
            e.close()
        try:
            from maru.client import MaruHandler

            with MaruHandler(srv.url, timeout_s=5) as h:
                res["server_usage"] = h.usage()
        except Exception as e:
            res["server_usage"] = {"error": repr(e)}
        srv.cleanup()
    res["summary"] = summarize(res, setup)
    md = markdown(res, setup)
    (out / "gpu_lmcache_e2e.md").write_text(md + "\n")
    (out / "gpu_lmcache_e2e.json").write_text(json.dumps(res, default=str))
    plot(res, out / "gpu_lmcache_e2e.png")
    print()
    print(f"== {res['env']}; pool {psize / GiB:.1f} GiB; errors: {res['errors']}")
    print(md)
    bad = [
        (r["workload"], c)
        for r in res["summary"]
        for c, _ in ROWS
        if (r.get(c + " outputs") or {}).get("different")
    ]
    if bad:
        print(f"OUTPUTS DIFFER (wrong KV?) in: {bad}")
    return 1 if (bad or res["errors"] or res["blocked"]) else 0


if __name__ == "__main__":
    raise SystemExit(main())
