"""The timeline of one small connector-level load: host calls and GPU work, from one clock.

Builds what ``bench/gpu_connector.py`` builds (a real ``maru server``, a ``KVTransferEngine`` over
CUDA caches, the pool registered with CUDA), stores one request of ``--tokens`` tokens, loads it
back 20 times, then loads it 3 more times under ``torch.profiler`` (CPU and CUDA activities) with
a named range around each step of the load path. Prints, for the middle load, every event in
start order: microseconds from the load's start, duration, where (host or GPU), name. Answers
where a 256-token load loses its time against the bus: when the copy starts on the GPU, what the
host does meanwhile, what the wait waits for.

Usage (GPU): python bench/load_timeline.py [--tokens 256] [--layers] [--trace out.json]
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_connector import stored_request  # noqa: E402

# (module path, owner attribute or None, function name): each call becomes a named range.
MARKED = [
    ("maru.client.handler", "MaruHandler", "batch_retrieve"),
    ("maru.client.handler", "MaruHandler", "batch_release"),
    ("maru.transfer.engine", "KVTransferEngine", "look_up"),
    ("maru.transfer.engine", "KVTransferEngine", "issue_load"),
    ("maru.transfer.engine", "KVTransferEngine", "_add_request"),
    ("maru.transfer.engine", "KVTransferEngine", "_check"),
    ("maru.transfer.loads", "InflightLoad", "finish"),
    ("maru.transfer.loads", "InflightLoad", "collect"),
    ("maru.transfer.loads", "InflightLoad", "release"),
    ("maru.kv_ops.device_pipeline", "DevicePipeline", "load"),
    ("maru.kv_ops.device_pipeline", "DevicePipeline", "_start"),
    ("maru.kv_ops.device_pipeline", "DevicePipeline", "_h2d"),
    ("maru.kv_ops.pipeline_inputs", "PipelineInputs", "_objects"),
    ("maru.kv_ops.pipeline_inputs", "PipelineInputs", "_slots"),
    ("maru.kv_ops.pipeline_inputs", "PipelineInputs", "_check_slots"),
    ("maru.kv_ops.staging_slot", "StagingSlot", "place"),
    ("maru.kv_ops.staging_slot", "StagingSlot", "buffer"),
    ("maru.kv_ops.checksum", None, "accumulate"),
    ("maru.kv_ops.checksum", None, "to_host"),
    ("maru.kv_ops.device_handles", "Transfer", "wait"),
    ("maru.kv_ops.device_handles", "Transfer", "checksums"),
    # the layer-overlap load (--layers)
    ("maru.transfer.engine", "KVTransferEngine", "pin"),
    ("maru.transfer.engine", "KVTransferEngine", "start_layer_load"),
    ("maru.kv_ops.device_pipeline", "DevicePipeline", "load_layers"),
    ("maru.kv_ops.layer_paths", "LayerPaths", "_issue_layers_direct"),
    ("maru.kv_ops.direct_kernel", None, "direct_table_host"),
    ("maru.kv_ops.placer", "GraphedPlacer", "scatter_direct_all"),
]


def mark_all() -> None:
    import importlib
    import inspect

    for mod_name, owner, fn in MARKED:
        mod = importlib.import_module(mod_name)
        holder: Any = getattr(mod, owner) if owner else mod
        if isinstance(inspect.getattr_static(holder, fn), staticmethod):
            continue  # re-set as a plain function it would receive self
        real = getattr(holder, fn)

        def wrapped(*a: Any, __real: Any = real, __name: str = f"{owner or mod_name}.{fn}", **kw: Any) -> Any:
            with record_function(__name):
                return __real(*a, **kw)

        functools.update_wrapper(wrapped, real)
        setattr(holder, fn, wrapped)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--trace", default=None, help="also write a Chrome trace here")
    ap.add_argument("--layers", action="store_true", help="the layer-overlap load (pin, then load_layers)")
    a = ap.parse_args()
    with stored_request(a.tokens, "timeline", 2 << 30) as (_storer, loader, req):
        mark_all()

        def one() -> Any:
            if not a.layers:
                return loader.load([req])
            ll = loader.start_layer_load(loader.pin([req]))  # what the connector issues a step
            h = ll.handle.load
            ll.wait()
            return h

        for _ in range(20):
            one()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            reps = []
            for i in range(3):
                with record_function(f"LOAD {i}"):
                    reps.append(one())
            torch.cuda.synchronize()
        print(f"{a.tokens} tokens{' (layer by layer)' if a.layers else ''}; the 3 profiled loads:")
        for r in reps:
            if a.layers:
                print(f"   issue {r.issue_s * 1e6:.0f} us ({r.issue_s / 32 * 1e6:.1f} a layer)")
            else:
                print(
                    "  ",
                    {k: round(v * 1e3, 3) for k, v in r.phases.items()},
                    "total",
                    round(r.seconds * 1e3, 3),
                )
        if a.trace:
            prof.export_chrome_trace(a.trace)
        print_window(prof, "LOAD 1")


def _ns(e: Any) -> tuple[int, int]:
    """(start, duration) in ns of a kineto event, whichever accessors this torch has."""
    if hasattr(e, "start_ns"):
        return int(e.start_ns()), int(e.duration_ns())
    return int(e.start_us() * 1000), int(e.duration_us() * 1000)


def print_window(prof: Any, label: str) -> None:
    events = list(prof.profiler.kineto_results.events())
    win = next(e for e in events if e.name() == label)
    t0, d0 = _ns(win)
    t1 = t0 + d0
    inside = [e for e in events if t0 <= _ns(e)[0] <= t1 + 2_000_000]
    inside.sort(key=lambda e: _ns(e)[0])
    print(f"\n{label}: {(t1 - t0) / 1e3:.1f} us on the host; events (us from its start):")
    print("| start | dur | where | name |\n|---:|---:|---|---|")
    for e in inside:
        where = "GPU" if e.device_type() == torch.autograd.DeviceType.CUDA else "host"
        name = e.name()
        start, dur = _ns(e)
        if where == "host" and name.startswith("aten::") and dur < 3000:
            continue  # small tensor ops: listed only when they take time
        print(f"| {(start - t0) / 1e3:.1f} | {dur / 1e3:.1f} | {where} | {name[:90]} |")


if __name__ == "__main__":
    main()
