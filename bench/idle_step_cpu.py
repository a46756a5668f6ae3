"""Host time of one engine step's connector hooks when Maru has nothing to load or store (CPU).

    .venv/bin/python bench/idle_step_cpu.py [--steps 2000] [--layers 32]

Most steps of a serving engine (every decode step) neither load nor store, yet vLLM calls the
connector in each: the scheduler's ``build_connector_meta``, then on the worker
``handle_preemptions``, ``start_load_kv``, ``wait_for_layer_load`` before every attention layer,
``wait_for_save``, ``get_finished``, ``get_block_ids_with_load_errors``,
``get_kv_connector_stats`` and ``build_connector_worker_meta``. What those cost is paid on vLLM's
threads every step: the idle connector's share of the storing and warm instances' TTFT
(bench/RESULTS.md: "connector attached, Maru off", +2-3% in the API workload with CUDA graphs).

A real ``maru server``, the connector's two sides as vLLM builds them (the default configuration,
no ``maru_log_timing``), CPU caches of two layers whose waits are called ``--layers`` times a step.
Prints the median of five rounds of ``--steps`` steps, then the hooks' own counts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--layers", type=int, default=32, help="wait_for_layer_load calls a step")
    a = ap.parse_args(argv)

    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from maru.vllm.connector import MaruKVConnector
    from tests.helpers import ServerProcess
    from tests.transfer.helpers import case
    from tests.vllm.helpers import BS, vllm_config

    srv = ServerProcess(Path(tempfile.mkdtemp(prefix="maru-idle-step-")), pool_size="16M")
    srv.start()
    try:
        cfg = vllm_config(srv.url, None)
        cfg.compilation_config = SimpleNamespace(static_forward_context={})
        worker = MaruKVConnector(cfg, KVConnectorRole.WORKER)
        cache = case(
            "kv_first", "NHD", 5, num_blocks=8, block_size=BS, num_kv_heads=2, head_size=32, num_layers=2
        )
        names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        worker.register_kv_caches(dict(zip(names, cache.caches, strict=True)))
        sched = MaruKVConnector(vllm_config(srv.url, None), KVConnectorRole.SCHEDULER)
        waits = [names[i % 2] for i in range(a.layers)]
        cached = SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        )  # fmt: skip

        def step() -> None:
            out = SimpleNamespace(
                scheduled_new_reqs=[], scheduled_cached_reqs=cached, num_scheduled_tokens={},
                finished_req_ids=set(), preempted_req_ids=set(), total_num_scheduled_tokens=0,
            )  # fmt: skip
            meta = sched.build_connector_meta(out)
            worker.bind_connector_metadata(meta)
            worker.handle_preemptions(meta)
            worker.start_load_kv(SimpleNamespace())
            for n in waits:
                worker.wait_for_layer_load(n)
            worker.wait_for_save()
            worker.get_finished(set())
            worker.get_block_ids_with_load_errors()
            worker.get_kv_connector_stats()
            worker.build_connector_worker_meta()
            worker.clear_connector_metadata()

        for _ in range(200):  # warm
            step()
        rounds = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(a.steps):
                step()
            rounds.append((time.perf_counter() - t0) / a.steps * 1e6)
        print(
            f"idle step: {statistics.median(rounds):.1f} us (rounds: {', '.join(f'{r:.1f}' for r in rounds)}); "
            f"{a.layers} layer waits a step"
        )
        print("worker hooks:", worker.hook_times.line())
        print("scheduler hooks:", sched.hook_times.line())
    finally:
        srv.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
