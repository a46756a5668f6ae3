import statistics, torch
a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
src = torch.empty(32 << 20, dtype=torch.uint8, device="cuda"); dst = [torch.empty(32 << 20, dtype=torch.uint8, pin_memory=True) for _ in range(24)]
main, side = torch.cuda.Stream(), torch.cuda.Stream()
for _ in range(3): torch.mm(a, b)
s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
def run(mode):
    torch.cuda.synchronize()
    with torch.cuda.stream(main):
        s.record(main)
    with torch.cuda.stream(side):
        for d in dst:
            if mode == "copies": d.copy_(src, non_blocking=True)
            elif mode == "kernels": src.add_(1)
    with torch.cuda.stream(main):
        for _ in range(18): torch.mm(a, b)
        e.record(main)
    e.synchronize(); torch.cuda.synchronize()
    return s.elapsed_time(e)
res = {m: [] for m in ("none", "copies", "kernels")}
for _ in range(10):
    for m in res: res[m].append(run(m))
for m, v in res.items(): print(m, f"{statistics.median(v):.2f} ms")
