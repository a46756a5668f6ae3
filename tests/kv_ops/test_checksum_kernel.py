"""``kv_ops.checksum`` computes exactly ``maru.checksum``: the Triton kernel (under the interpreter
on CPU tensors, in a fresh subprocess since TRITON_INTERPRET must be set before triton is imported),
the torch fallback and the numpy path, on random bytes of many lengths (partial last words
included), whole objects, pieces of one object and many objects per launch. The fused checksum of
the direct layer kernel is compared in ``maru.kv_ops.selfcheck`` (``test_kv_ops_triton.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from maru.checksum import checksum
from maru.kv_ops import checksum as ck

pytest.importorskip("triton")

SIZES = [0, 1, 7, 8, 9, 15, 64, 1000, 8 * ck.BLOCK_WORDS - 1, 8 * ck.BLOCK_WORDS, 8 * ck.BLOCK_WORDS * 3 + 5]

_INTERPRETED = r"""
import torch
from maru.checksum import checksum
from maru.kv_ops import checksum as ck
g = torch.Generator().manual_seed(11)
sizes = [int(x) for x in __import__("sys").argv[1].split(",")]
n = 0
for size in sizes:
    t = torch.randint(0, 256, (size + 8,), dtype=torch.uint8, generator=g)[:size]
    assert ck.kernel_checksums([t]) == [checksum(t.numpy())], ("whole", size)
    n += 1
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    x = torch.randn(3, 2, 5, 12, generator=g).to(dtype)
    assert ck.kernel_checksums([x]) == [checksum(x.view(-1).view(torch.uint8).numpy())], dtype
    n += 1
ts = [torch.randint(0, 256, (s,), dtype=torch.uint8, generator=g) for s in sizes]
acc = torch.zeros(len(ts), dtype=torch.int64)
ck.accumulate_many(ts, acc)
got = [ck.finalize(a, t.numel()) for a, t in zip(acc.tolist(), ts)]
assert got == [checksum(t.numpy()) for t in ts], "many"
n += 1
obj = torch.randint(0, 256, (8 * 9000 + 3,), dtype=torch.uint8, generator=g)
for cuts in ([0, 8, 8 * 4000, obj.numel()], [0, obj.numel() - 3, obj.numel()]):
    acc = torch.zeros(1, dtype=torch.int64)
    for a, b in zip(cuts, cuts[1:]):
        ck.accumulate(obj[a:b], acc, 0, a // 8)
    assert ck.finalize(acc[0], obj.numel()) == checksum(obj.numpy()), cuts
    n += 1
bad = obj.clone(); bad[8 * 4000 + 1] ^= 1
assert ck.kernel_checksums([bad]) != ck.kernel_checksums([obj])
print(f"checksum kernel: {n} comparisons matched")
"""


def test_the_triton_kernel_matches_maru_checksum_bit_for_bit_under_the_interpreter() -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run(
        [sys.executable, "-c", _INTERPRETED, ",".join(map(str, SIZES))],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "comparisons matched" in proc.stdout


@pytest.mark.parametrize("size", SIZES)
def test_torch_and_numpy_checksums_match_maru_checksum(size: int) -> None:
    g = torch.Generator().manual_seed(size)
    t = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
    want = checksum(t.numpy())
    assert ck.torch_checksum(t) == want
    assert ck.checksums([t]) == [want]


def test_checksums_of_a_non_contiguous_tensor_are_refused_with_the_fix() -> None:
    x = torch.zeros(4, 6)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        ck.checksums([x])
