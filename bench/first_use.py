"""What the first transfers of a fresh ``KVTransferEngine`` cost against the later ones (GPU).

A new vLLM instance pays its first store and its first load on the forward thread: anything the
engine did not prepare at start (a kernel Triton compiles or loads from its disk cache, a CUDA
graph, a pinned buffer) lands on a request. This builds an engine as the vLLM worker does (real
server, CUDA caches of Llama-3-8B's KV geometry, the warm-up), then times, in order, three rounds
of: a write-behind store (issue on the calling thread + completion), a load, a layer-by-layer
load, each of fresh 2048-token requests. Run it once with an empty ``TRITON_CACHE_DIR`` (a fresh
host) and once again with the same directory (a host that ran Maru before).

Usage (GPU machine, repo root): TRITON_CACHE_DIR=$(mktemp -d) python bench/first_use.py
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.gpu_connector import BS, CHUNK, HS, NB, NH, make_caches, request, server_client  # noqa: E402
from maru import kv_ops  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402

TOKENS = 2048


def main() -> None:
    rows = []
    with server_client(2 << 30) as client:
        src = make_caches(NB, 1)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        t0 = time.perf_counter()
        engine = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK)
        build = time.perf_counter() - t0
        gen = torch.Generator().manual_seed(0)
        for rnd in range(3):
            reqs = [request(TOKENS, f"first-{rnd}-{uuid.uuid4().hex[:6]}", gen)]
            t0 = time.perf_counter()
            pending = engine.issue_store(reqs)
            issue = time.perf_counter() - t0
            rep = engine.complete_store(pending)
            store = time.perf_counter() - t0
            assert rep.stored == len(reqs[0].chunks), rep
            t0 = time.perf_counter()
            lrep = engine.load(reqs)
            load = time.perf_counter() - t0
            assert not lrep.failed, lrep
            t0 = time.perf_counter()
            lrep = engine.start_layer_load(engine.pin(reqs)).wait()
            layer = time.perf_counter() - t0
            assert len(lrep.loaded_req_ids) == 1, lrep.failed
            rows.append((rnd, issue, store, load, layer))
        engine.close()
    print(f"{torch.cuda.get_device_name()}, TRITON_CACHE_DIR={os.environ.get('TRITON_CACHE_DIR')}")
    print(f"engine build (registration, warm-up): {build * 1e3:.0f} ms")
    print("| round | store issue ms | store ms | load ms | layer load ms |\n|---|---:|---:|---:|---:|")
    for rnd, issue, store, load, layer in rows:
        print(f"| {rnd} | {issue * 1e3:.1f} | {store * 1e3:.1f} | {load * 1e3:.1f} | {layer * 1e3:.1f} |")


if __name__ == "__main__":
    main()
