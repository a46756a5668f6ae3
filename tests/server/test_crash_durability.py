"""Acknowledged stores survive kill -9 of the server while writers are in full flight."""

from __future__ import annotations

import mmap
import os
import threading
import time
from pathlib import Path

from maru.protocol import Op
from tests.helpers import RawClient, ServerProcess, map_pool

WRITERS = 2
ROUNDS = 3
# The kill comes after at least this many new acknowledgements (raise it for a longer run:
# MARU_CRASH_ACKED=10000 gives the figure in docs/reliability.md).
ACKED_PER_ROUND = int(os.environ.get("MARU_CRASH_ACKED", "200"))


class Writer(threading.Thread):
    """Stores batches of 4 unique random objects until the server stops answering."""

    def __init__(self, url: str, pool: mmap.mmap, name: str) -> None:
        super().__init__(daemon=True)
        self.url, self.pool, self.tag = url, pool, name
        self.data: dict[str, bytes] = {}
        self.acked: list[str] = []
        self.n = 0

    def run(self) -> None:
        with RawClient(self.url, timeout_s=1.0) as c:
            try:
                c.handshake()
                while True:
                    keys = [f"{self.tag}-{self.n + i}" for i in range(4)]
                    self.n += 4
                    sizes = [1 + int.from_bytes(os.urandom(2), "little") % 9000 for _ in keys]
                    r = c.call(Op.RESERVE, sizes=sizes)
                    for k, (_, off, size) in zip(keys, r["allocs"], strict=True):
                        value = os.urandom(size)
                        self.data[k] = value
                        self.pool[off : off + size] = value
                    res = c.call(Op.COMMIT, items=[[k, a[0]] for k, a in zip(keys, r["allocs"], strict=True)])
                    assert res["results"] == ["stored"] * 4, res
                    self.acked.extend(keys)  # only now: the reply is the acknowledgement
            except (TimeoutError, KeyError, TypeError):
                return  # the server died mid-request (or answered with an error while dying)


def test_acknowledged_stores_survive_three_kill_9s_with_their_bytes(tmp_path: Path) -> None:
    all_data: dict[str, bytes] = {}
    acked: set[str] = set()
    # Room for every store of every round (objects are at most 3 pages): no eviction may hide a loss.
    pool_mib = 64 + ACKED_PER_ROUND * ROUNDS * 16 // 1024
    with ServerProcess(tmp_path, pool_size=f"{pool_mib}M") as srv:
        for rnd in range(ROUNDS):
            pool = map_pool(srv.pool_path)
            writers = [Writer(srv.url, pool, f"r{rnd}w{i}") for i in range(WRITERS)]
            for w in writers:
                w.start()
            deadline = time.monotonic() + 60
            while sum(len(w.acked) for w in writers) < ACKED_PER_ROUND:
                assert time.monotonic() < deadline, "writers made no progress"
                assert any(w.is_alive() for w in writers), "every writer stopped before the kill"
                time.sleep(0.01)
            with RawClient(srv.url) as c:
                assert c.call(Op.STATS)["counters"]["evictions"] == 0  # so a missing key is a loss
            srv.kill()  # SIGKILL while both writers have requests in flight
            for w in writers:
                w.join(timeout=10)
                assert not w.is_alive()
                all_data.update(w.data)
                acked.update(w.acked)
            pool.close()
            srv.start()
            # Every acknowledged store of every round so far: present, with its own bytes.
            pool = map_pool(srv.pool_path)
            with RawClient(srv.url) as c:
                keys = sorted(all_data)
                found: dict[str, bytes] = {}
                for i in range(0, len(keys), 1000):
                    chunk = keys[i : i + 1000]
                    for k, e in zip(chunk, c.call(Op.LOOKUP, keys=chunk)["entries"], strict=True):
                        if e is not None:
                            found[k] = bytes(pool[e[0] : e[0] + e[1]])
            missing = acked - set(found)
            assert not missing, (
                f"round {rnd}: {len(missing)} acknowledged stores lost, e.g. {sorted(missing)[:3]}"
            )
            # In-flight stores (no reply seen) may or may not be there; if there, with their bytes.
            wrong = [k for k, v in found.items() if v != all_data[k]]
            assert not wrong, f"round {rnd}: {len(wrong)} keys name other bytes, e.g. {wrong[:3]}"
            pool.close()
    assert len(acked) >= ROUNDS * ACKED_PER_ROUND
    print(f"{len(acked)} acknowledged stores survived {ROUNDS} kill -9s; {len(all_data)} attempted")
