"""Could the write-behind store run in a helper process? A probe of the mechanism and its costs.

    python bench/store_helper_probe.py [--batches 24] [--chunks 8] [--drain-python-ms 3]
    python bench/store_helper_probe.py --device cpu --batches 3     (a smoke run, no GPU)

Why: in real vLLM the write-behind drain thread's ~3 ms of Python CPU a store batch is paid by
vLLM's own threads, wherever it lands (bench/RESULTS.md, fifty-fifth pass: issued before the next
forward it delays that forward's start, held until the forward started it lengthens the forward's
issue). Only less of it on the engine's interpreter would help. A helper process with its own
interpreter would take all of it: the engine would record an interprocess CUDA event after the
forward and send the batch's block ids (tens of microseconds); the helper, holding the KV cache
through CUDA IPC, would wait for the event, gather, copy, checksum and publish.

Unknowns this probe measures on the device host, before any of it is built:

1. that a KV cache allocated as vLLM allocates it (one tensor from torch's caching allocator) and
   an interprocess event reach a spawned process, and that its gather reads the right bytes
   (every batch's digest compared with the engine side's own gather of the same blocks);
2. the engine side's CPU a batch in each mode (the event record and the send; in the thread mode,
   nothing but the queue: the drain's work is on another thread of the same interpreter);
3. what the engine's "forward thread" loses: a pure-Python section (``--host-ms`` of adds, vLLM's
   host work between steps) timed beside the drain, in three modes: no store, a drain thread in
   the same process (today's design, its Python stretched to ``--drain-python-ms`` a batch to stand
   for the real drain's issue), and the helper process (the same stretch, in its interpreter);
   and the whole step beside it (the host work, the wait for the previous batch's reply and for
   the previous forward): where the drain's Python fits into the engine thread's waits, the host
   work alone does not show it (the fifty-sixth pass's H100 run: host work 1.001 in every mode);
4. what the device loses: the stand-in forward's device time (``--forward-ms`` of matmuls, CUDA
   events) in each mode. Two processes on one GPU without MPS share it by time slices, not
   concurrently: if the helper's copies and kernels stall the engine's forward, the design fails
   here whatever it saves on the host;
5. how long a batch stays unread: from the send to the helper's "read done" (blocks held that long),
   and how much of that it waited to be taken up. (The fifty-sixth and fifty-seventh passes' runs
   digested every byte of each 256 MiB batch on the drain, ~0.3 s a batch: the drain fell seconds
   behind and its stand-in Python was diluted ~20x, so those runs measured nothing of the design.
   The digest now samples the batch, ``DIGEST_STRIDE``.)

The table last. No vLLM needed; the geometry is Llama-3-8B's KV (32 layers, 8 KV heads of 128, bf16,
blocks of 16 tokens, chunks of 256).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import statistics
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODES = ("none", "thread", "helper")
BLOCK = 16
CHUNK = 256


def geometry(device: str) -> dict[str, Any]:
    if device == "cpu":  # a smoke run: small enough for the CI machine
        return {"layers": 4, "heads": 2, "head": 64, "dtype": "float32"}
    return {"layers": 32, "heads": 8, "head": 128, "dtype": "bfloat16"}


def make_cache(torch: Any, g: dict[str, Any], blocks: int, device: str) -> Any:
    """One tensor ``[layers, 2, blocks, BLOCK, heads, head]``, as vLLM's runner allocates its cache."""
    shape = (g["layers"], 2, blocks, BLOCK, g["heads"], g["head"])
    return torch.zeros(shape, dtype=getattr(torch, g["dtype"]), device=device)


def batch_blocks(batch: int, chunks: int) -> list[int]:
    """The blocks of batch ``batch``: ``chunks`` chunks of consecutive blocks, after the batches
    before it (``Engine``'s cache holds every batch's: none is rewritten in a run)."""
    per = chunks * CHUNK // BLOCK
    return list(range(batch * per, (batch + 1) * per))


# Every DIGEST_STRIDE-th element is digested, not the whole batch: a whole 256 MiB batch took the
# drain ~0.3 s of hashing (the drain then fell seconds behind the engine, its stand-in Python diluted
# ~20x: the fifty-seventh pass's "sent to taken up" of 6.4-8.4 s). Every forward writes new values
# everywhere, so a stale or wrong copy still differs at the sampled elements.
DIGEST_STRIDE = 4099  # a prime: no alignment with the cache's rows or blocks


