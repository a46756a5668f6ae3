"""The layer load under a busy device: the SMs' direct reads against the copy engine.

Alone on the device the direct layer kernel reads a burst step's chunks at ~90% of pinned; inside
vLLM's forward the same step ran at 34-39 GB/s (bench/RESULTS.md, pass 35), sharing the SMs with
the prefill. This replays the burst shape (32 layers, 8 KV heads x 128, bf16, block 16; 30 chunk
objects of 256 tokens in pinned host memory, 15 requests each skipping 128 tokens of its first
chunk, segment sums on) three ways, each alone and beside a stream of GEMMs that keeps every SM
busy:

- ``direct``: the production path (``DevicePipeline.load_layers``, one kernel a layer over the bus);
- ``ce-loop``: the copy engine brings each layer's read rows into a device mirror of the objects
  (one raw ``cudaMemcpyAsync`` a whole object's layer, one ``cudaMemcpy2DAsync`` for both planes of
  a partial one), then the same kernel places and sums them from device memory;
- ``ce-batch``: the same copies, one ``cudaMemcpyBatchAsync`` a layer (CUDA >= 12.8);
- ``copied``: the production copied way (``layer_path="copied"``, ``kv_ops.layer_copies``).

Reports each way's device time, GB/s and % of pinned, its host issue time, and the GEMMs' slowdown.
Usage (GPU): ``python bench/layer_contention.py [--reps 10]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from maru import kv_ops
from maru.kv_ops import checksum as ck
from maru.kv_ops import device_pipeline as pl
from maru.kv_ops import direct_kernel as dk
from maru.kv_ops import ops
from maru.kv_ops import triton_kernels as tk
from maru.kv_ops.cuda_sync import BatchCopies
from maru.segments import mark_unread

L, NH, HS, BS, CHUNK, NCHUNK = 32, 8, 128, 16, 256, 30
ROW, ES = NH * HS, 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--gemm", type=int, default=4096)
    ap.add_argument(
        "--programs",
        default="0,-1,528,264,66,32",
        help="the direct way's programs, both planes, to sweep (TuneParams.direct_programs; 0: one a "
        "tile; -1: one an SM, the default)",
    )
    ap.add_argument(
        "--tiles", default="4,8,16", help="tokens a program (TuneParams.block_t) to sweep with them"
    )
    ap.add_argument("--ways", default="direct,copied,ce-loop,ce-batch", help="the ways of the first table")
    args = ap.parse_args()
    nb = NCHUNK * CHUNK // BS * 2
    caches = [torch.randn(2, nb, BS, NH, HS, dtype=torch.bfloat16, device="cuda") for _ in range(L)]
    layout = kv_ops.detect_layouts(caches, block_size=BS, num_kv_heads=NH, head_size=HS)
    eng = pl.DevicePipeline(caches, layout, use_graphs=False, layer_path="direct")
    copied = pl.DevicePipeline(caches, layout, use_graphs=False, layer_path="copied")
    copied.warm(0, layer_tokens=[NCHUNK * CHUNK])
    objs = [torch.empty(L, 2, CHUNK, ROW, dtype=torch.bfloat16).pin_memory() for _ in range(NCHUNK)]
    for o in objs:
        o.view(torch.int16).random_(-30000, 30000)
    slots = torch.randperm(nb * BS)[: NCHUNK * CHUNK]
    store = eng.store(objs, slots, checksums=True, segment_tokens=BS)
    store.wait()
    segs, want = store.segment_sums(), store.checksums()
    load = slots.clone()
    for r in range(NCHUNK // 2):
        load[2 * r * CHUNK : 2 * r * CHUNK + CHUNK // 2] = -1
    total = sum(o.numel() * ES for o in objs)
    host = torch.empty(total, dtype=torch.uint8).pin_memory()
    dev = torch.empty(total, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    pinned = 5 * total / (time.perf_counter() - t) / 1e9
    print(f"pinned H2D {pinned:.1f} GB/s, torch {torch.__version__}", flush=True)

    # The copy-engine ways: a device mirror of the objects, the same table over it.
    mirror = [torch.empty_like(o, device="cuda") for o in objs]
    marked = load.clone().numpy()
    prefill, unread = mark_unread(marked, [CHUNK] * NCHUNK, segs)
    tab_host = dk.direct_table_host(
        [(m.data_ptr(), CHUNK) for m in mirror], torch.from_numpy(marked), ROW, ES, prefill=prefill
    )
    refs = ops.layer_refs(caches, layout)
    plane = CHUNK * ROW * ES
    first_read = [int(np.argmax(marked[k * CHUNK : (k + 1) * CHUNK] >= -1)) for k in range(NCHUNK)]
    read_bytes = sum((CHUNK - f) * ROW * ES * 2 * L for f in first_read)
    # Per layer: (dst, src, bytes) of each plane range read (batch), and the loop's calls.
    per_layer = []
    for i in range(L):
        d, s, z = [], [], []
        for k in range(NCHUNK):
            off = i * 2 * plane + first_read[k] * ROW * ES
            n = (CHUNK - first_read[k]) * ROW * ES
            for p in range(2):
                d.append(mirror[k].data_ptr() + off + p * plane)
                s.append(objs[k].data_ptr() + off + p * plane)
                z.append(n)
        per_layer.append(
            (np.array(d, dtype=np.uint64), np.array(s, dtype=np.uint64), np.array(z, dtype=np.uint64))
        )
    sync = eng._sync
    copy_s, place_s = torch.cuda.Stream(), torch.cuda.Stream()
    batch = BatchCopies.load(0)  # the binding kv_ops.layer_copies uses
    if batch is None:
        print(f"no cudaMemcpyBatchAsync: {BatchCopies.why_not}")
    evs = [torch.cuda.Event() for _ in range(L)]
    host_ms: dict[str, float] = {}

    def ce(way: str) -> torch.cuda.Event:
        t0 = time.perf_counter()
        tab = tab_host.to("cuda", non_blocking=True)
        copy_s.wait_stream(torch.cuda.current_stream())
        place_s.wait_stream(torch.cuda.current_stream())
        h = copy_s.cuda_stream
        for i in range(L):
            if way == "ce-batch":
                d, s, z = per_layer[i]
                batch.copy(d.ctypes.data, s.ctypes.data, z.ctypes.data, len(z), h)
            else:
                for k in range(NCHUNK):
                    off = i * 2 * plane + first_read[k] * ROW * ES
                    n = (CHUNK - first_read[k]) * ROW * ES
                    dst, src = mirror[k].data_ptr() + off, objs[k].data_ptr() + off
                    if first_read[k] == 0:
                        sync.copy(dst, src, 2 * plane, h)
                    else:
                        sync.copy2d(dst, plane, src, plane, n, 2, h)
            evs[i].record(copy_s)
        with torch.cuda.stream(place_s):
            for i in range(L):
                place_s.wait_event(evs[i])
                dk.direct_scatter_layer(tab, refs[i], layout, i, NCHUNK * CHUNK, checksum=True)
        host_ms[way] = (time.perf_counter() - t0) * 1e3
        end = torch.cuda.Event()
        end.record(place_s)
        torch.cuda.current_stream().wait_event(end)
        ce.tab = tab  # type: ignore[attr-defined]
        return end

    def direct(way: str = "direct") -> None:
        t0 = time.perf_counter()
        h = (eng if way == "direct" else copied).load_layers(objs, load, checksums=True, segments=segs)
        host_ms[way] = (time.perf_counter() - t0) * 1e3
        h.wait_on()
        direct.h = h  # type: ignore[attr-defined]

    # Correctness first: each way places the same bytes and sums to the committed checksums.
    ref_caches = None
    for way in ("direct", "copied", "ce-loop", "ce-batch"):
        if way == "ce-batch" and batch is None:
            continue
        for c in caches:
            c.zero_()
        if way in ("direct", "copied"):
            direct(way)
            torch.cuda.synchronize()
            ok = direct.h.checksums() == want  # type: ignore[attr-defined]
        else:
            ce(way)
            torch.cuda.synchronize()
            got = ce.tab[dk.DIRECT_SUMS_ROW, :NCHUNK].cpu().numpy().view(np.uint64)  # type: ignore[attr-defined]
            ok = [ck.finalize(int(g), o.numel() * ES) for g, o in zip(got, objs, strict=True)] == list(want)
        snap = torch.cat([c.flatten() for c in caches])
        same = True if ref_caches is None else bool(torch.equal(snap, ref_caches))
        ref_caches = snap if ref_caches is None else ref_caches
        print(
            f"{way}: checksums {'ok' if ok else 'DIFFER'}, placement {'same' if same else 'DIFFERS'}",
            flush=True,
        )

    a = torch.randn(args.gemm, args.gemm, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(args.gemm, args.gemm, dtype=torch.bfloat16, device="cuda")
    comp = torch.cuda.Stream()

    def gemms(n: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        comp.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(comp):
            s.record()
            for _ in range(n):
                torch.mm(a, b)
            e.record()
        return s, e

    s, e = gemms(20)
    e.synchronize()
    s, e = gemms(20)
    e.synchronize()
    gemm_ms = s.elapsed_time(e) / 20
    print(f"GEMM {args.gemm}^3 bf16 alone: {gemm_ms:.3f} ms each", flush=True)

    def timed(fn, busy: bool) -> tuple[float, float]:  # noqa: ANN001
        """(load ms, GEMM slowdown) over reps."""
        loads, slow = [], []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            if busy:
                n = 40
                gs, ge = gemms(n)
            st, en = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            st.record()
            fn()
            en.record()
            en.synchronize()
            if busy:
                ge.synchronize()
                slow.append(gs.elapsed_time(ge) / (n * gemm_ms))
            loads.append(st.elapsed_time(en))
        return float(np.median(loads)), float(np.median(slow)) if slow else 1.0

    print("| way | beside | load ms | GB/s | % of pinned | host issue ms | GEMM time x |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for way in args.ways.split(","):
        if way == "ce-batch" and batch is None:
            continue
        fn = (lambda w=way: direct(w)) if way in ("direct", "copied") else (lambda w=way: ce(w))
        for busy in (False, True):
            ms, slow = timed(fn, busy)
            gbs = read_bytes / ms / 1e6
            print(
                f"| {way} | {'GEMMs' if busy else 'nothing'} | {ms:.2f} | {gbs:.1f} | "
                f"{100 * gbs / pinned:.1f}% | {host_ms[way]:.2f} | {slow:.2f} |",
                flush=True,
            )
    print(f"read {read_bytes / 2**20:.0f} MiB a load ({unread} tokens left unread)")

    # The direct way with fewer programs, each looping over its tiles (TuneParams.direct_programs),
    # and other tile sizes: every setting checked against the first placement and the committed sums.
    print(
        "\n| programs (both planes) | tokens a program | beside | load ms | GB/s | % of pinned | GEMM time x |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|")
    tune = tk.TuneParams
    keep = (tune.direct_programs, tune.block_t)
    try:
        for bt in (int(x) for x in args.tiles.split(",")):
            for cap in (int(x) for x in args.programs.split(",")):
                tune.direct_programs, tune.block_t = cap, bt
                for c in caches:
                    c.zero_()
                direct("direct")
                torch.cuda.synchronize()
                ok = direct.h.checksums() == want  # type: ignore[attr-defined]
                same = bool(torch.equal(torch.cat([c.flatten() for c in caches]), ref_caches))
                if not (ok and same):
                    print(f"| {cap} | {bt} | WRONG: checksums {ok}, placement same {same} | | | | |")
                    continue
                for busy in (False, True):
                    ms, slow = timed(lambda: direct("direct"), busy)
                    gbs = read_bytes / ms / 1e6
                    print(
                        f"| {({0: 'a tile', -1: 'an SM'}).get(cap, cap)} | {bt} | {'GEMMs' if busy else 'nothing'} | {ms:.2f} | {gbs:.1f} | "
                        f"{100 * gbs / pinned:.1f}% | {slow:.2f} |",
                        flush=True,
                    )
    finally:
        tune.direct_programs, tune.block_t = keep


if __name__ == "__main__":
    main()
