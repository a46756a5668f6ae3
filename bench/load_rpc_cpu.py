"""What the server round trips cost a small connector-level load, on CPU caches.

A real ``maru server``, a ``KVTransferEngine`` over CPU caches (blocks of 16 tokens, 8 KV heads
of 64, 4 layers, fp16: a 64-token chunk is 256 KiB), one stored request of ``--tokens`` tokens,
then ``--reps`` timed ``engine.load`` calls (lookup-and-pin, placement, unpin). Rounds alternate
between the UNPIN sent without waiting (``batch_release(wait=False)``, what the engine does) and
the UNPIN awaited (the engine before), so load drift on a shared machine hits both alike.

    python bench/load_rpc_cpu.py [--tokens 64] [--reps 400] [--rounds 4]

Prints p50 / mean per mode and the difference (a Markdown table for bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from maru import kv_ops  # noqa: E402
from maru.client import MaruHandler  # noqa: E402
from maru.demo.server import ServerProcess  # noqa: E402
from maru.kv_ops.testing import make_cache  # noqa: E402
from maru.transfer.engine import KVTransferEngine  # noqa: E402
from maru.transfer.records import ChunkRef, RequestTransfer  # noqa: E402

BS, NH, HS, LAYERS, CHUNK = 16, 8, 64, 4, 64


class AwaitedUnpins:
    """The client as the engine saw it before: every release waits for its UNPIN reply."""

    def __init__(self, inner: MaruHandler) -> None:
        self.inner = inner

    def batch_release(self, handles: list[Any], **_: Any) -> None:
        self.inner.batch_release(handles, wait=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def engine(
    seed: int,
    client: Any,
    num_blocks: int,
    *,
    heads: int = NH,
    head_size: int = HS,
    layers: int = LAYERS,
    chunk: int = CHUNK,
    dtype: torch.dtype | None = None,
) -> KVTransferEngine:
    """A ``KVTransferEngine`` over fresh random CPU caches (kv_first, NHD; block size ``BS``);
    also ``bench/load_prep_cpu.py``'s, with its geometry."""
    kw = {} if dtype is None else {"dtype": dtype}
    case = make_cache(
        "kv_first",
        "NHD",
        num_blocks=num_blocks,
        block_size=BS,
        num_kv_heads=heads,
        head_size=head_size,
        num_layers=layers,
        generator=torch.Generator().manual_seed(seed),
        **kw,
    )
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    caches = [case.caches] if isinstance(case.caches, torch.Tensor) else case.caches
    return KVTransferEngine(caches, layout, client, chunk_tokens=chunk)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    n_chunks = -(-a.tokens // CHUNK)
    blocks = tuple(range(1, 1 + -(-a.tokens // BS)))
    req = RequestTransfer(
        "bench",
        blocks,
        tuple(ChunkRef(f"bench/c{i}", i * CHUNK, min(CHUNK, a.tokens - i * CHUNK)) for i in range(n_chunks)),
    )
    with tempfile.TemporaryDirectory() as tmp:
        srv = ServerProcess(tmp, pool_size=64 << 20, log_level="WARNING")
        srv.start()
        client = MaruHandler(srv.url, timeout_s=30)
        try:
            assert engine(1, client, len(blocks) + 1).store([req]).stored == n_chunks
            modes = {
                "UNPIN sent, reply read later": engine(2, client, len(blocks) + 1),
                "UNPIN awaited": engine(2, AwaitedUnpins(client), len(blocks) + 1),
            }
            times: dict[str, list[float]] = {m: [] for m in modes}
            for _ in range(a.rounds):
                for mode, eng in modes.items():
                    for i in range(a.reps // a.rounds + 20):
                        t0 = time.perf_counter()
                        rep = eng.load([req])
                        dt = time.perf_counter() - t0
                        assert not rep.failed, rep.failed
                        if i >= 20:  # warm-up of each round
                            times[mode].append(dt)
            assert client.usage()["pinned"] == 0
        finally:
            client.close()
            srv.cleanup()  # stop() keeps the pool file (for restarts): remove it
    print(f"{a.tokens} tokens ({n_chunks} chunks), {len(times[next(iter(times))])} loads per mode\n")
    print("| mode | p50 (us) | mean (us) |\n| --- | ---: | ---: |")
    for mode, ts in times.items():
        print(f"| {mode} | {statistics.median(ts) * 1e6:.0f} | {statistics.mean(ts) * 1e6:.0f} |")


if __name__ == "__main__":
    main()
