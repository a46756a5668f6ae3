"""What vLLM's scheduling thread would pay if Maru's scheduler side ran in a helper process.

    .venv/bin/python bench/helper_probe.py [--users 16] [--reps 20] [--busy 0.5]

A measurement of a design not built (bench/RESULTS.md, fiftieth pass: every storing and warm cost
left is Maru's Python in vLLM's interpreter, ~475 us of scheduler hooks a new request in a serving
vLLM). The same burst as ``bench/scheduler_probe.py --pin-at-offer --arrival --block-hashes``
(16 users' second round of the multi-round workload, their first round stored; a real ``maru
server`` with its key index), two ways:

* in process: ``MaruSchedulerConnector.on_new_request`` for each request of the burst, then
  ``get_num_new_matched_tokens`` for each (keys, probe, pins posted at arrival, read at the offer);
* through a helper: the same connector runs in another process. The scheduling thread sends each
  request's tokens and block hashes at its arrival (one message, not waited for) and at its offer
  asks for the answer: the tokens offered and the request's chunk keys (what the worker needs to
  store and load), one round trip over a pipe.

Reported per request: the scheduling thread's wall time and its own CPU time (``thread_time``: what
it holds the GIL for, the part another Python thread of vLLM's process cannot have), median over
``--reps`` bursts. ``--busy F``: a second Python thread in the measuring process computes F of each
millisecond, as vLLM's worker thread beside the scheduler; waiting for the GIL shows in the wall
time. Both ways must offer the same tokens and return the same keys (checked every burst).

Not measured here: the pins' ownership by the helper's client, its death, and the hop's cost to the
worker side (the helper would hand the held chunks over with the keys).
"""

from __future__ import annotations

import argparse
import array
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgpack

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.scheduler_probe import _block_hashes, _tokens, busy_loop  # noqa: E402
from maru.client import MaruHandler  # noqa: E402
from maru.demo.server import ServerProcess  # noqa: E402
from maru.vllm.config import MaruConnectorConfig  # noqa: E402
from maru.vllm.keys import ChunkKeyer, KeySpace  # noqa: E402
from maru.vllm.metadata import MaruWorkerMeta  # noqa: E402
from maru.vllm.scheduler import MaruSchedulerConnector  # noqa: E402

CHUNK, BS = 256, 16


def keyer() -> ChunkKeyer:
    return ChunkKeyer(KeySpace("bench", "", "bfloat16", 32, 8, 128, CHUNK))


def connector(url: str) -> MaruSchedulerConnector:
    """A scheduler side as vLLM's V2 runner uses it (offers pinned, pins posted at arrival), its
    worker reported ready, its probe path reported (one untimed round trip)."""
    cfg = MaruConnectorConfig(server_url=url, kv_chunk_tokens=CHUNK)
    h = MaruHandler(url, timeout_s=5)
    s = MaruSchedulerConnector(
        cfg, keyer(), BS, client_factory=lambda: h, hold_offers=True, pin_at_offer=True
    )
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=MaruWorkerMeta(ready=1)))
    s.get_num_new_matched_tokens(request("warm", _tokens(64, 7), None), 0)
    return s


def request(rid: str, tokens: list[int], hashes: list[bytes] | None) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=tokens, num_tokens=len(tokens), lora_request=None,
        mm_features=[], block_hashes=hashes,
    )  # fmt: skip


def answer(s: MaruSchedulerConnector, rid: str) -> list[Any]:
    """What the scheduling thread needs back at the offer: the tokens offered and the chunk keys."""
    st = s._reqs[rid]
    return [list(st.keys.full), st.own_tail[1] if st.own_tail else ""]


def helper_main(url: str, conn: Any) -> None:
    """The helper process: arrivals (not answered) and offers (answered), until an empty message."""
    s = connector(url)
    conn.send_bytes(b"ready")
    while msg := conn.recv_bytes():
        kind, rid, *rest = msgpack.unpackb(msg)
        if kind == "a":  # arrival: the tokens as int64 bytes, the block hashes
            toks = list(memoryview(rest[0]).cast("q"))
            s.on_new_request(request(rid, toks, rest[1]))
        elif kind == "o":  # offer: vLLM's own hit
            st = s._reqs[rid]
            n, _ = s.get_num_new_matched_tokens(
                SimpleNamespace(request_id=rid, prompt_token_ids=st.prompt, num_tokens=len(st.prompt),
                                lora_request=None, mm_features=[], block_hashes=None),
                rest[0],
            )  # fmt: skip
            conn.send_bytes(msgpack.packb([n, *answer(s, rid)]))
        elif kind == "f":  # finished: its pins go
            s.request_finished(SimpleNamespace(request_id=rid), ())


