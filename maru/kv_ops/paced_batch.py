"""The device state a paced store's chunk graphs read and advance (``kv_ops.paced_store``).

A paced store queues, per chunk, one graph and one copy to the pool page: two libcudart calls.
The graph (``GraphedPlacer``'s ``("paced-chunk", T, None)``) cannot take the chunk's place in the
store as an argument (a graph's arguments are baked in), so it reads it from device memory kept
here and advances it:

* ``slots``: the whole store's slot mapping, copied in once a store (``start``);
* ``state = [cursor, k]``: the token the next chunk's slots start at, and that chunk's index;
* ``acc``: the store's raw checksum sums, entry ``k`` for chunk ``k``.

A chunk graph for T tokens: its slots fetched from ``slots[cursor : cursor + T]`` into the
placer's static slot mapping, the gather into the staging buffer, the raw sum of the staged bytes,
that sum written to ``acc[k]``, then ``cursor += T``, ``k += 1``. Without this state each chunk
would also need its slot mapping's copy and its sum's copy, libcudart copies at ~6.7 us of host
time each on the H100 host, the most expensive calls a chunk made (bench/RESULTS.md,
fifty-seventh pass).

Invariants:

* Everything here is written and read on the paced lane's one stream, in stream order: a store's
  ``start`` (its slots in, ``state`` and its sums zeroed) follows the previous store's last read
  of them (its sums' copy to the host).
* A store must fit (``fits``); one that does not goes the torch way, announced.
* The graphs' warm-up launch (at capture) really runs and advances ``state``: captures happen
  before a store's ``start`` is queued, with the lane's stream current, so that launch follows
  the stores already queued there (``PacedStores._queue_store``), never runs inside one.
"""

from __future__ import annotations

from typing import Any

import torch

from maru.kv_ops.cuda_sync import D2D

MAX_TOKENS = 1 << 20  # 8 MiB of slots: a store of 4096 chunks of 256 tokens
MAX_CHUNKS = 4096  # 32 KiB of sums


class PacedBatch:
    """The paced lane's store state on the device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.slots = torch.zeros(MAX_TOKENS, dtype=torch.int64, device=device)
        # One buffer: ``start`` zeroes the state and the store's sums with one memset.
        self.words = torch.zeros(2 + MAX_CHUNKS, dtype=torch.int64, device=device)
        self.state = self.words[:2]
        self.acc = self.words[2:]
        # Per chunk size, static buffers the graphs read: 0..T-1, their slot indices, [T, 1].
        self._ar: dict[int, torch.Tensor] = {}
        self._idx: dict[int, torch.Tensor] = {}
        self._step: dict[int, torch.Tensor] = {}
        # The pause between two pieces of a chunk's copy: a graph of one tiny kernel (``tick``),
        # its raw ``cudaGraphExec_t`` set by the placer that captured it (0: none, copies go whole).
        self.pause = 0
        self._ticks = torch.zeros(1, dtype=torch.int64, device=device)

    @staticmethod
    def fits(tokens: int, chunks: int) -> bool:
        return tokens <= MAX_TOKENS and chunks <= MAX_CHUNKS

    def start(self, sync: Any, slots: torch.Tensor, chunks: int, stream: int) -> torch.Tensor:
        """Queue a store's start on raw ``stream``: its slot mapping (contiguous int64 on the
        device) copied in, ``state`` and its ``chunks`` sums zeroed. Returns its sums, ``acc[:chunks]``."""
        sync.copy(self.slots.data_ptr(), slots.data_ptr(), 8 * slots.numel(), stream, D2D)
        sync.zero(self.words.data_ptr(), 8 * (2 + chunks), stream)
        return self.acc[:chunks]

    def _sized(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if num_tokens not in self._ar:  # the warm-up launch (outside the capture) makes them
            self._ar[num_tokens] = torch.arange(num_tokens, dtype=torch.int64, device=self.device)
            self._idx[num_tokens] = torch.empty(num_tokens, dtype=torch.int64, device=self.device)
            # [T, 1] made on the device: ``torch.tensor`` of host values would wait for the stream.
            step = torch.ones(2, dtype=torch.int64, device=self.device)
            step[:1].fill_(num_tokens)
            self._step[num_tokens] = step
        return self._ar[num_tokens], self._idx[num_tokens], self._step[num_tokens]

    def fetch(self, out: torch.Tensor) -> None:
        """Queue (on the current stream) ``out[:] = slots[cursor : cursor + len(out)]``."""
        ar, idx, _ = self._sized(out.numel())
        torch.add(ar, self.state[0], out=idx)
        torch.index_select(self.slots, 0, idx, out=out)

    def append(self, raw_sum: torch.Tensor, num_tokens: int) -> None:
        """Queue ``acc[k] = raw_sum[0]``, then the step past a chunk of ``num_tokens`` tokens."""
        self.acc.index_copy_(0, self.state[1:2], raw_sum)
        self.advance(num_tokens)

    def tick(self) -> None:
        """Queue one tiny kernel that touches only this lane's tick counter (the pause graph's body:
        a kernel as the stream's next item between two copies lets the copy engine serve others)."""
        self._ticks.add_(1)

    def advance(self, num_tokens: int) -> None:
        """Queue ``cursor += num_tokens``, ``k += 1`` (a chunk queued another way, in its turn)."""
        self.state.add_(self._sized(num_tokens)[2])
