"""Soak: 32 client processes for 60 s store and read one pool while the test stalls some of
them past their lease (SIGSTOP/SIGCONT); every byte of every hit is compared with what its key
says it must be. The promise: no hit ever returns bytes other than the committed ones."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maru.client import MaruHandler
from tests.helpers import REPO_ROOT, ServerProcess

WORKERS = 32
SECONDS = 60.0
LEASE_S = 3.0


@pytest.mark.slow
def test_32_clients_for_60_s_with_stalls_never_read_wrong_bytes(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1")
    with ServerProcess(tmp_path, pool_size="64M", lease_timeout=LEASE_S, log_level="WARNING") as srv:
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.soak_worker", srv.url, str(i), str(WORKERS), str(SECONDS)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
            for i in range(WORKERS)
        ]
        try:
            # Stall a few workers past their lease while the others work on (bounded: 5 stalls).
            rng = random.Random(0)
            time.sleep(10)
            for _ in range(5):
                victim = procs[rng.randrange(WORKERS)]
                victim.send_signal(signal.SIGSTOP)
                time.sleep(LEASE_S + 2.0)
                victim.send_signal(signal.SIGCONT)
                time.sleep(2.0)
            results = []
            for p in procs:
                out, err = p.communicate(timeout=SECONDS + 60)
                assert p.returncode == 0, err.decode()[-2000:]
                results.append(json.loads(out.decode().strip().splitlines()[-1]))
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGCONT)
                    p.kill()
                    p.wait(timeout=10)
        total = {k: sum(r[k] for r in results) for k in results[0] if k != "integrity"}
        assert total["wrong"] == 0, total
        assert total["hits"] > 0 and total["stores"] > 0 and total["bytes_verified"] > 0, total
        with MaruHandler(srv.url) as h:
            c = h.stats()["counters"]
        assert c["integrity_failures"] == 0, c
        # The stalls did happen. Whether a stalled worker held a reservation at that moment (then
        # quarantined) is chance: with the compiled checksum a reservation is short-lived, and one
        # CI run saw 5 expired leases and 0 quarantines. The quarantine path has deterministic
        # tests of its own (tests/e2e/test_multiprocess.py, tests/server/test_server_process.py).
        assert c["leases_expired"] >= 1, c
        print("soak totals:", total, {k: c[k] for k in ("leases_expired", "quarantines", "evictions")})
