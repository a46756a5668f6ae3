"""Host issue cost of the layer-overlap load alone (direct path), at 1 / 8 / 64 chunks.

A quick probe next to bench/gpu_datapath.py (which measures everything): the same geometry
(32 layers, 8 KV heads, head size 128, bf16, block 16, 256-token chunks in a registered mapping),
median over 30 calls after warm-up, per-layer graph replays against one launch for all layers, split into the part before the first replay (table build and
upload) and the replays with their events. Usage (on a GPU): python bench/layer_issue.py
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_datapath import BS, HS, NB, NH, L, make_caches, request_slots  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.client import cuda_host  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402


def main() -> None:
    caches = make_caches(NB)
    layout = kv_ops.detect_layouts(caches, block_size=BS, num_kv_heads=NH, head_size=HS)
    mm = None
    print(
        "| variant | tokens (chunks) | issue us/layer | table+upload us/layer | replays+events us/layer | path |"
    )
    print("|---|---|---|---|---|---|")
    for variant in ("per-layer replays", "one launch", "per-layer replays", "one launch"):
        # What the connector builds: graphs warmed at start for every bucket, none captured later.
        engine = pl.DevicePipeline(caches, layout, use_graphs=False, layer_graphs=True, lazy_capture=False)
        engine.one_launch_layers = variant == "one launch"
        engine.warm(0, layer_tokens=[256, 2048, 16384])
        cb = engine.object_bytes(256)
        if mm is None:
            mm = mmap.mmap(-1, 64 * cb, flags=mmap.MAP_SHARED)
            torch.frombuffer(mm, dtype=torch.uint8).fill_(1)
            cuda_host.register_host_mapping(mm, name="layer-issue probe")
        run(engine, mm, cb, torch.Generator().manual_seed(0), variant)


def run(engine: pl.DevicePipeline, mm: mmap.mmap, cb: int, gen: torch.Generator, variant: str) -> None:
    for chunks in (1, 8, 64):
        objs = [engine.host_object(mm, 256, i * cb) for i in range(chunks)]
        slots = request_slots(256 * chunks, NB, gen)
        for _ in range(3):
            engine.load_layers(objs, slots).wait()
        hs = []
        for _ in range(30):
            h = engine.load_layers(objs, slots)
            hs.append(
                (
                    h.issue_s,
                    h.copy_issue_s,
                    h.place_issue_s,
                    h.path + (" (one launch)" if getattr(h, "one_launch", False) else ""),
                )
            )
            h.wait()
        med = [statistics.median(x[i] for x in hs) / L * 1e6 for i in range(3)]
        print(
            f"| {variant} | {256 * chunks} ({chunks}) | {med[0]:.1f} | {med[1]:.1f} | {med[2]:.1f} | {hs[-1][3]} |"
        )


if __name__ == "__main__":
    main()
