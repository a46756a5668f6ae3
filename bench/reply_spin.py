"""A client's round trip to ``maru server`` when it polls for the reply (``reply_spin_s``) or
blocks, beside a Python thread that takes the GIL a share of each millisecond.

    .venv/bin/python bench/reply_spin.py [--busy 0 0.5 0.9] [--spin-us 500] [--n 300]

A real server in its own process; one ``MaruHandler`` per setting does ``--n`` one-key lookups
(LOOKUP, no pin), a short sleep between them (a scheduler asks between other work). The busy thread
computes ``busy`` of each millisecond and sleeps the rest (releasing the GIL), like vLLM's other
threads beside its scheduling thread. Reported per setting: p50, mean and p90 of a round trip, and
how many replies the polling client read while polling. On a machine with few cores the polling
thread competes with the server for a core (see ``maru.vllm.config.MIN_CPUS_TO_SPIN``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.scheduler_probe import busy_loop  # noqa: E402
from maru.client import MaruHandler  # noqa: E402
from maru.demo.server import ServerProcess  # noqa: E402


def one(url: str, spin_s: float, busy: float, n: int) -> dict[str, float]:
    with MaruHandler(url, timeout_s=5, reply_spin_s=spin_s) as h:
        key = f"spin-{spin_s}-{busy}"
        obj = h.alloc(8)
        obj.buf[:] = b"\0" * 8
        h.store(key, obj)
        stop = threading.Event()
        if busy > 0:
            threading.Thread(target=busy_loop, args=(busy, stop), daemon=True).start()
        ts = []
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                h.batch_retrieve([key], pin=False)
                ts.append(time.perf_counter() - t0)
                time.sleep(0.0003)
        finally:
            stop.set()
        ts.sort()
        w = h.reply_waits
        return {
            "p50": ts[len(ts) // 2] * 1e6,
            "mean": statistics.mean(ts) * 1e6,
            "p90": ts[int(0.9 * (len(ts) - 1))] * 1e6,
            "polled": w["replies_spun"],
            "blocked": w["spun_out"],
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=float, nargs="*", default=[0.0, 0.5, 0.9])
    ap.add_argument("--spin-us", type=float, default=500.0)
    ap.add_argument("--n", type=int, default=300)
    a = ap.parse_args()
    srv = ServerProcess(Path(tempfile.mkdtemp(prefix="maru-reply-spin-")), pool_size="64M")
    srv.start()
    try:
        print("| busy share | wait | p50 us | mean us | p90 us | replies read while polling / blocked |")
        print("|---:|---|---:|---:|---:|---|")
        for busy in a.busy:
            for spin in (0.0, a.spin_us * 1e-6):
                r = one(srv.url, spin, busy, a.n)
                wait = f"polls {a.spin_us:.0f} us" if spin else "blocks"
                print(
                    f"| {busy:.2f} | {wait} | {r['p50']:.0f} | {r['mean']:.0f} | {r['p90']:.0f} "
                    f"| {r['polled']} / {r['blocked']} |"
                )
    finally:
        srv.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