def burst(second: list[list[int]], rep: int) -> list[SimpleNamespace]:
    return [request(f"{rep}-{u}", p, _block_hashes(p, BS)) for u, p in enumerate(second)]


def in_process(s: MaruSchedulerConnector, reqs: list[SimpleNamespace]) -> tuple[float, float, list[Any]]:
    t0, c0 = time.perf_counter(), time.thread_time()
    for r in reqs:
        s.on_new_request(r)
    out = [[s.get_num_new_matched_tokens(r, 0)[0], *answer(s, r.request_id)] for r in reqs]
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    for r in reqs:
        s.request_finished(r, ())
    return wall, cpu, out


def through_helper(conn: Any, reqs: list[SimpleNamespace]) -> tuple[float, float, list[Any]]:
    t0, c0 = time.perf_counter(), time.thread_time()
    for r in reqs:  # vLLM's on_new_request: one message each, not waited for
        toks = array.array("q", r.prompt_token_ids).tobytes()
        conn.send_bytes(msgpack.packb(["a", r.request_id, toks, r.block_hashes]))
    out = []
    for r in reqs:  # the offer: one round trip each
        conn.send_bytes(msgpack.packb(["o", r.request_id, 0]))
        out.append(msgpack.unpackb(conn.recv_bytes()))
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    for r in reqs:
        conn.send_bytes(msgpack.packb(["f", r.request_id]))
    return wall, cpu, out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--busy", type=float, default=0.0, help="a second Python thread's share of each ms")
    a = ap.parse_args()
    system = _tokens(2048, 1)
    first = [system + _tokens(128, 100 + u) for u in range(a.users)]
    second = [f + _tokens(256, 200 + u) for u, f in enumerate(first)]
    work = Path(tempfile.mkdtemp(prefix="maru-helper-probe-"))
    srv = ServerProcess(work, pool_size="64M")
    srv.start()
    stop = threading.Event()
    ctx = mp.get_context("spawn")
    mine, theirs = ctx.Pipe()
    helper = ctx.Process(target=helper_main, args=(srv.url, theirs), daemon=True)
    try:
        h = MaruHandler(srv.url, timeout_s=5)
        k = keyer()
        keys: set[str] = set()
        for p in first:  # stored: the system prompt and each user's first round (chunks and tail)
            pk = k.prompt_keys(p)
            keys.update(pk.full)
            n, usable = len(pk.full) * CHUNK, (len(p) - 1) // BS * BS
            if usable > n:
                keys.add(k.tail_key(pk.parent(len(pk.full)), p[n:usable]))
        objs = h.batch_alloc([8] * len(keys))
        for o in objs:
            o.buf[:] = b"\0" * 8
        h.batch_store(sorted(keys), objs)
        helper.start()
        assert mine.recv_bytes() == b"ready"
        s = connector(srv.url)
        if a.busy > 0:
            threading.Thread(target=busy_loop, args=(a.busy, stop), daemon=True).start()
        rows: dict[str, list[tuple[float, float]]] = {"in process": [], "through a helper": []}
        for rep in range(a.reps):
            w1, c1, here = in_process(s, burst(second, 2 * rep))
            w2, c2, there = through_helper(mine, burst(second, 2 * rep + 1))
            assert here == there, "the helper's answers differ from the scheduler's own"
            if rep:  # the first burst of each way warms it
                rows["in process"].append((w1, c1))
                rows["through a helper"].append((w2, c2))
        n = a.users
        print(f"offered {here[-1][0]} tokens of {len(second[-1])} (last request); busy thread: {a.busy}")
        print("| way | scheduling thread, wall us a request | its CPU us a request |\n|---|---:|---:|")
        for way, rs in rows.items():
            wall = statistics.median(w for w, _ in rs) / n * 1e6
            cpu = statistics.median(c for _, c in rs) / n * 1e6
            print(f"| {way} | {wall:.0f} | {cpu:.0f} |")
        mine.send_bytes(b"")
        helper.join(10)
        h.close()
    finally:
        stop.set()
        if helper.is_alive():
            helper.kill()
        srv.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
