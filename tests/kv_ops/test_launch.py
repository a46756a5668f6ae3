"""``maru.kv_ops.launch.Launcher``: direct launches of compiled Triton kernels, on a model of Triton.

No GPU here, so Triton is modelled: a fake ``@triton.jit`` function that specialises the way
Triton does (pointer dtype and 16-byte alignment; integer width, divisibility by 16 and equality
to 1; bool apart from int; constexpr values; num_warps; the current device), compiles one fake
kernel per specialisation and records every launch. The property checked on random calls: every
call, direct or through Triton, ran exactly once, on the kernel Triton would pick, with the
call's grid and arguments unchanged. The GPU tests (tests/kv_ops/test_kv_ops_gpu.py and the rest)
run the real kernels through the launcher against the reference.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest
import torch

from maru import announce
from maru.kv_ops import launch
from maru.kv_ops.launch import Launcher


class _Param:
    def __init__(self, constexpr: bool) -> None:
        self.is_constexpr = constexpr


def _triton_spec(a: Any) -> Any:
    """What Triton specialises one non-constexpr argument on (the model)."""
    if isinstance(a, bool):
        return "i1"
    if isinstance(a, int):
        width = "i32" if -(2**31) <= a < 2**31 else "i64"
        return (width, a == 1, a % 16 == 0)
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    return type(a).__name__


class _Compiled:
    def __init__(self, spec: tuple, log: list) -> None:
        self.spec = spec
        self.function = object()
        self.packed_metadata = ("meta", spec)
        self._log = log

    def run(self, g0, g1, g2, stream, function, packed, meta, enter, leave, *args) -> None:  # noqa: ANN001
        assert function is self.function and packed == self.packed_metadata
        self._log.append(("direct", self, (g0, g1, g2), stream, args))

    def launch_metadata(self, grid, stream, *args) -> None:  # noqa: ANN001
        return None


class _FakeJit:
    """Three runtime arguments (tensor, int, int) and one constexpr, like the placement kernels."""

    params = [_Param(False), _Param(False), _Param(False), _Param(True)]

    def __init__(self, device: list[int], stream: list[int]) -> None:
        self.kernels: dict[tuple, _Compiled] = {}
        self.log: list = []
        self._device, self._stream = device, stream

    def pick(self, args: tuple, num_warps: int) -> _Compiled:
        spec = (self._device[0], num_warps, *map(_triton_spec, args[:3]), (type(args[3]), args[3]))
        if spec not in self.kernels:
            self.kernels[spec] = _Compiled(spec, self.log)
        return self.kernels[spec]

    def __getitem__(self, grid):  # noqa: ANN001
        def call(*args: Any, num_warps: int) -> _Compiled:
            kernel = self.pick(args, num_warps)
            g = tuple(grid) + (1,) * (3 - len(grid))
            self.log.append(("triton", kernel, g, self._stream[0], args))
            return kernel

        return call


@pytest.fixture
def fake() -> tuple[_FakeJit, Launcher, list[int], list[int]]:
    device, stream = [0], [7]
    fn = _FakeJit(device, stream)
    launcher = Launcher(fn, device_hooks=(lambda: device[0], lambda d: stream[0] + 100 * d))
    assert launcher.unavailable is None
    return fn, launcher, device, stream


def test_every_call_runs_once_on_the_kernel_triton_would_pick(fake, monkeypatch) -> None:  # noqa: ANN001
    fn, launcher, device, stream = fake
    monkeypatch.setattr(launch, "MAX_KERNELS", 100_000)  # the random keys here outnumber a real kernel's
    rng = random.Random(0)
    buf = torch.zeros(64, dtype=torch.int64)
    tensors = [buf, buf[1:], buf[2:], buf.view(torch.int16), buf.view(torch.int16)[3:], buf.view(torch.int32)]
    ints = [0, 1, 2, 15, 16, 17, 32, 48, 2**31 - 16, 2**31, 2**31 + 16, 2**40, -16, -1, True, False]
    few = [1, 16, 17, 2**31 + 16, True]
    for i in range(4000):
        device[0] = rng.choice([0, 1])
        stream[0] = rng.choice([7, 8])
        # The first half covers every kind of value; the second repeats few, so most launch directly.
        pool = ints if i < 2000 else few
        args = (rng.choice(tensors[:3]), rng.choice(pool), rng.choice(few), rng.choice([1, 32, True]))
        grid = rng.choice([(3,), (2, 5), (1, 2, 3)])
        warps = rng.choice([4, 8])
        before = len(fn.log)
        launcher.launch(grid, warps, *args)
        assert len(fn.log) == before + 1, "one launch per call"
        how, kernel, g, s, passed = fn.log[-1]
        assert kernel is fn.pick(args, warps), f"{how} launch ran another specialisation's kernel"
        assert g == tuple(grid) + (1,) * (3 - len(grid))
        assert passed == args and all(a is b for a, b in zip(passed, args, strict=True))
        if how == "direct":
            assert s == stream[0] + 100 * device[0], "launched on the current device's current stream"
    assert launcher.direct_calls > 2000, launcher.stats()
    assert launcher.triton_calls == len(fn.log) - launcher.direct_calls


def test_an_argument_of_another_kind_takes_tritons_path(fake) -> None:  # noqa: ANN001
    fn, launcher, _, _ = fake
    t = torch.zeros(4, dtype=torch.int64)
    launcher.launch((1,), 4, t, 3, 5, 16)
    launcher.launch((1,), 4, t, 3, 5, 16)
    assert [e[0] for e in fn.log] == ["triton", "direct"]
    for swapped in ((3, t, 5, 16), (t, t, 5, 16)):  # an int where the tensor was; a tensor where an int was
        assert launcher.key(0, 4, swapped) is None
        launcher.launch((1,), 4, *swapped)
        assert fn.log[-1][0] == "triton" and fn.log[-1][1] is fn.pick(swapped, 4)
    assert len(launcher._kernels) == 1  # nothing kept under a key of the wrong kinds


def test_a_kernel_without_the_direct_entry_is_announced_and_served_by_triton(fake, caplog) -> None:  # noqa: ANN001
    fn, launcher, _, _ = fake
    announce.forget("kv_ops.launch:_FakeJit")
    real_pick = fn.pick

    def bare(args: tuple, num_warps: int) -> Any:
        kernel = real_pick(args, num_warps)
        kernel.packed_metadata = None
        del kernel.packed_metadata  # what an older Triton's compiled kernel lacks
        return kernel

    fn.pick = bare  # type: ignore[method-assign]
    t = torch.zeros(4, dtype=torch.int64)
    with caplog.at_level(logging.WARNING, logger="maru.kv_ops"):
        for _ in range(3):
            launcher.launch((1,), 4, t, 3, 5, 16)
    assert [e[0] for e in fn.log] == ["triton"] * 3
    assert launcher.unavailable and "packed_metadata" in launcher.unavailable
    slow = [r for r in caplog.records if "SLOWER PATH" in r.getMessage()]
    assert len(slow) == 1 and "_FakeJit" in slow[0].getMessage()


def test_a_refused_first_direct_launch_runs_the_call_once_through_triton(fake, caplog) -> None:  # noqa: ANN001
    fn, launcher, _, _ = fake
    announce.forget("kv_ops.launch:_FakeJit")
    t = torch.zeros(4, dtype=torch.int64)
    launcher.launch((1,), 4, t, 3, 5, 16)
    kernel = fn.log[-1][1]

    def refuse(*a: Any) -> None:
        raise TypeError("function takes exactly 9 arguments (13 given)")

    kernel.run = refuse
    with caplog.at_level(logging.WARNING, logger="maru.kv_ops"):
        launcher.launch((1,), 4, t, 3, 5, 16)
    assert [e[0] for e in fn.log] == ["triton", "triton"]
    assert launcher.direct_calls == 0 and "refused" in (launcher.unavailable or "")
    assert any("SLOWER PATH" in r.getMessage() for r in caplog.records)


def test_key_tells_apart_what_triton_specialises_on() -> None:
    key = launch.key_function("tiic")
    buf = torch.zeros(8, dtype=torch.int64)
    base = key(0, 4, buf, 16, 5, 1)
    for other in [
        key(1, 4, buf, 16, 5, 1),  # device
        key(0, 8, buf, 16, 5, 1),  # num_warps
        key(0, 4, buf[1:], 16, 5, 1),  # address alignment
        key(0, 4, buf.view(torch.int32), 16, 5, 1),  # pointer type
        key(0, 4, buf, 17, 5, 1),  # divisibility
        key(0, 4, buf, 2**35, 5, 1),  # width (2**35 divides by 16 too)
        key(0, 4, buf, 16, 1, 1),  # equal to 1
        key(0, 4, buf, 16, True, 1),  # bool, not int
        key(0, 4, buf, 16, 5, 2),  # constexpr
        key(0, 4, buf, 16, 5, True),  # constexpr True, not 1
    ]:
        assert other != base
    assert key(0, 4, buf, 32, 21, 1) == base  # same facts, same kernel


def test_the_kernels_are_launched_through_launchers() -> None:
    pytest.importorskip("triton")
    from maru.kv_ops import checksum, direct_kernel, triton_kernels

    for lau in (triton_kernels._PLACE, direct_kernel._DIRECT, checksum._CHECKSUM, checksum._CHECKSUM_PIECES):
        assert isinstance(lau, Launcher)
        assert lau._constexpr is not None and any(lau._constexpr), lau.name


class _CudaLike:
    """What the launcher reads of a CUDA tensor (no GPU here): its address, dtype and device kind."""

    is_cuda = True

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def test_a_cuda_tensor_is_launched_directly_as_its_address(fake) -> None:  # noqa: ANN001
    fn, launcher, _, _ = fake
    a, b = _CudaLike(0x7F0000001000, torch.int16), _CudaLike(0x7F0000002000, torch.int16)
    host = torch.zeros(4, dtype=torch.int16)
    launcher.launch((1,), 4, a, 3, 5, 16)
    launcher.launch((1,), 4, b, 3, 5, 16)
    launcher.launch((1,), 4, host, 3, 5, 16)
    launcher.launch((1,), 4, host, 3, 5, 16)
    (how0, k0, _, _, args0), (how1, k1, _, _, args1), (_, _, _, _, _), (how3, _, _, _, args3) = fn.log
    assert (how0, how1) == ("triton", "direct") and k1 is k0  # same facts: one kernel
    assert args0[0] is a, "Triton's own call gets the tensor"
    assert args1 == (0x7F0000002000, 3, 5, 16) and type(args1[0]) is int, "the direct launch, its address"
    assert how3 == "direct" and args3[0] is host, "a host tensor is passed as it is (Triton translates it)"


def test_triton_compiles_for_the_view_and_the_key_tells_dtypes_apart() -> None:
    device, stream = [0], [7]
    fn = _FakeJit(device, stream)
    views: list[Any] = []

    def as_ints(t: Any) -> Any:
        views.append(t)
        return t.view(torch.int16) if t.dtype == torch.bfloat16 else t

    launcher = Launcher(fn, device_hooks=(lambda: 0, lambda d: 7), triton_view=as_ints)
    buf = torch.zeros(8, dtype=torch.bfloat16)
    launcher.launch((1,), 4, buf, 3, 5, 16)
    launcher.launch((1,), 4, buf, 3, 5, 16)
    launcher.launch((1,), 4, buf.view(torch.int16), 3, 5, 16)
    hows = [e[0] for e in fn.log]
    assert hows == ["triton", "direct", "triton"]  # an int16 tensor is another key, though the same kernel
    assert fn.log[0][4][0].dtype == torch.int16, "Triton's call sees the integer view"
    assert fn.log[1][4][0] is buf, "the direct launch passes the tensor (a host one) as given"
    assert fn.log[2][1] is fn.log[0][1], "both keys run the kernel compiled for int16"
    assert len(views) == 2, "views only on Triton's path"


class _Chain:
    """Triton's HookChain as the launcher sees it: ``calls``, never None."""

    def __init__(self) -> None:
        self.calls: list[Any] = []

    def __call__(self, *a: Any) -> None:
        for c in self.calls:
            c(*a)


