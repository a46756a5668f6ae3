"""What a prompt's chunk keys cost vLLM's scheduling thread beside a busy Python thread.

    .venv/bin/python bench/gil_hashing.py [--tokens 2304] [--chunk 256] [--calls 200]

CPython's hashlib gives the GIL up for one input of 2048 bytes or more; taking it back beside a
thread that runs Python waits for that thread's switch interval (5 ms). A 256-token chunk is 2081
bytes to hash. Timed per prompt, alone and beside a thread that never sleeps: the keys hashed one
call per chunk (the chain of ``maru.vllm.keys`` as one blake2b call each, as before) and
``ChunkKeyer.prompt_keys`` (input fed in pieces below the threshold). Both give the same keys.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import statistics
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo: maru and bench

from bench.busy_thread import BusyThread  # noqa: E402
from maru.vllm.keys import ChunkKeyer, KeySpace  # noqa: E402


def one_call_per_chunk(root: bytes, prefix: str, ct: int, toks: list[int]) -> list[str]:
    data = struct.pack(f"<{len(toks)}q", *toks)
    prev, out = root, []
    for i in range(len(toks) // ct):
        prev = hashlib.blake2b(b"C" + prev + data[i * ct * 8 : (i + 1) * ct * 8], digest_size=16).digest()
        out.append(prefix + prev.hex())
    return out


def per_call_us(f: Callable[[], object], calls: int) -> tuple[float, float]:
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        f()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), statistics.mean(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2304)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--calls", type=int, default=200)
    a = ap.parse_args()
    space = KeySpace("m", "r", "bfloat16", 32, 8, 128, a.chunk)
    keyer = ChunkKeyer(space)
    toks = list(range(1000, 1000 + a.tokens))
    root, prefix = space.digest(), space.prefix()
    assert one_call_per_chunk(root, prefix, a.chunk, toks) == keyer.prompt_keys(toks).full
    ways = {
        "one blake2b call a chunk": lambda: one_call_per_chunk(root, prefix, a.chunk, toks),
        "ChunkKeyer (pieces < 2048 B)": lambda: keyer.prompt_keys(toks),
    }
    rows = []
    for beside in ("alone", "beside a busy thread"):
        with BusyThread() if beside != "alone" else contextlib.nullcontext():
            for name, f in ways.items():
                med, mean = per_call_us(f, a.calls)
                rows.append((beside, name, med, mean))
    print(f"{a.tokens} tokens, {a.tokens // a.chunk} chunks of {a.chunk}; us per prompt ({a.calls} calls)")
    print(f"{'':<22} {'way':<30} {'median':>8} {'mean':>8}")
    for beside, name, med, mean in rows:
        print(f"{beside:<22} {name:<30} {med:>8.0f} {mean:>8.0f}")


if __name__ == "__main__":
    main()