def digest(host: Any) -> str:
    """A digest of a sample of a contiguous host tensor's elements (every ``DIGEST_STRIDE``-th)."""
    import torch

    sample = host.reshape(-1)[::DIGEST_STRIDE].contiguous()
    return hashlib.blake2b(sample.view(torch.uint8).numpy()).hexdigest()[:16]


def gather_to_host(torch: Any, cache: Any, blocks: list[int], pinned: Any) -> Any:
    """The batch's blocks of every layer into ``pinned`` (a flat host buffer, large enough), synced."""
    idx = torch.tensor(blocks, device=cache.device)
    src = cache.index_select(2, idx).contiguous()
    if src.numel() > pinned.numel():
        raise ValueError(f"a batch of {src.numel()} elements, a host buffer of {pinned.numel()}")
    out = pinned[: src.numel()].view(src.shape)
    out.copy_(src, non_blocking=True)
    if cache.is_cuda:
        torch.cuda.current_stream().synchronize()
    return out


def python_work(ms: float) -> None:
    """Pure-Python CPU for about ``ms`` (the drain's issue, vLLM's host work): holds the GIL."""
    end = time.thread_time() + ms / 1e3
    x = 0
    while time.thread_time() < end:
        for _ in range(200):
            x += 1


# ------------------------------------------------------------------------------------ the helper
def helper_main(conn: Any, cache: Any, event: Any, per: int, drain_python_ms: float) -> None:
    """The helper process: per message, the drain's Python, then wait for the engine's event,
    gather, digest, reply. ``cache`` and ``event`` arrive through torch's reductions (CUDA IPC;
    shared memory on the CPU)."""
    import torch

    if cache.is_cuda:
        torch.cuda.set_device(cache.device)
    pinned = torch.empty(cache[:, :, :per].numel(), dtype=cache.dtype, pin_memory=cache.is_cuda)
    stream = torch.cuda.Stream(cache.device) if cache.is_cuda else None
    conn.send({"ready": True})
    while True:
        msg = conn.recv()
        if msg.get("stop"):
            break
        conn.send(drain_one(torch, cache, event, stream, pinned, msg, drain_python_ms))


def drain_one(
    torch: Any, cache: Any, event: Any, stream: Any, pinned: Any, msg: dict[str, Any], python_ms: float
) -> dict[str, Any]:
    """One store batch, as the real drain orders it: its Python first (the issue's planning: the
    real drain's ~3 ms a batch), then the device work after the forward's event, then the digest."""
    start = time.perf_counter() - msg["sent"]  # how long the batch waited to be taken up
    python_work(python_ms)
    if stream is not None:
        with torch.cuda.stream(stream):
            stream.wait_event(event)  # the forward that wrote the blocks
            out = gather_to_host(torch, cache, msg["blocks"], pinned)
    else:
        out = gather_to_host(torch, cache, msg["blocks"], pinned)
    read = time.perf_counter() - msg["sent"]  # CLOCK_MONOTONIC: one clock for both processes
    return {"batch": msg["batch"], "digest": digest(out), "read_s": read, "start_s": start}


# ------------------------------------------------------------------------------------ the engine
class Engine:
    """The engine side: a stand-in forward, vLLM's host work, a store a batch in one of three modes.

    Every batch writes blocks of its own (the cache holds them all), so each store's bytes can be
    checked against the engine's own gather after the run."""

    def __init__(self, a: argparse.Namespace) -> None:
        import torch

        self.torch, self.a = torch, a
        self.cuda = a.device == "cuda"
        self.g = geometry(a.device)
        self.per = a.chunks * CHUNK // BLOCK
        self.blocks = a.batches * self.per
        self.cache = make_cache(torch, self.g, self.blocks, a.device)
        self.pinned = torch.empty(
            self.cache[:, :, : self.per].numel(), dtype=self.cache.dtype, pin_memory=self.cuda
        )
        if self.cuda:
            self.mat = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
            self.event = torch.cuda.Event(interprocess=True, enable_timing=False)
        else:
            self.event = None

    def forward(self, blocks: list[int], seed: int) -> Any:
        """Queue a forward: fresh values into ``blocks``, then ``--forward-ms`` of device work; not
        waited for (as vLLM's). Its timing events (None on the CPU)."""
        torch = self.torch
        gen = torch.Generator(device=self.cache.device).manual_seed(seed)
        idx = torch.tensor(blocks, device=self.cache.device)
        shape = self.cache[:, :, : len(blocks)].shape
        vals = torch.randn(shape, generator=gen, device=self.cache.device, dtype=torch.float32)
        if not self.cuda:
            self.cache.index_copy_(2, idx, vals.to(self.cache.dtype))
            return None
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        self.cache.index_copy_(2, idx, vals.to(self.cache.dtype))
        x = self.mat
        for _ in range(max(1, int(self.a.forward_ms / 0.15))):  # ~0.15 ms a 4096^2 bf16 matmul (H100)
            x = torch.mm(x, self.mat) * 1e-3
        t1.record()
        return (t0, t1)

    def reference(self, blocks: list[int]) -> str:
        return digest(gather_to_host(self.torch, self.cache, blocks, self.pinned))


