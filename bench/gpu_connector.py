"""Connector-level GPU figures: ``KVTransferEngine`` (what the vLLM connector calls) against a real server.

Where ``bench/gpu_datapath.py`` times the kv_ops transfer engine alone, this times what a prefix
hit costs the connector end to end, RPCs included: a store is ``batch_alloc`` + gather into the
reserved pool pages + wait + ``batch_store`` (publish); a load is ``batch_retrieve(pin=True)`` +
pipelined H2D and scatter + wait + ``batch_release``. The pool is a real ``maru server``'s
``/dev/shm`` pool, mapped by a ``MaruHandler`` and registered with CUDA by the engine.

Geometry as in gpu_datapath.py: 32 layers, 8 KV heads, head size 128, bf16, block size 16, a
FlashInfer-order NHD cache, random blocks, 256-token chunks. Each size stores fresh keys (a
store of keys already present would publish nothing) and loads them back several times.

Usage (on a GPU machine, from the repo root): python bench/gpu_connector.py [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maru import kv_ops  # noqa: E402
from maru.client import MaruHandler  # noqa: E402
from maru.kv_ops.chunk_loads import FUSED_ENV  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402
from maru.transfer.records import ChunkRef, RequestTransfer  # noqa: E402
from maru.vllm.offer_pins import OfferPins  # noqa: E402
from tests.helpers import ServerProcess  # noqa: E402

L, NH, HS, BS = 32, 8, 128, 16
NB = 4096
CHUNK = 256
SIZES = (256, 2048, 16384)
BATCH, BATCH_TOKENS = 8, 2048  # one batched load: 8 requests of 2048 tokens in one call
GB = 1e9


def make_caches(nb: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    buf = torch.randint(
        -(2**15), 2**15 - 1, (L, nb, 2, BS, NH, HS), dtype=torch.int16, device="cuda", generator=g
    )
    return [b for b in buf.view(torch.bfloat16)]


@contextlib.contextmanager
def server_client(pool_size: int) -> Iterator[MaruHandler]:
    """A real ``maru server`` with a ``/dev/shm`` pool of ``pool_size`` bytes and a client of it;
    both gone (the pool file removed) on exit."""
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(tmp, pool_size=pool_size, log_level="WARNING")
        srv.start()
        client = MaruHandler(srv.url, timeout_s=30)
        try:
            yield client
        finally:
            client.close()
            srv.cleanup()


@contextlib.contextmanager
def stored_request(
    tokens: int, tag: str, pool_size: int = 4 << 30
) -> Iterator[tuple[Any, Any, RequestTransfer]]:
    """A real server, a storing and a loading ``KVTransferEngine`` over CUDA caches, and one request of
    ``tokens`` tokens stored through the first: ``(storer, loader, request)``; closed on exit."""
    with server_client(pool_size) as client:
        src, dst = make_caches(NB, 1), make_caches(NB, 2)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        storer = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK)
        loader = KVTransferEngine(dst, layout, client, chunk_tokens=CHUNK)
        req = request(tokens, tag, torch.Generator().manual_seed(0))
        assert storer.store([req]).stored == len(req.chunks)
        try:
            yield storer, loader, req
        finally:
            storer.close()
            loader.close()


def request(tokens: int, tag: str, gen: torch.Generator) -> RequestTransfer:
    blocks = torch.randperm(NB, generator=gen)[: (tokens + BS - 1) // BS].tolist()
    chunks = tuple(ChunkRef(f"bench-{tag}-{i}", i * CHUNK, CHUNK) for i in range(tokens // CHUNK))
    return RequestTransfer(req_id=tag, block_ids=tuple(blocks), chunks=chunks)


def pinned_h2d_gbps(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    dst = torch.empty_like(src, device="cuda")
    times = []
    for _ in range(6):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / GB


def measure(
    storer: KVTransferEngine,
    loader: KVTransferEngine,
    t: int,
    n: int,
    gen: torch.Generator,
    reps: int,
    load_reps: int,
    profile: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Store ``n`` fresh requests of ``t`` tokens ``reps`` times, then load the last ones back
    ``load_reps`` times in one call (and as many times layer by layer); medians, first call dropped."""
    nbytes = n * storer.geometry.nbytes(t)
    store_s, load_s, phases = [], [], []
    last: list[RequestTransfer] = []
    for r in range(reps + 1):
        reqs = [request(t, f"{t}-{r}-{k}-{uuid.uuid4().hex[:6]}", gen) for k in range(n)]
        rep = storer.store(reqs)
        assert rep.stored == sum(len(q.chunks) for q in reqs), rep
        if r:
            store_s.append(rep.seconds)
        last = reqs
    # The write-behind store as the worker runs it (issue on the forward thread, then the drain's
    # complete_store), paced (kv_ops.paced_store, the default): one untimed, one timed.
    wb_s = 0.0
    for r in range(2):
        reqs = [request(t, f"{t}-wb{r}-{k}-{uuid.uuid4().hex[:6]}", gen) for k in range(n)]
        prof = (profile or {}).get("store") if r else None
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        rep = storer.complete_store(storer.issue_store(reqs))
        wb_s = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        assert rep.stored == sum(len(q.chunks) for q in reqs), rep
    for r in range(load_reps + 1):
        rep = loader.load(last)
        assert sorted(rep.loaded_req_ids) == sorted(q.req_id for q in last), rep.failed
        if r:
            load_s.append(rep.seconds)
            phases.append(rep.phases)
    # The load as the worker runs it in vLLM with offer pins (the default): the scheduler side
    # pinned the chunks at its offer (its own client, untimed here: the pin trip is timed apart, it
    # runs in the scheduler before the step) and hands their locations over; no lookup round trip.
    held_s, held_phases, pin_s = [], [], []
    pins = OfferPins()
    with MaruHandler(loader.client.url, timeout_s=30) as sched_client:
        for r in range(load_reps + 1):
            t0 = time.perf_counter()
            for q in last:
                assert pins.hold(sched_client, q.req_id, [c.key for c in q.chunks]) == len(q.chunks)
            t1 = time.perf_counter()
            held = []
            for q in last:
                locs, ticket = pins.hand_over(q.req_id, [c.key for c in q.chunks])
                held.append(dataclasses.replace(q, held=locs, ticket=ticket))
            rep = loader.load(held)
            assert sorted(rep.loaded_req_ids) == sorted(q.req_id for q in last), rep.failed
            pins.worker_done({q.ticket: 1 for q in held})
            pins.flush(sched_client)
            if r:
                pin_s.append(t1 - t0)
                held_s.append(rep.seconds)
                held_phases.append(rep.phases)
    # The layer-overlap load as the connector issues it: one pin, one load_layers a step.
    issue, total = [], []
    for r in range(load_reps + 1):
        t0 = time.perf_counter()
        ll = loader.start_layer_load(loader.pin(last))
        h = ll.handle.load  # kv_ops' LayerLoad under the transfer handle (release() drops it)
        rep = ll.wait()
        assert len(rep.loaded_req_ids) == n, rep.failed
        if r:
            issue.append(h.copy_issue_s + h.place_issue_s)
            total.append(time.perf_counter() - t0)
    # The same with offer pins (the connector's default): the scheduler side pinned the chunks and
    # handed their places over (untimed), so the issue follows no lookup round trip.
    held_issue, held_cpu = [], []
    held_parts: dict[str, list[float]] = {}
    held_steps: dict[str, list[float]] = {}  # the layer load's own phases: pin, prepare, issue
    with MaruHandler(loader.client.url, timeout_s=30) as sched_client:
        for r in range(load_reps + 1):
            held = []
            for q in last:
                assert pins.hold(sched_client, q.req_id, [c.key for c in q.chunks]) == len(q.chunks)
                locs, ticket = pins.hand_over(q.req_id, [c.key for c in q.chunks])
                held.append(dataclasses.replace(q, held=locs, ticket=ticket))
            prof = (profile or {}).get("issue") if r else None
            if prof is not None:
                prof.enable()
            ll = loader.start_layer_load(loader.pin(held))
            if prof is not None:
                prof.disable()
            h = ll.handle.load
            rep = ll.wait()
            assert len(rep.loaded_req_ids) == n, rep.failed
            pins.worker_done({q.ticket: 1 for q in held})
            pins.flush(sched_client)
            if r:
                held_issue.append(h.copy_issue_s + h.place_issue_s)
                held_cpu.append(getattr(h, "issue_cpu_s", 0.0))
                for part, sec in getattr(h, "issue_parts", {}).items():
                    held_parts.setdefault(part, []).append(sec)
                for part, sec in ll.report.phases.items():
                    held_steps.setdefault(part, []).append(sec)
    return {
        "held_layer_issue_us": statistics.median(held_issue) / L * 1e6,
        # The held direct issue's parts, median us for the whole load (not a layer).
        "held_issue_parts_us": {k: round(statistics.median(v) * 1e6, 1) for k, v in held_parts.items()},
        # The issuing thread's CPU time over the held issue (us a load): the wall time above it waited.
        "held_issue_cpu_us": round(statistics.median(held_cpu) * 1e6, 1),
        # The whole held layer load before the forward, median us: the pin's objects and slots, the
        # per-request lists, and the path's issue (the objects' checks, then the direct issue).
        "held_load_phases_us": {k: round(statistics.median(v) * 1e6, 1) for k, v in held_steps.items()},
        "layer_path": f"{h.path}{' (graphs)' if h.graphed else ' (eager)'}",
        "layer_issue_us": statistics.median(issue) / L * 1e6,
        "layer_load_GBps": nbytes / statistics.median(total) / GB,
        "tokens": n * t,
        "requests": n,
        "MB": nbytes / 1e6,
        "pinned_h2d_GBps": pinned_h2d_gbps(nbytes),
        "store_GBps": nbytes / statistics.median(store_s) / GB,
        "load_GBps": nbytes / statistics.median(load_s) / GB,
        "store_ms": statistics.median(store_s) * 1e3,
        "wb_store_GBps": nbytes / wb_s / GB,
        "load_ms": statistics.median(load_s) * 1e3,
        "first_key": last[0].chunks[0].key,
        "load_phases_ms": {k: statistics.median(p.get(k, 0.0) for p in phases) * 1e3 for k in phases[0]},
        "held_load_GBps": nbytes / statistics.median(held_s) / GB,
        "held_load_ms": statistics.median(held_s) * 1e3,
        "held_phases_ms": {
            k: statistics.median(p.get(k, 0.0) for p in held_phases) * 1e3 for k in held_phases[0]
        },
        "offer_pin_ms": statistics.median(pin_s) * 1e3,
    }


