"""``maru server --spin-us``: after each request the server polls for the next one before it
sleeps. Every answer stays the server's answer, SIGTERM still stops it, bad values are refused."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from maru.client import MaruHandler
from maru.config import DEFAULT_SPIN_US, MIN_CPUS_TO_SPIN, MaruConfig
from maru.errors import ConfigError
from tests.helpers import REPO_ROOT, ServerProcess, free_port


def test_the_default_polls_only_on_a_host_with_the_cores_for_it() -> None:
    cfg = MaruConfig()
    assert cfg.resolved_spin_us(cpus=MIN_CPUS_TO_SPIN) == DEFAULT_SPIN_US > 0
    assert cfg.resolved_spin_us(cpus=MIN_CPUS_TO_SPIN - 1) == 0
    assert MaruConfig(spin_us=0).resolved_spin_us(cpus=64) == 0  # an explicit value is kept
    assert MaruConfig(spin_us=250).resolved_spin_us(cpus=2) == 250
    with pytest.raises(ConfigError, match="--spin-us"):
        MaruConfig(spin_us=-1)


def test_a_polling_server_answers_bursts_and_sparse_requests_and_stops_on_sigterm(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, pool_size="16M", extra_args=["--spin-us", "5000"]) as srv:
        assert "spin=5000us" in srv.ready_line
        with MaruHandler(srv.url, timeout_s=5) as h:
            data = {f"spin/{i}": os.urandom(512) for i in range(24)}
            objs = h.batch_alloc([512] * len(data))
            for o, d in zip(objs, data.values(), strict=True):
                o.buf[:] = d
            h.batch_store(list(data), objs)
            for i, (k, d) in enumerate(data.items()):  # back to back, then with gaps past the polling
                [r] = h.batch_retrieve([k])
                assert r is not None and bytes(r.view) == d
                h.batch_release([r])
                if i % 6 == 5:
                    time.sleep(0.01)
            assert h.exists(list(data) + ["spin/none"]) == [True] * len(data) + [False]
        t0 = time.monotonic()
        assert srv.stop() == 0  # a polling loop still sees SIGTERM
        assert time.monotonic() - t0 < 8.0
        assert "stopped" in srv.log()


@pytest.mark.parametrize("value", ["-1", "1000000"])
def test_a_spin_out_of_range_is_refused_with_exit_code_2(tmp_path: Path, value: str) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "maru.server", "--port", str(free_port()), "--pool-path", str(tmp_path / "p"),
         "--state-dir", str(tmp_path), "--spin-us", value],
        capture_output=True, text=True, timeout=30, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)),
    )  # fmt: skip
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "--spin-us" in res.stderr and "0..100000" in res.stderr
    assert not (tmp_path / "p").exists()
