"""An off connector is visible from outside its process: it reports why it is off to the server, so
``maru doctor`` and ``maru stats`` show it (``RefusalReport``), without ever mapping the pool and
without vLLM's start waiting on the server."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.errors import PoolError
from maru.vllm.refusal import RefusalReport, refusal_info
from tests.helpers import ServerProcess, flat, maru, reported_slow
from tests.pool_fixtures import module_server
from tests.vllm.helpers import vllm_config

pytest.importorskip("vllm")
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402

from maru.vllm.connector import MaruKVConnector  # noqa: E402

server = module_server("refusal-server")


def _pipeline(vc: SimpleNamespace) -> None:
    vc.parallel_config.pipeline_parallel_size = 2


def _sleep(vc: SimpleNamespace) -> None:
    vc.model_config.enable_sleep_mode = True
    vc.kv_transfer_config.kv_connector_extra_config["maru_allow_sleep_mode"] = False


@pytest.mark.parametrize(
    ("refuse", "said"),
    [(_pipeline, "pipeline parallelism (pipeline_parallel_size=2)"), (_sleep, "vLLM's sleep mode is on")],
    ids=["pipeline-parallel", "sleep-mode"],
)
def test_a_refused_connector_shows_in_maru_doctor_with_its_reason_and_fix(
    server: ServerProcess, refuse: Any, said: str
) -> None:
    vc = vllm_config(server.url, False)
    refuse(vc)
    before = set(reported_slow(server))
    conn = MaruKVConnector(vc, KVConnectorRole.SCHEDULER)
    try:
        cfg = conn.maru_config
        assert not (cfg.enable_load or cfg.enable_store)
        (why,) = cfg.fallbacks
        assert said in why and "Fix:" in why
        assert conn._refusal is not None and conn._refusal.reported.wait(20)
        new = {cid: slow for cid, slow in reported_slow(server).items() if cid not in before}
        assert list(new.values()) == [[why]]
        p = maru("doctor", "--url", server.url, "--quick")
        assert p.returncode == 0, p.stdout + p.stderr  # a warning, not a failure
        out = flat(p.stdout)
        row = out[out.index("serving clients' data paths") :]
        assert "vllm-scheduler" in row and "connector=off" in row and flat(said) in row
    finally:
        conn.shutdown()
    assert conn._refusal._thread.is_alive() is False


def test_a_connector_turned_off_by_its_user_reports_nothing(server: ServerProcess) -> None:
    conn = MaruKVConnector(
        vllm_config(server.url, False, maru_enable_load=False, maru_enable_store=False),
        KVConnectorRole.SCHEDULER,
    )
    try:
        assert conn._refusal is None and conn.maru_config.fallbacks == ()
    finally:
        conn.shutdown()


def test_the_report_waits_for_a_server_that_does_not_answer_yet_without_raising(
    server: ServerProcess,
) -> None:
    tries: list[int] = []
    made: list[MaruHandler] = []

    def connect() -> MaruHandler:
        tries.append(1)
        if len(tries) < 3:
            raise ConnectionRefusedError("no server yet")
        made.append(MaruHandler(server.url, map_pool=False))
        return made[0]

    info = refusal_info(["the connector is off: a test reason. Fix: none"])
    report = RefusalReport(connect, info, retry_s=0.01)
    try:
        assert report.reported.wait(20)
        assert len(tries) == 3 and reported_slow(server)[made[0].client_id] == info["slow"]
    finally:
        report.close()
    assert made[0].connected is False


def test_closing_a_report_that_never_connected_stops_it(server: ServerProcess) -> None:
    gate = threading.Event()

    def never() -> Any:
        gate.set()
        raise ConnectionRefusedError("down")

    report = RefusalReport(never, refusal_info([]), retry_s=60.0)
    assert gate.wait(10)
    report.close()  # does not wait the minute out
    assert not report._thread.is_alive() and not report.reported.is_set()


def test_a_report_only_client_maps_no_pool_and_refuses_data_calls_clearly(server: ServerProcess) -> None:
    with MaruHandler(server.url, map_pool=False) as h:
        assert h._mapping is None and h.connected
        h.set_client_info(refusal_info(["x. Fix: y"]))
        assert reported_slow(server)[h.client_id] == ["x. Fix: y"]
        with pytest.raises(PoolError, match="map_pool=False"):
            h.alloc(4096)
        with pytest.raises(PoolError, match="map_pool=False"):
            h.batch_retrieve(["some-key"])
