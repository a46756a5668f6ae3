"""vLLM's scheduling thread keeps the GIL through Maru's probe of a new request (key index on).

Why it matters: the probe runs on vLLM's scheduling thread, in a process where other Python
threads run (vLLM's input and output threads; in a one-GPU engine, the worker's). A call that
gives the GIL up, however briefly, must take it back from whichever of them took it, and waits
up to the switch interval (5 ms) for that: a 256-token chunk hashed in one hashlib call did so
once a chunk (``maru.vllm.keys``).

How it is seen without timing anything: ``tests.gil_witness``.
"""

from __future__ import annotations

import pytest

from maru.client import MaruHandler
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import ChunkKeyer, KeySpace
from maru.vllm.prefix_probe import answers_locally
from maru.vllm.scheduler import MaruSchedulerConnector
from tests.gil_witness import GilWitness, long_switch_interval  # noqa: F401 (a fixture)
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server
from tests.vllm.helpers import publish, req, tokens

server = module_server("scheduler-gil", pool_size="16M")

CHUNK, BLOCK = 256, 16  # vLLM's GPU geometry: a chunk is 2081 bytes to hash


def _scheduler(server: ServerProcess, client: MaruHandler) -> MaruSchedulerConnector:
    keyer = ChunkKeyer(KeySpace("gil-model", "", "bfloat16", 32, 8, 128, CHUNK))
    cfg = MaruConnectorConfig(server_url=server.url, kv_chunk_tokens=CHUNK)
    return MaruSchedulerConnector(cfg, keyer, BLOCK, client_factory=lambda: client)


@pytest.mark.usefixtures("long_switch_interval")
def test_the_witness_sees_a_call_that_gives_the_gil_up() -> None:
    """The check can fail: a hashlib call on 2048 bytes or more gives the GIL up, and is seen (a
    long one here, so that the witness is scheduled in time even on a loaded machine)."""
    import hashlib

    data = bytes(32 << 20)
    with GilWitness() as w:
        seen = sum(w.gave_up(lambda: hashlib.blake2b(data, digest_size=16).digest()) for _ in range(5))
    assert seen > 0


@pytest.mark.usefixtures("long_switch_interval")
def test_the_probe_of_new_requests_never_gives_the_gil_up(server) -> None:
    system = tokens(2048, seed=1)
    prompts = [system + tokens(130 + 16 * u, seed=10 + u) for u in range(8)]
    with MaruHandler(server.url, timeout_s=5) as client:
        sched = _scheduler(server, client)
        stored = sched._state(req("stored", prompts[0]))
        assert stored is not None
        publish(server, stored.keys.full[:6])  # the pool holds most of the system prompt
        sched.get_num_new_matched_tokens(req("warm", tokens(300, seed=2)), 0)  # connects, reports its path
        assert answers_locally(client)
        offers, moved = [], 0
        with GilWitness() as w:
            for i, p in enumerate(prompts * 4):
                moved += w.gave_up(
                    lambda i=i, p=p: offers.append(sched.get_num_new_matched_tokens(req(f"r{i}", p), 0))
                )
        sched.shutdown()
    assert offers[0] == (6 * CHUNK, False) and len(set(offers)) == 1  # every request probed, each a hit
    assert moved == 0, f"{moved} of {len(offers)} probes gave the GIL up"
