"""RPC latency and throughput of ``maru server`` as a client sees it (through ``MaruHandler``).

    python bench/rpc.py                 # starts a throw-away server (emulated pool in /dev/shm)
    python bench/rpc.py --url tcp://127.0.0.1:5555

For exists, lookup and commit at batch sizes 1, 16 and 64, one client calls the op in a loop
and times every call: p50/p99 latency of one call (one round trip) and calls/s, keys/s.

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


def measure(fn: Callable[[], object], iterations: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure_commit(h: MaruHandler, batch: int, iterations: int, warmup: int, tag: str) -> list[float]:
    out = []
    for i in range(warmup + iterations):
        objs = h.batch_alloc([64] * batch)
        for o in objs:
            o.buf[:] = b"m" * 64
        keys = [f"bench/{tag}/c{batch}/{i}/{j}" for j in range(batch)]
        t0 = time.perf_counter()
        h.batch_store(keys, objs)
        if i >= warmup:
            out.append(time.perf_counter() - t0)
    return out


def _echo_server(port: int) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    while True:
        sock.send_multipart(sock.recv_multipart())


def measure_floor(iterations: int, warmup: int) -> list[float]:
    """Round trips of a bare zmq echo (python on both ends) carrying a 64-key EXISTS frame."""
    import multiprocessing as mp

    import zmq

    from maru import protocol
    from maru.cli.embedded import free_port

    port = free_port()
    proc = mp.get_context("spawn").Process(target=_echo_server, args=(port,), daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 10_000)
    sock.connect(f"tcp://127.0.0.1:{port}")
    frame = protocol.encode(
        protocol.Op.EXISTS, 1, {"client_id": "x" * 32, "keys": [f"k{i:06d}" for i in range(64)]}
    )
    try:

        def once() -> None:
            sock.send(frame)
            sock.recv()

        return measure(once, iterations, warmup)
    finally:
        sock.close(0)
        proc.terminate()
        proc.join(5)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run(url: str, iterations: int, warmup: int, batches: list[int]) -> list[tuple[str, int, list[float]]]:
    rows = []
    tag = uuid.uuid4().hex[:8]
    with MaruHandler(url) as h:
        keys = [f"bench/{tag}/k{i}" for i in range(max(batches))]
        objs = h.batch_alloc([4096] * len(keys))
        for o in objs:
            o.buf[:] = os.urandom(4096)
        h.batch_store(keys, objs)
        for b in batches:
            ks = keys[:b]
            rows.append(("exists", b, measure(lambda ks=ks: h.exists(ks), iterations, warmup)))
        for b in batches:
            ks = keys[:b]
            rows.append(
                ("lookup", b, measure(lambda ks=ks: h.batch_retrieve(ks, pin=False), iterations, warmup))
            )
        for b in batches:
            ks = keys[:b]
            rows.append(
                (
                    "lookup+pin+unpin",
                    b,
                    measure(lambda ks=ks: h.batch_release(h.batch_retrieve(ks)), iterations, warmup),
                )
            )
        for b in batches:
            rows.append(("commit", b, measure_commit(h, b, iterations, warmup, tag)))
        # Leave an external server as we found it.
        h.delete(keys)
        for b in batches:
            h.delete([f"bench/{tag}/c{b}/{i}/{j}" for i in range(warmup + iterations) for j in range(b)])
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
        from maru.cli.embedded import EmbeddedServer

        server = EmbeddedServer(pool_size="1G").start()
        url = server.url
    try:
        rows = [("zmq echo, no Maru (floor)", 64, measure_floor(args.iterations, args.warmup))]
        rows += run(url, args.iterations, args.warmup, batches)
    finally:
        if server is not None:
            server.stop()

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
