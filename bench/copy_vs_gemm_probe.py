"""Does a plain device-to-host copy stream, or a stream of small memory-bound kernels, slow a GEMM
forward beside it? 18 bf16 GEMMs of 8192^3 on one stream; beside them, on another, 24 copies of
32 MiB to pinned memory (the bytes of a store batch, no gathers) or 24 in-place adds over 32 MiB.
Sixty-first pass, H100: 27.14 ms alone, 27.28 beside the copies, 27.34 beside the adds.

Usage (GPU machine): python bench/copy_vs_gemm_probe.py
"""

import statistics

import torch


def main() -> None:
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    src = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
    dst = [torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(24)]
    fwd, side = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(3):
        torch.mm(a, b)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def run(mode: str) -> float:
        torch.cuda.synchronize()
        with torch.cuda.stream(fwd):
            s.record(fwd)
        with torch.cuda.stream(side):
            for d in dst:
                if mode == "copies":
                    d.copy_(src, non_blocking=True)
                elif mode == "kernels":
                    src.add_(1)
        with torch.cuda.stream(fwd):
            for _ in range(18):
                torch.mm(a, b)
            e.record(fwd)
        e.synchronize()
        torch.cuda.synchronize()
        return s.elapsed_time(e)

    res = {m: [] for m in ("none", "copies", "kernels")}
    for _ in range(10):
        for m in res:
            res[m].append(run(m))
    for m, v in res.items():
        print(m, f"{statistics.median(v):.2f} ms")


if __name__ == "__main__":
    main()
