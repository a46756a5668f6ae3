"""A lookup-and-pin round trip and its UNPIN post, alone and beside a busy Python thread: pyzmq's
send and receive (each gives the GIL up) against libzmq called with the GIL kept (``maru.client.gil_io``).

    .venv/bin/python bench/rpc_gil.py [--trips 300] [--spin-us 2000]

A real ``maru server``; the client polls for each reply (``reply_spin_s``, as vLLM's scheduling
thread does). Each way runs in a process of its own (``MARU_GIL_IO=1`` / ``0``). Microseconds per
round trip (median and mean).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def one_way(trips: int, spin_us: float) -> list[tuple[str, float, float]]:
    from bench.busy_thread import BusyThread
    from bench.pin_trips import pin_trip_us, store_keys
    from maru.client import MaruHandler
    from maru.demo.server import ServerProcess

    work = Path(tempfile.mkdtemp(prefix="maru-rpc-gil-"))
    srv = ServerProcess(work, pool_size="64M")
    srv.start()
    rows = []
    try:
        h = MaruHandler(srv.url, timeout_s=5, reply_spin_s=spin_us * 1e-6)
        keys = store_keys(h)
        for beside in ("alone", "beside a busy thread"):
            with BusyThread() if beside != "alone" else contextlib.nullcontext():
                ts = [pin_trip_us(h, keys, i) for i in range(trips)]
            rows.append((beside, statistics.median(ts), statistics.mean(ts)))
        h.close()
    finally:
        srv.cleanup()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=300)
    ap.add_argument("--spin-us", type=float, default=2000.0)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        for beside, med, mean in one_way(a.trips, a.spin_us):
            print(f"{beside}\t{med:.0f}\t{mean:.0f}")
        return
    print(f"lookup-and-pin of 2 keys + UNPIN post, {a.trips} trips, polling {a.spin_us:.0f} us; us per trip")
    print(f"{'way':<34} {'beside':<22} {'median':>8} {'mean':>8}")
    for label, env in (("GIL kept (libzmq direct)", "1"), ("pyzmq (gives the GIL up)", "0")):
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--trips", str(a.trips), "--spin-us", str(a.spin_us)],
            env={**os.environ, "MARU_GIL_IO": env},
            capture_output=True,
            text=True,
            check=True,
        )
        for line in out.stdout.splitlines():
            beside, med, mean = line.split("\t")
            print(f"{label:<34} {beside:<22} {med:>8} {mean:>8}")


if __name__ == "__main__":
    main()
