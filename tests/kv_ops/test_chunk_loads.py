"""The chunk load's checksum way (``maru.kv_ops.chunk_loads``) as a user sees it, without a GPU.

The fused way itself (a scatter that sums what it reads) is compared byte for byte and sum for sum
by ``python -m maru.kv_ops.selfcheck`` (interpreter: ``test_kv_ops_triton.py``; CUDA:
``test_fused_checksum_gpu.py``). Here: the switch, what ``maru doctor`` and the stats are told,
and the kernel's refusal of what it cannot sum.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from maru.kv_ops import chunk_loads, detect_layouts, triton_kernels  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402
from maru.kv_ops.ops import layer_refs  # noqa: E402
from maru.kv_ops.testing import bits, make_cache  # noqa: E402


def _case(head_size: int = 8, dtype: torch.dtype = torch.bfloat16) -> tuple:
    case = make_cache("kv_first", "NHD", num_blocks=6, block_size=4, num_kv_heads=3, head_size=head_size,
                      num_layers=2, dtype=dtype)  # fmt: skip
    return case, detect_layouts(case.caches, **case.detect_kwargs())


def test_the_switch_is_the_environment_unless_the_pipeline_is_told(monkeypatch: pytest.MonkeyPatch) -> None:
    case, layout = _case()
    monkeypatch.delenv(chunk_loads.FUSED_ENV, raising=False)  # the default: fused
    assert chunk_loads.fused_checksums_wanted() is True
    assert pl.DevicePipeline(case.caches, layout).fuse_checksums is True
    monkeypatch.setenv(chunk_loads.FUSED_ENV, "0")
    assert chunk_loads.fused_checksums_wanted() is False
    assert pl.DevicePipeline(case.caches, layout).fuse_checksums is False
    assert pl.DevicePipeline(case.caches, layout, fuse_checksums=True).fuse_checksums is True
    monkeypatch.setenv(chunk_loads.FUSED_ENV, "maybe")  # not a switch value: the default (said)
    assert chunk_loads.fused_checksums_wanted() is True


def test_cpu_caches_check_on_the_host() -> None:
    case, layout = _case()
    assert pl.DevicePipeline(case.caches, layout, fuse_checksums=True).load_checksum_way() == ("host", None)


def _gpu_like(**kw: object) -> SimpleNamespace:
    placer = SimpleNamespace(fused_checksum=True, layout=SimpleNamespace(row_size=24))
    base = dict(on_gpu=True, fuse_checksums=True, _ring=[SimpleNamespace(placer=placer)],
                _sync=SimpleNamespace(raw=True), graphs=True, fused_checksums=5)  # fmt: skip
    base.update(kw)
    return SimpleNamespace(**base)


def test_the_way_and_why_not_fused_are_said(monkeypatch: pytest.MonkeyPatch) -> None:
    way = chunk_loads.ChunkLoads.load_checksum_way
    monkeypatch.delenv(chunk_loads.FUSED_ENV, raising=False)
    assert way(_gpu_like()) == ("fused (5 objects)", None)
    # Told so by its builder (a bench's A/B): nothing for a user to fix.
    assert way(_gpu_like(fuse_checksums=False)) == ("separate kernel", None)
    # Turned off by the user: a slower way, said with its fix.
    monkeypatch.setenv(chunk_loads.FUSED_ENV, "off")
    name, why = way(_gpu_like(fuse_checksums=False))
    assert name == "separate kernel" and f"{chunk_loads.FUSED_ENV}=0" in why and "Fix: unset" in why
    monkeypatch.delenv(chunk_loads.FUSED_ENV)
    name, why = way(_gpu_like(graphs=False))
    assert name == "separate kernel" and "the default" in why and "CUDA graphs" in why
    name, why = way(_gpu_like(_sync=SimpleNamespace(raw=False)))
    assert name == "separate kernel" and "libcudart" in why
    odd = SimpleNamespace(fused_checksum=False, layout=SimpleNamespace(row_size=3))
    name, why = way(_gpu_like(_ring=[SimpleNamespace(placer=odd)]))
    assert name == "separate kernel" and "64-bit words" in why and "3 elements" in why


def test_the_rule_for_fusing_is_whole_words_per_row() -> None:
    _, layout = _case(head_size=8)  # 3 heads x 8 = 24 elements
    assert triton_kernels.fused_checksum_ok(layout, 2)  # 48 bytes
    assert triton_kernels.fused_checksum_ok(layout, 1)  # 24 bytes
    _, odd = _case(head_size=5)  # 15 elements
    assert not triton_kernels.fused_checksum_ok(odd, 2)  # 30 bytes: not whole words
    assert not triton_kernels.fused_checksum_ok(layout, 3)


@pytest.mark.parametrize("what", ["gather", "strided", "odd rows"])
def test_place_refuses_a_checksum_it_cannot_compute(what: str) -> None:
    """Refused before anything is launched, with the reason (the caches stay as they were)."""
    case, layout = _case(head_size=5 if what == "odd rows" else 8)
    refs = layer_refs(case.caches, layout)
    obj = torch.zeros((2, layout.num_kv, 6, layout.row_size), dtype=torch.bfloat16)
    if what == "strided":
        obj = torch.zeros((2, layout.num_kv, 12, layout.row_size), dtype=torch.bfloat16)[:, :, ::2]
    before = [s.clone() for s in case.storages()]
    acc = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="fused checksum needs a scatter of a contiguous object"):
        triton_kernels.place(
            refs, layout, torch.arange(6), triton_kernels.as_bits(obj), gather=what == "gather",
            checksum_into=acc,
        )  # fmt: skip
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(before, case.storages(), strict=True))
    assert int(acc[0]) == 0


_FUSED_TILES = r"""
import torch
from maru.checksum import checksum
from maru.kv_ops import detect_layouts, scatter, triton_kernels as tk
from maru.kv_ops.checksum import finalize
from maru.kv_ops.ops import layer_refs
from maru.kv_ops.testing import bits, make_cache, random_bits_, random_slots
# Tiny tiles: a program a token and several column steps a row, so the sum is many programs'
# atomics over many row pieces (the selfcheck runs the default tiles).
tk.TuneParams.block_t, tk.TuneParams.max_block_r = 1, 8
g = torch.Generator().manual_seed(5)
n = 0
for fmt, physical, dtype in (("kv_first", "HND", torch.bfloat16), ("blocks_first", "NHD", torch.uint8),
                             ("cross_layer", "HND", torch.float32)):
    def make(seed):
        gen = torch.Generator().manual_seed(seed)
        return make_cache(fmt, physical, num_blocks=5, block_size=4, num_kv_heads=3, head_size=8,
                          num_layers=2, dtype=dtype, generator=gen)
    case = make(1)
    layout = detect_layouts(case.caches, **case.detect_kwargs())
    for tokens in (1, 11):
        slots = torch.tensor(random_slots(layout.num_slots, tokens, negatives=min(3, tokens - 1), generator=g))
        obj = random_bits_(torch.empty((2, layout.num_kv, tokens, layout.row_size), dtype=dtype), g)
        want = make(2)
        scatter(obj, want.caches, layout, slots, backend="reference")
        got = make(2)
        acc = torch.zeros(1, dtype=torch.int64)
        tk.place(layer_refs(got.caches, layout), layout, slots, tk.as_bits(obj), gather=False, checksum_into=acc)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(want.storages(), got.storages())), (fmt, tokens)
        total = finalize(int(acc[0]), obj.numel() * obj.element_size())
        assert total == checksum(obj.reshape(-1).view(torch.uint8).numpy()), (fmt, tokens)
        n += 2
