"""``GraphedPlacer``'s static buffers, on the CPU: the bookkeeping of ``share_staging`` (the tail
graphs' one chunk-sized staging a slot), which the GPU tests exercise only on a device.

A placer needs CUDA caches to be built; here one is made without ``__init__`` and given just the
fields its buffer methods read, so that the rules are checked where CI runs: every size up to the
shared one is a view at the buffer's start (contiguous, its own shape), those sizes do not count
against ``max_token_counts``, larger sizes get buffers of their own and do, sharing after a buffer
exists is refused, and sharing again is a no-op.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from maru.kv_ops.placer import GraphedPlacer  # noqa: E402

L, KV, ROW = 3, 2, 24


def _placer(max_token_counts: int = 2) -> GraphedPlacer:
    p = GraphedPlacer.__new__(GraphedPlacer)
    p.layout = SimpleNamespace(num_kv=KV, row_size=ROW)  # type: ignore[assignment]
    p.num_layers, p.dtype, p.device = L, torch.bfloat16, torch.device("cpu")
    p.max_token_counts = max_token_counts
    p._slots, p._staging, p._sums = {}, {}, {}
    p._own_sizes, p._shared, p._shared_tokens = 0, None, 0
    return p


def test_shared_sizes_are_views_at_the_start_of_one_buffer_and_cost_no_bucket() -> None:
    p = _placer(max_token_counts=2)
    p.share_staging(64)
    views = {t: p.staging(t) for t in range(4, 65, 4)}  # 16 sizes, more than max_token_counts
    base = views[64].data_ptr()
    for t, v in views.items():
        assert v.shape == (L, KV, t, ROW) and v.is_contiguous() and v.data_ptr() == base
    assert p._own_sizes == 0
    assert p._shared is not None and p._shared.numel() == math.prod((L, KV, 64, ROW))
    # A size above the shared one has a buffer of its own, and counts.
    own = p.staging(128)
    assert own.data_ptr() != base and p._own_sizes == 1
    p.staging(256)
    with pytest.raises(ValueError, match="max_token_counts"):
        p.staging(512)
    assert p.slots(16).shape == (16,) and bool((p.slots(16) == -1).all())  # each size its own slots


def test_sharing_after_a_buffer_exists_is_refused_and_sharing_again_is_a_no_op() -> None:
    p = _placer()
    p.share_staging(64)
    first = p.staging(64)
    p.share_staging(32)  # covered already: nothing changes
    assert p.staging(64).data_ptr() == first.data_ptr() and p._shared_tokens == 64
    q = _placer()
    q.staging(64)
    with pytest.raises(RuntimeError, match="before any staging buffer"):
        q.share_staging(64)


def test_without_sharing_every_size_counts() -> None:
    p = _placer(max_token_counts=2)
    a, b = p.staging(16), p.staging(32)
    assert a.data_ptr() != b.data_ptr() and p._own_sizes == 2
    with pytest.raises(ValueError, match="max_token_counts"):
        p.staging(48)
