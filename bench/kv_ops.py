"""Benchmark: paged-KV placement on a GPU (payload GB/s) against the PyTorch reference and the copy ceiling.

Geometry (the ANCHORS.md one): 32 layers, 8 KV heads, head size 128, bf16, block size 16, 8192 blocks
per layer, random slot order, for 256, 2048 and 16384 tokens. "Payload" counts the KV bytes moved
once (a placement reads and writes them, so memory traffic is twice that); the ceiling is half the
measured device-to-device copy bandwidth. Also measures the destination-ordered variant of the kernel
(bench/kernel_variants.py; slots sorted first, with and without the sort counted). ``--sweep`` first
tries tile sizes and warps (kept when better), then the scatter stores' cache operator (a variant).
Prints a short table last.

    python bench/kv_ops.py [--quick] [--layout kv_first/NHD] [--sweep]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.kernel_variants import CACHE_OPERATORS, Variant, place_variant  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.kv_ops import triton_kernels  # noqa: E402
from maru.kv_ops.ops import layer_refs  # noqa: E402
from maru.kv_ops.testing import make_cache  # noqa: E402

L, NH, HS, BS, NB = 32, 8, 128, 16, 8192
DTYPE = torch.bfloat16


def payload_bytes(tokens: int) -> int:
    return L * 2 * tokens * NH * HS * 2


def time_events(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median seconds of one ``fn()`` by CUDA events (each rep timed alone)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def time_graph(fn, inner: int = 10, reps: int = 10) -> float:
    """Seconds per ``fn()`` when ``inner`` calls are captured in one CUDA graph and replayed."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return time_events(graph.replay, reps=reps, warmup=1) / inner


def ceiling() -> float:
    """Payload ceiling in bytes/s: half the device-to-device copy traffic (read + write)."""
    n = 1 << 30
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = time_events(lambda: dst.copy_(src), reps=10)
    return (2 * n / t) / 2


def fmt_bw(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:8.1f}"


