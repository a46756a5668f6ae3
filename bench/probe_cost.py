"""What vLLM's scheduler thread pays per new request to ask Maru about it: the key index vs EXISTS round trips.

    .venv/bin/python bench/probe_cost.py [--users 16] [--rounds 3] [--system 2048] [--turn 128]

Real vLLM (the CPU build here, any build elsewhere), in-process engine, the tiny test model; a
``maru server`` started twice, once as by default (the key index on) and once with
``--no-key-index``. The workload is the multi-round chat of ``bench/api_workload.py``: U users
sharing an S-token system prompt, round r of a user extends round r-1 by an answer and a new
question, a round's prompts sent together. The connector stores as by default, so later rounds
find earlier rounds' chunks and probe a second time for the tails after them. Reported: the
connector's own host time in ``get_num_new_matched_tokens`` (``hook_ms`` of its scheduler side),
per call, and how the probes went (``probe_path``, ``probes_local`` / ``probes_remote``).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from maru.demo.runner import EngineProcess  # noqa: E402
from maru.demo.server import ServerProcess  # noqa: E402
from maru.demo.tiny_model import build_tiny_model  # noqa: E402


def _tokens(n: int, seed: int, vocab: int = 2048) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def conversation(system: list[int], user: int, rnd: int, turn: int) -> list[int]:
    p = list(system)
    for r in range(rnd + 1):
        p += _tokens(turn, 10_000 + 100 * user + 2 * r)
        if r < rnd:
            p += _tokens(turn, 10_001 + 100 * user + 2 * r)
    return p


def one_run(index: bool, a: argparse.Namespace, model: str, tmp: Path) -> dict[str, Any]:
    srv = ServerProcess(tmp, pool_size="512M", extra_args=[] if index else ["--no-key-index"])
    srv.start()
    try:
        extra = {"maru_server_url": srv.url, "maru_kv_chunk_tokens": a.chunk_tokens}
        spec = {
            "model": model,
            "block_size": 32,
            "max_model_len": a.system + 2 * a.rounds * a.turn + 64,
            "kv_cache_memory_bytes": 256 << 20,
            "connector": {"extra": extra},
        }
        label = "index" if index else "round-trips"
        with EngineProcess(spec, log_path=tmp / f"{label}.log") as e:
            system = _tokens(a.system, 5555)
            for rnd in range(a.rounds):
                prompts = [conversation(system, u, rnd, a.turn) for u in range(a.users)]
                r = e.call({"op": "generate", "prompts": prompts, "max_tokens": 2})
                if "error" in r:
                    raise RuntimeError(r["error"])
                e.call({"op": "flush_stores"})  # the next round finds this one's chunks
            sched = e.call({"op": "stats"})["scheduler"]
    finally:
        srv.cleanup()
    hook = sched["hook_ms"].get("get_num_new_matched_tokens", {"calls": 0, "ms": 0.0})
    return {
        "label": label,
        "calls": int(hook["calls"]),
        "us_per_call": hook["ms"] * 1e3 / max(1, hook["calls"]),
        "cpu_us_per_call": hook.get("cpu_ms", 0.0) * 1e3 / max(1, hook["calls"]),
        "probe_path": sched.get("probe_path"),
        "local": sched.get("probes_local"),
        "remote": sched.get("probes_remote"),
        "tokens_offered": sched.get("tokens_offered"),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--turn", type=int, default=128)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--model-dir", default=None)
    a = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="maru-probe-cost-"))
    model = str(build_tiny_model(a.model_dir or tmp / "model"))
    rows = [one_run(True, a, model, tmp), one_run(False, a, model, tmp)]
    print(f"\n{a.users} users x {a.rounds} rounds, {a.system}-token system prompt, {a.turn}-token turns")
    print(
        "| EXISTS answered by | calls | host time per call (the thread's CPU) | probes local / remote "
        "| tokens offered |"
    )
    print("|---|---:|---:|---|---:|")
    for r in rows:
        print(
            f"| {r['label']} ({r['probe_path']}) | {r['calls']} | {r['us_per_call']:.0f} us "
            f"({r['cpu_us_per_call']:.0f}) | "
            f"{r['local']} / {r['remote']} | {r['tokens_offered']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
