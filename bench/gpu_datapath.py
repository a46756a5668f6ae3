"""GPU data path benchmark: store and load GB/s through a shared-memory pool, next to the bus ceiling.

Geometry: 32 layers, 8 KV heads, head size 128, bf16, block size 16 (a Llama-3-8B-like model), a
FlashInfer-order NHD cache of 4096 blocks per layer; a request's blocks are random, tokens in a
block consecutive (as vLLM allocates). Objects are 256-token chunks in a pool file under /dev/shm,
mmapped and registered with CUDA (maru.client.cuda_host), moved by maru.kv_ops.device_pipeline.

Prints, for 256, 2048 and 16384 tokens:
* the measured pinned host<->device ceiling (a plain pinned tensor copy of the same bytes),
* load and store GB/s through the pool: pipelined (copy engine + kernel overlapped), synchronous,
  and unregistered (pageable) for comparison,
* the layer-overlap load: GPU-side GB/s and the host issue cost per layer.

Every figure is the median of several timed runs after warm-up, wall clock around issue + wait
(what a caller sees). Usage: python bench/gpu_datapath.py [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from maru import kv_ops  # noqa: E402
from maru.client import cuda_host  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402

L, NH, HS, BS = 32, 8, 128, 16
NB = 4096
CHUNK = 256
SIZES = (256, 2048, 16384)
GB = 1e9


def copy_gbps(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """GB/s of ``dst.copy_(src)`` (non_blocking, then synchronize): the plain-copy ceiling."""

    def run() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return src.numel() * src.element_size() / timed(run, reps) / GB


def transfer_gbps(fn: Callable[[], Any], nbytes: int, reps: int) -> float:
    """GB/s of a transfer issued by ``fn`` (returns a handle) and waited for."""
    return nbytes / timed(lambda: fn().wait(), reps) / GB


def timed(fn: Callable[[], Any], reps: int, warmup: int = 2) -> float:
    """Median wall seconds of ``fn()`` (which must leave the GPU idle when it returns)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Pool:
    """A pool file under /dev/shm (anonymous shared memory if /dev/shm is too small), mmapped."""

    def __init__(self, size: int) -> None:
        self.size = size
        st = os.statvfs("/dev/shm") if os.path.isdir("/dev/shm") else None
        free = st.f_bavail * st.f_frsize if st else 0
        if free >= size + (256 << 20):
            self.path = f"/dev/shm/maru-bench-{uuid.uuid4().hex[:8]}"
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, size)
                self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
            finally:
                os.close(fd)
            self.kind = f"/dev/shm file ({free / 2**30:.1f} GiB free there)"
        else:
            self.path = None
            self.mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
            self.kind = f"anonymous shared mmap (/dev/shm has only {free / 2**30:.2f} GiB free)"
        # Touch every page once, so first-touch faults are not timed as copy bandwidth.
        torch.frombuffer(self.mm, dtype=torch.uint8).fill_(0x5A)

    def close(self) -> None:
        try:
            self.mm.close()
        except BufferError:
            pass
        if self.path:
            os.unlink(self.path)


def make_caches(nb: int) -> list[torch.Tensor]:
    # FlashInfer order [NB, 2, BS, NH, HS], NHD; random bits (never time on zeros).
    buf = torch.randint(-(2**15), 2**15 - 1, (L, nb, 2, BS, NH, HS), dtype=torch.int16, device="cuda")
    buf = buf.view(torch.bfloat16)
    return [buf[i] for i in range(L)]


