"""Where the connector-level load's host time goes: cProfile of the held load and the layer-overlap
issue, and a CUDA timeline (torch.profiler) of one held load, against a real ``maru server``.

``bench/gpu_connector.py`` gives the figures; this says what makes them: for each size, the top
functions by own time over ``--reps`` calls, then for one 256-token load the host and device
events in time order, relative to the load call (when the first copy starts, when the last
kernel ends, when the host returns).

Usage (on a GPU machine, from the repo root): python bench/gpu_connector_profile.py [--sizes 256,2048]
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import time
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_connector import BS, CHUNK, HS, NB, NH, make_caches, request, server_client  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.client import MaruHandler  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402
from maru.transfer.records import RequestTransfer  # noqa: E402
from maru.vllm.offer_pins import OfferPins  # noqa: E402


def held(pins: OfferPins, client: MaruHandler, reqs: list[RequestTransfer]) -> list[RequestTransfer]:
    out = []
    for q in reqs:
        keys = [c.key for c in q.chunks]
        assert pins.hold(client, q.req_id, keys) == len(keys)
        locs, ticket = pins.hand_over(q.req_id, keys)
        out.append(dataclasses.replace(q, held=locs, ticket=ticket))
    return out


def done(pins: OfferPins, client: MaruHandler, reqs: list[RequestTransfer]) -> None:
    pins.worker_done({q.ticket: 1 for q in reqs})
    pins.flush(client)


def top(prof: cProfile.Profile, n: int) -> str:
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(n)
    lines = s.getvalue().splitlines()
    start = next((i for i, ln in enumerate(lines) if ln.strip().startswith("ncalls")), 0)
    return "\n".join(lines[start : start + n + 1])


def profile_size(
    loader: KVTransferEngine, sched: MaruHandler, reqs: list[RequestTransfer], reps: int
) -> None:
    pins = OfferPins()
    tag = f"{sum(len(q.chunks) for q in reqs) * CHUNK} tokens, {len(reqs)} request(s)"
    for mode in ("held load", "held layer load"):
        walls, issues = [], []
        prof = cProfile.Profile()
        for r in range(reps + 2):
            h = held(pins, sched, reqs)
            torch.cuda.synchronize()
            if r >= 2:
                prof.enable()
            t0 = time.perf_counter()
            if mode == "held load":
                rep = loader.load(h)
                issues.append(rep.phases.get("prepare", 0) + rep.phases.get("issue", 0))
            else:
                ll = loader.start_layer_load(loader.pin(h))
                hd = ll.handle.load
                issues.append(hd.copy_issue_s + hd.place_issue_s)
                rep = ll.wait()
            walls.append(time.perf_counter() - t0)
            prof.disable()
            assert len(rep.loaded_req_ids) == len(reqs), rep.failed
            done(pins, sched, h)
        print(
            f"\n=== {mode}, {tag}: wall median {statistics.median(walls[2:]) * 1e3:.3f} ms, "
            f"prepare+issue median {statistics.median(issues[2:]) * 1e3:.3f} ms (profiled calls: slower)"
        )
        print(top(prof, 28))


def timeline(loader: KVTransferEngine, sched: MaruHandler, reqs: list[RequestTransfer]) -> None:
    """One held load under torch.profiler: every host op and device activity, relative to the call."""
    from torch.profiler import ProfilerActivity, profile, record_function

    pins = OfferPins()
    for r in range(4):  # warm, then the profiled one
        h = held(pins, sched, reqs)
        torch.cuda.synchronize()
        if r < 3:
            loader.load(h)
            done(pins, sched, h)
            continue
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("maru_load_call"):
                t0 = time.perf_counter()
                rep = loader.load(h)
                wall = time.perf_counter() - t0
            torch.cuda.synchronize()
        done(pins, sched, h)
        assert len(rep.loaded_req_ids) == len(reqs), rep.failed
    evs = []
    for e in prof.events():
        start = getattr(e, "time_range", None)
        if start is None:
            continue
        dev = str(getattr(e, "device_type", "")).endswith("CUDA")
        evs.append((e.time_range.start, e.time_range.end, "GPU" if dev else "cpu", e.name))
    call = [e for e in evs if e[3] == "maru_load_call" and e[2] == "cpu"]
    base = call[0][0] if call else min(e[0] for e in evs)
    print(
        f"\n=== timeline of one held load ({len(reqs)} request(s)), wall {wall * 1e3:.3f} ms, us from the call"
    )
    for s, e, kind, name in sorted(evs):
        if kind == "cpu" and e - s < 3 and name != "maru_load_call":
            continue
        print(f"{s - base:9.1f} {e - base:9.1f} {e - s:8.1f} {kind} {name[:90]}")


def micro(loader: KVTransferEngine, sched: MaruHandler, req: RequestTransfer, reps: int = 200) -> None:
    """The direct layer issue's pieces, each timed alone over ``reps`` calls (medians, us)."""
    from maru.kv_ops import direct_kernel as dk

    pipe = loader.path.pipeline
    pins = OfferPins()
    h = held(pins, sched, [req])
    pl = loader.pin(h)
    objs, slots = pl.ready[0].objs, pl.ready[0].slots
    total = int(slots.numel())
    tb = 16
    while tb < total:
        tb *= 2
    chunks = [(o.data_ptr(), o.shape[2]) for o in objs]

    def timed(fn: Any, n: int = reps, sync_every: int = 0) -> float:
        out = []
        for i in range(n):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
            if sync_every and i % sync_every == 0:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        return statistics.median(out) * 1e6

    _, buf = pipe._scratch.take(dk.DIRECT_ROWS * (tb + 1))
    row, es = pipe.layout.row_size, pipe.esize
    tab = pipe._layer_placer.direct_table(tb)
    res = {
        "direct_table_host": timed(lambda: dk.direct_table_host(chunks, slots, row, es, tb, out=buf)),
        "scratch.take": timed(lambda: pipe._scratch.take(dk.DIRECT_ROWS * (tb + 1))),
        "_after_caller": timed(lambda: pipe._after_caller(pipe._place_stream)),
        "table upload (raw)": timed(
            lambda: pipe._sync.copy(
                tab.data_ptr(), buf.data_ptr(), dk.DIRECT_ROWS * (tb + 1) * 8, pipe._place_h
            )
        ),
        "graph launch, all layers": timed(
            lambda: pipe._layer_placer.scatter_direct_all(tb, checksum=True, stream=pipe._place_h), 60, 5
        ),
        "_check_slots": timed(lambda: pipe._check_slots(slots, objs, 0)),
        "_objects": timed(lambda: pipe._objects(objs)),
    }
    issue = []
    for _ in range(60):
        lh = pipe.load_layers(objs, slots, checksums=True)
        issue.append(lh.issue_s)
        lh.wait()
    res["load_layers issue_s"] = statistics.median(issue) * 1e6
    loader.release(pl)
    done(pins, sched, h)
    print(f"\n=== direct layer issue pieces, {total} tokens ({len(objs)} chunks, bucket {tb}), median us")
    for k, v in res.items():
        print(f"{k:28s} {v:8.1f}")