def _profiles() -> dict[str, Any]:
    import cProfile

    return {"issue": cProfile.Profile(), "store": cProfile.Profile()}


def last_key(results: dict[str, Any]) -> str:
    return results["sizes"]["256"]["first_key"]


def rpc_floor(client: MaruHandler, key: str, n: int = 50) -> dict[str, float]:
    """p50 of the bare round trips a load makes (one key): what the load's lookup phase cannot beat."""
    out: dict[str, list[float]] = {"exists": [], "lookup+pin, UNPIN posted": []}
    for i in range(n + 5):
        t0 = time.perf_counter()
        client.exists([key])
        t1 = time.perf_counter()
        hs = list(client.batch_retrieve([key], pin=True, verify=False))
        t2 = time.perf_counter()
        client.batch_release(hs, wait=False)
        if i >= 5:
            out["exists"].append(t1 - t0)
            out["lookup+pin, UNPIN posted"].append(t2 - t1)
    return {k: statistics.median(v) * 1e6 for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--reps", type=int, default=3, help="stores per size (the pool holds them all)")
    ap.add_argument("--load-reps", type=int, default=10, help="loads per size and path")
    ap.add_argument(
        "--sizes", default=None, help="comma-separated token counts (default: all, and the batch)"
    )
    ap.add_argument(
        "--no-prestage",
        action="store_true",
        help="an A/B: loads copy their first chunk only once prepared (KVTransferEngine._issuing off)",
    )
    ap.add_argument(
        "--profile-issue",
        action="store_true",
        help="cProfile the held layer loads' issue (pin + start_layer_load) and the timed write-behind "
        "store (issue + complete) of the last size (the batch without --sizes); top 30 by own time",
    )
    ap.add_argument(
        "--fused",
        action="store_true",
        help="an A/B: the chunk load's checksum inside its scatter (MARU_FUSED_LOAD_CHECKSUM=1)",
    )
    args = ap.parse_args()
    if args.fused:
        os.environ[FUSED_ENV] = "1"  # read when the engines' pipelines are built
    if args.no_prestage:
        KVTransferEngine._issuing = lambda self, looked: contextlib.nullcontext()  # type: ignore[method-assign]
    sizes = [int(t) for t in args.sizes.split(",")] if args.sizes else SIZES
    dev = torch.cuda.get_device_properties(0)
    chunk_bytes = L * 2 * CHUNK * NH * HS * 2
    stores = sum(SIZES) // CHUNK + BATCH * BATCH_TOKENS // CHUNK
    pool_bytes = (stores * (args.reps + 3) + 64) * chunk_bytes  # + 2 write-behind stores a size
    results: dict[str, Any] = {"device": dev.name, "sizes": {}}
    with server_client(pool_bytes) as client:
        src = make_caches(NB, 1)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        t0 = time.perf_counter()
        storer = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK)
        results["engine_build_s"] = time.perf_counter() - t0
        results["data_path"] = storer.data_path
        results["registration"] = storer.host_registration.describe() if storer.host_registration else None
        dst = make_caches(NB, 2)
        loader = KVTransferEngine(dst, layout, client, chunk_tokens=CHUNK)
        gen = torch.Generator().manual_seed(0)
        prof = None
        for i, t in enumerate(sizes):
            if args.profile_issue and args.sizes and i == len(sizes) - 1:
                prof = _profiles()
            row = measure(storer, loader, t, 1, gen, args.reps, args.load_reps, prof)
            results["sizes"][str(t)] = row
            print(json.dumps(row), flush=True)
        if not args.sizes:
            if args.profile_issue:  # without --sizes, the batch is what is profiled
                prof = _profiles()
            row = measure(storer, loader, BATCH_TOKENS, BATCH, gen, args.reps, args.load_reps, prof)
            results["sizes"][f"{BATCH}x{BATCH_TOKENS}"] = row
            print(json.dumps(row), flush=True)
        pipe = loader.path.pipeline
        if pipe is not None:
            print(f"prestaged first chunks: {pipe.prestages}, unused {pipe.prestages_unused}", flush=True)
            results["load_checksum"] = pipe.load_checksum_way()[0]
            print(f"load checksum: {results['load_checksum']}", flush=True)
        results["rpc_us"] = rpc_floor(client, last_key(results))
        if prof is not None:
            import pstats

            what = f"{sizes[-1]} tokens" if args.sizes else f"{BATCH}x{BATCH_TOKENS} tokens"
            for name, label in (("issue", f"the held layer loads' issue ({args.load_reps} loads)"),
                                ("store", "one write-behind store, issue + complete")):  # fmt: skip
                print(f"cProfile of {label}, {what}:")
                pstats.Stats(prof[name], stream=sys.stdout).sort_stats("tottime").print_stats(30)
        storer.close()
        loader.close()

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    print()
    print(f"connector level (KVTransferEngine + real server), {dev.name}, data path {results['data_path']}")
    print(f"registration: {results['registration']}")
    print(f"KVTransferEngine build (registration + layer graph warm-up): {results['engine_build_s']:.2f} s")
    print(f"layer-overlap path: {next(iter(results['sizes'].values()))['layer_path']}")
    print("bare round trips, p50 us: " + ", ".join(f"{k} {v:.0f}" for k, v in results["rpc_us"].items()))
    print(
        "| tokens | MB | pinned H2D GB/s | store GB/s (ms) | write-behind store, paced, GB/s "
        "| load GB/s (ms) | load % of pinned "
        "| load ms: lookup / prepare / issue / wait | overlap load GB/s | overlap issue us/layer "
        "| held load % of pinned | held load ms: lookup / prepare / issue / wait | offer pin ms "
        "| held overlap issue us/layer |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, row in results["sizes"].items():
        ph, hp = row["load_phases_ms"], row["held_phases_ms"]
        print(
            f"| {name} | {row['MB']:.1f} | {row['pinned_h2d_GBps']:.1f} | {row['store_GBps']:.1f} "
            f"({row['store_ms']:.2f}) | {row['wb_store_GBps']:.1f} | {row['load_GBps']:.1f} ({row['load_ms']:.2f}) | "
            f"{100 * row['load_GBps'] / row['pinned_h2d_GBps']:.1f}% | "
            f"{' / '.join(f'{ph.get(k, 0.0):.2f}' for k in ('lookup', 'prepare', 'issue', 'wait'))} | "
            f"{row['layer_load_GBps']:.1f} | {row['layer_issue_us']:.1f} | "
            f"{100 * row['held_load_GBps'] / row['pinned_h2d_GBps']:.1f}% | "
            f"{' / '.join(f'{hp.get(k, 0.0):.2f}' for k in ('lookup', 'prepare', 'issue', 'wait'))} | "
            f"{row['offer_pin_ms']:.2f} | {row['held_layer_issue_us']:.1f} |"
        )
    print("held overlap issue by part, median us a load: " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.get("held_issue_parts_us", {}).items())
        + f" (the thread's CPU {row.get('held_issue_cpu_us', 0):.0f})"
        for name, row in results["sizes"].items()
    ))  # fmt: skip
    print("held layer load before the forward, median us: " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.get("held_load_phases_us", {}).items())
        for name, row in results["sizes"].items()
    ))  # fmt: skip


if __name__ == "__main__":
    main()
