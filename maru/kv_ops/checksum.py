"""``maru.checksum`` over tensors: a Triton kernel on the device, numpy on the CPU, bit for bit.

The connector checks the bytes it *placed* (the device staging slot after its copy, the pool
object after a CPU scatter) against the checksum the writer committed, and computes the
checksum of a store from the staging slot it gathered, so no CPU pass over pool bytes is
needed on a GPU. The definition is in ``maru.checksum``: a sum mod 2**64 of a per-word mix
of 64-bit little-endian words and their index, xor the byte length. The sum is
order-independent, so each program of the grid mixes one block of words, reduces it with a
wrapping uint64 sum and adds it into the object's accumulator with an integer atomic (exact:
integer addition commutes). ``xor nbytes`` is applied on the host (``finalize``).

Entry points:

* ``checksum_tensor(t)`` / ``checksums(ts)``: synchronous, any device (the convenience form);
* ``accumulate(t, acc, k)``: queue the kernel on the current stream, adding ``t``'s raw sum into
  ``acc[k]`` (int64, zeroed by the caller); ``accumulate_pieces`` does many objects, or pieces
  of objects, in one launch; ``finalize(raw, nbytes)`` turns raw sums into checksums. This is
  what the pipelines use (no host sync).
* ``mix_words``: the per-word term, for kernels that fuse the checksum into a placement
  (``direct_kernel.direct_scatter_layer``).

Contracts: tensors are contiguous; on the device their first byte is 8-byte aligned (the kernel
reads whole words; every pool object and staging slot is); any byte length (a partial last word
is zero-padded, as in ``maru.checksum``). ``checksums`` of CPU tensors uses numpy
(``maru.checksum``, ~1 GB/s a core); the kernel runs on the CPU only under Triton's interpreter
(the tests of this kernel).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from maru.checksum import K1, K2, K3, MASK64
from maru.checksum import checksum as _np_checksum

BLOCK_WORDS = 2048  # words a program: 16 KiB in flight, one atomic per 16 KiB

try:  # the kernels need triton; the CPU paths do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None  # type: ignore[assignment]

if triton is not None:
    _K1 = tl.constexpr(K1)
    _K2 = tl.constexpr(K2)
    _K3 = tl.constexpr(K3)

    @triton.jit
    def mix_words(w, idx):
        """The per-word term of ``maru.checksum``: ``w`` and ``idx`` are uint64 tensors (wrapping)."""
        x = w + idx * _K1
        x = x * _K2
        x = x ^ (x >> 32)
        x = x * _K3
        x = x ^ (x >> 29)
        return x

    @triton.jit
    def row_terms(
        vals,
        word0,
        r0,
        read,
        ROW: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_R: tl.constexpr,
        ESIZE: tl.constexpr,
    ):
        """Per row of ``vals`` (``[BLOCK_T, BLOCK_R]`` elements of ``ESIZE`` bytes: columns ``r0 ..``
        of rows of ``ROW`` elements, whole 8-byte words, whose first word has index ``word0`` in its
        object), the wrapping sum of the ``maru.checksum`` terms of those words. Rows where ``read``
        is false and columns past ``ROW`` count 0. What a kernel that fuses the checksum into a
        placement (``triton_kernels``) or reads rows for segment sums (``segment_kernels``) adds."""
        EPW: tl.constexpr = 8 // ESIZE  # elements a word
        if ESIZE == 1:
            u = vals.to(tl.uint8, bitcast=True)
        elif ESIZE == 2:
            u = vals.to(tl.uint16, bitcast=True)
        elif ESIZE == 4:
            u = vals.to(tl.uint32, bitcast=True)
        else:
            u = vals.to(tl.uint64, bitcast=True)
        shifts = (tl.arange(0, EPW) * (8 * ESIZE)).to(tl.uint64)
        wcol = tl.arange(0, BLOCK_R // EPW)
        parts = tl.reshape(u.to(tl.uint64), [BLOCK_T, BLOCK_R // EPW, EPW])
        words = tl.sum(parts << shifts[None, None, :], axis=2)  # little-endian: element j at 8*ESIZE*j
        widx = word0[:, None] + (r0 // EPW + wcol)[None, :]
        terms = mix_words(words, widx.to(tl.uint64))
        wm = read[:, None] & ((r0 + wcol * EPW) < ROW)[None, :]
        return tl.sum(tl.where(wm, terms, 0).to(tl.uint64), axis=1)

    @triton.jit
    def _block_sum(src, nbytes, start, first_word, BLOCK: tl.constexpr):
        """Wrapping sum of the mixes of words ``[start, start + BLOCK)`` of the ``nbytes`` at
        ``src``, word j counted as index ``first_word + j`` of its object; a partial last word is
        read byte by byte and zero-padded."""
        full = nbytes // 8
        idx = start + tl.arange(0, BLOCK).to(tl.int64)
        words = tl.load(src.to(tl.pointer_type(tl.int64)) + idx, mask=idx < full, other=0)
        terms = mix_words(words.to(tl.uint64, bitcast=True), (idx + first_word).to(tl.uint64))
        total = tl.sum(tl.where(idx < full, terms, 0).to(tl.uint64), axis=0)
        rem = nbytes - full * 8
        has_tail = (rem > 0) & (full >= start) & (full < start + BLOCK)
        j = tl.arange(0, 8)
        # A block-shaped mask (the interpreter rejects a scalar-and-vector one).
        tail_ptr = src.to(tl.pointer_type(tl.uint8)) + full * 8 + j
        b = tl.load(tail_ptr, mask=j < tl.where(has_tail, rem, 0), other=0)
        tail = tl.sum(b.to(tl.uint64) << (8 * j).to(tl.uint64), axis=0)
        tail_term = mix_words(tail, (full + first_word).to(tl.uint64))
        return total + tl.where(has_tail, tail_term, 0).to(tl.uint64)

    @triton.jit
    def _checksum_kernel(src_ptr, acc_ptr, nbytes, first_word, BLOCK: tl.constexpr):
        start = tl.program_id(0).to(tl.int64) * BLOCK
        s = _block_sum(src_ptr, nbytes, start, first_word, BLOCK)
        tl.atomic_add(acc_ptr, s.to(tl.int64, bitcast=True))

    @triton.jit
    def _checksum_pieces_kernel(tab_ptr, acc_ptr, tab_stride, any_ptr, BLOCK: tl.constexpr):
        # Program (b, k): block b of piece k. Table rows (see ``pieces_table``): address, byte
        # length, index of its first word in its object, accumulator.
        k = tl.program_id(1)
        start = tl.program_id(0).to(tl.int64) * BLOCK
        nbytes = tl.load(tab_ptr + tab_stride + k)
        if start * 8 < nbytes:
            addr = tl.load(tab_ptr + k)
            first_word = tl.load(tab_ptr + 2 * tab_stride + k)
            which = tl.load(tab_ptr + 3 * tab_stride + k)
            src = addr.to(tl.pointer_type(any_ptr.dtype.element_ty))
            s = _block_sum(src, nbytes, start, first_word, BLOCK)
            tl.atomic_add(acc_ptr + which, s.to(tl.int64, bitcast=True))

    from maru.kv_ops.launch import Launcher

    _CHECKSUM = Launcher(_checksum_kernel)
    _CHECKSUM_PIECES = Launcher(_checksum_pieces_kernel)


def finalize(raw: int, nbytes: int) -> int:
    """The checksum from a raw accumulated sum (an int64 or uint64 value) and the byte length."""
    return (int(raw) & MASK64) ^ int(nbytes)


def nbytes_of(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _triton_runs_on(device: torch.device) -> bool:
    if triton is None:
        return False
    from maru.kv_ops.selection import triton_interpreted

    return device.type == "cuda" or (device.type == "cpu" and triton_interpreted())


def _check(t: torch.Tensor, what: str = "tensor") -> None:
    if not t.is_contiguous():
        raise ValueError(f"checksum of a non-contiguous {what} (strides {t.stride()}): pass .contiguous()")
    if t.data_ptr() % 8:
        raise ValueError(
            f"checksum of a {what} at address {t.data_ptr():#x}, not 8-byte aligned: the kernel reads "
            "whole words; pass a tensor at the start of its buffer (pool objects and staging slots are)"
        )


def accumulate(t: torch.Tensor, acc: torch.Tensor, k: int = 0, first_word: int = 0) -> None:
    """Queue, on the current stream, the addition of ``t``'s raw checksum sum into ``acc[k]``.

    ``acc``: int64 on ``t``'s device, zeroed by the caller; one object per entry. The checksum is
    ``finalize(acc[k], nbytes_of(t))`` once the stream reached this point. ``first_word``: ``t``
    is a piece of a larger object starting at that word (its byte offset / 8; the pieces of one
    object, each accumulated into the same entry, sum to the object's). Needs Triton on ``t``'s
    device (CUDA, or the CPU under the interpreter).
    """
    n = nbytes_of(t)
    if n == 0:
        return
    _check(t)
    if not _triton_runs_on(t.device):
        raise ValueError(f"device checksums need triton on {t.device}; use checksums()")
    grid = (triton.cdiv((n + 7) // 8, BLOCK_WORDS),)
    _CHECKSUM.launch(grid, 4, t, acc[k:], n, first_word, BLOCK_WORDS)


def pieces_table(pieces: Sequence[tuple[int, int, int, int]]) -> torch.Tensor:
    """The host ``[4, n]`` int64 table of ``accumulate_pieces``: per piece (address, byte length,
    index of its first word in its object, accumulator entry). Addresses 8-byte aligned."""
    tab = torch.tensor(list(zip(*pieces, strict=True)), dtype=torch.int64).reshape(4, len(pieces))
    if bool((tab[0] % 8).any()):
        raise ValueError("checksum pieces must start at 8-byte aligned addresses")
    return tab


def accumulate_pieces(
    tab: torch.Tensor, acc: torch.Tensor, like: torch.Tensor, max_bytes: int | None = None
) -> None:
    """One launch adding each piece of ``tab`` (``pieces_table``, on ``acc``'s device) into its
    accumulator: objects anywhere the device can address, whole or in pieces (e.g. the layer
    slices of a staging buffer). ``like``: any tensor of that memory (the kernel's pointer type);
    ``max_bytes``: the longest piece (read from ``tab`` when not given: a sync if on a device)."""
    n = tab.shape[1]
    if n == 0:
        return
    if not _triton_runs_on(acc.device):
        raise ValueError(f"device checksums need triton on {acc.device}; use checksums()")
    most = int(tab[1].max()) if max_bytes is None else int(max_bytes)
    if most <= 0:
        return
    grid = (triton.cdiv((most + 7) // 8, BLOCK_WORDS), n)
    _CHECKSUM_PIECES.launch(grid, 4, tab, acc, tab.stride(0), like, BLOCK_WORDS)


def accumulate_many(ts: Sequence[torch.Tensor], acc: torch.Tensor) -> None:
    """``accumulate(ts[k], acc, k)`` for every k, in one launch (a small table is uploaded first)."""
    ts = list(ts)
    if not ts:
        return
    for t in ts:
        _check(t)
    host = pieces_table([(t.data_ptr(), nbytes_of(t), 0, k) for k, t in enumerate(ts)])
    # From pinned memory the upload is asynchronous; torch's host allocator keeps the block until
    # the copy ran.
    tab = host.pin_memory().to(acc.device, non_blocking=True) if acc.device.type == "cuda" else host
    accumulate_pieces(tab, acc, ts[0], max(nbytes_of(t) for t in ts))


def warm(like: torch.Tensor) -> None:
    """Compile (or load from Triton's disk cache) the checksum kernels a transfer of objects like
    ``like`` launches, now: on a fresh host the first compile took ~0.6 s, on the forward thread of
    the first store that checksums, when it was left to first use (``bench/first_use.py``).

    The specialisations a transfer meets: the whole-object kernel into an accumulator entry at a
    16-byte aligned address and at an 8-byte one (``acc[k:]`` for even and odd ``k``), and the
    pieces kernel over tables of 1, 2 and 16 pieces (Triton specialises the table's stride on
    being 1 and dividing by 16). Queued on the current stream; only ``like`` is read. No-op where
    the kernels do not run (no Triton on ``like``'s device).
    """
    if not _triton_runs_on(like.device) or nbytes_of(like) == 0:
        return
    acc = torch.zeros(16, dtype=torch.int64, device=like.device)
    accumulate(like, acc, 0)
    accumulate(like, acc, 1)
    for pieces in (1, 2, 16):
        accumulate_many([like] * pieces, acc)


def checksum_tensor(t: torch.Tensor) -> int:
    """``maru.checksum`` of ``t``'s bytes (synchronous): Triton on a device, numpy on the CPU."""
    return checksums([t])[0]


def checksums(ts: Sequence[torch.Tensor]) -> list[int]:
    """``maru.checksum`` of each tensor's bytes (synchronous; the tensors on one device).

    CPU: numpy (``maru.checksum``); CUDA: the kernel; another device: ``torch_checksum``.
    """
    ts = list(ts)
    if not ts:
        return []
    dev = ts[0].device
    if dev.type == "cpu":
        return [_np_checksum(_bytes_view(t).numpy()) for t in ts]
    if not _triton_runs_on(dev):
        return [torch_checksum(t) for t in ts]
    return kernel_checksums(ts)


def kernel_checksums(ts: Sequence[torch.Tensor]) -> list[int]:
    """``checksums`` through the Triton kernel, one launch per tensor (the CPU too, under the
    interpreter: how the tests check the kernel)."""
    ts = list(ts)
    acc = torch.zeros(len(ts), dtype=torch.int64, device=ts[0].device)
    for k, t in enumerate(ts):
        accumulate(t, acc, k)
    raw = acc.cpu().tolist()
    return [finalize(r, nbytes_of(t)) for r, t in zip(raw, ts, strict=True)]


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"checksum of a non-contiguous tensor (strides {t.stride()}): pass .contiguous()")
    return t.reshape(-1).view(torch.uint8)


_I64 = 1 << 63


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= _I64 else v


def torch_checksum(t: torch.Tensor) -> int:
    """``maru.checksum`` with plain torch int64 ops, on any device (no Triton needed).

    int64 multiply and add wrap like uint64; right shifts are made logical with a mask. Several
    elementwise passes: for devices without Triton, not a hot path.
    """
    b = _bytes_view(t)
    n = b.numel()
    if n % 8:
        b = torch.cat([b, torch.zeros(8 - n % 8, dtype=torch.uint8, device=b.device)])
    if b.numel() == 0:
        return n
    w = b.view(torch.int64)
    idx = torch.arange(w.numel(), dtype=torch.int64, device=w.device)
    x = w + idx * _signed(K1)
    x = x * _signed(K2)
    x = x ^ ((x >> 32) & 0xFFFFFFFF)
    x = x * _signed(K3)
    x = x ^ ((x >> 29) & ((1 << 35) - 1))
    return finalize(int(x.sum()), n)


class HostSums:
    """Pinned host buffers for the raw sums transfers copy back from the device, reused.

    A fresh pinned tensor costs a ``cudaHostAlloc`` (~35 us on the H200 host) whenever torch's
    caching host allocator still sees the last one alive, which it is while the last transfer's
    handle is (bench/RESULTS.md, the layer-load timeline). Ownership, the invariant that makes reuse
    safe: a buffer belongs to one transfer from ``take`` until that transfer's handle read it
    after completing (``Transfer.checksums`` gives it back then); a handle dropped unread keeps
    its buffer to the garbage collector. So no device-to-host copy still in flight can write into
    a buffer that was handed out again. Thread-safe (``take`` and ``give_back`` are deque ops).
    """

    MIN_CAPACITY = 64  # objects: a step's chunks fit one buffer, whatever the request count

    def __init__(self, keep: int = 8, pin: bool = True) -> None:
        self._free: deque[torch.Tensor] = deque()
        self._keep = keep
        self._pin = pin  # False only in tests without CUDA (the ownership rules are the same)

    def take(self, n: int) -> torch.Tensor:
        """A pinned int64 tensor of ``n`` entries (a view of a reused buffer); contents undefined."""
        try:
            base = self._free.pop()
        except IndexError:
            base = None
        if base is None or base.numel() < n:
            cap = max(self.MIN_CAPACITY, 1 << max(int(n) - 1, 0).bit_length())
            base = torch.empty(cap, dtype=torch.int64, pin_memory=self._pin)
        return base[:n]

    def give_back(self, sums: torch.Tensor) -> None:
        """Return the buffer under ``sums`` (from ``take``); only once no copy writes into it."""
        base = sums._base if sums._base is not None else sums
        if len(self._free) < self._keep:
            self._free.append(base)


def to_host(acc: torch.Tensor | None, pool: HostSums | None = None) -> torch.Tensor | None:
    """Queue the copy of device sums into a pinned host tensor (from ``pool``: see ``HostSums``,
    else a new one) on the current stream."""
    if acc is None:
        return None
    n = acc.numel()
    host = pool.take(n) if pool is not None else torch.empty(n, dtype=torch.int64, pin_memory=True)
    host.copy_(acc.view(-1), non_blocking=True)
    return host


def attach_host_checksums(
    handle: Any,
    objs: Sequence[torch.Tensor],
    wanted: bool,
    slots: torch.Tensor | None = None,
    segments: Sequence[Any] | None = None,
    segment_tokens: int | None = None,
) -> Any:
    """Give a transfer that completed on the host (``kv_ops.Transfer``) the checksums of its host
    objects (``set_checksums``), when ``wanted``; returns the handle.

    A load given ``segments`` (committed ``SegmentSums`` per object) and its ``slots`` (one per
    token of every object, negative = not written) reads only the segments it placed
    (``maru.segments.host_checksum``). A store given ``segment_tokens`` also attaches each object's
    segment sums (``set_segments``), from the same single read of its bytes.
    """
    if not wanted:
        return handle
    sizes = [nbytes_of(o) for o in objs]
    sums = [host_segment_sums(o, segment_tokens) for o in objs] if segment_tokens else []
    if sums and None not in sums:
        most = max(len(s.raws) for s in sums)
        flat = [r for s in sums for r in (*s.raws, *([0] * (most - len(s.raws))))]
        handle.set_segments(segment_tokens, most, [o.shape[2] for o in objs], flat)
        cs = [s.checksum(n) for s, n in zip(sums, sizes, strict=True)]
    elif segments is not None and slots is not None:
        written = slots.numpy() >= 0
        cs, start = [], 0
        for o, segs in zip(objs, segments, strict=True):
            c, unread = placed_checksum(o, written[start : start + o.shape[2]], segs)
            cs.append(c)
            handle.unread_bytes += unread
            start += o.shape[2]
    else:
        cs = checksums(objs)
    # finalize(raw, n) == raw ^ n: each checksum is stored as the raw sum that yields it.
    handle.set_checksums([c ^ n for c, n in zip(cs, sizes, strict=True)], sizes)
    return handle


def host_segment_sums(obj: torch.Tensor, seg_tokens: int) -> Any:
    """``maru.segments.host_segment_sums`` of a host chunk object ``[L, KV, T, ROW]``; None where its
    rows are not whole 8-byte words (no segment sums for such a layout)."""
    from maru import segments as sg

    if (obj.shape[-1] * obj.element_size()) % 8:
        return None
    return sg.host_segment_sums(_bytes_view(obj).numpy(), obj.shape, obj.element_size(), seg_tokens)


def placed_checksum(obj: torch.Tensor, written: Any, segs: Any) -> tuple[int, int]:
    """(checksum, bytes left unread) a verifying load of the host object ``obj`` vouches with, given
    which of its tokens it wrote and its committed segment sums (``maru.segments.host_checksum``)."""
    from maru import segments as sg

    return sg.host_checksum(_bytes_view(obj).numpy(), obj.shape, obj.element_size(), written, segs)