def store_issue(storer: KVTransferEngine, tokens: int, reps: int = 30) -> None:
    """The write-behind store's host time on the drain thread, as the connector issues it (paced):
    ``issue_gather`` (slot mappings, object views, the pipeline's issue) timed alone, medians."""
    from maru.transfer.records import StoreReport
    from maru.transfer.stores import PreparedStore

    gen = torch.Generator().manual_seed(tokens)
    walls, issues = [], []
    for r in range(reps + 2):
        req = request(tokens, f"st-{tokens}-{r}-{time.perf_counter_ns()}", gen)
        prep = PreparedStore(report=StoreReport())
        reserved = storer._reserve([req], prep)
        assert reserved is not None, prep.report.error
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ig = storer.issue_gather(*reserved, prep, paced=True)
        wall = time.perf_counter() - t0
        issue = ig.handle.transfer.issue_s
        storer.finish_gather(ig, prep)
        assert storer.commit_store(prep).stored == len(req.chunks)
        if r >= 2:
            walls.append(wall)
            issues.append(issue)
    print(
        f"\n=== write-behind store issue, {tokens} tokens ({tokens // CHUNK} chunks, paced): issue_gather "
        f"{statistics.median(walls) * 1e6:.0f} us, of which the pipeline's store {statistics.median(issues) * 1e6:.0f} us"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="256,2048,16384")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    chunk_bytes = 32 * 2 * CHUNK * NH * HS * 2
    pool = (sum(sizes) // CHUNK + 16) * chunk_bytes  # the stores at the end evict what they must
    print(f"device {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    with server_client(pool) as client:
        src, dst = make_caches(NB, 1), make_caches(NB, 2)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        storer = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK)
        loader = KVTransferEngine(dst, layout, client, chunk_tokens=CHUNK)
        gen = torch.Generator().manual_seed(0)
        with MaruHandler(client.url, timeout_s=30) as sched:
            stored = {}
            for t in sizes:
                req = request(t, f"prof-{t}", gen)
                assert storer.store([req]).stored == len(req.chunks)
                stored[t] = req
            for t in sizes:
                try:
                    profile_size(loader, sched, [stored[t]], args.reps)
                except Exception as e:  # one size failing must not hide the others
                    print(f"size {t}: {type(e).__name__}: {e}")
            for t in sizes:
                try:
                    micro(loader, sched, stored[t])
                except Exception as e:
                    print(f"micro {t}: {type(e).__name__}: {e}")
            for t in sizes[:2]:
                try:
                    timeline(loader, sched, [stored[t]])
                except Exception as e:
                    print(f"timeline {t}: {type(e).__name__}: {e}")
            # Last: its fresh stores fill the pool (evicting the loads' prefixes).
            for t in sizes[:2]:
                try:
                    store_issue(storer, t)
                except Exception as e:
                    print(f"store issue {t}: {type(e).__name__}: {e}")
        storer.close()
        loader.close()


if __name__ == "__main__":
    main()
