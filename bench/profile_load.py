"""Where a small connector-level load spends its host time: cProfile over repeated 256-token loads.

Builds what ``bench/gpu_connector.py`` builds (a real ``maru server``, a ``KVTransferEngine`` over
CUDA caches, the pool registered with CUDA), stores one request of ``--tokens`` tokens, then loads it
``--reps`` times under cProfile and prints the functions with the most own time, then the most
cumulative time. ``--layers``: the layer-overlap load instead (one pin, then ``start_layer_load``
and its wait, as the connector issues it); only the issue is profiled. ``--store N``: the
write-behind store of N fresh chunks as the drain thread runs it (``issue_store`` then
``complete_store``: reserve, gather after the forward's event, wait, publish), whole.
Usage (GPU): python bench/profile_load.py [--tokens 256] [--reps 200] [--layers | --store 16]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu_connector import BS, CHUNK, HS, NB, NH, make_caches, request, server_client, stored_request  # noqa: E402

from maru import kv_ops  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--top", type=int, default=22)
    ap.add_argument("--kv-ops", action="store_true", help="profile kv_ops.scatter calls (16 tokens) instead")
    ap.add_argument("--layers", action="store_true", help="profile the layer-overlap load's issue instead")
    ap.add_argument("--store", type=int, default=0, help="profile write-behind stores of this many chunks")
    a = ap.parse_args()
    if a.store:
        return profile_store(a)
    if a.kv_ops:
        return profile_kv_ops(a)
    if a.layers:
        return profile_layers(a)
    with stored_request(a.tokens, "profile") as (_storer, loader, req):
        for _ in range(10):
            loader.load([req])
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(a.reps):
            rep = loader.load([req])
        prof.disable()
        assert rep.loaded_req_ids == [req.req_id], rep.failed
        print(
            f"{a.tokens} tokens, last load phases (ms):",
            {k: round(v * 1e3, 3) for k, v in rep.phases.items()},
        )
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(a.top)
        st.sort_stats("cumulative").print_stats(a.top)


def profile_layers(a: argparse.Namespace) -> None:
    """The layer-overlap load's issue (``start_layer_load``) under cProfile; pin and wait outside it."""
    with stored_request(a.tokens, "profile-layers") as (_storer, loader, req):
        for _ in range(10):
            ll = loader.start_layer_load(loader.pin([req]))
            ll.finish()
            ll.release()
        prof = cProfile.Profile()
        issue = []
        for _ in range(a.reps):
            pinned = loader.pin([req])
            prof.enable()
            ll = loader.start_layer_load(pinned)
            prof.disable()
            issue.append(ll.handle.load.issue_s)
            rep = ll.finish()
            ll.release()
        assert rep.loaded_req_ids == [req.req_id], rep.failed
        issue.sort()
        print(f"{a.tokens} tokens, layer load issue (kv_ops) p50 {issue[len(issue) // 2] * 1e6:.0f} us")
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(a.top)
        st.sort_stats("cumulative").print_stats(a.top)


def profile_store(a: argparse.Namespace) -> None:
    """``complete_store(issue_store(...))`` of ``--store`` fresh chunks, as the drain runs it."""
    with server_client(8 << 30) as client:
        src = make_caches(NB, 1)
        layout = kv_ops.detect_layouts(src, block_size=BS, num_kv_heads=NH, head_size=HS)
        engine = KVTransferEngine(src, layout, client, chunk_tokens=CHUNK)
        gen = torch.Generator().manual_seed(0)
        reps = min(a.reps, 40)

        def one(i: int) -> Any:
            reqs = [request(a.store * CHUNK, f"prof-store-{i}", gen)]
            return engine.complete_store(engine.issue_store(reqs))

        for i in range(5):
            one(-1 - i)
        prof = cProfile.Profile()
        secs = []
        for i in range(reps):
            prof.enable()
            rep = one(i)
            prof.disable()
            secs.append(rep.seconds)
            assert rep.stored == a.store, rep
        secs.sort()
        print(
            f"write-behind store of {a.store} chunks ({engine.data_path}): host p50 {secs[len(secs) // 2] * 1e3:.2f} ms"
        )
        st = pstats.Stats(prof)
        st.sort_stats("tottime").print_stats(a.top)
        st.sort_stats("cumulative").print_stats(a.top)


def profile_kv_ops(a: argparse.Namespace) -> None:
    caches = make_caches(NB, 1)
    layout = kv_ops.detect_layouts(caches, block_size=BS, num_kv_heads=NH, head_size=HS)
    slots = torch.randperm(NB * BS, device="cuda")[:16].to(torch.int64)
    obj = kv_ops.gather(caches, layout, slots)
    for _ in range(50):
        kv_ops.scatter(obj, caches, layout, slots)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.reps):
        kv_ops.scatter(obj, caches, layout, slots)
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    st.sort_stats("tottime").print_stats(a.top)
    st.sort_stats("cumulative").print_stats(a.top)


if __name__ == "__main__":
    main()
