"""Stand-ins for what vLLM's scheduler hands the connector, shared by the scheduler-side tests.

Requests with token ids, block lists and per-step scheduler outputs (``new_out``, ``cached_out``,
``empty_out``), so each rule can be driven exactly; ``publish`` puts keys on a real server and
``CountingClient`` counts the EXISTS round trips. No tests here: test modules import this, never
each other.
"""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from maru.client import MaruHandler
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import ChunkKeyer
from maru.vllm.scheduler import MaruSchedulerConnector
from tests.helpers import ServerProcess

BS, C = 32, 64


class CountingClient:
    """A real MaruHandler that counts exists round trips."""

    def __init__(self, url: str) -> None:
        self.h = MaruHandler(url, timeout_s=2)
        self.exists_calls = 0
        self.keys_asked = 0

    def exists(self, keys: list[str]) -> list[bool]:
        self.exists_calls += 1
        self.keys_asked += len(keys)
        return self.h.exists(keys)

    def close(self) -> None:
        self.h.close()


def make_sched(
    server: ServerProcess, keyer: ChunkKeyer, client: Any, local_prefix_cache: bool = True, **cfg: Any
) -> MaruSchedulerConnector:
    conf = MaruConnectorConfig(server_url=server.url, kv_chunk_tokens=C, **cfg)
    return MaruSchedulerConnector(
        conf, keyer, BS, client_factory=lambda: client, local_prefix_cache=local_prefix_cache
    )


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def req(rid: str, toks: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=rid, prompt_token_ids=toks, num_tokens=len(toks), lora_request=None, mm_features=[]
    )


def publish(server: ServerProcess, keys: list[str]) -> None:
    with MaruHandler(server.url, timeout_s=2) as h:
        objs = h.batch_alloc([8] * len(keys))
        for o in objs:
            o.buf[:] = b"\0" * 8
        h.batch_store(keys, objs)


def stored_keys_of(sched: MaruSchedulerConnector, toks: list[int]) -> tuple[list[str], str | None]:
    st = sched._state(req("probe", toks))
    full, tail = st.keys.full, (st.own_tail[1] if st.own_tail else None)
    sched._reqs.pop("probe")
    return full, tail


def stored_then_asked(
    server: ServerProcess, sched: MaruSchedulerConnector, seed: int, rid: str = "a"
) -> tuple[SimpleNamespace, list[str], str, tuple[int | None, bool]]:
    """A 300-token prompt stored whole (its four chunks and tail), then asked for by request
    ``rid``: (the request, the chunk keys, the tail key, ``sched``'s answer)."""
    toks = tokens(300, seed=seed)
    full, tail = stored_keys_of(sched, toks)
    assert tail is not None
    publish(server, full + [tail])
    r = req(rid, toks)
    return r, full, tail, sched.get_num_new_matched_tokens(r, 0)


def new_out(rid: str, blocks: list[int], computed: int, scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, block_ids=(blocks,), num_computed_tokens=computed)],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={rid: scheduled},
        preempted_req_ids=set(),
    )


def cached_out(
    rid: str,
    new_blocks: list[int] | None,
    computed: int,
    scheduled: int,
    resumed: bool = False,
    preempted: set[str] | None = None,
) -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[rid],
            resumed_req_ids={rid} if resumed else set(),
            new_block_ids=[(new_blocks,) if new_blocks is not None else None],
            num_computed_tokens=[computed],
        ),
        num_scheduled_tokens={rid: scheduled},
        preempted_req_ids=preempted or set(),
    )


def as_v034(out: SimpleNamespace) -> SimpleNamespace:
    """``out`` as vLLM 0.34 shapes a step: ``scheduled_cached_reqs`` has no ``resumed_req_ids`` (a
    resumed request is sent in full among the new ones, as ``new_out`` builds it)."""
    cached = SimpleNamespace(**vars(out.scheduled_cached_reqs))
    del cached.resumed_req_ids
    return SimpleNamespace(**{**vars(out), "scheduled_cached_reqs": cached})


def blocks_obj(ids: list[int]) -> SimpleNamespace:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def empty_out() -> SimpleNamespace:
    return SimpleNamespace(
        scheduled_new_reqs=[],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
        ),
        num_scheduled_tokens={},
        preempted_req_ids=set(),
    )


_models = iter(range(10**6))


def vllm_config(url: str, v2: Any, **extra: Any) -> SimpleNamespace:
    """What the facade reads of a ``VllmConfig``; ``v2`` is ``use_v2_model_runner`` (a callable raises)."""
    mc = SimpleNamespace(
        model=f"proto-model-{next(_models)}",  # a fresh key space per connector
        dtype="float32",
        revision=None,
        get_num_layers=lambda pc: 2,
        get_num_kv_heads=lambda pc: 2,
        get_head_size=lambda: 32,
    )
    ns = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(
            kv_connector_extra_config={"maru_server_url": url, "maru_kv_chunk_tokens": C, **extra},
            kv_load_failure_policy="recompute",
        ),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        model_config=mc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    if callable(v2):
        cls = type("RaisingConfig", (SimpleNamespace,), {"use_v2_model_runner": property(lambda self: v2())})
        ns = cls(**ns.__dict__)
    elif v2 is not None:
        ns.use_v2_model_runner = v2
    return ns


def write_adapter(d: Path, seed: int, size: int = 3000) -> str:
    """An adapter directory as PEFT writes one (a config, a weights file) with random bytes."""
    d.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    (d / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (d / "adapter_model.safetensors").write_bytes(bytes(rng.randrange(256) for _ in range(size)))
    return str(d)


class LoRARequest(SimpleNamespace):
    """Stands for vLLM's ``LoRARequest`` (Maru keys an adapter only for that class: a subclass may
    bring its weights another way)."""


def lora(name: str, path: str, lora_int_id: int = 1, **kw: object) -> LoRARequest:
    return LoRARequest(lora_name=name, lora_int_id=lora_int_id, lora_path=path, **kw)
