"""``HostScratch``: pinned host buffers that a load's small uploads (slot mappings, the direct
layer table) are written into and copied from, reused in turn.

Why: each load uploads a few KB to a few hundred KB of int64 the host computed. A fresh pinned
tensor per load costs torch's caching host allocator a lookup and an event query (~30-70 us on the
H200 host, the profile in bench/RESULTS.md), a pageable one makes the copy synchronous. A ring of
buffers the pipeline owns costs a numpy write and one raw ``cudaMemcpyAsync``.

Invariant: a buffer is never written while an upload queued from it may still read it. Each
``take`` hands out the next buffer of the ring only after the event recorded by its previous
``uploaded`` completed (normally long ago: the ring is ``size`` loads deep, and a load's uploads
are the first thing its stream runs). Needs the raw CUDA calls (``cuda_sync.RawSync``); issue is
serialized by the pipeline's lock, so the ring needs no lock of its own.
"""

from __future__ import annotations

from typing import Any

import torch


class HostScratch:
    """A ring of ``size`` pinned int64 buffers, each grown on demand (never shrunk)."""

    MIN_WORDS = 4096  # 32 KB: a 2048-token slot mapping, or a small direct table, without regrowth

    def __init__(self, sync: Any, size: int = 8, pin: bool = True) -> None:
        """``sync``: a ``cuda_sync.RawSync`` (event, record_on, query, synchronize); ``pin``: False
        only in tests without CUDA (the reuse rules are the same)."""
        self._sync = sync
        self._pin = pin
        self._bufs: list[torch.Tensor | None] = [None] * size
        self._events: list[int | None] = [None] * size
        self._pending: list[bool] = [False] * size
        self._next = 0

    def take(self, words: int) -> tuple[int, torch.Tensor]:
        """(ticket, a pinned int64 tensor of ``words`` entries, contents undefined). Give the ticket
        to ``uploaded`` once the copies that read the buffer are queued."""
        k = self._next
        self._next = (k + 1) % len(self._bufs)
        if self._pending[k]:
            ev = self._events[k]
            if not self._sync.query(ev):
                self._sync.synchronize(ev)  # a ring lap within one upload's flight: rare
            self._pending[k] = False
        buf = self._bufs[k]
        if buf is None or buf.numel() < words:
            buf = torch.empty(max(int(words), self.MIN_WORDS), dtype=torch.int64, pin_memory=self._pin)
            self._bufs[k] = buf
        return k, buf[:words]

    def take_slots(self, slot_mapping: torch.Tensor, skip_tokens: int = 0) -> tuple[int, torch.Tensor]:
        """``take`` a buffer and write a host slot mapping into it as int64, its first
        ``skip_tokens`` set to -1 (a negative slot is never written: skipping is masking)."""
        ticket, buf = self.take(int(slot_mapping.numel()))
        rows = buf.numpy()
        rows[:] = (
            slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.to(torch.int64)
        ).numpy()
        if skip_tokens:
            rows[:skip_tokens] = -1
        return ticket, buf

    def uploaded(self, ticket: int, stream: int) -> None:
        """Every copy from buffer ``ticket`` is queued on raw ``stream``: mark it busy until then."""
        ev = self._events[ticket]
        if ev is None:
            ev = self._events[ticket] = self._sync.event()
        self._sync.record_on(ev, stream)
        self._pending[ticket] = True
