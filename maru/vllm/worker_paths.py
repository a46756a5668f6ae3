"""What a vLLM worker reports to the server about the paths it runs (``maru stats``, ``maru doctor``)."""

from __future__ import annotations

from typing import Any

from maru import checksum, env_flags, kv_ops
from maru.client import frames
from maru.vllm import early_loads
from maru.vllm.layer_loads import UNWAITED
from maru.vllm.sampled_profile import slow_note as profiling_note


def early_load_path(worker: Any) -> str:
    """What ``maru_early_load`` does on this worker, as far as the worker can tell: off, or why a
    requested early load never applies here, or issued at each safe step's plan. (Per step, the
    scheduler side's ``maru_stats()["early_loads"]`` counts where it did.)"""
    if not worker.cfg.early_load_wanted:
        return "off"
    asked = "requested" if worker.cfg.early_load else "default"
    if not worker.cfg.enable_load:
        return f"{asked}, no effect: loads are off (maru_enable_load=false)"
    if worker.tp_size > 1:
        return f"{asked}, no effect: tensor parallel (the worker is not in the scheduler's process)"
    if not worker.layer_overlap:
        return f"{asked}, no effect: loads are not layer by layer"
    if (why := early_loads.untested_here()) is not None:
        return f"{asked}, off: {why}"
    return "at the step's plan (one GPU, vLLM's in-process executor)"


def worker_data_paths(worker: Any) -> dict[str, Any]:
    """The client-info map (role, paths, slow) this worker reports to the server.

    ``maru stats`` shows it and ``maru doctor`` warns when ``slow`` is not empty: the paths a
    process actually runs are visible from outside it, not only in its own log.
    """
    eng = worker.engine
    paths: dict[str, Any] = {
        "device": str(eng.device) if eng else "?",
        "kv_ops": kv_ops_backend(),
        "layout": worker.layout.describe() if worker.layout is not None else "?",
        "async_load": "on" if worker.cfg.async_load else "off",
        "layer_overlap": "on" if worker.layer_overlap else "off",
        "early_load": early_load_path(worker),
        # "fail": vLLM's V2 runner, same-step loads kept (offer pins); docs/vllm.md
        "load_failure": "ends the request" if worker.cfg.load_failures_fail else "recomputed",
        "store": "write-behind"
        + (", paced" if eng and eng.paces_stores else "")
        + (
            # maru_store_helper's batches go to the helper at once: only the drain thread's wait
            (", drain-thread batches yield to prefill" if worker.cfg.store_helper else ", yields to prefill")
            if worker.write_behind.gate is not None
            else ""
        )
        if worker.cfg.async_store
        else "sync",
    }
    if worker.cfg.store_helper:
        paths["store_helper"], helper_why = worker.write_behind.helper_path()
    else:
        helper_why = None
    slow: list[str] = list(worker.cfg.fallbacks)  # settings the connector replaced, with the fix
    if helper_why is not None:
        slow.append(helper_why)
    slow.extend(env_flags.misread())  # a MARU_* switch set to a value that is not one (left off)
    if (profiling := profiling_note()) is not None:
        slow.append(profiling)
    early = paths["early_load"]
    if worker.cfg.early_load is True and early.startswith("requested, "):  # set, yet never applies
        slow.append(
            f"maru_early_load is set but {early.removeprefix('requested, ')}: each step's load is "
            "issued at its forward. Fix: see the reason (docs/vllm.md, maru_early_load), or unset it"
        )
    if worker.stats.layer_loads_unwaited:
        slow.append(f"{worker.stats.layer_loads_unwaited} {UNWAITED}")
    if eng is not None:
        paths["load"] = eng.data_path
        reg = eng.host_registration
        if eng.device.type == "cuda":
            paths["pool"] = reg.state if reg is not None else "not registered"
            if reg is None or not reg.registered:
                why = reg.describe() if reg is not None else "the client exposes no pool mapping"
                slow.append(
                    f"pool not registered with CUDA ({why}): pool<->GPU copies are pageable, ~11x "
                    "slower. Fix: see `maru doctor` (pool registered with CUDA) and docs/gpu.md"
                )
        if eng.device.type == "cpu":  # CUDA caches are checked by a Triton kernel instead
            paths["checksum"] = checksum.implementation()
            slow.extend(checksum.slow_reasons())
        paths["segment_sums"] = f"{eng.path.segment_tokens} tokens" if eng.path.segment_tokens else "off"
        if why := eng.path.segments_off():
            slow.append(
                f"stores commit no segment sums ({why}): a load that places only a chunk's last "
                "tokens reads the whole chunk to verify it (more bus bytes). Fix: see the reason "
                "(docs/reliability.md, segment sums)"
            )
        if bad := frames.bad_segments_seen:
            slow.append(
                f"the server sent segment sums that do not parse ({bad}): those chunks are verified "
                "whole (more bus bytes). Fix: run a client and server of the same Maru version"
            )
        if ways := eng.path.store_ways:  # known after the first store
            torch_ways = sorted(w for w in ways if w != "libcudart")
            paths["store_issue"] = "; ".join((["libcudart"] if "libcudart" in ways else []) + torch_ways)
            if torch_ways:
                slow.append(
                    f"{'some' if 'libcudart' in ways else 'all'} stores are queued through "
                    f"{' and '.join(torch_ways)}, not libcudart: the same bytes, about 5x the drain "
                    "thread's host time a chunk (it shares the GIL with vLLM's forward). Fix: see "
                    "the reason; the chunk size (maru_kv_chunk_tokens) and its block multiples (a "
                    "prompt's partial tail) are warmed at start, so only a chunk of another size goes "
                    "this way (the store's other chunks still go through libcudart); libcudart must "
                    "be reachable (maru doctor)"
                )
        extra, path_slow = eng.path.report(worker.layer_overlap)
        paths.update(extra)
        slow.extend(path_slow)
    return {"role": "vllm-connector", "rank": worker.tp_rank, "paths": paths, "slow": slow}


def kv_ops_backend() -> str:
    try:
        return str(kv_ops.backend())
    except Exception:
        return "unknown"
