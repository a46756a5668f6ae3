"""``StoreSegments._warm_segments`` where the kernel cannot be compiled: said once, and the engine
build goes on (the first store then compiles it). The kernel call is replaced by one that fails
(no GPU here); on a GPU, ``test_segments_gpu`` checks that the warm-up compiles what a store runs.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from maru import announce
from maru.kv_ops import checksum as ck
from maru.kv_ops import segment_kernels as sk
from maru.kv_ops.store_segments import StoreSegments


def _pipeline_part() -> StoreSegments:
    part = StoreSegments()
    part.caches = []
    part.layout = SimpleNamespace(num_slots=64, block_size=16)  # type: ignore[assignment]
    part.device = torch.device("cpu")
    part.esize = 2
    return part


def test_a_segment_warm_up_that_fails_is_said_once_and_raises_nothing(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Any] = []

    def refuse(caches: Any, layout: Any, lengths: list[int], slots: Any, seg: int, device: Any) -> None:
        calls.append((lengths, slots.tolist()[:3], len(slots), seg))
        raise RuntimeError("no kernel for you")

    monkeypatch.setattr(ck, "_triton_runs_on", lambda device: True)
    monkeypatch.setattr(sk, "supported", lambda layout, esize: True)
    monkeypatch.setattr(sk, "queue_cache_segments", refuse)
    announce.forget("kv_ops.segments-warm")
    part = _pipeline_part()
    with caplog.at_level(logging.WARNING, logger="maru.kv_ops"):
        part._warm_segments(256)
        part._warm_segments(256)
    # One launch a warm-up, of a whole chunk at valid slots (wrapped into the cache's 64).
    assert calls == [([256], [0, 1, 2], 256, 16)] * 2
    said = [r.getMessage() for r in caplog.records if "segment-sum kernel" in r.getMessage()]
    assert len(said) == 1 and "RuntimeError: no kernel for you" in said[0]
    assert "the first store compiles it" in said[0]
    assert part.segments_unwarmed is not None and said[0].endswith(part.segments_unwarmed)  # doctor


def test_no_warm_up_where_the_kernel_does_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ck, "_triton_runs_on", lambda device: False)
    monkeypatch.setattr(sk, "queue_cache_segments", lambda *a: pytest.fail("launched off the GPU"))
    part = _pipeline_part()
    part._warm_segments(256)
    assert part.segments_unwarmed is None
