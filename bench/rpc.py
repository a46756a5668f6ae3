"""RPC latency and throughput of ``maru server`` as a client sees it (through ``MaruHandler``).

    python bench/rpc.py                 # starts a throw-away server (emulated pool in /dev/shm)
    python bench/rpc.py --url tcp://127.0.0.1:5555

For exists, lookup and commit at batch sizes 1, 16 and 64, one client times every call:
p50/p99 latency of one call (one round trip) and calls/s, keys/s. Each row is measured in
four blocks of back-to-back calls, the rows' blocks taking turns, so a machine whose load
drifts during the run (a shared 2-core box) skews all rows alike, not whichever ran last.

* exists:  ``exists(keys)``, every key present.
* lookup:  ``batch_retrieve(keys, pin=False)`` (LOOKUP; hits, views built, no pin).
* lookup+pin+unpin: ``batch_retrieve(keys)`` then ``batch_release`` (two round trips).
* commit:  ``batch_store`` of freshly reserved 64-byte objects (only the COMMIT round trip is
  timed; the RESERVE before it is not).

For scale, the first row is the floor: a bare ZeroMQ DEALER/ROUTER echo of the same 64-key
EXISTS frame between two Python processes (no Maru code on either side).

Prints a Markdown table (paste it into bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable

from maru import MaruHandler


class CommitCase:
    """One commit row: each call reserves ``batch`` 64-byte objects (untimed), then times the COMMIT."""

    def __init__(self, h: MaruHandler, batch: int, tag: str) -> None:
        self.h, self.batch, self.tag, self.n = h, batch, tag, 0

    def __call__(self) -> float:
        objs = self.h.batch_alloc([64] * self.batch)
        for o in objs:
            o.buf[:] = b"m" * 64
        keys = [f"bench/{self.tag}/c{self.batch}/{self.n}/{j}" for j in range(self.batch)]
        self.n += 1
        t0 = time.perf_counter()
        self.h.batch_store(keys, objs)
        return time.perf_counter() - t0

    def keys(self) -> list[str]:
        return [f"bench/{self.tag}/c{self.batch}/{i}/{j}" for i in range(self.n) for j in range(self.batch)]


def timed(fn: Callable[[], object]) -> Callable[[], float]:
    def once() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return once


def measure_interleaved(
    cases: dict[str, Callable[[], float]], iterations: int, warmup: int, rounds: int = 4
) -> dict[str, list[float]]:
    """Run each case in ``rounds`` blocks of back-to-back calls, the blocks of all cases taking turns.

    Back-to-back calls measure an op warm (as a busy scheduler calls it); taking turns spreads
    every row over the whole run, so load that drifts on a shared machine skews all rows alike.
    """
    out: dict[str, list[float]] = {name: [] for name in cases}
    per_round = max(1, iterations // rounds)
    for r in range(rounds):
        for name, case in cases.items():
            for _ in range(warmup if r == 0 else min(warmup, 20)):
                case()
            out[name] += [case() for _ in range(per_round)]
    return out


def measure(fn: Callable[[], object], iterations: int, warmup: int) -> list[float]:
    return measure_interleaved({"": timed(fn)}, iterations, warmup)[""]


def _echo_server(port: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        sock.send_multipart(sock.recv_multipart())


class EchoFloor:
    """A bare zmq echo (python on both ends) of a 64-key EXISTS frame: the round trip without Maru."""

    def __init__(self) -> None:
        import multiprocessing as mp

        import zmq

        from maru import protocol
        from maru.demo.server import free_port

        port = free_port()
        self.proc = mp.get_context("spawn").Process(target=_echo_server, args=(port,), daemon=True)
        self.proc.start()
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.RCVTIMEO, 10_000)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        keys = [f"k{i:06d}" for i in range(64)]
        self.frame = protocol.encode(protocol.Op.EXISTS, 1, {"client_id": "x" * 32, "keys": keys})

    def once(self) -> None:
        self.sock.send(self.frame)
        self.sock.recv()

    def close(self) -> None:
        self.sock.close(0)
        self.proc.terminate()
        self.proc.join(5)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(url: str, iterations: int, warmup: int, batches: list[int]) -> list[tuple[str, int, list[float]]]:
    tag = uuid.uuid4().hex[:8]
    floor = EchoFloor()
    with MaruHandler(url) as h:
        keys = [f"bench/{tag}/k{i}" for i in range(max(batches))]
        objs = h.batch_alloc([4096] * len(keys))
        for o in objs:
            o.buf[:] = os.urandom(4096)
        h.batch_store(keys, objs)
        cases: dict[tuple[str, int], Callable[[], float]] = {
            ("zmq echo, no Maru (floor)", 64): timed(floor.once)
        }
        commits = []
        for b in batches:
            ks = keys[:b]
            cases[("exists", b)] = timed(lambda ks=ks: h.exists(ks))
            cases[("lookup", b)] = timed(lambda ks=ks: h.batch_retrieve(ks, pin=False))
            cases[("lookup+pin+unpin", b)] = timed(lambda ks=ks: h.batch_release(h.batch_retrieve(ks)))
            commits.append(CommitCase(h, b, tag))
            cases[("commit", b)] = commits[-1]
        results = measure_interleaved(cases, iterations, warmup)  # type: ignore[arg-type]
        floor.close()
        order = ["zmq echo, no Maru (floor)", "exists", "lookup", "lookup+pin+unpin", "commit"]
        rows = sorted(
            ((k[0], k[1], xs) for k, xs in results.items()),  # type: ignore[misc]
            key=lambda r: (order.index(r[0]), r[1]),
        )
        # Leave an external server as we found it.
        h.delete(keys)
        for c in commits:
            h.delete(c.keys())
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="benchmark this server instead of starting one")
    ap.add_argument("--iterations", type=int, default=2000, help="timed calls per row (default 2000)")
    ap.add_argument("--warmup", type=int, default=200, help="untimed calls before each row (default 200)")
    ap.add_argument("--batches", default="1,16,64", help="batch sizes (default 1,16,64)")
    args = ap.parse_args(argv)
    batches = [int(x) for x in args.batches.split(",")]

    server = None
    url = args.url
    if url is None:
        from maru.demo.server import EmbeddedServer

        server = EmbeddedServer(pool_size="1G").start()
        url = server.url
    try:
        rows = run(url, args.iterations, args.warmup, batches)
    finally:
        if server is not None:
            server.cleanup()

    print(
        f"maru RPC benchmark: {url}, {args.iterations} timed calls per row, Python {platform.python_version()}, "
        f"{os.cpu_count()} CPUs ({platform.machine()})\n"
    )
    print("| op | batch | p50 (us) | p99 (us) | mean (us) | calls/s | keys/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for op, b, xs in rows:
        mean = statistics.fmean(xs)
        print(
            f"| {op} | {b} | {pct(xs, 0.5) * 1e6:.0f} | {pct(xs, 0.99) * 1e6:.0f} | {mean * 1e6:.0f} | "
            f"{1 / mean:,.0f} | {b / mean:,.0f} |"
        )
    exists64 = [xs for op, b, xs in rows if op == "exists" and b == 64]
    if exists64:
        p50 = pct(exists64[0], 0.5) * 1e6
        verdict = "met" if p50 < 200 else "MISSED"
        print(f"\ntarget: exists batch of 64 keys < 200 us p50: {verdict} ({p50:.0f} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
