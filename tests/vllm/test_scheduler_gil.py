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
from tests.gil_witness import GilWitness, quiet_interpreter  # noqa: F401 (a fixture)
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server
from tests.vllm.helpers import publish, req, tokens

server = module_server("scheduler-gil", pool_size="16M")

CHUNK, BLOCK = 256, 16  # vLLM's GPU geometry: a chunk is 2081 bytes to hash


def _scheduler(server: ServerProcess, client: MaruHandler) -> MaruSchedulerConnector:
    keyer = ChunkKeyer(KeySpace("gil-model", "", "bfloat16", 32, 8, 128, CHUNK))
    cfg = MaruConnectorConfig(server_url=server.url, kv_chunk_tokens=CHUNK)
    return MaruSchedulerConnector(cfg, keyer, BLOCK, client_factory=lambda: client)


@pytest.mark.usefixtures("quiet_interpreter")
def test_the_witness_sees_a_call_that_gives_the_gil_up() -> None:
    """The check can fail: a hashlib call on 2048 bytes or more gives the GIL up, and is seen (a
    long one here, so that the witness is scheduled in time even on a loaded machine)."""
    import hashlib

    data = bytes(32 << 20)
    with GilWitness() as w:
        seen = sum(w.gave_up(lambda: hashlib.blake2b(data, digest_size=16).digest()) for _ in range(5))
    assert seen > 0


@pytest.mark.usefixtures("quiet_interpreter")
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


@pytest.mark.usefixtures("quiet_interpreter")
def test_a_storing_requests_whole_life_on_the_scheduler_never_gives_the_gil_up(server) -> None:
    """Matched (a miss), allocated, its stores planned in the step, decoding steps, finished: no
    hook of a request that needs no round trip gives vLLM's scheduling thread's GIL up."""
    from maru.vllm.metadata import MaruConnectorMetadata
    from tests.vllm.helpers import blocks_obj, cached_out, new_out

    with MaruHandler(server.url, timeout_s=5) as client:
        sched = _scheduler(server, client)
        sched.get_num_new_matched_tokens(req("warm", tokens(300, seed=3)), 0)  # connects
        moved, metas = 0, []
        with GilWitness() as w:
            for i in range(6):
                r = req(f"s{i}", tokens(2300 + 16 * i, seed=40 + i))
                n_blocks = -(-len(r.prompt_token_ids) // BLOCK)
                blocks = list(range(1000 * i, 1000 * i + n_blocks))
                calls = [
                    lambda r=r: sched.get_num_new_matched_tokens(r, 0),
                    lambda r=r, b=blocks: sched.update_state_after_alloc(r, blocks_obj(b), 0),
                    lambda r=r, b=blocks: metas.append(
                        sched.build_connector_meta(new_out(r.request_id, b, 0, len(r.prompt_token_ids)))
                    ),
                    lambda r=r: metas.append(
                        sched.build_connector_meta(cached_out(r.request_id, None, len(r.prompt_token_ids), 1))
                    ),
                    lambda r=r, b=blocks: sched.request_finished(r, b),
                ]
                moved += sum(w.gave_up(c) for c in calls)
        sched.shutdown()
    stores = [m for m in metas if isinstance(m, MaruConnectorMetadata) and m.stores]
    assert len(stores) == 6  # each request's chunks were planned for storing in its first step
    assert moved == 0, f"{moved} hook calls gave the GIL up"
