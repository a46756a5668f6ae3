"""Does the bus traffic of a store slow a host-bound forward by itself (no Python beside it)?

A stand-in forward (``--ops`` small kernel launches from Python, as in ``bench/store_issue.py``)
is timed alone, then while one background copy of ``--mb`` MiB runs: device to pinned host memory
(what a store's copies do, with one host call and a blocking wait, so the GIL is not contended),
and device to device (the control: no bus traffic). If the device-to-host case costs the forward
time and the control does not, a store's cost to a host-bound step is the bus traffic itself
(e.g. inbound DMA taking the CPU's last-level cache), not Maru's Python.
Usage (GPU machine): python bench/dma_contention.py [--reps 10] [--ops 3000] [--mb 1024]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def forward(x: torch.Tensor, ops: int) -> float:
    t = time.perf_counter()
    for _ in range(ops):
        x.add_(1.0)
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--mb", type=int, default=1024)
    a = ap.parse_args()
    n = a.mb << 20
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    x = torch.zeros(1024, device="cuda")
    side = torch.cuda.Stream()

    def copy(dst: torch.Tensor) -> None:
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        side.synchronize()

    for _ in range(3):
        forward(x, a.ops)
        copy(host)
        copy(dev)
    rows: dict[str, list[float]] = {"alone": [], "d2h": [], "d2d": []}
    for _ in range(a.reps):
        torch.cuda.synchronize()
        rows["alone"].append(forward(x, a.ops))
        for name, dst in (("d2h", host), ("d2d", dev)):
            torch.cuda.synchronize()
            th = threading.Thread(target=copy, args=(dst,))
            th.start()
            rows[name].append(forward(x, a.ops))
            th.join()
    t = time.perf_counter()
    copy(host)
    gbps = n / (time.perf_counter() - t) / 1e9
    base = statistics.median(rows["alone"])
    print(
        f"{torch.cuda.get_device_name()}; forward of {a.ops} launches; copy of {a.mb} MiB ({gbps:.1f} GB/s d2h)"
    )
    print("| forward | median ms | paid ms |")
    print("|---|---:|---:|")
    for name, v in rows.items():
        print(f"| {name} | {statistics.median(v) * 1e3:.2f} | {(statistics.median(v) - base) * 1e3:.2f} |")


if __name__ == "__main__":
    main()
