"""The copied layer way's plan (``kv_ops.layer_copies.CopyPlan``), replayed byte by byte on the CPU.

The GPU runs the plan with ``cudaMemcpyBatchAsync`` (tests/kv_ops/test_device_pipeline_gpu.py and
test_segments_gpu.py check it there); here every copy of every layer is applied to one byte array
that holds the host objects and the staging ring, and each row the kernel reads must then sit in
its layer's slot, at its object's region, exactly as in the object's own layer layout.
"""

from __future__ import annotations

import numpy as np
import pytest

from maru.kv_ops.layer_copies import CopiedLayers, CopyPlan

L = 5


def _replay(lengths: list[int], read: np.ndarray, kv: int, row_b: int, ring: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    lengths_a = np.array(lengths, dtype=np.int64)
    obj_bytes = L * kv * lengths_a * row_b
    gaps = rng.integers(0, 3, len(lengths)) * 64  # objects need not be adjacent in the pool
    ptrs = np.cumsum(obj_bytes + gaps) - obj_bytes
    host_end = int(ptrs[-1] + obj_bytes[-1])
    plan = CopyPlan.of(lengths_a, read, ptrs, kv, row_b)
    assert plan.slot_bytes == int((kv * lengths_a * row_b).sum())
    base = host_end + 128
    mem = np.zeros(base + ring * plan.slot_stride, dtype=np.uint8)
    mem[:host_end] = rng.integers(0, 256, host_end, dtype=np.uint8)
    srcs, dsts, sizes = plan.layers(L, base, ring)
    starts = np.cumsum(lengths_a) - lengths_a
    for i in range(L):
        slot = base + (i % ring) * plan.slot_stride
        mem[slot : slot + plan.slot_bytes] = 0xEE  # what the slot held before: an earlier layer
        for d, s, n in zip(srcs[i].tolist(), dsts[i].tolist(), sizes.tolist(), strict=True):
            assert slot <= s and s + n <= slot + plan.slot_bytes, "a copy lands outside its slot"
            assert d + n <= host_end, "a copy reads past the objects"
            mem[s : s + n] = mem[d : d + n]
        for k, t in enumerate(lengths):
            obj = mem[ptrs[k] : ptrs[k] + obj_bytes[k]].reshape(L, kv, t, row_b)
            region = mem[slot + plan.offset[k] : slot + plan.offset[k] + kv * t * row_b].reshape(kv, t, row_b)
            rows = read[starts[k] : starts[k] + t]
            assert np.array_equal(region[:, rows], obj[i][:, rows]), f"layer {i} object {k}"
    # Nothing copied that no read row needs: each object's copies span its first to last read row.
    for k, t in enumerate(lengths):
        rows = np.flatnonzero(read[starts[k] : starts[k] + t])
        span = 0 if rows.size == 0 else int(rows[-1] - rows[0] + 1)
        mine = (plan.dst0 >= plan.offset[k]) & (plan.dst0 < plan.offset[k] + kv * t * row_b)
        assert int(plan.sizes[mine].sum()) == kv * span * row_b


@pytest.mark.parametrize("kv", [1, 2])
@pytest.mark.parametrize("ring", [2, 4])
def test_a_plan_puts_every_read_row_of_every_layer_where_the_kernel_reads_it(kv: int, ring: int) -> None:
    lengths = [16, 16, 16, 5]
    read = np.ones(sum(lengths), dtype=bool)
    read[:7] = False  # a skipped prefix (vLLM's own hit)
    read[16:32] = False  # an object nobody reads
    read[32 + 3 : 32 + 9] = False  # a gap inside an object: its span is still copied
    _replay(lengths, read, kv, 24, ring, seed=kv * 10 + ring)


@pytest.mark.parametrize("seed", range(6))
def test_random_lengths_and_reads(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    lengths = rng.integers(1, 40, rng.integers(1, 7)).tolist()
    read = rng.random(sum(lengths)) < rng.choice([0.3, 0.8, 1.0])
    _replay(
        lengths, read, int(rng.integers(1, 3)), 8 * int(rng.integers(1, 5)), int(rng.integers(2, 5)), seed
    )


def test_whole_objects_are_one_copy_a_layer_and_partial_ones_one_a_plane() -> None:
    lengths = np.array([8, 8, 8])
    read = np.ones(24, dtype=bool)
    read[8:11] = False
    plan = CopyPlan.of(lengths, read, np.array([0, 4096, 8192]), 2, 16)
    assert plan.sizes.tolist() == [2 * 8 * 16, 2 * 8 * 16, 5 * 16, 5 * 16]
    srcs, dsts, _ = plan.layers(3, 1 << 20, 2)
    assert (srcs[1] - srcs[0]).tolist() == [2 * 8 * 16] * 4  # the next layer of each object
    assert (dsts[2] == dsts[0]).all() and (dsts[1] - dsts[0] == plan.slot_stride).all()
    assert plan.slot_stride % plan.SLOT_ALIGN == 0 and plan.slot_stride >= plan.slot_bytes


def test_layer_way_reports_what_copied_got_and_every_fallback_with_its_fix() -> None:
    """What the worker reports (``paths.layer_way`` and a slow path: ``maru stats``/``maru doctor``)."""
    way = CopiedLayers()
    assert way.layer_way() == (None, None)  # not asked for: the direct way, nothing to say
    way._copied_ok, way.copied_off = False, "the CUDA runtime is 12.4; batched copies need 12.8"
    name, why = way.layer_way()
    assert name.startswith("direct") and "12.4" in why and "Fix:" in why
    way._copied_ok, way.copied_off = True, None
    assert way.layer_way() == ("copy engines", None)
    way._copies_failed(MemoryError("CUDA out of memory. Tried to allocate 1.00 GiB"))
    name, why = way.layer_way()
    assert name == "copy engines" and "out of memory" in why and "Fix:" in why
