"""Benchmark: paged-KV placement on a GPU (payload GB/s) against the PyTorch reference and the copy ceiling.

Geometry (the ANCHORS.md one): 32 layers, 8 KV heads, head size 128, bf16, block size 16, 8192 blocks
per layer, random slot order, for 256, 2048 and 16384 tokens. "Payload" counts the KV bytes moved
once (a placement reads and writes them, so memory traffic is twice that); the ceiling is half the
measured device-to-device copy bandwidth. Prints a short table last.

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

    def kernel(t: int, gather: bool, sl: dict | None = None):
        obj = triton_kernels.as_bits(objs[t])
        idx = (sl or slots)[t]
        return lambda: triton_kernels.place(refs, layout, idx, obj, gather=gather)

    tp = triton_kernels.TuneParams
    if args.sweep:
        print(
            "\n## tile sweep (kernel-only, graph-replayed; payload GB/s load / store at 256 and 2048 tokens)",
            flush=True,
        )
        best = None
        # Streaming eviction hints (tp.stream) measured no better on 2026-11-29; not swept again.
        configs = ((2, 4), (4, 4), (8, 4), (16, 4), (8, 8), (16, 8), (32, 8))
        for block_t, warps, layer_fast in [(b, w, lf) for lf in (False, True) for b, w in configs]:
            tp.block_t, tp.num_warps, tp.layer_fast = block_t, warps, layer_fast
            line, score = [], 9.0
            for pattern in ("random slots", "random blocks"):
                row = [
                    payload_bytes(t) / time_graph(kernel(t, g, patterns[pattern]))
                    for t in (256, 2048)
                    for g in (False, True)
                ]
                line.append(f"{pattern}: " + " ".join(f"{x / 1e9:6.0f}" for x in row))
                score = min(score, row[0] / 1.3e12, row[1] / 1.3e12, row[2] / 1.9e12, row[3] / 1.9e12)
            print(
                f"BLOCK_T={block_t:3d} warps={warps} layer_fast={layer_fast!s:5}: " + " | ".join(line),
                flush=True,
            )
            if best is None or score > best[0]:
                best = (score, block_t, warps, layer_fast)
        assert best is not None
        tp.block_t, tp.num_warps, tp.layer_fast = best[1], best[2], best[3]
        print(f"chosen: BLOCK_T={tp.block_t} num_warps={tp.num_warps} layer_fast={tp.layer_fast}", flush=True)

    rows = []
    for pattern, pslots in patterns.items():
        for t in token_counts:
            nbytes = payload_bytes(t)
            placer = kv_ops.GraphedPlacer(caches, layout)
            placer.staging(t).copy_(objs[t])
            placer.set_slots(pslots[t])
            placer.warm(t)
            res = {
                "load_eager": time_events(
                    lambda t=t, s=pslots: kv_ops.scatter(objs[t], caches, layout, s[t])
                ),
                "store_eager": time_events(
                    lambda t=t, s=pslots: kv_ops.gather(caches, layout, s[t], out=objs[t])
                ),
                "load_graph": time_events(lambda p=placer, t=t: p.scatter(t)),
                "store_graph": time_events(lambda p=placer, t=t: p.gather(t)),
                "load_kernel": time_graph(kernel(t, False, pslots)),
                "store_kernel": time_graph(kernel(t, True, pslots)),
            }
            if pattern == "random slots" or not args.quick:
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
            del placer

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
        "| slots | tokens | MB | load graph | load kernel | load eager | store graph | store kernel | store eager "
        "| reference load / store |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for pattern, t, nbytes, r in rows:
        ref = "-"
        if "load_ref" in r:
            ref = f"{fmt_bw(nbytes, r['load_ref']).strip()} / {fmt_bw(nbytes, r['store_ref']).strip()}"
        print(
            f"| {pattern} | {t} | {nbytes / 1e6:.1f} | {fmt_bw(nbytes, r['load_graph'])} | "
            f"{fmt_bw(nbytes, r['load_kernel'])} | {fmt_bw(nbytes, r['load_eager'])} | "
            f"{fmt_bw(nbytes, r['store_graph'])} | {fmt_bw(nbytes, r['store_kernel'])} | "
            f"{fmt_bw(nbytes, r['store_eager'])} | {ref} |"
        )
    print(
        "(GB/s of payload; 'graph' = one GraphedPlacer replay timed alone, 'kernel' = 10 launches captured in one"
    )
    print(" graph, per launch, 'eager' = kv_ops.scatter/gather called from Python)")
    print(
        f"\n| single-layer load, {issue_tokens} tokens x {L} layers | host issue per layer (us) | 32 layers, GPU time (ms) |"
    )
    print("| --- | --- | --- |")
    for name, (host, dev_t) in issue.items():
        print(f"| {name} | {host * 1e6:.1f} | {dev_t * 1e3:.3f} |")
    print(
        f"tiles: BLOCK_T={tp.block_t} num_warps={tp.num_warps} stream={tp.stream} layer_fast={tp.layer_fast}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
