"""The direct layer load's host side: its slot plan and the table its kernel reads.

``direct_host_slots`` plans which rows a load reads (the skipped tokens, the segments left unread,
``maru.segments``); ``direct_table_spans`` writes the ``[DIRECT_ROWS, W + 1]`` int64 table that
``direct_kernel.direct_scatter_layer`` reads (addresses, plane strides, slots, checksum starts).

The table is built by one compiled call (``maru.native``'s ``maru_direct_table``) where it passed
its check against ``_table_numpy`` (the definition, about ten numpy operations) at first use in the
process. Both run on the layer load's issue path, between vLLM's step and the load's first byte on
the bus, where every Python or numpy operation costs several times its hot time (cold caches; the
held 256-token load's table took 89 us on an H100 host, bench/RESULTS.md, fifty-first pass).
Where the compiled table is missing or refused, numpy builds the same table: said once in the log
with the reason and the fix, and in ``maru doctor`` (``table_way``).
"""

from __future__ import annotations

import array
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from maru.announce import announce_once
from maru.segments import mark_unread

log = logging.getLogger("maru.kv_ops")

DIRECT_ROWS = 6  # source address, plane stride, slot, object (per token), token in object, checksum sums
DIRECT_SUMS_ROW = 5  # where the checksum variant adds each object's terms
_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)


def direct_host_slots(
    slot_mapping: torch.Tensor,
    lengths: list[int],
    skip_tokens: int = 0,
    segments: list[Any] | None = None,
) -> tuple[np.ndarray, np.ndarray | None, int]:
    """The host slots ``direct_table_host`` takes, for a direct layer load of objects of
    ``lengths`` tokens: (int64 slots as a numpy array, per object the raw sum its checksum starts
    at or None, tokens left unread). The first ``skip_tokens`` are -1 (not written); with
    ``segments`` (a verifying load: each object's committed segment sums or None), the rows of
    segments that place nothing are -2, left unread and counted at their committed sums
    (``maru.segments``: the bus carries only what is placed, and its checksum vouches for it). A
    device slot mapping gives all -1: the slots then come from the device, and every row is read.
    Never changes the caller's tensor. In numpy: a torch op costs several times a numpy one on the
    issue path, more with cold caches (bench/layer_issue_cpu.py)."""
    total = int(slot_mapping.numel())
    if slot_mapping.device.type != "cpu":
        return np.full(total, -1, dtype=np.int64), None, 0
    given = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
    host = given.numpy()
    if not skip_tokens and segments is None:
        return host, None, 0  # read only from here on (direct_table_host copies it)
    host = host.copy()
    if skip_tokens:
        host[:skip_tokens] = -1
    if segments is None:
        return host, None, 0
    prefill, unread = mark_unread(host, lengths, segments)
    return host, prefill, unread


def direct_table_host(
    chunks: list[tuple[int, int]],
    slots: torch.Tensor | np.ndarray,
    row: int,
    esize: int,
    width: int | None = None,
    out: torch.Tensor | None = None,
    prefill: np.ndarray | None = None,
) -> torch.Tensor:
    """``direct_table_spans`` of ``chunks``: (address of the object's first byte, tokens) per chunk
    object ``[L, KV, T, ROW]``, in order."""
    return direct_table_spans(
        [p for p, _ in chunks], [t for _, t in chunks], slots, row, esize, width, out, prefill
    )


