"""Where a write-behind store's host time goes on the drain thread (GPU; no vLLM).

Why: the storing cost of the API workload follows how much CPU the drain thread takes a store
batch (about 3 ms on the H100 host, two thirds of it the gather's issue: fifty-fifth pass), not
where it lands. This measures that CPU on a quiet process, per phase and per chunk, for batches
shaped like the API workload's (each request a full chunk and a block-aligned partial tail, the
prompt's end) and like a long prompt's (full chunks only), and profiles the issue
(``cProfile``, the functions with the most own time).

An engine is built as the vLLM worker builds it (real server, CUDA caches of Llama-3-8B's KV
geometry, the paced write-behind store, the warm-up); each batch is ``issue_store`` on this
thread, then ``complete_store`` on a drain thread, timed by ``time.thread_time`` there.

``--gil``: each timed batch's drain runs beside a Python thread that only counts (as vLLM's loop
would spin): the drain's GIL-held time is its wall time less the counter's share of it (the
counter's count over its rate alone, taken right after each drain over as long a time).

``--launches``: the thread beside the drain launches small kernels instead (``Launcher``): the time
it loses is what the drain costs another thread's CUDA launches (the GIL and the CUDA driver's
per-context locks together). Sixtieth pass (H100): the paced lane's two calls a chunk took the
drain of the API-shaped batch from 4.60 to 2.08 ms and the launcher's loss from 3.33 to 2.85 ms; in
real vLLM the round's TTFT did not move (bench/RESULTS.md).

Usage (GPU machine, repo root): python bench/drain_cpu.py [--reps 12] [--profile 3] [--gil | --launches]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import threading
import time
import uuid
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_connector import BS, CHUNK, HS, NB, NH, make_caches, server_client  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402
from maru.transfer.records import ChunkRef, RequestTransfer  # noqa: E402

SHAPES = {
    # name: (requests, full chunks a request, tail tokens a request)
    "16 x (1 full + tail 144)": (16, 1, 144),
    "16 x tail 144": (16, 0, 144),
    "1 x 8 full": (1, 8, 0),
    "1 x 32 full": (1, 32, 0),
}


def batch(shape: tuple[int, int, int], gen: torch.Generator) -> list[RequestTransfer]:
    """Requests of fresh keys (a store of known keys would find them present and issue nothing)."""
    n, full, tail = shape
    tag = uuid.uuid4().hex[:10]
    tokens = full * CHUNK + tail
    perm = torch.randperm(NB, generator=gen).tolist()
    per = (tokens + BS - 1) // BS
    out = []
    for r in range(n):
        blocks = tuple(perm[r * per : (r + 1) * per])
        chunks = [ChunkRef(f"dc-{tag}-{r}-{i}", i * CHUNK, CHUNK) for i in range(full)]
        if tail:
            chunks.append(ChunkRef(f"dc-{tag}-{r}-t", full * CHUNK, tail))
        out.append(RequestTransfer(req_id=f"{tag}-{r}", block_ids=blocks, chunks=tuple(chunks)))
    return out


class Counter(threading.Thread):
    """A thread that counts in pure Python while it holds the GIL."""

    def __init__(self) -> None:
        super().__init__(name="gil-counter", daemon=True)
        self.count, self.stop = 0, False

    def run(self) -> None:
        while not self.stop:
            self.count += 1

    def counts_alone(self, seconds: float) -> float:
        """Counts a second with nothing else of this process running (this thread sleeps)."""
        c0, t0 = self.count, time.perf_counter()
        time.sleep(seconds)
        return (self.count - c0) / (time.perf_counter() - t0)


class Launcher(Counter):
    """A thread that launches small kernels back to back, as vLLM's eager forward issues its ops
    (``x.add_(1)`` on 4 KiB: ~5 us of host time a launch through torch, less on the device). Its
    lost time beside the drain is what the drain's GIL and CUDA calls cost another thread's
    launches: where the native store issue lets the GIL go and this still loses as much, the
    contention is in the CUDA driver, not the interpreter."""

    def __init__(self) -> None:
        super().__init__()
        self.name = "kernel-launcher"
        self.x = torch.zeros(1024, device="cuda")

    def run(self) -> None:
        x = self.x
        while not self.stop:
            x.add_(1.0)
            self.count += 1


def gil_elsewhere(wall_s: float, counted: int, rate_alone: float) -> float:
    """Seconds of ``wall_s`` in which the counter did not count: the GIL held by another thread.

    ``rate_alone`` is taken right after the window, over as long a time (the process's background
    threads then as busy as during it): with a rate taken once, at start, the counter counted far
    more during the drains than that rate allowed (H100, fifty-ninth pass): the column came out
    negative."""
    return wall_s - counted / rate_alone


def one(
    engine: KVTransferEngine,
    reqs: list[RequestTransfer],
    prof: cProfile.Profile | None,
    counter: Counter | None = None,
) -> dict[str, Any]:
    """One batch: issued here, completed on a drain thread; its CPU times (seconds), and with
    ``counter`` (a ``Counter`` or a ``Launcher``) the time it lost beside the drain (``gil``)."""
    c0 = time.thread_time()
    pending = engine.issue_store(reqs)
    issue_cpu = time.thread_time() - c0
    out: dict[str, Any] = {}

    def drain() -> None:
        t0, w0 = time.thread_time(), time.perf_counter()
        n0 = counter.count if counter is not None else 0
        if prof is not None:
            prof.enable()
        rep = engine.complete_store(pending)
        if prof is not None:
            prof.disable()
        out["cpu"] = time.thread_time() - t0
        out["wall"], out["counted"] = time.perf_counter() - w0, (counter.count - n0 if counter else 0)
        out["rep"] = rep

    th = threading.Thread(target=drain, name="maru-store-drain")
    th.start()
    th.join(60)
    if counter is not None:  # the counter alone as long again, the drain done: its rate now
        rate = counter.counts_alone(max(out["wall"], 0.02))
        out["gil"] = gil_elsewhere(out["wall"], out["counted"], rate)
    rep = out["rep"]
    assert rep.failed == 0 and rep.stored == sum(len(r.chunks) for r in reqs), rep
    extra = {"gil": out["gil"]} if "gil" in out else {}
    return {
        "forward": issue_cpu,
        "drain": out["cpu"],
        **extra,
        **{f"phase:{k}": v for k, v in rep.cpu.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=12)
    ap.add_argument(
        "--profile", type=int, default=3, help="batches of each shape profiled (after the timed ones)"
    )
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--gil", action="store_true", help="the drain's GIL-held time beside a counting thread")
    ap.add_argument(
        "--launches", action="store_true", help="the time a kernel-launching thread loses beside the drain"
    )
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    with server_client(6 << 30) as client:
        src = make_caches(NB, 1)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        engine = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK, paced_store=True)
        for shape in SHAPES.values():  # warm: graphs (tail sizes included), pinned buffers, streams
            one(engine, batch(shape, gen), None)
        rows, profiles = [], {}
        counter = None
        if a.gil and a.launches:
            raise SystemExit("drain_cpu: --gil or --launches, not both (one thread beside the drain)")
        if a.gil or a.launches:
            counter = Counter() if a.gil else Launcher()
            counter.start()
        for name, shape in SHAPES.items():
            runs = [one(engine, batch(shape, gen), None, counter) for _ in range(a.reps)]
            chunks = shape[0] * (shape[1] + (1 if shape[2] else 0))
            keys = sorted({k for r in runs for k in r})
            med = {k: statistics.median(r.get(k, 0.0) for r in runs) for k in keys}
            rows.append((name, chunks, med))
            if a.profile <= 0:
                continue
            prof = cProfile.Profile()
            for _ in range(a.profile):
                one(engine, batch(shape, gen), prof)
            s = io.StringIO()
            st = pstats.Stats(prof, stream=s)
            st.sort_stats("tottime").print_stats(a.top)
            st.sort_stats("cumulative").print_stats(a.top)
            profiles[name] = s.getvalue()
        ways, paced = (
            sorted(engine.path.store_ways) if hasattr(engine.path, "store_ways") else [],
            engine.paces_stores,
        )
        engine.close()
        if counter is not None:
            counter.stop = True
    for name, text in profiles.items():
        print(f"\n=== profile of {a.profile} drains, {name} (sorted by own time)")
        print("\n".join(line for line in text.splitlines() if line.strip())[:12000])
    print(
        f"\n{torch.cuda.get_device_name()}; {CHUNK}-token chunks; paced={paced}; store ways {ways}; "
        f"median of {a.reps} batches; CPU ms (thread_time)"
    )
    phases = sorted({k for _, _, m in rows for k in m if k.startswith("phase:")})
    gil = (
        " GIL held by the drain (wall, beside a counting thread) |"
        if a.gil
        else " launch time lost beside the drain (wall, a thread launching small kernels) |"
        if a.launches
        else ""
    )
    print(
        "| batch | chunks | forward thread (issue_store) | drain thread | drain a chunk |"
        + gil
        + " "
        + " | ".join(p.removeprefix("phase:") for p in phases)
        + " |"
    )
    print("|---|---:|---:|---:|---:|" + ("---:|" if gil else "") + "---:|" * len(phases))
    for name, chunks, m in rows:
        cells = " | ".join(f"{m.get(p, 0.0) * 1e3:.2f}" for p in phases)
        held = f" {m['gil'] * 1e3:.2f} |" if gil else ""
        print(
            f"| {name} | {chunks} | {m['forward'] * 1e3:.3f} | {m['drain'] * 1e3:.2f} | "
            f"{m['drain'] / chunks * 1e3:.3f} |{held} {cells} |"
        )


if __name__ == "__main__":
    main()