class Drain:
    """A store batch's drain in ``mode``: ``send`` queues it, ``reply`` waits for the oldest."""

    def __init__(self, eng: Engine, mode: str, ctx: Any) -> None:
        torch, a = eng.torch, eng.a
        self.mode, self.eng = mode, eng
        self.proc: Any = None
        self.thread: threading.Thread | None = None
        if mode == "helper":
            self.conn, child = ctx.Pipe()
            args = (child, eng.cache, eng.event, eng.per, a.drain_python_ms)
            self.proc = ctx.Process(target=helper_main, args=args, daemon=True)
            self.proc.start()
            if not self.conn.poll(120):
                raise RuntimeError("the helper process did not start in 120 s")
            assert self.conn.recv()["ready"]
        elif mode == "thread":
            self.work: queue.Queue = queue.Queue()
            self.replies: queue.Queue = queue.Queue()
            pinned = torch.empty_like(eng.pinned, pin_memory=eng.cuda)
            stream = torch.cuda.Stream() if eng.cuda else None

            def loop() -> None:
                while (item := self.work.get()) is not None:
                    msg, ev = item
                    self.replies.put(drain_one(torch, eng.cache, ev, stream, pinned, msg, a.drain_python_ms))

            self.thread = threading.Thread(target=loop, daemon=True)
            self.thread.start()

    def send(self, batch: int, blocks: list[int]) -> None:
        """What the engine's thread does at a step's end (timed by the caller)."""
        msg = {"batch": batch, "blocks": blocks, "sent": time.perf_counter()}
        if self.mode == "helper":
            if self.eng.event is not None:
                self.eng.event.record()  # one interprocess event, re-recorded: a wait sees this record or later
            self.conn.send(msg)
        elif self.mode == "thread":
            ev = self.eng.torch.cuda.Event() if self.eng.cuda else None
            if ev is not None:
                ev.record()
            self.work.put((msg, ev))

    def poll(self) -> list[dict[str, Any]]:
        """Every reply already here, without waiting (vLLM's loop never waits for a store)."""
        out: list[dict[str, Any]] = []
        if self.mode == "helper":
            while self.conn.poll(0):
                out.append(self.conn.recv())
        elif self.mode == "thread":
            while True:
                try:
                    out.append(self.replies.get_nowait())
                except queue.Empty:
                    break
        return out

    def reply(self) -> dict[str, Any] | None:
        if self.mode == "helper":
            if not self.conn.poll(120):
                raise RuntimeError("the helper process did not reply in 120 s")
            return self.conn.recv()
        if self.mode == "thread":
            return self.replies.get(timeout=120)
        return None

    def close(self) -> None:
        if self.proc is not None:
            self.conn.send({"stop": True})
            self.proc.join(30)
        if self.thread is not None:
            self.work.put(None)
            self.thread.join(30)