def direct_table_spans(
    ptrs: Sequence[int],
    lengths: Sequence[int],
    slots: torch.Tensor | np.ndarray,
    row: int,
    esize: int,
    width: int | None = None,
    out: torch.Tensor | None = None,
    prefill: np.ndarray | None = None,
) -> torch.Tensor:
    """The ``[DIRECT_ROWS, width + 1]`` int64 table ``direct_scatter_layer`` reads, built on the host.

    ``ptrs[i]``, ``lengths[i]``: the address of chunk object i's first byte and its tokens (objects
    ``[L, KV, T, ROW]``, in order); ``slots``: one slot per token of all chunks (CPU, int64, a tensor
    or a numpy array; negative = not written). Columns
    past the tokens (``width`` > tokens) get slot -1. When every chunk but the last has the same
    length C and the last at most C (the connector's usual step: whole chunks, one tail), the
    addresses are per chunk (n entries, whatever the token count); otherwise per token. Pinned when
    CUDA is available, so the upload is asynchronous. ``out``: a flat int64 host tensor of at least
    ``DIRECT_ROWS * (width + 1)`` entries to build it in (``HostScratch``), instead of a new one.
    ``prefill``: per object, the raw sum its checksum accumulator starts at (uint64: the committed
    sums of the segments whose rows are marked -2, left unread); zeros when not given.
    """
    fn = _state[0] if _state is not None else _compiled()
    if fn is None:
        return _table_numpy(ptrs, lengths, slots, row, esize, width, out, prefill)
    host = slots if type(slots) is np.ndarray else slots.numpy()
    n = len(lengths)
    # Identity, not ==: a dtype comparison costs ~1 us; numpy's builtin dtypes are one object each,
    # and anything else (another byte order, a strided view) takes the numpy way, which copes.
    if (
        host.dtype is not _I64
        or not host.flags.c_contiguous
        or (
            prefill is not None
            and (len(prefill) != n or (prefill.dtype is not _U64 and prefill.dtype is not _I64))
        )
    ):
        return _table_numpy(ptrs, lengths, slots, row, esize, width, out, prefill)  # the rare shapes
    total = int(host.size)
    width = total if width is None else int(width)
    if len(ptrs) != n:
        raise ValueError(f"{len(ptrs)} object addresses for {n} token counts")
    if out is not None:
        if out.dtype != torch.int64 or out.device.type != "cpu" or not out.is_contiguous():
            raise ValueError(
                f"the table's buffer must be contiguous int64 on the host, got {out.dtype} on {out.device}"
            )
        tab = out[: DIRECT_ROWS * (width + 1)].view(DIRECT_ROWS, width + 1)  # too short: raises
    else:
        tab = torch.empty((DIRECT_ROWS, width + 1), dtype=torch.int64, pin_memory=torch.cuda.is_available())
    if prefill is not None and not prefill.flags.c_contiguous:
        prefill = np.ascontiguousarray(prefill)
    p, c = array.array("q", ptrs), array.array("q", lengths)
    rc = fn(
        tab.data_ptr(), width, host.ctypes.data, total, p.buffer_info()[0], c.buffer_info()[0], n,
        int(row), int(esize), 0 if prefill is None else prefill.ctypes.data,
    )  # fmt: skip
    if rc == -1:
        raise ValueError(f"table width {width} < {total} tokens")
    if rc == -2:
        if any(t < 0 for t in lengths):
            raise ValueError(f"negative object lengths in {list(lengths)}")
        raise ValueError(f"the chunks hold {sum(lengths)} tokens, the slot mapping {total}")
    return tab


# The compiled table, once checked: (the function or None, why not, the fix). Decided at the first table.
_state: tuple[Any, str, str] | None = None
_state_lock = threading.Lock()


def _compiled() -> Any:
    global _state
    if _state is None:
        with _state_lock:
            if _state is None:
                _state = _load_compiled()
                if _state[0] is None:
                    announce_once(
                        log,
                        "kv_ops.direct-table-numpy",
                        logging.WARNING,
                        "maru.kv_ops: %s",
                        table_note(),
                    )
    return _state[0]


def _load_compiled() -> tuple[Any, str, str]:
    from maru import native

    nat = native.load()
    fn = nat.direct_table
    if fn is None:
        return None, nat.reason or "the compiled library has no table", nat.fix
    problem = self_check(fn)
    if problem is not None:
        why = f"the compiled table {nat.library} disagrees with its definition ({problem})"
        return (
            None,
            why,
            "none needed (numpy builds the same table); please report it with `maru doctor`'s output",
        )
    return fn, "", ""


def table_way() -> str:
    """How the direct layer load's table is built in this process: "compiled", or "numpy (<why>)"
    (decided once a process, at the first table or here)."""
    _compiled()
    assert _state is not None
    return "compiled" if _state[0] is not None else f"numpy ({_state[1]})"


def table_note() -> str | None:
    """The slower way said with its reason and fix (``maru doctor``, the log once); None when compiled."""
    if _state is None or _state[0] is not None:
        return None
    return (
        "the direct layer load's table is built with numpy (about ten array operations a load, "
        f"~50-100 us more of host time a load on a serving host) because {_state[1]}. Fix: {_state[2]}"
    )


