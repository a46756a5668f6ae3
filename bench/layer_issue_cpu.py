"""Host time of a direct layer load's host part, in process, hot and with cold caches.

    .venv/bin/python bench/layer_issue_cpu.py [--reps 200] [--cold MB]

What ``DevicePipeline._issue_layers_direct`` computes on the host before its upload and graph
launch (``kv_ops.layer_paths``), with the same functions, and the objects before it, made and
checked (``load_layers``' ``_objects``) two ways: one tensor an object (every view made, then each
object's token count and address read once) and ``PoolObjects`` (checked together, none made; what
the pin makes since the forty-seventh pass). Then the slot
mapping's checks, ``direct_kernel.direct_host_slots`` (skipped rows, the segments left
unread) and ``direct_kernel.direct_table_host`` into a reused buffer (the pipeline's scratch).
Objects of 32 layers (2 KV heads of 64, fp16, 256-token chunks) over one buffer, each a held
turn's: the first chunk placed from token 128, the last ending inside its chunk, segment sums of
16 tokens (a verifying load). 1, 8 and 64 chunks.

Why: on the H200 host the same parts took 3-10x their hot time inside a load
(``bench/gpu_connector.py``'s "held overlap issue by part", bench/RESULTS.md, forty-fifth pass:
the thread's CPU time equals the wall time, so cold caches, not waiting). ``--cold MB`` runs
``bench/load_prep_cpu.py``'s turnover between two calls: a proxy on this machine for what to cut.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.load_prep_cpu import _evictor  # noqa: E402
from maru.kv_ops import direct_kernel as dk  # noqa: E402
from maru.kv_ops.geometry import ObjectGeometry  # noqa: E402
from maru.kv_ops.pipeline_inputs import PipelineInputs  # noqa: E402
from maru.kv_ops.pool_objects import PoolObjects  # noqa: E402
from maru.segments import SegmentSums  # noqa: E402

LAYERS, KV, ROW, CHUNK, SEG = 32, 2, 128, 256, 16  # ROW: 2 heads x 64 in one row of a plane


GEOMETRY = ObjectGeometry(LAYERS, KV, ROW, torch.float16)


def case(chunks: int) -> tuple[torch.Tensor, list[tuple[int, int]], torch.Tensor, list[SegmentSums]]:
    """(pool tensor, (byte offset, tokens) of each object, slot mapping, segment sums) of a step
    of ``chunks`` chunks (see the docstring)."""
    per = GEOMETRY.nbytes(CHUNK)
    base = torch.empty((chunks * per) // 2, dtype=torch.float16)
    slots = torch.randperm(chunks * CHUNK * 4)[: chunks * CHUNK].to(torch.int64)
    slots[:128] = -1  # vLLM's own prefix cache holds the first half of the first chunk
    slots[-100:] = -1  # the turn's hit ends inside its last chunk
    segs = [SegmentSums(SEG, tuple(range(1, CHUNK // SEG + 1))) for _ in range(chunks)]
    return base, [(k * per, CHUNK) for k in range(chunks)], slots, segs


class _Inputs(PipelineInputs):
    """The pipeline's argument checks over this bench's geometry (``_objects`` reads these)."""

    num_layers, dtype, geometry = LAYERS, torch.float16, GEOMETRY
    layout = type("Layout", (), {"num_kv": KV, "row_size": ROW})()

    def object_shape(self, tokens: int) -> tuple[int, int, int, int]:
        return (LAYERS, KV, tokens, ROW)


def parts(
    base: torch.Tensor,
    at: list[tuple[int, int]],
    slots: torch.Tensor,
    segs: list[SegmentSums],
    buf: torch.Tensor,
) -> dict:
    """One issue's host part, timed by part as ``_issue_layers_direct`` times it, and the objects
    before it, made and checked: ``tensors``, one view an object (every ``PoolObjects`` view made, what
    the pin made until ``PoolObjects``) then ``load_layers``' checks of each; ``pool``, the
    ``PoolObjects`` the pin makes now, which the checks take as they are."""
    inputs = _Inputs()
    t = time.perf_counter()
    inputs._objects(list(PoolObjects.make(base, GEOMETRY, at)))
    tp = time.perf_counter()
    checked = inputs._objects(PoolObjects.make(base, GEOMETRY, at))
    t0 = time.perf_counter()
    lengths = checked.tokens
    mapping = PipelineInputs._check_slots(slots, checked, 0, lengths)
    host, prefill, _ = dk.direct_host_slots(mapping, lengths, 0, segs)
    t1 = time.perf_counter()
    total = int(mapping.numel())
    width = 1 << max(total - 1, 0).bit_length()  # the graphs' power-of-two bucket
    dk.direct_table_spans(checked.ptrs, lengths, host, ROW, 2, width, out=buf, prefill=prefill)
    t2 = time.perf_counter()
    return {"tensors": tp - t, "pool": t0 - tp, "checks": t1 - t0, "table": t2 - t1}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cold", type=int, default=0, metavar="MB", help="caches turned over before each call")
    a = ap.parse_args()
    evict = _evictor(a.cold) if a.cold else (lambda: None)
    print(
        f"direct layer issue, host part ({'cold caches, ' + str(a.cold) + ' MiB' if a.cold else 'hot'}), median us:"
    )
    print("| chunks | objects: tensors | objects: pool | checks | table | pool + checks + table |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in (1, 8, 64):
        base, at, slots, segs = case(n)
        buf = torch.empty(dk.DIRECT_ROWS * (2 * n * CHUNK + 1), dtype=torch.int64)
        got: dict[str, list[float]] = {"tensors": [], "pool": [], "checks": [], "table": []}
        for i in range(a.reps + 5):
            evict()
            row = parts(base, at, slots, segs, buf)
            if i >= 5:
                for k, v in row.items():
                    got[k].append(v)
        med = {k: statistics.median(v) * 1e6 for k, v in got.items()}
        every = statistics.median(np.add(np.add(got["pool"], got["checks"]), got["table"])) * 1e6
        print(
            f"| {n} | {med['tensors']:.1f} | {med['pool']:.1f} | {med['checks']:.1f} | {med['table']:.1f} "
            f"| {every:.1f} |"
        )


if __name__ == "__main__":
    main()