def cpu_main() -> int:
    """The reference on the CPU (the vLLM CPU connector's hot path): 8192 tokens x 8 layers x 2 x 512 fp32."""
    tokens, layers, nb, bs, nh, hs = 8192, 8, 1024, 16, 4, 128
    print(f"# kv_ops reference on the CPU, torch {torch.__version__}, {torch.get_num_threads()} threads")
    big = torch.randn(layers * 2 * tokens * nh * hs)
    copy_s = min(_wall(lambda: big.clone()) for _ in range(3))
    nbytes = big.numel() * 4
    print(f"plain copy of the payload ({nbytes / 1e6:.0f} MB): {copy_s * 1e3:.1f} ms")
    print("| layout | slots | load (scatter) ms | store (gather) ms |")
    print("| --- | --- | --- | --- |")
    for fmt, physical in (("cpu_attn", "HND"), ("kv_first", "NHD"), ("kv_first", "HND"), ("packed", "HND")):
        case = make_cache(
            fmt,
            physical,
            num_blocks=nb,
            block_size=bs,
            num_kv_heads=nh,
            head_size=hs,
            num_layers=layers,
            dtype=torch.float32,
        )
        layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
        whole = (torch.randperm(nb)[: tokens // bs, None] * bs + torch.arange(bs)).reshape(-1)
        scattered = torch.randperm(nb * bs)[:tokens]
        obj = kv_ops.gather(case.caches, layout, whole)
        for name, sl in (("whole blocks", whole), ("random slots", scattered)):
            load = min(
                _wall(lambda sl=sl, c=case, la=layout, o=obj: kv_ops.scatter(o, c.caches, la, sl))
                for _ in range(3)
            )
            store = min(
                _wall(lambda sl=sl, c=case, la=layout, o=obj: kv_ops.gather(c.caches, la, sl, out=o))
                for _ in range(3)
            )
            print(f"| {fmt} {physical} | {name} | {load * 1e3:.1f} | {store * 1e3:.1f} |", flush=True)
    return 0


def _wall(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu", action="store_true", help="time the reference on the CPU instead")
    parser.add_argument("--layout", default="kv_first/NHD")
    parser.add_argument("--sweep", action="store_true", help="try tile sizes and warps first, keep the best")
    parser.add_argument("--no-reference", action="store_true", help="skip the PyTorch reference timings")
    args = parser.parse_args()
    if args.cpu:
        return cpu_main()
    fmt, physical = args.layout.split("/")
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    print(f"# kv_ops bench on {dev}, torch {torch.__version__}, layout {fmt} {physical}", flush=True)
    ceil = ceiling()
    print(
        f"device-to-device copy: {2 * ceil / 1e9:.0f} GB/s traffic -> payload ceiling {ceil / 1e9:.0f} GB/s",
        flush=True,
    )

    case = make_cache(
        fmt,
        physical,
        num_blocks=NB,
        block_size=BS,
        num_kv_heads=NH,
        head_size=HS,
        num_layers=L,
        dtype=DTYPE,
        device="cuda",
    )
    caches = case.caches
    layout = kv_ops.detect_layouts(caches, **case.detect_kwargs())
    refs = layer_refs(caches, layout)
    token_counts = [256, 2048] if args.quick else [256, 2048, 16384]
    objs = {t: torch.randn(L, 2, t, NH * HS, device="cuda").to(DTYPE) for t in token_counts}
    # "random slots": a random permutation of all token slots (every token its own random place);
    # "random blocks": random block ids, tokens in offset order inside a block (what vLLM's block
    # allocator produces once its free list is shuffled). Both are reported.
    patterns = {
        "random slots": {t: torch.randperm(NB * BS, device="cuda")[:t].contiguous() for t in token_counts},
        "random blocks": {
            t: (
                torch.randperm(NB, device="cuda")[: t // BS, None] * BS + torch.arange(BS, device="cuda")
            ).reshape(-1)
            for t in token_counts
        },
    }
    slots = patterns["random slots"]
    # Destination order: each mapping sorted once (torch.sort's values and permutation).
    sorted_pats = {name: {t: torch.sort(p[t]) for t in token_counts} for name, p in patterns.items()}

    variant = Variant()

    def kernel(t: int, gather: bool, sl: dict | None = None, ordered: str | None = None):
        obj = triton_kernels.as_bits(objs[t])
        if ordered is not None:
            srt, order = sorted_pats[ordered][t]
            return lambda: place_variant(refs, layout, srt, obj, gather=gather, variant=variant, order=order)
        idx = (sl or slots)[t]
        return lambda: triton_kernels.place(refs, layout, idx, obj, gather=gather)

    def kernel_cm(t: int, sl: dict):
        obj = triton_kernels.as_bits(objs[t])
        return lambda: place_variant(refs, layout, sl[t], obj, gather=False, variant=variant)

    tp = triton_kernels.TuneParams
    # Cost of the sort that destination order needs (eager, events around one torch.sort).
    sort_cost = {}
    for t in token_counts:
        vals = torch.empty(t, dtype=torch.int64, device="cuda")
        perm = torch.empty(t, dtype=torch.int64, device="cuda")
        sort_cost[t] = time_events(lambda t=t, v=vals, q=perm: torch.sort(slots[t], out=(v, q)))
    print(
        "torch.sort of the slot mapping (device time, us): "
        + ", ".join(f"{t}: {v * 1e6:.1f}" for t, v in sort_cost.items()),
        flush=True,
    )
    if args.sweep:
        print(
            "\n## tile sweep (kernel-only, graph-replayed; payload GB/s load / store at "
            + "/".join(map(str, token_counts))
            + " tokens)",
            flush=True,
        )
        best = None
        for block_t, warps in ((2, 4), (4, 4), (8, 8)):
            tp.block_t, tp.num_warps = block_t, warps
            line, score = [], 9.0
            for pattern in ("random slots", "random blocks"):
                row = [
                    payload_bytes(t) / time_graph(kernel(t, g, patterns[pattern]))
                    for t in token_counts
                    for g in (False, True)
                ]
                line.append(f"{pattern}: " + " ".join(f"{x / 1e9:6.0f}" for x in row))
                # Score on loads and stores alike: 1.3 TB/s at 256 tokens, 1.9 at 2048 and above.
                for x, t in zip(row, [t for t in token_counts for _ in (0, 1)], strict=True):
                    score = min(score, x / (1.3e12 if t < 2048 else 1.9e12))
            print(f"BLOCK_T={block_t:3d} warps={warps}: " + " | ".join(line), flush=True)
            if best is None or score > best[0]:
                best = (score, block_t, warps)
        assert best is not None
        tp.block_t, tp.num_warps = best[1], best[2]
        print(f"chosen: BLOCK_T={tp.block_t} num_warps={tp.num_warps}", flush=True)
        # The scattered stores' cache operator (loads only: it changes nothing else).
        print("\n## scatter store cache operator (load GB/s at " + "/".join(map(str, token_counts)) + ")")
        best_cm = None
        for cm in CACHE_OPERATORS:
            variant.scatter_store_cache = cm
            line, score = [], 9.0
            for pattern in ("random slots", "random blocks"):
                row = [payload_bytes(t) / time_graph(kernel_cm(t, patterns[pattern])) for t in token_counts]
                line.append(f"{pattern}: " + " ".join(f"{x / 1e9:6.0f}" for x in row))
                for x, t in zip(row, token_counts, strict=True):
                    score = min(score, x / (1.3e12 if t < 2048 else 1.9e12))
            print(f"store cache operator {cm or 'default':8}: " + " | ".join(line), flush=True)
            if best_cm is None or score > best_cm[0]:
                best_cm = (score, cm)
        assert best_cm is not None
        variant.scatter_store_cache = best_cm[1]
        print(
            f"best: scatter_store_cache={variant.scatter_store_cache!r} (a variant; production is '')",
            flush=True,
        )
        # Locality probe: the same random-slot scatter confined to 1/16 of each layer's blocks.
        t = 2048
        near = torch.randperm(NB * BS // 16, device="cuda")[:t].contiguous()
        near_sorted = torch.sort(near)
        ob = triton_kernels.as_bits(objs[t])
        for name, fn in (
            ("plain", lambda: triton_kernels.place(refs, layout, near, ob, gather=False)),
            (
                "ordered",
                lambda: place_variant(
                    refs, layout, near_sorted[0], ob, gather=False, variant=variant, order=near_sorted[1]
                ),
            ),
        ):
            print(
                f"locality probe, random slots in 1/16 of the cache, {t} tokens, load {name}: "
                f"{payload_bytes(t) / time_graph(fn) / 1e9:.0f} GB/s",
                flush=True,
            )

    rows = []
    for pattern, pslots in patterns.items():
        for t in token_counts:
            nbytes = payload_bytes(t)
            res = {}
            placer = kv_ops.GraphedPlacer(caches, layout)
            placer.staging(t).copy_(objs[t])
            placer.set_slots(pslots[t])
            placer.warm(t)
            res["load_graph"] = time_events(lambda p=placer, t=t: p.scatter(t))
            res["store_graph"] = time_events(lambda p=placer, t=t: p.gather(t))
            del placer
            res["load_kernel"] = time_graph(kernel(t, False, pslots))
            res["load_kernel_ord"] = time_graph(kernel(t, False, pslots, pattern))
            # The sort and the ordered kernel captured together (the sort counted in the time).
            vals = torch.empty(t, dtype=torch.int64, device="cuda")
            perm = torch.empty(t, dtype=torch.int64, device="cuda")
            ob = triton_kernels.as_bits(objs[t])

            def sort_then_place(t=t, v=vals, q=perm, ob=ob, s=pslots):
                torch.sort(s[t], out=(v, q))
                place_variant(refs, layout, v, ob, gather=False, variant=variant, order=q)

            try:
                res["load_kernel_ord_sort"] = time_graph(sort_then_place)
            except Exception as exc:  # a sort that cannot be captured must not end the run
                print(f"sort + ordered kernel in one graph failed: {type(exc).__name__}: {exc}", flush=True)
            res["store_kernel"] = time_graph(kernel(t, True, pslots))
            res["store_kernel_ord"] = time_graph(kernel(t, True, pslots, pattern))
            res["load_eager"] = time_events(
                lambda t=t, s=pslots: kv_ops.scatter(objs[t], caches, layout, s[t])
            )
            res["store_eager"] = time_events(
                lambda t=t, s=pslots: kv_ops.gather(caches, layout, s[t], out=objs[t])
            )
            if not args.no_reference and (pattern == "random slots" or not args.quick):
                res["load_ref"] = time_events(
                    lambda t=t, s=pslots: kv_ops.scatter(objs[t], caches, layout, s[t], backend="reference"),
                    reps=5,
                )
                res["store_ref"] = time_events(
                    lambda t=t, s=pslots: kv_ops.gather(
                        caches, layout, s[t], backend="reference", out=objs[t]
                    ),
                    reps=5,
                )
            rows.append((pattern, t, nbytes, res))
            print(
                f"{pattern}, {t} tokens: "
                + ", ".join(f"{k} {fmt_bw(nbytes, v).strip()}" for k, v in res.items()),
                flush=True,
            )

    # Per-layer issue cost (the layer-overlap load): host time to issue 32 single-layer placements.
    t = issue_tokens = 256
    slots = patterns["random slots"]
    obj_bits = triton_kernels.as_bits(objs[t])
    placer = kv_ops.GraphedPlacer(caches, layout)
    placer.staging(t).copy_(objs[t])
    placer.set_slots(slots[t])
    placer.warm(t, per_layer=True)

    def api_layers():
        for layer in range(L):
            kv_ops.scatter_layer(objs[t][layer], caches[layer], layout, slots[t])

    def direct_layers():
        for layer in range(L):
            triton_kernels.place(
                [refs[layer]], layout, slots[t], obj_bits[layer : layer + 1], gather=False, single_layer=True
            )

    def graph_layers():
        for layer in range(L):
            placer.scatter_layer(layer, t)

    issue = {}
    for name, fn in (
        ("scatter_layer API", api_layers),
        ("kernel launch", direct_layers),
        ("graph replay", graph_layers),
    ):
        fn()
        torch.cuda.synchronize()
        host = []
        for _ in range(20):
            torch.cuda.synchronize()
            s = time.perf_counter()
            fn()
            host.append(time.perf_counter() - s)
        torch.cuda.synchronize()
        dev_t = time_events(fn, reps=10)
        issue[name] = (statistics.median(host) / L, dev_t)

    print("\n## kv_ops on " + dev + f" ({fmt} {physical}; payload ceiling {ceil / 1e9:.0f} GB/s)")
    print(
        "| slots | tokens | load kernel | load graph | load eager | store kernel | store graph | store eager "
        "| reference load / store | ordered kernel load / store | sort + ordered load |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def cell(r: dict, nb: int, *keys: str) -> str:
        return " / ".join(fmt_bw(nb, r[k]).strip() if k in r else "-" for k in keys)

    for pattern, t, nbytes, r in rows:
        print(
            f"| {pattern} | {t} | **{cell(r, nbytes, 'load_kernel')}** | {cell(r, nbytes, 'load_graph')} | {cell(r, nbytes, 'load_eager')} | "
            f"**{cell(r, nbytes, 'store_kernel')}** | {cell(r, nbytes, 'store_graph')} | {cell(r, nbytes, 'store_eager')} | "
            f"{cell(r, nbytes, 'load_ref', 'store_ref')} | {cell(r, nbytes, 'load_kernel_ord', 'store_kernel_ord')} | "
            f"{cell(r, nbytes, 'load_kernel_ord_sort')} |"
        )
    print(
        "(GB/s of payload; 'kernel' = 10 launches captured in one graph, per launch; 'graph' = one GraphedPlacer"
    )
    print(
        " replay timed alone; 'eager' = kv_ops.scatter/gather from Python; 'ordered' = the destination-ordered"
    )
    print(" kernel on a pre-sorted mapping; 'sort + ordered' = torch.sort and that kernel in one graph)")
    print(
        f"\n| single-layer load, {issue_tokens} tokens x {L} layers | host issue per layer (us) | 32 layers, GPU time (ms) |"
    )
    print("| --- | --- | --- |")
    for name, (host, dev_t) in issue.items():
        print(f"| {name} | {host * 1e6:.1f} | {dev_t * 1e3:.3f} |")
    print(
        f"tiles: BLOCK_T={tp.block_t} num_warps={tp.num_warps}; variant: ordered BLOCK_T={variant.ordered_block_t} "
        f"num_warps={variant.ordered_num_warps} scatter_store_cache={variant.scatter_store_cache!r}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