def self_check(fn: Any) -> str | None:
    """None if ``fn`` writes ``_table_numpy``'s table, byte for byte, on random cases: uniform and
    per-token layouts, a last object shorter or longer, empty objects, padding columns, with and
    without checksum starts; else the first case that differed. Both write over the same garbage,
    so a row one writes and the other leaves differs too."""
    rng = np.random.default_rng(0x7461626C)
    cases = [[8], [8, 8, 5], [8, 8, 8], [5, 8], [3, 0, 7], [], [256] * 64 + [100], [1] * 9]
    for k, lengths in enumerate(cases):
        n, total = len(lengths), sum(lengths)
        width = total + int(rng.integers(0, 5))
        slots = rng.integers(-2, 1 << 20, total).astype(np.int64)
        ptrs = [int(x) for x in rng.integers(1 << 30, 1 << 46, n)]
        for prefill in (None, rng.integers(0, 1 << 63, n, dtype=np.uint64)):
            garbage = rng.integers(-(1 << 62), 1 << 62, DIRECT_ROWS * (width + 1))
            want = torch.from_numpy(garbage.copy())
            got = torch.from_numpy(garbage.copy())
            _table_numpy(ptrs, lengths, slots, 40, 2, width, out=want, prefill=prefill)
            p, c = array.array("q", ptrs), array.array("q", lengths)
            rc = fn(
                got.data_ptr(), width, slots.ctypes.data, total, p.buffer_info()[0], c.buffer_info()[0],
                n, 40, 2, 0 if prefill is None else prefill.ctypes.data,
            )  # fmt: skip
            if rc != 0 or not torch.equal(got, want):
                where = f"returned {rc}" if rc else "wrote another table"
                return (
                    f"case {k} (object lengths {lengths[:4]}{'...' if n > 4 else ''}, width {width}): {where}"
                )
        if n and fn(0, total - 1, 0, total, 0, 0, 0, 40, 2, 0) != -1:  # checked before anything is written
            return f"case {k}: a width below the tokens was not refused"
    return None


def _table_numpy(
    ptrs: Sequence[int],
    lengths: Sequence[int],
    slots: torch.Tensor | np.ndarray,
    row: int,
    esize: int,
    width: int | None = None,
    out: torch.Tensor | None = None,
    prefill: np.ndarray | None = None,
) -> torch.Tensor:
    """``direct_table_spans`` in numpy: the definition the compiled table is checked against."""
    slots = slots if isinstance(slots, np.ndarray) else slots.numpy()
    total = int(slots.size)
    width = total if width is None else int(width)
    if width < total:
        raise ValueError(f"table width {width} < {total} tokens")
    n = len(lengths)
    if len(ptrs) != n:
        raise ValueError(f"{len(ptrs)} object addresses for {n} token counts")
    if sum(lengths) != total:
        raise ValueError(f"the chunks hold {sum(lengths)} tokens, the slot mapping {total}")
    if out is not None:
        tab = out[: DIRECT_ROWS * (width + 1)].view(DIRECT_ROWS, width + 1)
    else:
        tab = torch.empty((DIRECT_ROWS, width + 1), dtype=torch.int64, pin_memory=torch.cuda.is_available())
    # numpy over the same memory: this runs on the layer load's issue path, and a numpy op costs a
    # fraction of torch's per-op overhead.
    out = tab.numpy()
    counts = np.asarray(lengths, dtype=np.int64)
    first = int(counts[0]) if n else 0
    if first > 0 and counts[-1] <= first and bool((counts[:-1] == first).all()):
        out[0, :n] = ptrs
        out[1, :n] = counts * row
        out[0, width] = first
    else:
        starts = np.cumsum(counts) - counts
        within = np.arange(total, dtype=np.int64) - np.repeat(starts, counts)
        out[0, :total] = np.repeat(np.asarray(ptrs, dtype=np.int64), counts) + within * (row * esize)
        out[1, :total] = np.repeat(counts * row, counts)
        out[3, :total] = np.repeat(np.arange(n, dtype=np.int64), counts)
        out[4, :total] = within
        out[0, width] = 0
    # Rows 0, 1, 3 and 4 past the used entries are never read (tokens past the count): not cleared.
    out[1, width] = total
    out[2, :total] = slots
    out[2, total:] = -1
    # The checksum accumulators, set by the upload itself.
    out[5, :n] = 0 if prefill is None else np.asarray(prefill, dtype=np.uint64).view(np.int64)
    return tab