def run_mode(eng: Engine, mode: str, ctx: Any) -> dict[str, Any]:
    """``a.batches`` steps, as vLLM's loop runs them: queue the forward, queue its store (``mode``),
    do the host work while the device runs, wait for the previous forward (vLLM waits for each
    step's sampled tokens). The store's replies are collected without waiting, as vLLM's loop
    never waits for a write-behind store: the engine thread's only waits are the device's, so a
    drain's Python either fits into them (a device-bound step) or takes the host work's time (a
    host-bound one, ``--forward-ms`` below ``--host-ms``). Every reply waited for at the end;
    digests checked then."""
    a = eng.a
    host_s: list[float] = []
    step_s: list[float] = []  # the whole step on the engine's thread: what vLLM's loop would take
    dev_ms: list[float] = []
    issue_cpu: list[float] = []
    replies: list[dict[str, Any]] = []
    drain = Drain(eng, mode, ctx)
    prev = None
    try:
        for b in range(a.batches):
            s0 = time.perf_counter()
            blocks = batch_blocks(b, a.chunks)
            # New values in every mode (a helper reading a stale copy of the cache must not match).
            fwd = eng.forward(blocks, seed=b + 1000 * MODES.index(mode))
            c0 = time.thread_time()
            drain.send(b, blocks)
            issue_cpu.append(time.thread_time() - c0)
            t0 = time.perf_counter()
            python_work(a.host_ms)  # vLLM's host work for the next step, the store draining beside it
            host_s.append(time.perf_counter() - t0)
            replies += drain.poll()
            if prev is not None:
                prev[1].synchronize()
                dev_ms.append(prev[0].elapsed_time(prev[1]))
            prev = fwd
            step_s.append(time.perf_counter() - s0)
        while mode != "none" and len(replies) < a.batches and (r := drain.reply()) is not None:
            replies.append(r)
        if prev is not None:
            prev[1].synchronize()
            dev_ms.append(prev[0].elapsed_time(prev[1]))
    finally:
        drain.close()
    bad = sum(r["digest"] != eng.reference(batch_blocks(r["batch"], a.chunks)) for r in replies)
    return {
        "mode": mode,
        "host_ms": statistics.median(host_s) * 1e3,
        "step_ms": statistics.median(step_s) * 1e3,
        "forward_ms": statistics.median(dev_ms) if dev_ms else None,
        "issue_us": statistics.median(issue_cpu) * 1e6,
        "unread_ms": statistics.median(r["read_s"] for r in replies) * 1e3 if replies else None,
        "queued_ms": statistics.median(r["start_s"] for r in replies) * 1e3 if replies else None,
        "digests_bad": bad + (a.batches - len(replies) if mode != "none" else 0),
        "stores": len(replies),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--batches", type=int, default=24)
    ap.add_argument("--chunks", type=int, default=8, help="chunks of 256 tokens a store batch")
    ap.add_argument("--host-ms", type=float, default=10.0, help="vLLM's host work a step (pure Python)")
    ap.add_argument("--forward-ms", type=float, default=25.0, help="the stand-in forward's device work")
    ap.add_argument("--drain-python-ms", type=float, default=3.0, help="the drain's Python a batch")
    ap.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    a = ap.parse_args(argv)
    import torch
    import torch.multiprocessing as tmp  # registers the reductions that share tensors (CUDA IPC, shm)

    if a.device == "cuda" and not torch.cuda.is_available():
        print("store_helper_probe: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 2
    ctx = tmp.get_context("spawn")
    eng = Engine(a)
    rows = [run_mode(eng, m, ctx) for m in a.modes]
    base = next((r for r in rows if r["mode"] == "none"), None)
    print(
        f"\nstore helper probe ({a.device}, {torch.__version__}; {a.chunks} chunks of {CHUNK} tokens a batch, "
        f"{a.batches} batches, host work {a.host_ms} ms, drain Python {a.drain_python_ms} ms a batch)"
    )
    print("| mode | host work, ms (median) | vs no store | whole step, ms | vs no store | forward on the device, ms | "
          "engine-side issue, us | sent to taken up, ms | sent to read, ms | digests wrong |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        vs = f"{r['host_ms'] / base['host_ms']:.3f}" if base else "-"
        vs_step = f"{r['step_ms'] / base['step_ms']:.3f}" if base else "-"
        fwd = f"{r['forward_ms']:.2f}" if r["forward_ms"] is not None else "-"
        unread = f"{r['unread_ms']:.2f}" if r["unread_ms"] is not None else "-"
        queued = f"{r['queued_ms']:.2f}" if r["queued_ms"] is not None else "-"
        print(f"| {r['mode']} | {r['host_ms']:.2f} | {vs} | {r['step_ms']:.2f} | {vs_step} | {fwd} | "
              f"{r['issue_us']:.0f} | {queued} | {unread} | {r['digests_bad']} of {r['stores']} |")  # fmt: skip
    return 1 if any(r["digests_bad"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
