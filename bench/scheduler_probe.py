"""Host time of the scheduler side's prefix probe, in process: ``get_num_new_matched_tokens``.

    .venv/bin/python bench/scheduler_probe.py [--users 16] [--system 2048] [--turn 128] [--reps 30]

A real ``maru server`` (the key index on, or ``--no-key-index``), one ``MaruSchedulerConnector``
with vLLM's GPU geometry (chunk 256, block 16). Stored: a system prompt and every user's first
round (its full chunks and its block-aligned tail), as a storing instance leaves them. Timed: each
user's second round (system prompt, turn, answer, turn), whose hit ends inside the prompt (the
system prompt's chunks, then round 1's tail), the case that asks about the most keys. Reported:
microseconds per new request (min and median over ``--reps`` rounds of ``--users`` requests),
and how many keys each request checked. ``--local-hit``: vLLM's own prefix cache holds each
user's first round (a storing instance's next turn): the chunks it covers are not asked about.
``--round first``: time each user's first round instead (the system prompt's chunks, shared by
every user, then the user's own tail), the burst that arrives at a conversation's start.
``--finished`` (with ``--block-hashes``): the scheduler stored and saw finish each user's first round
(its chunks and block hashes noted: the arrival's guess of vLLM's hit, ``RecentKeys`` and
``RecentBlocks``). ``--block-hashes``: the requests carry vLLM's block hashes and the scheduler keyed the first round
(its chunk keys then come from ``ChunkKeyCache``). ``--busy F``: a second Python thread computes F of each millisecond (the GIL competition a
scheduler meets beside vLLM's worker thread); ``--switch-interval S``: the interpreter's switch
interval (default 5 ms). ``--pin-at-offer``: each offer is pinned before it is made (the V2 runner's way; the worker is
reported ready first); the pins' round trips and shared pins are reported too. ``--arrival`` (with
``--pin-at-offer``): the burst is announced first (vLLM's ``on_new_request``: each request probed
and its pins posted, not waited for), then offered: the offers read the replies. ``--profile N``:
cProfile over the timed part (every round but the first), its N top functions by own time.
``--warm`` (with ``--local-hit --finished``): another instance stored the second round too, so the
burst is a warm instance's next turn (a chunk or two and a tail found, pinned and offered a request).
``--parts``: the hooks' parts are timed (``maru_log_timing``'s detail) and the last round's printed.
``--gc``: the garbage collector's side, the last round: the tracked objects (lists, dicts, ...)
the scheduler side still holds when the burst was offered, a request's share, by type, and the
elements of its lists, which every young collection walks; and the net tracked allocations the
burst counted towards the next collection (threshold ``gc.get_threshold()[0]``). In real vLLM
the Maru instances ran 2-3x the idle connector's collections (fiftieth pass).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import hashlib
import pstats
import random
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
# --tree DIR: another tree's maru/ (e.g. .ab/before from bench/ab_tree.py) runs instead of this
# checkout's. Read before the imports below: PYTHONPATH cannot do it (this checkout is put first).
TREE = next((sys.argv[i + 1] for i, x in enumerate(sys.argv[:-1]) if x == "--tree"), None)
if TREE is not None:
    sys.path.insert(0, str(Path(TREE).resolve()))

from maru.client import MaruHandler  # noqa: E402
from maru.demo.server import ServerProcess  # noqa: E402
from maru.vllm.config import MaruConnectorConfig  # noqa: E402
from maru.vllm.keys import ChunkKeyer, KeySpace  # noqa: E402
from maru.vllm.metadata import MaruWorkerMeta  # noqa: E402
from maru.vllm.scheduler import MaruSchedulerConnector  # noqa: E402


def _tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 128_000) for _ in range(n)]


class _Counting:
    """The handler, counting the keys asked about."""

    def __init__(self, h: MaruHandler) -> None:
        self.h, self.keys = h, 0

    def exists(self, keys: list[str]) -> list[bool]:
        self.keys += len(keys)
        return self.h.exists(keys)

    def __getattr__(self, name: str) -> object:
        return getattr(self.h, name)


def busy_loop(share: float, stop: threading.Event) -> None:
    """Pure-Python work for ``share`` of each millisecond, then a sleep (which releases the GIL)."""
    while not stop.is_set():
        t_end = time.perf_counter() + share * 1e-3
        x = 0
        while time.perf_counter() < t_end:
            x += 1
        time.sleep((1 - share) * 1e-3)


def _block_hashes(tokens: list[int], bs: int) -> list[bytes]:
    """A chain of block hashes as vLLM's prefix cache makes them (sha256 over the parent and the block)."""
    out, parent = [], b""
    for b in range(len(tokens) // bs):
        parent = hashlib.sha256(parent + struct.pack(f"<{bs}q", *tokens[b * bs : (b + 1) * bs])).digest()
        out.append(parent)
    return out


class GcCensus:
    """From its making to ``report``: the garbage collector's young objects made meanwhile and still
    alive (the collector is off in between, so none is promoted or freed by a collection)."""

    def __init__(self) -> None:
        gc.collect()
        gc.disable()
        self.base = {id(o) for o in gc.get_objects(0)}
        self.count0 = gc.get_count()[0]

    def report(self, n: int) -> str:
        try:
            net = gc.get_count()[0] - self.count0
            young = [o for o in gc.get_objects(0) if id(o) not in self.base and o is not self.base]
            kinds = Counter(type(o).__name__ for o in young)
            elements = sum(len(o) for o in young if isinstance(o, list))
            t0 = time.perf_counter()
            gc.collect(0)
            walk = time.perf_counter() - t0
        finally:
            gc.enable()
        top = ", ".join(f"{k} {v / n:.1f}" for k, v in kinds.most_common(8))
        return (
            f"GC: {len(young) / n:.1f} tracked objects kept a request ({top}); {elements / n:.0f} list "
            f"elements a request; net tracked allocations {net / n:.1f} a request (a young collection every "
            f"{gc.get_threshold()[0]}); that young collection {walk * 1e3:.2f} ms"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--tree", default=None,
        help="a directory holding another maru/ (e.g. .ab/before, made by bench/ab_tree.py): it runs "
        "instead of this checkout's (an A/B of two trees with one script)",
    )  # fmt: skip
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--system", type=int, default=2048)
    ap.add_argument("--turn", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-key-index", action="store_true")
    ap.add_argument(
        "--local-hit", action="store_true",
        help="vLLM's own cache holds each user's first round (the storing instance's next turn)",
    )  # fmt: skip
    ap.add_argument(
        "--pin-at-offer", action="store_true",
        help="offer pins taken at each offer (the V2 runner's way): one lookup-and-pin trip a hit",
    )  # fmt: skip
    ap.add_argument("--round", choices=("first", "second"), default="second")
    ap.add_argument(
        "--warm", action="store_true",
        help="(second round) another instance stored each user's second round too: with --local-hit "
        "and --finished the burst is a warm instance's next turn (its own cache holds the first "
        "round, Maru the rest: a chunk or two and a tail a request found, pinned and offered)",
    )  # fmt: skip
    ap.add_argument(
        "--empty", action="store_true",
        help="store nothing: every probe misses (a cold instance's probes, as a storing instance pays them)",
    )  # fmt: skip
    ap.add_argument(
        "--busy", type=float, default=0.0,
        help="a second Python thread computes this share of each millisecond (0-1), like vLLM's "
        "worker thread preparing a step beside the scheduler: each request then competes for the GIL",
    )  # fmt: skip
    ap.add_argument(
        "--arrival", action="store_true",
        help="with --pin-at-offer: every request of the burst is announced first (vLLM's "
        "on_new_request: probed, its pins posted), then offered; the time of both is counted",
    )  # fmt: skip
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval (s)")
    ap.add_argument(
        "--spin-us", type=float, default=0.0,
        help="the scheduler's client polls for each reply this long before blocking (reply_spin_s)",
    )  # fmt: skip
    ap.add_argument(
        "--block-hashes", action="store_true",
        help="requests carry vLLM-like block hashes (sha256 chain, made untimed as vLLM makes them "
        "before the hook), and the scheduler has seen the first round: chunk keys found by them",
    )  # fmt: skip
    ap.add_argument(
        "--finished", action="store_true",
        help="(second round, with --block-hashes) the engine stored and finished each user's first "
        "round before: its chunks and vLLM's block hashes are noted (RecentKeys, RecentBlocks), as "
        "a storing instance's scheduler has them when the next turns arrive",
    )  # fmt: skip
    ap.add_argument(
        "--profile", type=int, default=0, metavar="N", help="cProfile the timed part: the N top functions"
    )
    ap.add_argument(
        "--profile-sort", default="tottime", choices=("tottime", "cumulative"),
        help="--profile's order: own time, or with callees",
    )  # fmt: skip
    ap.add_argument("--gc", action="store_true", help="the tracked objects the last burst left (see above)")
    ap.add_argument(
        "--parts", action="store_true",
        help="time the hooks' parts (keys, probe, pins: maru_log_timing's detail, ~5 us a part) and "
        "print the last round's",
    )  # fmt: skip
    a = ap.parse_args()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    stop = threading.Event()
    if a.busy > 0:
        threading.Thread(target=busy_loop, args=(a.busy, stop), daemon=True).start()
    chunk, bs = 256, 16
    space = KeySpace("bench", "", "bfloat16", 32, 8, 128, chunk)
    keyer = ChunkKeyer(space)
    system = _tokens(a.system, 1)
    first = [system + _tokens(a.turn, 100 + u) for u in range(a.users)]
    second = [f + _tokens(2 * a.turn, 200 + u) for u, f in enumerate(first)]
    work = Path(tempfile.mkdtemp(prefix="maru-sched-probe-"))
    srv = ServerProcess(work, pool_size="64M", extra_args=["--no-key-index"] if a.no_key_index else [])
    srv.start()
    try:
        h = MaruHandler(srv.url, timeout_s=5, reply_spin_s=a.spin_us * 1e-6)
        keys: set[str] = set()
        for p in first + (second if a.warm else []):
            pk = keyer.prompt_keys(p)
            keys.update(pk.full)
            n = len(pk.full) * chunk
            usable = (len(p) - 1) // bs * bs
            if usable > n:
                keys.add(keyer.tail_key(pk.parent(len(pk.full)), p[n:usable]))
        objs = h.batch_alloc([8] * len(keys))
        for o in objs:
            o.buf[:] = b"\0" * 8
        if a.empty:
            h.abort(objs)
        else:
            h.batch_store(sorted(keys), objs)
        client = _Counting(h)
        cfg = MaruConnectorConfig(server_url=srv.url, kv_chunk_tokens=chunk, log_timing=a.parts)
        per_req: list[float] = []
        offered = None
        timed = first if a.round == "first" else second
        trips = shared = 0
        profs: list[cProfile.Profile] = []
        for rep in range(a.reps):
            s = MaruSchedulerConnector(
                cfg, keyer, bs, client_factory=lambda: client, hold_offers=a.pin_at_offer,
                pin_at_offer=a.pin_at_offer,
            )  # fmt: skip
            if a.pin_at_offer:  # offers wait for every worker's word that it can load
                s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=MaruWorkerMeta(ready=1)))
            reqs = [
                SimpleNamespace(request_id=f"{rep}-{u}", prompt_token_ids=p, num_tokens=len(p),
                                lora_request=None, mm_features=[],
                                block_hashes=_block_hashes(p, bs) if a.block_hashes else None)
                for u, p in enumerate(timed)
            ]  # fmt: skip
            if a.block_hashes and a.round == "second":  # the scheduler keyed the first round
                for p in first:
                    pk = s._key_cache.prompt_keys(p, _block_hashes(p, bs), len(p))
                    if a.finished:  # ... stored it, and saw it finish
                        s.recent_keys.note(pk.full)
                        s.recent_blocks.note(
                            SimpleNamespace(num_tokens=len(p), block_hashes=_block_hashes(p, bs))
                        )
            # Untimed: a new connector reports its probe path to the server once (one round trip),
            # which a serving scheduler pays once, not per request.
            s.get_num_new_matched_tokens(
                SimpleNamespace(request_id=f"{rep}-warm", prompt_token_ids=_tokens(64, 7), num_tokens=64,
                                lora_request=None, mm_features=[]),
                0,
            )  # fmt: skip
            client.keys = 0
            before = s.pins.snapshot() if s.pins is not None else {}
            prof = cProfile.Profile() if a.profile and rep else None
            if prof is not None:
                prof.enable()
            census = GcCensus() if a.gc and rep == a.reps - 1 else None
            t0 = time.perf_counter()
            if a.arrival:  # the burst arrives before it is scheduled (posts in flight together)
                for r in reqs:
                    s.on_new_request(r)
            for u, r in enumerate(reqs):
                local = len(first[u]) // bs * bs if a.local_hit and a.round == "second" else 0
                offered = s.get_num_new_matched_tokens(r, local)
            per_req.append((time.perf_counter() - t0) / len(reqs))
            if census is not None:
                print(census.report(len(reqs)))
            last_hooks = s.hook_times
            if prof is not None:
                prof.disable()
                profs.append(prof)
            if s.pins is not None:
                after = s.pins.snapshot()
                trips += after["pin_trips"] - before.get("pin_trips", 0)
                shared += after.get("pins_shared", 0) - before.get("pins_shared", 0)
                s.pins.close(client)  # releases the offer pins (untimed); the shared client stays open
        keys_per_req = client.keys / a.users
        print(f"path: {h.local_exists.path}; {a.round} round; offered {offered} of {len(timed[-1])} tokens")
        print(f"maru: {Path(sys.modules['maru'].__file__).parent}")
        print(
            f"us per new request: min {min(per_req) * 1e6:.0f}, median {statistics.median(per_req) * 1e6:.0f}; "
            f"keys checked per request: {keys_per_req:.0f}"
        )
        if a.pin_at_offer:
            n = a.reps * a.users
            print(
                f"pin round trips per request: {trips / n:.2f}; keys pinned through a shared pin: {shared / n:.2f}"
            )
        if a.parts:
            print(f"the last round's parts: {last_hooks.line()}")
        if profs:  # profiled rounds run slower: their times above are not comparable
            st = pstats.Stats(profs[0])
            for p in profs[1:]:
                st.add(p)
            st.sort_stats(a.profile_sort).print_stats(a.profile)
        h.close()
    finally:
        stop.set()
        srv.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
