"""The bench's ``ApiServer`` start: one that lost a port race (EADDRINUSE) is started again.

No vLLM here: the server is a small Python script in its own process that fails the way vLLM does
when the rendezvous port it picked was taken (the message in its log, a non-zero exit) as many times
as asked, then answers ``/health``. A start failing for another reason is not retried.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest

from bench.vllm_harness import ApiServer

SCRIPT = """
import http.server, sys, pathlib
count = pathlib.Path(sys.argv[1]); fails = int(sys.argv[2]); message = sys.argv[3]
n = int(count.read_text()) if count.exists() else 0
count.write_text(str(n + 1))
if n < fails:
    print(message, flush=True)
    sys.exit(1)
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *a):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[4])), H).serve_forever()
"""


class ScriptServer(ApiServer):
    def __init__(self, tmp: Path, fails: int, message: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        super().__init__("probe", {}, port, tmp / "server.log")
        self.count = tmp / "starts"
        (tmp / "server.py").write_text(SCRIPT)
        self.script, self.fails, self.message = tmp / "server.py", fails, message

    def argv(self) -> list[str]:
        return [
            sys.executable,
            str(self.script),
            str(self.count),
            str(self.fails),
            self.message,
            str(self.port),
        ]

    def starts(self) -> int:
        return int(self.count.read_text())


RACE = "torch.distributed.DistNetworkError: ... port 45807 ... EADDRINUSE"


def test_a_start_that_lost_a_port_race_is_started_again(tmp_path: Path) -> None:
    srv = ScriptServer(tmp_path, fails=2, message=RACE).start()
    try:
        srv.wait_ready(timeout=30, port_retries=2)
        assert srv.starts() == 3
    finally:
        srv.close()


def test_retries_are_bounded_and_the_last_failure_is_raised(tmp_path: Path) -> None:
    srv = ScriptServer(tmp_path, fails=5, message=RACE).start()
    try:
        with pytest.raises(RuntimeError, match="EADDRINUSE"):
            srv.wait_ready(timeout=30, port_retries=1)
        assert srv.starts() == 2
    finally:
        srv.close()


def test_another_failure_is_not_retried(tmp_path: Path) -> None:
    srv = ScriptServer(tmp_path, fails=1, message="CUDA out of memory").start()
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            srv.wait_ready(timeout=30)
        assert srv.starts() == 1
    finally:
        srv.close()


def test_host_facts_name_the_cpu_and_time_a_fixed_loop() -> None:
    from bench.vllm_harness import host_facts

    said = host_facts(loop_n=10_000)
    assert said.count(",") >= 2 and "CPUs" in said
    ms = int(said.rsplit(" adds ", 1)[1].removesuffix(" ms"))
    assert ms >= 0


def test_each_server_s_metrics_are_its_own_whatever_folder_the_parent_had(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM keeps Prometheus counters in files under ``PROMETHEUS_MULTIPROC_DIR`` where it is set:
    servers inheriting one folder report each other's counts (a CI run: a plain instance showed a
    warm one's external hits). A parent that ran vLLM in process has it set; a server never
    inherits it."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path / "shared"))
    seen = tmp_path / "seen"

    class EnvServer(ApiServer):
        def argv(self) -> list[str]:
            code = "import os, sys; open(sys.argv[1], 'w').write(os.environ.get('PROMETHEUS_MULTIPROC_DIR', 'unset'))"
            return [sys.executable, "-c", code, str(seen)]

    srv = EnvServer("env", {}, 0, tmp_path / "server.log").start()
    assert srv.proc is not None and srv.proc.wait(60) == 0
    assert seen.read_text() == "unset"
