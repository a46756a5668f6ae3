"""Launching a Triton kernel without paying Triton's per-call binding: ``Launcher``.

``kernel[grid](...)`` binds and specialises every argument on every call before it launches. What
Triton specialises a compiled kernel on is known and small:

* a tensor argument: its dtype (the pointer type) and whether its address is 16-byte aligned;
* an integer argument: its width (32 or 64 bit), whether it is 1, whether it divides by 16;
* every constexpr's value, the launch options (``num_warps``), the current device.

``Launcher`` keys compiled kernels by those facts (a superset: a bool is told from an int, an
integer's alignment is kept whole), gets each kernel once through Triton's own ``kernel[grid]``
call (which compiles or picks it, and launches that first call), and launches it directly after
that, with the arguments Triton passes its launcher, but each CUDA tensor as its address (Triton's
launcher would call ``data_ptr()`` and ask the driver to translate it, about 1 us a tensor). Empty
launch hook chains are passed as None (no launch metadata built for nobody). Invariant: two calls
with the same key are calls Triton itself would serve with the same compiled kernel (with
``triton_view``, Triton's call sees each tensor through it: e.g. the integer view of a float
tensor, so one kernel compiled for integers moves the bits of every dtype of that width); a call
whose facts differ in any way takes Triton's path and adds a kernel.

Where the direct launch is not available (Triton's interpreter on the CPU, which the tests use, or
a Triton whose compiled kernels lack the launch entry), every call takes Triton's path; on a GPU
that is announced once as a slower path with the reason.

Measured on an H200 (Triton 3.6, bench/RESULTS.md "Eighth H200 pass"): a public ``kv_ops.scatter``
of 16 tokens costs 17.7-20.0 us of host time (22.9-24.9 before addresses, the hook chains and the
integer views moved off the call); Triton's C launcher alone takes 4.9 us of it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from maru.announce import announce_once

log = logging.getLogger("maru.kv_ops")

MAX_KERNELS = 256  # compiled kernels kept per Triton function; a new key past it starts over
_LAUNCHERS: list[Launcher] = []  # every launcher made (module-level, one per kernel): for the stats

# The key part of one argument, by its kind (fixed per position at the first call). An integer's
# (type, residue mod 16, == 1, value >> 31) tells apart everything Triton does (bool or int, 32 or
# 64 bit, divisible by 16, equal to 1) and more; a tensor's (dtype, address mod 16) likewise; a
# constexpr is its type and value (True is not 1); anything else (a float, None) its type: Triton
# does not specialise those. ``int.__and__`` raises TypeError for anything but an int (a tensor's
# ``&`` would not), and ``.data_ptr`` AttributeError for anything but a tensor: a call whose kinds
# differ from the first call's gets no key.
_FACTS = {
    "c": "type({a}), {a}",
    "t": "{a}.dtype, {p} & 15",
    "i": "type({a}), int.__and__({a}, 15), {a} == 1, {a} >> 31",
    "o": "type({a})",
}


def kinds_of(args: Sequence[Any], constexpr: Sequence[bool]) -> str:
    """One letter per argument: c(onstexpr), t(ensor), i(nteger or bool), o(ther)."""
    out = []
    for a, c in zip(args, constexpr, strict=True):
        if c:
            out.append("c")
        elif isinstance(a, int):
            out.append("i")
        elif hasattr(a, "data_ptr"):
            out.append("t")
        else:
            out.append("o")
    return "".join(out)


def key_function(kinds: str) -> Callable[..., tuple]:
    """``key(device, num_warps, *args)`` for arguments of these kinds (see ``prep_function``)."""
    prep = prep_function(kinds)
    return lambda device, num_warps, *args: prep(device, num_warps, *args)[0]


def prep_function(kinds: str) -> Callable[..., tuple[tuple, tuple]]:
    """``prep(device, num_warps, *args) -> (key, run_args)`` for arguments of these kinds, generated
    once: a call's host budget is a few microseconds, and a loop over the arguments with type tests
    costs several.

    ``run_args`` are the arguments for the compiled kernel's launcher: a CUDA tensor is passed as its
    address (an int), which Triton's launcher takes as the device pointer as it is, where for a
    tensor it calls ``data_ptr()`` and asks the driver to translate the address (about 1 us a
    tensor on an H200 host); every other argument (a host tensor included) is passed unchanged.
    """
    names = [f"a{i}" for i in range(len(kinds))]
    ptrs = {i: f"p{i}" for i, k in enumerate(kinds) if k == "t"}
    body = "".join(f"    p{i} = a{i}.data_ptr()\n" for i in ptrs)
    parts = ", ".join(
        _FACTS[k].format(a=n, p=ptrs.get(i)) for i, (k, n) in enumerate(zip(kinds, names, strict=True))
    )
    run = ", ".join(f"p{i} if a{i}.is_cuda else a{i}" if i in ptrs else n for i, n in enumerate(names))
    src = (
        f"def prep(device, num_warps, {', '.join(names)}):\n{body}"
        f"    return (device, num_warps, {parts}), ({run},)\n"
    )
    scope: dict[str, Any] = {}
    exec(compile(src, f"<maru.kv_ops.launch prep {kinds}>", "exec"), scope)  # noqa: S102 - our own text
    return scope["prep"]


class Launcher:
    """Direct launches of one ``@triton.jit`` function ``fn`` (see the module docstring).

    ``launch(grid, num_warps, *args)`` takes every parameter of ``fn`` positionally, constexprs
    included, in ``fn``'s order. Not thread-safe for the first call of a key (two threads may both
    take Triton's path, which is harmless); later calls only read.
    """

    def __init__(
        self,
        fn: Any,
        *,
        device_hooks: tuple[Callable[[], int], Callable[[int], int]] | None = None,
        triton_view: Callable[[Any], Any] | None = None,
    ):
        self.fn = fn
        self.name = getattr(getattr(fn, "fn", fn), "__name__", repr(fn))
        params = getattr(fn, "params", None)
        self._constexpr: tuple[bool, ...] | None = (
            tuple(bool(p.is_constexpr) for p in params) if params is not None else None
        )
        self._kernels: dict[tuple, Any] = {}
        self._hooks = device_hooks
        self._view = triton_view
        self._prep: Callable[..., tuple[tuple, tuple]] | None = None
        self.direct_calls = 0
        self.triton_calls = 0
        self.unavailable: str | None = None
        from maru.kv_ops.selection import triton_interpreted

        self.interpreted = triton_interpreted()
        if self.interpreted:  # the CPU interpreter (tests): no compiled kernels, nothing to announce
            self.unavailable = "Triton's CPU interpreter (TRITON_INTERPRET=1)"
        _LAUNCHERS.append(self)

    def _device_hooks(self) -> tuple[Callable[[], int], Callable[[int], int]]:
        if self._hooks is None:
            from triton.runtime import driver

            active = driver.active
            self._hooks = (active.get_current_device, active.get_current_stream)
        return self._hooks

    def key(self, device: int, num_warps: int, args: Sequence[Any]) -> tuple | None:
        """The specialisation key of a call, None when an argument's kind differs from the first
        call's (that call takes Triton's path). Public for the tests."""
        prepped = self.prep(device, num_warps, args)
        return None if prepped is None else prepped[0]

    def prep(self, device: int, num_warps: int, args: Sequence[Any]) -> tuple[tuple, tuple] | None:
        """(key, the arguments of a direct launch) of a call (``prep_function``), None when an
        argument's kind differs from the first call's."""
        if self._prep is None:
            flags = self._constexpr
            assert flags is not None
            self._prep = prep_function(kinds_of(args, flags))
        try:
            return self._prep(device, num_warps, *args)
        except (AttributeError, TypeError):  # a tensor where an int was, or the reverse
            return None

    def launch(self, grid: Sequence[int], num_warps: int, *args: Any) -> None:
        if self.unavailable is None and self._constexpr is None:
            self._give_up(f"{self.name} has no parameter list (an unknown Triton)")
        if self.unavailable is not None:
            self._triton(grid, num_warps, args)
            return
        get_device, get_stream = self._device_hooks()
        device = get_device()
        prepped = self.prep(device, num_warps, args)
        kernel = self._kernels.get(prepped[0]) if prepped is not None else None
        if kernel is None:
            self._triton(grid, num_warps, args, keep=None if prepped is None else prepped[0])
            return
        run_args = prepped[1]  # type: ignore[index]
        n = len(grid)
        g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        enter, leave = _launch_hooks()
        stream = get_stream(device)
        hooked = enter is not None or leave is not None
        meta = kernel.launch_metadata(grid, stream, *self._triton_args(args)) if hooked else None
        if self.direct_calls:
            kernel.run(
                g0, g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *run_args
            )
        else:
            # The first direct launch proves the argument convention of this Triton: its launcher
            # parses the arguments before anything is queued, so a refusal launched nothing.
            try:
                kernel.run(
                    g0, g1, g2, stream, kernel.function, kernel.packed_metadata, meta, enter, leave, *run_args
                )
            except TypeError as exc:
                self._give_up(f"its compiled kernel refused Triton's launch arguments ({exc})")
                self._triton(grid, num_warps, args)
                return
        self.direct_calls += 1

    def _triton(
        self, grid: Sequence[int], num_warps: int, args: Sequence[Any], keep: tuple | None = None
    ) -> None:
        """Triton's own call; with ``keep``, the kernel it returns is kept under that key when it can
        be launched directly."""
        self.triton_calls += 1
        kernel = self.fn[grid](*self._triton_args(args), num_warps=num_warps)
        if keep is None or self.unavailable is not None:
            return
        reason = _direct_unavailable(kernel)
        if reason is not None:
            self._give_up(reason)
            return
        if len(self._kernels) >= MAX_KERNELS:
            self._kernels.clear()
        self._kernels[keep] = kernel

    def _triton_args(self, args: Sequence[Any]) -> Sequence[Any]:
        """The arguments as Triton's own call sees them: each tensor through ``triton_view`` (e.g.
        its same-width integer view, so a kernel compiled for integers serves every dtype of that
        width: the key tells the dtypes apart, the direct launch passes only addresses)."""
        view = self._view
        if view is None:
            return args
        return tuple(view(a) if hasattr(a, "data_ptr") else a for a in args)

    def _give_up(self, reason: str) -> None:
        """Every later call takes Triton's path: announced once (a slower path, on a GPU)."""
        self.unavailable = reason
        self._kernels.clear()
        announce_once(
            log,
            f"kv_ops.launch:{self.name}",
            logging.WARNING,
            "maru.kv_ops: SLOWER PATH: %s launches through Triton's per-call argument binding (about "
            "5 us of host time a call more on an H200): %s. Measured working with Triton 3.6 "
            "(the GPU kit's); report this Triton version to Maru",
            self.name,
            reason,
        )

    def stats(self) -> dict[str, Any]:
        return {
            "kernel": self.name,
            "compiled": len(self._kernels),
            "direct_calls": self.direct_calls,
            "triton_calls": self.triton_calls,
            "direct": self.unavailable is None,
            "reason": self.unavailable,
        }