print(f"fused place: {n} comparisons matched")
"""


def test_the_fused_scatter_sums_over_many_programs_and_column_steps_under_the_interpreter() -> None:
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _FUSED_TILES], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "fused place: 12 comparisons matched" in proc.stdout


def test_a_refused_fused_kernel_turns_the_fused_way_off_says_why_and_queues_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Triton's compiler has refused fused variants of other kernels on some layouts: the placer's
    capture raising turns its fused way off (the load then sums with the separate kernel), warns
    once with the reason, clears CUDA's error, and ``load_checksum_way`` names it."""
    import logging

    from maru.announce import forget
    from maru.kv_ops.placer import GraphedPlacer

    replays: list[tuple] = []
    cleared: list[int] = []
    fake = SimpleNamespace(
        fused_checksum=True, fused_refused=None, _graphs={}, layout=SimpleNamespace(row_size=24),
        _launcher=SimpleNamespace(clear_error=lambda: cleared.append(1)),
        _replay=lambda key: replays.append(key),
    )  # fmt: skip

    def refuse(key: tuple) -> None:
        raise RuntimeError("PassManager::run failed")

    fake._graph = refuse
    fake._capture_fused = lambda key: GraphedPlacer._capture_fused(fake, key)
    forget("kv_ops.fused-refused")
    with caplog.at_level(logging.WARNING, logger="maru.kv_ops"):
        assert GraphedPlacer.scatter_checksum(fake, 256) is False
        assert GraphedPlacer.scatter_checksum(fake, 256) is False  # off now: not tried again
    assert replays == [] and cleared == [1]
    assert fake.fused_checksum is False and "PassManager" in fake.fused_refused
    warned = [r.getMessage() for r in caplog.records if "fused load checksum" in r.getMessage()]
    assert len(warned) == 1 and "PassManager" in warned[0]
    name, why = chunk_loads.ChunkLoads.load_checksum_way(_gpu_like(_ring=[SimpleNamespace(placer=fake)]))
    assert name == "separate kernel" and "refused" in why and "PassManager" in why
    # A captured size replays without a new capture.
    ok = SimpleNamespace(fused_checksum=True, _graphs={("scatter+checksum", 64, None): object()},
                         _replay=lambda key: replays.append(key))  # fmt: skip
    assert GraphedPlacer.scatter_checksum(ok, 64) is True and replays == [("scatter+checksum", 64, None)]