def request_slots(tokens: int, nb: int, gen: torch.Generator) -> torch.Tensor:
    blocks = torch.randperm(nb, generator=gen)[: (tokens + BS - 1) // BS]
    slots = (blocks[:, None] * BS + torch.arange(BS)[None, :]).reshape(-1)[:tokens]
    return slots.to(torch.int64)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    ap.add_argument("--backend", default=None, help="kv_ops backend (default: best available)")
    args = ap.parse_args()
    reps = {256: 20, 2048: 10, 16384: 5} if not args.quick else {256: 5, 2048: 3, 16384: 2}
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"device: {props.name}, torch {torch.__version__}, kv_ops backend: {kv_ops.backend('cuda')}")
    results: dict[str, Any] = {"device": props.name, "torch": torch.__version__, "sizes": {}}

    caches = make_caches(NB)
    layout = kv_ops.detect_layouts(caches, block_size=BS, num_kv_heads=NH, head_size=HS)
    engine = pl.DevicePipeline(caches, layout, backend=args.backend)
    chunk_bytes = engine.object_bytes(CHUNK)
    max_tokens = max(SIZES)
    pool_size = (max_tokens // CHUNK) * chunk_bytes + (64 << 20)
    pool = Pool(pool_size)
    print(f"pool: {pool.kind}, {pool_size / 2**30:.2f} GiB")
    results["pool"] = pool.kind
    gen = torch.Generator().manual_seed(0)

    def objects(tokens: int) -> list[torch.Tensor]:
        return [engine.host_object(pool.mm, CHUNK, i * chunk_bytes) for i in range(tokens // CHUNK)]

    # -- unregistered (pageable) pool: what a missing registration costs (2048 tokens only).
    t = 2048
    objs, slots = objects(t), request_slots(t, NB, gen)
    nbytes = engine.object_bytes(t)
    results["unregistered_2048"] = {
        "h2d_copy_GBps": copy_gbps(
            torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev),
            torch.frombuffer(pool.mm, dtype=torch.bfloat16, count=nbytes // 2),
            3,
        ),
        "load_GBps": transfer_gbps(lambda: engine.load(objs, slots), nbytes, 3),
        "store_GBps": transfer_gbps(lambda: engine.store(objs, slots), nbytes, 3),
    }

    # -- register the pool (once), then everything else runs on DMA.
    reg = cuda_host.register_host_mapping(pool.mm, name="bench pool")
    print(reg.describe())
    results["registration"] = reg.as_dict()
    if not reg.registered:
        print("registration failed: the figures below are pageable copies")

    # The layer-overlap load through staging copies (the path before the direct kernel), for comparison.
    staged = pl.DevicePipeline(caches, layout, backend=args.backend, layer_path="staged")
    rows = []
    for t in SIZES:
        region = torch.frombuffer(pool.mm, dtype=torch.bfloat16, count=engine.object_bytes(t) // 2)
        row = measure_size(engine, objects(t), request_slots(t, NB, gen), reps[t], dev, region, staged)
        rows.append(row)
        results["sizes"][str(t)] = row
        print(json.dumps(row))

    # -- what one layer's placement and one layer's copy cost the host (breakdown of the issue cost).
    t = 2048
    objs, slots = objects(t), request_slots(t, NB, gen)
    stage = torch.empty(engine.object_shape(t), dtype=torch.bfloat16, device=dev)
    dslots = slots.to(dev)
    for _ in range(3):
        kv_ops.scatter_layer(stage[0], caches[0], layout, dslots, backend=args.backend)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(L):
        kv_ops.scatter_layer(stage[i], caches[i], layout, dslots, backend=args.backend)
    place_us = (time.perf_counter() - t0) / L * 1e6
    torch.cuda.synchronize()
    ev = torch.cuda.Event()
    t0 = time.perf_counter()
    for _ in range(L):
        ev.record()
        torch.cuda.current_stream().wait_event(ev)
    event_us = (time.perf_counter() - t0) / L * 1e6
    torch.cuda.synchronize()
    results["layer_breakdown_us"] = {"scatter_layer_call": place_us, "event_record_and_wait": event_us}

    # -- host cost of one raw copy call: 1-D vs pitched (the layer path issues one per chunk and layer).
    raw = engine._sync
    if raw.raw:
        dst = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
        src = objs[0].data_ptr()
        cs = engine._copy_stream.cuda_stream
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            raw.copy(dst.data_ptr(), src, 512 << 10, cs)
        one_d = (time.perf_counter() - t0) / 200 * 1e6
        engine._copy_stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(200):
            raw.copy2d(dst.data_ptr(), 512 << 10, src, 256 << 10, 256 << 10, 2, cs)
        two_d = (time.perf_counter() - t0) / 200 * 1e6
        engine._copy_stream.synchronize()
        results["copy_call_us"] = {"memcpy_1d_512KiB": one_d, "memcpy_2d_2x256KiB": two_d}
        print(f"raw copy call host cost: 1-D {one_d:.1f} us, 2-D {two_d:.1f} us")

    # -- what graphs and raw CUDA calls buy, at 256 and 2048 tokens.
    for t in (256, 2048):
        objs, slots = objects(t), request_slots(t, NB, gen)
        results[f"variants_{t}"] = variants(caches, layout, objs, slots, args.backend)

    # -- a copy that straddles two separately registered slices (does slicing keep DMA speed?).
    try:
        straddle: Any = straddle_check(dev)
    except Exception as exc:  # noqa: BLE001 - a finding to report, not a reason to lose the table
        straddle = f"failed: {type(exc).__name__}: {exc}"
    results["straddle"] = straddle

    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)

    reg_s = reg.seconds
    print()
    print(f"GPU data path, {props.name}, {L} layers x {NH} heads x {HS} bf16, block {BS}, 256-token chunks")
    print(f"pool registration: {reg.registered_bytes / 2**30:.2f} GiB in {reg_s:.2f} s ({reg.state})")
    u = results["unregistered_2048"]
    print(
        f"unregistered pool, 2048 tokens: H2D copy {u['h2d_copy_GBps']:.1f} GB/s, load {u['load_GBps']:.1f}, "
        f"store {u['store_GBps']:.1f} GB/s"
    )
    hdr = (
        "| tokens | MB | pinned H2D | pinned D2H | load pipelined | (% H2D) | store pipelined | (% D2H) "
        "| load sync | store sync | load layers | layer issue us/layer (table/copies + placement) "
        "| wait_for_layer us | pool plain copy H2D/D2H | staged layers GB/s, us/layer |"
    )
    print(hdr)
    print("|" + "---|" * 15)
    for row in rows:
        print(
            f"| {row['tokens']} | {row['MB']:.1f} | {row['pinned_h2d_GBps']:.1f} | {row['pinned_d2h_GBps']:.1f} | "
            f"{row['load_pipelined_GBps']:.1f} | {100 * row['load_pipelined_GBps'] / row['pinned_h2d_GBps']:.1f}% | "
            f"{row['store_pipelined_GBps']:.1f} | {100 * row['store_pipelined_GBps'] / row['pinned_d2h_GBps']:.1f}% | "
            f"{row['load_sync_GBps']:.1f} | {row['store_sync_GBps']:.1f} | {row['load_layers_GBps']:.1f} | "
            f"{row['layer_issue_us']:.1f} ({row['layer_copy_issue_us']:.1f} + {row['layer_place_issue_us']:.1f}) | "
            f"{row['wait_for_layer_us']:.1f} | {row.get('pool_h2d_GBps', 0):.1f} / {row.get('pool_d2h_GBps', 0):.1f} | "
            f"{row['load_layers_staged_GBps']:.1f}, {row['layer_staged_issue_us']:.1f} |"
        )
    print(
        f"layer path: {rows[0]['layer_path']} (default engine); staged = staging copies per chunk and layer"
    )
    b = results["layer_breakdown_us"]
    print(
        f"per-layer host cost breakdown: scatter_layer call {b['scatter_layer_call']:.1f} us, "
        f"event record + stream wait {b['event_record_and_wait']:.1f} us"
    )
    for t in (256, 2048):
        print(f"variants at {t} tokens (layer path GB/s, issue us/layer; pipelined load/store GB/s):")
        for name, v in results[f"variants_{t}"].items():
            print(
                f"  {name}: layers {v['layers_GBps']:.1f} GB/s, {v['layer_issue_us']:.1f} us/layer; "
                f"pipelined {v['load_pipelined_GBps']:.1f} / {v['store_pipelined_GBps']:.1f} GB/s"
            )
    print(f"copy across two separately registered slices: {straddle}")
    print_checksum_table(rows)
    pool.close()


def print_checksum_table(rows: list[dict[str, Any]]) -> None:
    """Load (and store) GB/s with the device checksum vs without, as % of the pinned ceiling."""
    print()
    print("integrity: GB/s without / with checksum (% of pinned H2D, or D2H for stores); the goal is >= 90%")
    print(
        "| tokens | pinned H2D | load pipelined | + checksum | layers direct | + checksum | layers staged "
        "| + checksum | store pipelined | + checksum |"
    )
    print("|" + "---|" * 10)
    for row in rows:
        h2d, d2h = row["pinned_h2d_GBps"], row["pinned_d2h_GBps"]

        def pct(key: str, ceiling: float, row: dict[str, Any] = row) -> str:
            return f"{row[key]:.1f} ({100 * row[key] / ceiling:.0f}%)"

        print(
            f"| {row['tokens']} | {h2d:.1f} | {pct('load_pipelined_GBps', h2d)} | {pct('load_pipelined_ck_GBps', h2d)} "
            f"| {pct('load_layers_GBps', h2d)} | {pct('load_layers_ck_GBps', h2d)} "
            f"| {pct('load_layers_staged_GBps', h2d)} | {pct('load_layers_staged_ck_GBps', h2d)} "
            f"| {pct('store_pipelined_GBps', d2h)} | {pct('store_pipelined_ck_GBps', d2h)} |"
        )


def measure_size(
    engine: pl.DevicePipeline,
    objs: list[torch.Tensor],
    slots: torch.Tensor,
    r: int,
    dev: torch.device,
    region: torch.Tensor,
    staged: pl.DevicePipeline,
) -> dict[str, float]:
    """Every figure of one table row (one request size)."""
    t = sum(o.shape[2] for o in objs)
    nbytes = engine.object_bytes(t)
    pinned = torch.empty(nbytes // 2, dtype=torch.bfloat16, pin_memory=True)
    dbuf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    row: dict[str, float] = {
        "tokens": t,
        "MB": nbytes / 1e6,
        "pinned_h2d_GBps": copy_gbps(dbuf, pinned, r),
        "pinned_d2h_GBps": copy_gbps(pinned, dbuf, r),
    }
    del pinned, dbuf
    issue: list[float] = []

    def tracked(fn: Callable[[], pl.Transfer]) -> Callable[[], pl.Transfer]:
        def run() -> pl.Transfer:
            h = fn()
            issue.append(h.issue_s)
            return h

        return run

    def issue_median() -> float:
        value = statistics.median(issue[2:])  # the first two are warm-ups
        issue.clear()
        return value

    # The same bytes as one plain copy to and from the registered pool (its own ceiling).
    dbuf = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=dev)
    row["pool_h2d_GBps"] = copy_gbps(dbuf, region[: nbytes // 2], r)
    row["pool_d2h_GBps"] = copy_gbps(region[: nbytes // 2], dbuf, r)
    del dbuf
    row["load_pipelined_GBps"] = transfer_gbps(tracked(lambda: engine.load(objs, slots)), nbytes, r)
    row["load_issue_ms"] = issue_median() * 1e3
    row["store_pipelined_GBps"] = transfer_gbps(tracked(lambda: engine.store(objs, slots)), nbytes, r)
    row["store_issue_ms"] = issue_median() * 1e3
    row["load_sync_GBps"] = transfer_gbps(lambda: engine.load(objs, slots, pipelined=False), nbytes, r)
    row["store_sync_GBps"] = transfer_gbps(lambda: engine.store(objs, slots, pipelined=False), nbytes, r)
    # The layer-overlap load: throughput, and host time to issue it (per layer).
    handles: list[pl.LayerLoad] = []

    def layers() -> pl.LayerLoad:
        h = engine.load_layers(objs, slots)
        handles.append(h)
        return h

    row["load_layers_GBps"] = transfer_gbps(layers, nbytes, r)
    hs = handles[2:]
    row["layer_path"] = hs[-1].path
    row["layer_issue_us"] = statistics.median(h.issue_s for h in hs) / L * 1e6
    row["layer_copy_issue_us"] = statistics.median(h.copy_issue_s for h in hs) / L * 1e6
    row["layer_place_issue_us"] = statistics.median(h.place_issue_s for h in hs) / L * 1e6
    handles.clear()

    def layers_staged() -> pl.LayerLoad:
        h = staged.load_layers(objs, slots)
        handles.append(h)
        return h

    row["load_layers_staged_GBps"] = transfer_gbps(layers_staged, nbytes, r)
    row["layer_staged_issue_us"] = statistics.median(h.issue_s for h in handles[2:]) / L * 1e6
    # The same loads and stores verifying integrity (kv_ops.checksum on the device: the staging slot,
    # fused into the direct layer kernel, one pass over the layer staging), as the connector runs.
    row["load_pipelined_ck_GBps"] = transfer_gbps(lambda: engine.load(objs, slots, checksums=True), nbytes, r)
    row["store_pipelined_ck_GBps"] = transfer_gbps(
        lambda: engine.store(objs, slots, checksums=True), nbytes, r
    )
    row["load_layers_ck_GBps"] = transfer_gbps(
        lambda: engine.load_layers(objs, slots, checksums=True), nbytes, r
    )
    row["load_layers_staged_ck_GBps"] = transfer_gbps(
        lambda: staged.load_layers(objs, slots, checksums=True), nbytes, r
    )
    # What the forward pass pays per layer: wait_for_layer (a stream wait on that layer's event).
    h = engine.load_layers(objs, slots)
    t0 = time.perf_counter()
    for i in range(L):
        h.wait_for_layer(i)
    row["wait_for_layer_us"] = (time.perf_counter() - t0) / L * 1e6
    h.wait()
    torch.cuda.synchronize()
    return row


def variants(
    caches: list[torch.Tensor], layout: Any, objs: list[torch.Tensor], slots: torch.Tensor, backend: Any
) -> dict:
    """At one size: what graphs and raw CUDA calls buy (pipelined GB/s and issue, layer issue cost)."""
    out: dict[str, Any] = {}
    t = sum(o.shape[2] for o in objs)
    for graphs in (True, False):
        for raw in (True, False):
            e = pl.DevicePipeline(caches, layout, backend=backend, use_graphs=graphs, raw_cuda=raw)
            nbytes = e.object_bytes(t)
            issue: list[float] = []

            def layers(e: pl.DevicePipeline = e, issue: list[float] = issue) -> pl.Transfer:
                h = e.load_layers(objs, slots)
                issue.append(h.issue_s)
                return h

            gbps = transfer_gbps(layers, nbytes, 6)
            name = f"graphs={'on' if e.graphs else 'off'},raw={'on' if e._sync.raw else 'off'}"
            out[name] = {
                "layers_GBps": gbps,
                "layer_issue_us": statistics.median(issue[2:]) / L * 1e6,
                "load_pipelined_GBps": transfer_gbps(lambda e=e: e.load(objs, slots), nbytes, 4),
                "store_pipelined_GBps": transfer_gbps(lambda e=e: e.store(objs, slots), nbytes, 4),
            }
            del e
    return out


def straddle_check(dev: torch.device) -> dict[str, Any]:
    """Register a 64 MiB mapping as two slices; copy inside one slice and across the boundary.
    Also: how long registering 2 GiB of never-touched shared memory takes."""
    size = 64 << 20
    mm = mmap.mmap(-1, size, flags=mmap.MAP_SHARED)
    host = torch.frombuffer(mm, dtype=torch.uint8)
    host.fill_(1)
    reg = cuda_host.CudaHostRegistry()
    address, _ = cuda_host.buffer_address(mm)
    rec = reg.register(address, size, name="straddle test", slice_bytes=size // 2, progress=lambda *a: None)
    dbuf = torch.empty(size // 2, dtype=torch.uint8, device=dev)
    out: dict[str, Any] = {"registered": rec.state}
    for name, src in (
        ("inside_one_slice", host[: size // 2]),
        ("across_slices", host[size // 4 : size // 4 + size // 2]),
    ):
        try:
            out[name + "_GBps"] = copy_gbps(dbuf, src, 10)
        except Exception as exc:  # noqa: BLE001 - the finding is the error
            out[name + "_GBps"] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            torch.cuda.synchronize()
    reg.close()
    del host, src
    try:
        mm.close()
    except BufferError:
        pass
    big = mmap.mmap(-1, 2 << 30, flags=mmap.MAP_SHARED)
    address, n = cuda_host.buffer_address(big)
    reg = cuda_host.CudaHostRegistry()
    rec = reg.register(address, n, name="untouched 2 GiB", progress=lambda *a: None)
    out["register_untouched_2GiB_s"] = rec.seconds if rec.registered else rec.reason
    reg.close()
    big.close()
    return out


if __name__ == "__main__":
    main()
