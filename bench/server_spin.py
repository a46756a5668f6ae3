"""A lookup-and-pin round trip with gaps between requests, the server polling for the next request
(``maru server --spin-us``) or sleeping at once.

    .venv/bin/python bench/server_spin.py [--trips 300] [--spin-us 2000]

A request that lands on a sleeping server waits for the server's thread to be woken; vLLM's
scheduler sends its offer pins a fraction of a millisecond apart, between its other work. Per gap
between requests (0, 0.5, 2 ms): microseconds per round trip, p50 and p90, the client blocking for
its reply.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.pin_trips import pin_trip_us, store_keys  # noqa: E402
from maru.client import MaruHandler  # noqa: E402
from maru.demo.server import ServerProcess  # noqa: E402


def trips(spin_us: int, n: int) -> list[tuple[float, float, float]]:
    work = Path(tempfile.mkdtemp(prefix="maru-server-spin-"))
    srv = ServerProcess(work, pool_size="64M", extra_args=["--spin-us", str(spin_us)])
    srv.start()
    rows = []
    try:
        with MaruHandler(srv.url, timeout_s=5) as h:
            keys = store_keys(h)
            for gap in (0.0, 0.0005, 0.002):
                ts = []
                for i in range(n):
                    ts.append(pin_trip_us(h, keys, i))
                    if gap:
                        time.sleep(gap)
                ts.sort()
                rows.append((gap * 1e3, ts[len(ts) // 2], ts[int(len(ts) * 0.9)]))
    finally:
        srv.cleanup()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=300)
    ap.add_argument("--spin-us", type=int, default=2000)
    a = ap.parse_args()
    print(f"lookup-and-pin of 2 keys, {a.trips} trips per gap; us per round trip")
    print(f"{'server':<22} {'gap ms':>7} {'p50':>7} {'p90':>7}")
    for spin in (0, a.spin_us):
        for gap, p50, p90 in trips(spin, a.trips):
            print(f"{'--spin-us ' + str(spin):<22} {gap:>7.1f} {p50:>7.0f} {p90:>7.0f}")


if __name__ == "__main__":
    main()