def slower_launches() -> list[str]:
    """One line per kernel that launches through Triton's per-call binding on a GPU, with the reason
    (the interpreter's launchers excluded): what ``maru stats`` and ``maru doctor`` show."""
    return [f"{x.name}: {x.unavailable}" for x in _LAUNCHERS if x.unavailable and not x.interpreted]


_RUNTIME: list[Any] = []


def _launch_hooks() -> tuple[Any, Any]:
    """Triton's launch enter/exit hooks (profilers set them), each None when there is none to call.

    Newer Tritons keep each hook as a ``HookChain`` that is never None, even empty; passed on, its
    launcher would build the launch metadata and call two empty chains on every launch (Triton's
    own call does). An empty chain calls nothing, so None is the same launch without that cost.
    """
    if not _RUNTIME:
        import triton

        _RUNTIME.append(triton.knobs.runtime)
    rt = _RUNTIME[0]
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    # ``calls``: a HookChain's hooks; a plain hook (older Tritons) has no such attribute.
    return (enter if getattr(enter, "calls", True) else None), (
        leave if getattr(leave, "calls", True) else None
    )


def _direct_unavailable(kernel: Any) -> str | None:
    """None when ``kernel`` (what ``fn[grid](...)`` returned) can be launched directly, else why not."""
    import triton

    if getattr(triton, "knobs", None) is None:
        return f"Triton {triton.__version__} has no triton.knobs (launch hooks)"
    missing = [a for a in ("run", "function", "packed_metadata", "launch_metadata") if not hasattr(kernel, a)]
    if kernel is None or missing:
        return f"Triton {triton.__version__}'s launch returned {type(kernel).__name__} without {missing or 'a kernel'}"
    return None
