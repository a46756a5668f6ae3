"""The direct layer kernel's grid (``direct_kernel.tile_programs``).

Its placements and fused checksums, with a program a tile and with two programs a plane looping over
every tile, are compared against the reference by ``python -m maru.kv_ops.selfcheck`` (interpreter:
``test_kv_ops_triton.py``; CUDA: ``test_kv_ops_gpu.py``).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from maru.kv_ops import direct_kernel  # noqa: E402
from maru.kv_ops.triton_kernels import TuneParams  # noqa: E402

CPU = torch.device("cpu")


def test_a_program_a_tile_or_capped_over_both_planes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TuneParams, "direct_programs", 0)
    assert direct_kernel.tile_programs(3600, 4, 2, CPU) == 900
    assert direct_kernel.tile_programs(3601, 4, 2, CPU) == 901
    assert direct_kernel.tile_programs(3600, 4, 2, CPU, 128) == 64  # 128 over two planes
    assert direct_kernel.tile_programs(3600, 4, 1, CPU, 128) == 128  # MLA: one plane
    assert direct_kernel.tile_programs(10, 4, 2, CPU, 128) == 3  # never more programs than tiles
    assert direct_kernel.tile_programs(3600, 4, 2, CPU, 1) == 1  # at least one a plane
    monkeypatch.setattr(TuneParams, "direct_programs", 132)
    assert direct_kernel.tile_programs(3600, 4, 2, CPU) == 66
    assert direct_kernel.tile_programs(3600, 4, 2, CPU, 0) == 900  # an explicit 0: no cap


def test_one_program_an_sm_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TuneParams, "direct_programs", -1)
    # No SMs to count on the CPU (the interpreter): a program a tile.
    assert direct_kernel.tile_programs(3600, 4, 2, CPU) == 900
    monkeypatch.setitem(direct_kernel._SMS, "gpu-like", 132)  # an H200's 132 SMs
    assert direct_kernel.tile_programs(3600, 4, 2, "gpu-like") == 66
    assert direct_kernel.tile_programs(100, 4, 2, "gpu-like") == 25


def test_the_default_is_one_an_sm_unless_the_environment_says_otherwise() -> None:
    import os
    import subprocess
    import sys

    code = "from maru.kv_ops.triton_kernels import TuneParams as T; print(T.direct_programs)"
    env = {k: v for k, v in os.environ.items() if k != "MARU_DIRECT_PROGRAMS"}
    out = [
        subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, check=True).stdout
        for e in (env, dict(env, MARU_DIRECT_PROGRAMS="0"))
    ]
    assert [o.strip() for o in out] == ["-1", "0"]


def test_a_grid_left_set_by_the_environment_is_reported_as_a_slow_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    from maru.kv_ops.layer_copies import CopiedLayers

    direct_way = SimpleNamespace(_copied_ok=False, copies_oom=None, copied_off=None)
    monkeypatch.setattr(TuneParams, "direct_programs", -1)
    assert direct_kernel.grid_override() is None
    assert CopiedLayers.layer_way(direct_way) == (None, None)  # type: ignore[arg-type]
    for cap, grid in ((0, "a program a token tile"), (64, "at most 64 programs")):
        monkeypatch.setattr(TuneParams, "direct_programs", cap)
        way, why = CopiedLayers.layer_way(direct_way)  # type: ignore[arg-type]
        assert way == f"direct, grid of MARU_DIRECT_PROGRAMS={cap}"
        assert why is not None and grid in why and "Fix: unset MARU_DIRECT_PROGRAMS" in why


# -- the host part of a direct layer load: its slots and its table --------------------------------


def _segs(tokens: int, seg: int, seed: int):  # type: ignore[no-untyped-def]
    from maru.segments import SegmentSums

    g = torch.Generator().manual_seed(seed)
    raws = torch.randint(0, 1 << 62, (-(-tokens // seg),), generator=g).tolist()
    return SegmentSums(seg, tuple(int(r) for r in raws))


@pytest.mark.parametrize("skip", [0, 5, 21])
def test_direct_host_slots_skip_mark_and_never_touch_the_callers_mapping(skip: int) -> None:
    from maru.segments import mark_unread

    lengths = [16, 16, 7]  # two whole chunks and a tail; 4-token segments
    slots = torch.randperm(1000)[: sum(lengths)].to(torch.int64)
    slots[30:] = -1  # the tail's last tokens are not written either
    before = slots.clone()
    segs = [_segs(t, 4, k) for k, t in enumerate(lengths)]
    got, prefill, unread = direct_kernel.direct_host_slots(slots, lengths, skip, segs)
    got = torch.from_numpy(got)
    assert torch.equal(slots, before)  # the caller's mapping is untouched
    # The reference: skip, then mark on a copy.
    want = before.clone()
    want[:skip] = -1
    want_np = want.numpy().copy()
    want_prefill, want_unread = mark_unread(want_np, lengths, segs)
    assert torch.equal(got, torch.from_numpy(want_np))
    assert unread == want_unread and unread >= 4 * (skip // 4)
    if want_prefill is None:
        assert prefill is None
    else:
        assert prefill is not None and (prefill == want_prefill).all()
    # Without segments (a load that does not verify): skipped rows -1, every other row as given.
    plain, none, zero = direct_kernel.direct_host_slots(slots, lengths, skip, None)
    plain = torch.from_numpy(plain)
    assert none is None and zero == 0
    assert (plain[:skip] == -1).all() and torch.equal(plain[skip:], before[skip:])
    assert torch.equal(slots, before)


def test_direct_host_slots_of_a_device_mapping_are_all_unwritten_on_the_host() -> None:
    meta = torch.empty(10, dtype=torch.int64, device="meta")  # not the CPU: the slots come from the device
    got, prefill, unread = direct_kernel.direct_host_slots(meta, [10], 3, [_segs(10, 4, 0)])
    assert (got == -1).all() and got.shape == (10,) and prefill is None and unread == 0


@pytest.mark.parametrize("lengths", [[256, 256, 100], [8, 3], [5], [16, 32, 16], [16, 16, 20], [16, 5, 16]])
def test_direct_table_host_against_a_per_token_reference(lengths: list[int]) -> None:
    """Per chunk addresses where every chunk but a shorter last one has one length, per token
    otherwise; a slot a column, -1 past the tokens; the sums row starts at the prefill."""
    import numpy as np

    row, esize, width = 24, 2, sum(lengths) + 9
    chunks = [(1 << 20 + k, t) for k, t in enumerate(lengths)]
    slots = torch.randperm(5000)[: sum(lengths)].to(torch.int64)
    prefill = np.arange(1, len(lengths) + 1, dtype=np.uint64) << np.uint64(60)
    tab = direct_kernel.direct_table_host(chunks, slots, row, esize, width, prefill=prefill)
    assert tab.shape == (direct_kernel.DIRECT_ROWS, width + 1)
    # The same from the slots as a numpy array (what direct_host_slots gives); entries past the
    # used ones are never written (nor read), hence the zeroed buffers.
    words = direct_kernel.DIRECT_ROWS * (width + 1)
    a, b = torch.zeros(words, dtype=torch.int64), torch.zeros(words, dtype=torch.int64)
    direct_kernel.direct_table_host(chunks, slots, row, esize, width, out=a, prefill=prefill)
    direct_kernel.direct_table_host(chunks, slots.numpy(), row, esize, width, out=b, prefill=prefill)
    assert torch.equal(a, b)
    # The issue path's form (the objects' addresses and token counts as two lists) is the same table.
    c = torch.zeros(words, dtype=torch.int64)
    ptrs = [p for p, _ in chunks]
    direct_kernel.direct_table_spans(
        ptrs, list(lengths), slots.numpy(), row, esize, width, out=c, prefill=prefill
    )
    assert torch.equal(a, c)
    with pytest.raises(ValueError, match="addresses for"):
        direct_kernel.direct_table_spans(ptrs[:-1], list(lengths), slots, row, esize, width)
    n, total = len(lengths), sum(lengths)
    assert torch.equal(tab[2, :total], slots) and (tab[2, total:width] == -1).all()
    assert int(tab[1, width]) == total
    assert [int(v) for v in tab[5, :n]] == [int(v) for v in prefill.view(np.int64)]
    # Where token j's bytes are: the address of row 0 of its object plus its index times a row.
    where = [p + i * row * esize for p, t in chunks for i in range(t)]
    per_chunk = all(t == lengths[0] for t in lengths[:-1]) and lengths[-1] <= lengths[0]
    if per_chunk:
        assert int(tab[0, width]) == lengths[0]
        assert [int(v) for v in tab[0, :n]] == [p for p, _ in chunks]
        assert [int(v) for v in tab[1, :n]] == [t * row for t in lengths]
        first = lengths[0]
        got = [int(tab[0, j // first]) + (j % first) * row * esize for j in range(total)]
    else:
        assert int(tab[0, width]) == 0
        got = [int(v) for v in tab[0, :total]]
        assert [int(v) for v in tab[3, :total]] == [k for k, t in enumerate(lengths) for _ in range(t)]
        assert [int(v) for v in tab[4, :total]] == [i for t in lengths for i in range(t)]
    assert got == where