def test_empty_hook_chains_launch_without_metadata_and_a_profilers_hook_gets_it(fake, monkeypatch) -> None:  # noqa: ANN001
    fn, launcher, _, _ = fake

    class Runtime:
        launch_enter_hook = _Chain()
        launch_exit_hook = _Chain()

    monkeypatch.setattr(launch, "_RUNTIME", [Runtime])
    metas: list[Any] = []
    t = torch.zeros(4, dtype=torch.int64)
    launcher.launch((1,), 4, t, 3, 5, 16)
    kernel = fn.log[-1][1]
    kernel.launch_metadata = lambda grid, stream, *args: metas.append(args) or "meta"
    runs: list[tuple] = []
    real_run = kernel.run
    kernel.run = lambda *a: (runs.append(a[6:9]), real_run(*a))
    launcher.launch((1,), 4, t, 3, 5, 16)
    assert runs[-1] == (None, None, None) and not metas, "empty chains: no metadata, no hooks passed"
    Runtime.launch_enter_hook.calls.append(lambda *a: None)  # a profiler attaches
    launcher.launch((1,), 4, t, 3, 5, 16)
    meta, enter, leave = runs[-1]
    assert meta == "meta" and enter is Runtime.launch_enter_hook and leave is None and len(metas) == 1
    assert [e[0] for e in fn.log] == ["triton", "direct", "direct"]
