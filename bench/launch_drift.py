"""Does Maru make a process's eager CUDA launches slower, and more so over time? (GPU)

Why: in the forty-ninth pass (H100, eager API workload) vLLM's decode forwards took more CPU on the
forward thread in the instances running Maru than in the one with the connector attached and Maru
off (22.6-22.9 against 19.5 ms a step), and in the warm instance more each repetition (18.9, 22.0,
27.8 ms), while Maru's own hooks stayed flat (a few us a layer) and the interpreter's pace did not
move. This separates the suspects in one process, without vLLM: a fixed eager "decode" (32 layers
of small matmuls and elementwise ops, the shape of a decode step that is host-bound) is timed on
the calling thread's CPU clock

1. with torch alone,
2. after a real ``maru server``'s pool is mapped by a client,
3. after a ``KVTransferEngine`` is built over CUDA caches (the pool registered with CUDA, the
   kernels and graphs warmed, the worker's threads started),
4. after each of ``--rounds`` rounds of what a serving instance does: write-behind stores of fresh
   requests, then held layer loads of them (offer pins, as the connector's default), several
   sizes (each size a graph of its own).

A probe's CPU time rising with the rounds says the growth is Maru's state in the process; flat says
it is elsewhere (vLLM, the host). Each probe also reports the other threads' CPU over it.

Usage (GPU machine, repo root): python bench/launch_drift.py [--rounds 8] [--pool-gib 10]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_connector import BS, CHUNK, HS, NB, NH, make_caches, request, server_client  # noqa: E402
from bench.gpu_connector_profile import done, held  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.client import MaruHandler  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402
from maru.vllm.offer_pins import OfferPins  # noqa: E402

LAYERS, HIDDEN, TOKENS = 32, 4096, 16


class DecodeProbe:
    """A fixed eager forward: per layer a norm, three projections, a stand-in attention and an MLP
    (about 20 launches a layer), on ``TOKENS`` rows: small enough that the host issue, not the
    device, sets its pace."""

    def __init__(self) -> None:
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda *s: torch.randn(*s, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02  # noqa: E731
        self.x = mk(TOKENS, HIDDEN)
        self.w = [
            (mk(HIDDEN, 1536), mk(1024, HIDDEN), mk(HIDDEN, 2048), mk(1024, HIDDEN)) for _ in range(LAYERS)
        ]

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        h = self.x
        for wqkv, wo, wup, wdown in self.w:
            n = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(h.dtype)
            qkv = n @ wqkv
            q, k, v = qkv.split([1024, 256, 256], dim=-1)
            att = torch.softmax((q[:, :256] * k).float(), dim=-1).to(h.dtype)
            o = torch.cat([att * v, q[:, 256:]], dim=-1) @ wo
            h = h + o
            n = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(h.dtype)
            up = n @ wup
            a, b = up.chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(a) * b) @ wdown
        return h

    def measure(self, n: int = 15) -> dict[str, float]:
        """Median host issue (wall and this thread's CPU) of ``n`` forwards, each after the device
        drained; and the other threads' CPU over the same spans."""
        self.forward()
        torch.cuda.synchronize()
        wall, cpu, others = [], [], []
        for _ in range(n):
            o0 = other_threads_cpu()
            t0, c0 = time.perf_counter(), time.thread_time()
            self.forward()
            c1, t1 = time.thread_time(), time.perf_counter()
            others.append(other_threads_cpu() - o0)
            torch.cuda.synchronize()
            wall.append(t1 - t0)
            cpu.append(c1 - c0)
        return {
            "issue_ms": statistics.median(wall) * 1e3,
            "cpu_ms": statistics.median(cpu) * 1e3,
            "others_cpu_ms": statistics.median(others) * 1e3,
            "threads": threading.active_count(),
        }


def other_threads_cpu() -> float:
    """CPU seconds of this process's threads other than the caller (Linux /proc)."""
    me = threading.get_native_id()
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for tid in os.listdir("/proc/self/task"):
        if int(tid) == me:
            continue
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


def serve_round(
    storer: KVTransferEngine, loader: KVTransferEngine, url: str, rnd: int, sizes: list[int]
) -> int:
    """One round as a serving pair does it: write-behind stores of fresh requests of each size, then
    the held layer loads of them (offer pins); returns the chunks loaded."""
    gen = torch.Generator().manual_seed(rnd)
    loaded = 0
    pins = OfferPins()
    with MaruHandler(url, timeout_s=30) as sched:
        for t in sizes:
            reqs = [request(t, f"drift-{rnd}-{t}-{k}-{uuid.uuid4().hex[:6]}", gen) for k in range(4)]
            rep = storer.complete_store(storer.issue_store(reqs))
            assert rep.stored == sum(len(q.chunks) for q in reqs), rep
            pinned = held(pins, sched, reqs)  # the offer pins, as the connector's default
            lrep = loader.start_layer_load(loader.pin(pinned)).wait()
            assert len(lrep.loaded_req_ids) == len(reqs), lrep.failed
            done(pins, sched, pinned)
            loaded += sum(len(q.chunks) for q in reqs)
    return loaded


def pace_trace(probe: DecodeProbe, seconds: float, path: str | None, window_s: float = 2.0) -> None:
    """The same forward again and again for ``seconds``, nothing else in the process: how far the
    host's pace moves on its own (the floor under any A/B of a few percent). Per ``window_s``
    window: the median, min and max of the forwards' CPU time, and a pure-Python loop's time."""
    probe.forward()
    torch.cuda.synchronize()
    t_end = time.perf_counter() + seconds
    rows = []
    print(f"{'window':>6} {'forwards':>8} {'CPU median':>10} {'min':>7} {'max':>7}  20k adds (us)")
    w = 0
    while time.perf_counter() < t_end:
        w_end = time.perf_counter() + window_s
        cpu, adds = [], []
        while time.perf_counter() < w_end:
            c0 = time.thread_time()
            probe.forward()
            cpu.append(time.thread_time() - c0)
            torch.cuda.synchronize()
            a0 = time.perf_counter()
            x = 0
            for i in range(20_000):
                x += i
            adds.append(time.perf_counter() - a0)
        row = {
            "window": w, "forwards": len(cpu), "cpu_median_ms": statistics.median(cpu) * 1e3,
            "cpu_min_ms": min(cpu) * 1e3, "cpu_max_ms": max(cpu) * 1e3,
            "adds_median_us": statistics.median(adds) * 1e6,
        }  # fmt: skip
        rows.append(row)
        print(f"{w:>6} {len(cpu):>8} {row['cpu_median_ms']:>8.2f} ms {row['cpu_min_ms']:>7.2f} "
              f"{row['cpu_max_ms']:>7.2f}  {row['adds_median_us']:.0f}", flush=True)  # fmt: skip
        w += 1
    med = [r["cpu_median_ms"] for r in rows]
    print(f"window medians: {min(med):.2f}-{max(med):.2f} ms (max/min {max(med) / min(med):.2f}x), "
          f"median of them {statistics.median(med):.2f} ms")  # fmt: skip
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--pool-gib", type=float, default=10.0)
    ap.add_argument("--sizes", default="256,512,1024,2048", help="request sizes (tokens) of each round")
    ap.add_argument(
        "--pace-trace", type=float, default=0.0, metavar="S",
        help="instead: the probe forward back to back for S seconds, torch alone; its CPU time by window",
    )  # fmt: skip
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    sizes = [int(s) for s in a.sizes.split(",")]
    probe = DecodeProbe()
    if a.pace_trace:
        pace_trace(probe, a.pace_trace, a.json)
        return
    rows: list[dict] = []

    def stage(name: str) -> None:
        m = probe.measure()
        rows.append({"stage": name, **m})
        print(f"{name:44} issue {m['issue_ms']:7.2f} ms  CPU {m['cpu_ms']:7.2f} ms  "
              f"others' CPU {m['others_cpu_ms']:5.2f} ms  threads {m['threads']}", flush=True)  # fmt: skip

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; probe: {LAYERS} layers, {TOKENS} rows")
    stage("torch alone")
    stage("torch alone, again")
    with server_client(int(a.pool_gib * (1 << 30))) as client:
        stage("server + client (pool mapped)")
        src, dst = make_caches(NB, 1), make_caches(NB, 2)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        storer = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK)
        stage("+ storing engine (registered, warmed)")
        loader = KVTransferEngine(dst, layout, client, chunk_tokens=CHUNK)
        stage("+ loading engine")
        total = 0
        for r in range(1, a.rounds + 1):
            total += serve_round(storer, loader, client.url, r, sizes)
            torch.cuda.synchronize()
            time.sleep(0.2)  # the drain and release work of the round settles
            stage(f"after round {r} ({total} chunks stored+loaded)")
        storer.close()
        loader.close()
        stage("engines closed")
    stage("server gone")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
