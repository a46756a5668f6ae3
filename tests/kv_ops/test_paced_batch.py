"""The paced lane's store state (``kv_ops.paced_batch``): what a chunk graph's ops do to it.

On CPU tensors, eagerly: the same torch ops a ``("paced-chunk", T, None)`` graph captures around
its gather and sum (``GraphedPlacer._launch``). A store of chunks of random sizes, one of them
queued another way (``advance`` alone): each chunk's slots come from its own stretch of the
store's mapping, each sum lands at its chunk's index, and a second store after ``start`` begins
again from the first token. The GPU tests check the graphs' bytes and sums against a reference.
"""

from __future__ import annotations

import random

import torch

from maru.kv_ops import paced_batch
from maru.kv_ops.paced_batch import PacedBatch


class _Sync:
    """``start``'s two raw calls, done on CPU memory by address."""

    def copy(self, dst: int, src: int, nbytes: int, stream: int, kind: int) -> None:
        n = nbytes // 8
        d = _BY_ADDR[dst]
        s = _BY_ADDR[src]
        d[:n] = s[:n]

    def zero(self, dst: int, nbytes: int, stream: int) -> None:
        _BY_ADDR[dst][: nbytes // 8] = 0


_BY_ADDR: dict[int, torch.Tensor] = {}


def _store(batch: PacedBatch, sizes: list[int], other_way: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    mapping = torch.randint(0, 1 << 30, (sum(sizes),), generator=gen, dtype=torch.int64)
    _BY_ADDR[mapping.data_ptr()] = mapping
    acc = batch.start(_Sync(), mapping, len(sizes), stream=0)
    assert acc.data_ptr() == batch.acc.data_ptr() and acc.numel() == len(sizes)
    assert torch.equal(acc, torch.zeros(len(sizes), dtype=torch.int64))  # the last store's sums gone
    token0, want = 0, []
    for k, t in enumerate(sizes):
        if k == other_way:  # the torch way: its sum added at k by the caller, then the state moved
            acc[k] += 1000 + k
            batch.advance(t)
        else:
            out = torch.full((t,), -1, dtype=torch.int64)
            batch.fetch(out)
            assert torch.equal(out, mapping[token0 : token0 + t])
            batch.append(torch.tensor([1000 + k], dtype=torch.int64), t)
        want.append(1000 + k)
        token0 += t
    assert batch.state.tolist() == [sum(sizes), len(sizes)]
    assert acc.tolist() == want


def test_each_chunk_reads_its_own_slots_and_writes_its_sum_at_its_index() -> None:
    batch = PacedBatch(torch.device("cpu"))
    _BY_ADDR[batch.slots.data_ptr()] = batch.slots
    _BY_ADDR[batch.words.data_ptr()] = batch.words
    rng = random.Random(3)
    for seed in range(6):
        sizes = [rng.choice([16, 48, 144, 256]) for _ in range(rng.randrange(1, 12))]
        _store(batch, sizes, other_way=rng.randrange(-1, len(sizes)), seed=seed)


def test_fits_names_the_limits() -> None:
    assert PacedBatch.fits(paced_batch.MAX_TOKENS, paced_batch.MAX_CHUNKS)
    assert not PacedBatch.fits(paced_batch.MAX_TOKENS + 1, 1)
    assert not PacedBatch.fits(16, paced_batch.MAX_CHUNKS + 1)
