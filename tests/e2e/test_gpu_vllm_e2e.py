"""MaruKVConnector end to end on a GPU with real vLLM: A stores, B loads, the output stays the same.

The model has Llama-3-8B's KV geometry (32 layers, 8 KV heads of 128, bf16, block 16), random
weights, generated locally (``bench/vllm_harness.py``). One real ``maru server``; seven vLLM
engines, each in its own process, started together (start-up overlaps) and driven in turn:

- A (Maru, synchronous store): computes a batch X of four prompts together, then X again
  (vLLM's own prefix hit: the reference for a warm run's numerics), and three eviction prompts;
- B-sync (``maru_overlap_load_with_compute=false``: the whole load before the forward),
  B-async (``maru_async_load``), B-overlap (``maru_overlap_load_with_compute``, the default on a
  GPU, with write-behind store): each loads X as a batch of concurrent hits. B-sync, B-async and
  B-plain (the layer-by-layer load issued at the forward; vLLM's asynchronous scheduling off) meet a chunk
  deleted between the scheduler's offer and the load (a connector subclass deletes it at
  ``start_load_kv``): B-sync and B-async hold what they offer pinned (the default), so the load
  still places it; B-plain runs with ``maru_hold_offers=false`` (the worker pins its loads itself
  before the forward), finds it gone and recomputes. B-overlap computes a batch Y and stores it
  write-behind, and B-sync loads Y. B-sync runs vLLM 0.26's default V2 model runner with
  same-step loads (offer pins make them safe there: vLLM issue #49250, see
  ``maru.vllm.connector``); B-plain and B-overlap the V1 runner (``VLLM_USE_V2_MODEL_RUNNER=0``);
  on CPU both are V1;
- B-early: the default V2 runner and layer-by-layer load with ``maru_early_load`` set (each step's
  load issued when vLLM plans the step; the default, as in B-overlap on the V1 runner): loads X as a
  batch of concurrent hits;
- P (write-behind, a slow drain, a KV cache too small for its two growing requests): preemption
  while stores are in flight; B-sync then loads what P stored.

"Same output" on a GPU: greedy tokens compared with ``same_greedy`` (identical, or a bf16 near-tie
where each side's token is in the other's top-5); a wrong KV shows up as ``different``.
Run on a GPU host with vLLM: ``pytest -m gpu tests/e2e/test_gpu_vllm_e2e.py`` (about 2 minutes
on an H200, most of it engine start-up); ``bench/gpu_vllm_pass.sh`` runs it on the device.
``MARU_GPU_E2E_KV`` (JSON) adds connector keys to every engine: a candidate default runs these
scenarios before it becomes one.
"""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

if importlib.util.find_spec("vllm") is None:  # pragma: no cover
    pytest.skip("vLLM is not installed", allow_module_level=True)

from bench.vllm_harness import (  # noqa: E402
    GPU_MODEL,
    TINY_MODEL,
    Engine,
    make_model,
    maru_kv_config,
    random_prompt,
)
from tests.e2e.gpu_runs import Runs, assert_same, generate_counted  # noqa: E402
from tests.helpers import ServerProcess  # noqa: E402

# MARU_GPU_E2E_TINY=1 runs the same scenarios on vLLM's CPU build with a tiny model, to debug the
# module without a GPU: ``MARU_GPU_E2E_TINY=1 pytest --noconftest tests/e2e/test_gpu_vllm_e2e.py``.
TINY = os.environ.get("MARU_GPU_E2E_TINY") == "1"
MODEL = TINY_MODEL if TINY else GPU_MODEL
BS, C = (32, 64) if TINY else (16, 256)
MAX_TOKENS = 8
V = MODEL.vocab
X = [random_prompt(1500, 100 + i, V) for i in range(4)]  # loaded as a batch of four hits
Y = [random_prompt(1200, 200 + i, V) for i in range(4)]  # stored write-behind by B-overlap
# A chunk deleted before the load: E1 a same-step load on vLLM's V2 runner, E2 an async load (both
# pinned at the offer), E3 a same-step load on the V1 runner without offer pins, with vLLM's
# asynchronous scheduling off (vLLM 0.26 turns it on by default on GPUs).
E1, E2, E3 = (random_prompt(1000, 301 + i, V) for i in range(3))
P = [random_prompt(1000, 400 + i, V) for i in range(2)]  # preempted under write-behind
# Four prompts with one head (a system prompt) and tails of their own, arriving together at an
# async-loading instance: the head's chunks are loaded once, the others wait for vLLM's cache.
HEAD = random_prompt(5 * C + 20, 500, V)
S = [HEAD + random_prompt(300, 510 + i, V) for i in range(4)]
P_TOKENS = 400


def offered(prompt: list[int]) -> int:
    """What a warm instance takes from Maru: everything but the last token, block-aligned."""
    return (len(prompt) - 1) // BS * BS


def objects(prompt: list[int]) -> int:
    """Pool objects a computed prompt is stored as: its full chunks and the block-aligned tail."""
    return offered(prompt) // C + (1 if offered(prompt) % C else 0)


def __getattr__(name: str) -> Any:
    # Built on first access (by vLLM's connector factory in the engine process), so collecting
    # this module does not import vLLM.
    if name == "EvictBeforeLoadConnector":
        return _evicting_connector_class()
    raise AttributeError(name)


def _evicting_connector_class() -> type:
    from maru.client import MaruHandler
    from maru.vllm import MaruKVConnector
    from maru.vllm.keys import ChunkKeyer

    class EvictBeforeLoadConnector(MaruKVConnector):
        """Deletes one stored chunk of a prompt at the next ``start_load_kv``, once per flag file.

        The flag file (path in the extra config key ``test_evict_flag``, not a ``maru_`` key, so
        the connector ignores it) holds ``{"prompt": [ids], "chunk": i}``. The scheduler has
        already offered the chunk when this runs: pinned (the default), the load still places it;
        without offer pins the worker's lookup-and-pin (now, or on the loader thread) finds it gone.
        """

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            flag = self._kv_transfer_config.kv_connector_extra_config.get("test_evict_flag")
            if flag and os.path.exists(flag):
                spec = json.loads(Path(flag).read_text())
                os.unlink(flag)
                key = ChunkKeyer(self.key_space).prompt_keys(spec["prompt"]).full[spec["chunk"]]
                with MaruHandler(self.maru_config.server_url, timeout_s=5) as h:
                    h.delete([key])
            super().start_load_kv(forward_context, **kwargs)

    return EvictBeforeLoadConnector


def _gen(e: Engine, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
    return generate_counted(e, prompts, max_tokens)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Runs]:
    import torch

    if not (torch.cuda.is_available() or TINY):
        pytest.skip("needs a CUDA device")
    tmp = tmp_path_factory.mktemp("gpu-vllm")
    logs = Path(os.environ.get("MARU_GPU_E2E_LOG_DIR", tmp))
    default_dir = Path(tempfile.gettempdir()) / ("h4-model-tiny" if TINY else "h4-model-l3kv")
    model = str(make_model(os.environ.get("MARU_GPU_E2E_MODEL_DIR", default_dir), MODEL))
    srv = ServerProcess(tmp, pool_size="3G", log_level="WARNING")
    srv.start()
    base = {"model": model, "dtype": MODEL.dtype, "block_size": BS, "max_model_len": 2048,
            "kv_cache_memory_bytes": 2 << 30, "max_num_batched_tokens": 8192,
            "gpu_memory_utilization": None if TINY else 0.1}  # fmt: skip
    if TINY:
        base["kv_cache_memory_bytes"] = 256 << 20
    extra = {"maru_server_url": srv.url, "maru_kv_chunk_tokens": C, "maru_log_timing": True}
    # MARU_GPU_E2E_KV: more connector keys for every engine, as JSON (a candidate default run
    # through these scenarios before it becomes one, e.g. '{"maru_paced_store": false}').
    extra.update(json.loads(os.environ.get("MARU_GPU_E2E_KV", "{}")))
    evict = {"module": "tests.e2e.test_gpu_vllm_e2e", "name": "EvictBeforeLoadConnector"}
    flag = tmp / "evict-now"

    def kv(more: dict[str, Any], **cls: str) -> dict[str, Any]:
        return maru_kv_config({**extra, **more, "test_evict_flag": str(flag)}, **cls)

    # P: a cache of 2400 tokens for two requests of 1000 growing to 1400 each: preemption.
    small = {
        **base,
        "max_model_len": 1536,
        "kv_cache_memory_bytes": 2400 // BS * BS * MODEL.kv_bytes_per_token(),
    }
    v1_runner = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # same-step loads (see the module docstring)
    specs = {
        "A": ({**base, "kv_transfer_config": kv({})}, {}),
        "B-sync": (
            {**base, "kv_transfer_config": kv({"maru_overlap_load_with_compute": False}, **evict)},
            {},
        ),
        "B-plain": (
            {
                **base,
                "async_scheduling": False,
                # At the forward: the chunk is deleted at start_load_kv, after an early load's pins.
                "kv_transfer_config": kv({"maru_hold_offers": False, "maru_early_load": False}, **evict),
            },
            v1_runner,
        ),
        "B-async": ({**base, "kv_transfer_config": kv({"maru_async_load": True}, **evict)}, {}),
        "B-overlap": (
            {
                **base,
                "kv_transfer_config": kv({"maru_overlap_load_with_compute": True, "maru_async_store": True}),
            },
            v1_runner,
        ),
        # The default (vLLM's V2 runner, its async scheduling, the layer-by-layer load) with each
        # step's load issued when the step is planned (maru_early_load).
        "B-early": (
            {
                **base,
                "kv_transfer_config": kv({"maru_overlap_load_with_compute": True, "maru_early_load": True}),
            },
            {},
        ),
        "P": (
            {**small, "kv_transfer_config": kv({"maru_async_store": True})},
            {"MARU_TEST_STORE_DRAIN_DELAY_S": "4"},  # stores still in flight when it preempts
        ),
    }
    eng = {n: Engine(n, s, logs / f"test-{n}.log", env=env).start() for n, (s, env) in specs.items()}
    res = Runs()
    stage = res.stage

    def evicted(e: Engine, prompt: list[int]) -> dict[str, Any]:
        flag.write_text(json.dumps({"prompt": prompt, "chunk": 1}))
        r = _gen(e, [prompt])
        r["flag_consumed"] = not flag.exists()
        return r

    try:
        a, bs, ba, bo, p = (eng[n] for n in ("A", "B-sync", "B-async", "B-overlap", "P"))
        stage("A-X", lambda: _gen(a, X))
        stage("A-X-hit", lambda: _gen(a, X))
        stage("A-E", lambda: _gen(a, [E1, E2, E3]))
        stage("A-S", lambda: _gen(a, S))
        stage("A-S-hit", lambda: _gen(a, S))
        stage("Bsync-X", lambda: _gen(bs, X))
        stage("Bsync-E1", lambda: evicted(bs, E1))
        stage("Bplain-E3", lambda: evicted(eng["B-plain"], E3))
        stage("Basync-X", lambda: _gen(ba, X))
        stage("Basync-E2", lambda: evicted(ba, E2))
        stage("Basync-S", lambda: {**_gen(ba, S), "sched": ba.stats()["scheduler"]})
        stage("Bovl-X", lambda: {**_gen(bo, X), "sched": bo.stats()["scheduler"]})
        stage("Bearly-X", lambda: {**_gen(eng["B-early"], X), "sched": eng["B-early"].stats()["scheduler"]})
        stage("Bovl-Y", lambda: _gen(bo, Y))
        stage("Bovl-Y-hit", lambda: _gen(bo, Y))
        stage("Bovl-settle", lambda: bo.settle())  # every write-behind store of Y published
        stage("Bovl-stats", lambda: bo.stats())
        stage("Bsync-Y", lambda: _gen(bs, Y))
        stage("Bsync-stats", lambda: bs.stats())
        stage("P-run", lambda: _gen(p, P, max_tokens=P_TOKENS))
        stage("P-settle", lambda: p.settle())
        stage("P-stats", lambda: p.stats())
        stage("Bsync-P", lambda: _gen(bs, P))
        for n, e in eng.items():
            e.close()
            res.setdefault("logs", {})[n] = e.log_path.read_text(errors="replace")
        yield res
    finally:
        for e in eng.values():
            e.close()
        srv.cleanup()


@pytest.mark.parametrize("engine", ["Bsync", "Basync", "Bovl", "Bearly"])
def test_a_batch_of_concurrent_hits_loads_every_prompt_and_keeps_the_output(runs: Runs, engine: str) -> None:
    r, ref = runs.need(f"{engine}-X"), runs.need("A-X-hit")
    assert runs.need("A-X")["cached"] == [0] * 4  # A computed X itself
    assert r["cached"] == [offered(x) for x in X]
    d = r["delta"]
    assert d["tokens_loaded"] == sum(offered(x) for x in X) and d["load_errors"] == 0
    assert d["loads_from_held_pins"] >= 1  # placed from the scheduler's pins: no lookup round trip
    if engine == "Bsync":  # on the V2 runner too: loaded in the step that computes, not parked
        assert d["async_loads"] == 0 and d["overlap_loads"] == 0  # the whole load before the forward
    if engine == "Bovl":  # the V1 runner, maru_early_load by default
        assert d["overlap_loads"] >= 1 and d["layer_loads_unwaited"] == 0
    if engine in ("Bovl", "Bearly"):  # every step's load issued at its plan, none at the forward
        early = r["sched"]["early_loads"]
        assert d["early_loads"] == d["overlap_loads"] >= 1 and d["layer_loads_unwaited"] == 0
        assert early["started"] == d["early_loads"] and early["at_forward"] == {}, early
    assert_same(r, ref)
    assert_same(r, runs.need("A-X"))


def test_prompts_stored_write_behind_load_in_another_instance(runs: Runs) -> None:
    assert runs.need("Bovl-Y")["cached"] == [0] * 4
    if not TINY:  # CUDA: the forward thread records an event; the drain thread reserves and gathers
        w = runs.need("Bovl-stats")["worker"]
        assert "the drain thread reserves, queues the gather" in w["write_behind"]
        assert w["store_failures"] == 0 and w["chunks_stored"] >= sum(objects(y) for y in Y)
    assert runs.need("Bovl-settle")["ok"]  # blocks freed, so every store drained
    r = runs.need("Bsync-Y")
    assert r["cached"] == [offered(y) for y in Y] and r["delta"]["load_errors"] == 0
    assert_same(r, runs.need("Bovl-Y-hit"))


@pytest.mark.parametrize("engine,prompt_index", [("Bsync", 0), ("Basync", 1), ("Bplain", 2)])
def test_a_chunk_deleted_after_the_offer_loads_from_its_pin_or_without_pins_is_recomputed(
    runs: Runs, engine: str, prompt_index: int
) -> None:
    r = runs.need(f"{engine}-E{prompt_index + 1}")
    assert r["flag_consumed"]
    prompt = (E1, E2, E3)[prompt_index]
    if engine == "Bplain":  # maru_hold_offers=false: the worker's lookup finds it gone
        assert r["delta"]["load_errors"] == 1
        assert r["delta"]["tokens_loaded"] == 0  # all or nothing: no partial KV used
    else:  # pinned since the offer: the deletion hides the key, the bytes stay until unpinned
        assert r["delta"]["load_errors"] == 0
        assert r["delta"]["tokens_loaded"] == offered(prompt) and r["cached"] == [offered(prompt)]
    ref = runs.need("A-E")
    one = {k: [v[prompt_index]] for k, v in ref.items() if k in ("tokens", "logprobs")}
    assert_same(r, one)


def test_on_the_v2_runner_each_offer_was_pinned_at_its_request_s_arrival(runs: Runs) -> None:
    """B-sync runs vLLM's V2 runner (offers pinned one at a time): vLLM announced every request
    (on_new_request), its pins were posted then, and no offer waited for a round trip of its own."""
    pins = runs.need("Bsync-stats")["scheduler"]["offer_pins"]
    if TINY and pins["pin_posts"] == 0:  # vLLM's CPU build runs the V1 runner: one trip a step's loads
        assert pins["pin_trips"] >= 3 and pins["open_now"] == 0  # X, E1, Y (at least)
        return
    assert pins["pin_posts"] >= 3 and pins["posts_failed"] == 0  # X, E1, Y (at least)
    assert pins["pin_trips"] == 0
    assert pins["open_now"] == 0 and pins["posts_unread"] == 0 and pins["posts_queued"] == 0


def test_preemption_under_write_behind_frees_every_block_and_stores_every_chunk(runs: Runs) -> None:
    r, st = runs.need("P-run"), runs.need("P-stats")
    sched, w = st["scheduler"], st["worker"]
    assert sched["requests_preempted"] >= 1  # the scenario really preempted
    assert [len(t) for t in r["tokens"]] == [P_TOKENS] * 2
    assert runs.need("P-settle")["ok"] and sched["delayed_frees_now"] == 0
    assert w["store_failures"] == 0 and w["load_errors"] == 0
    # The forward thread only queued each store (the drain thread gathered), the barrier included.
    assert w["write_behind"].startswith("the forward thread records an event") or TINY
    # Every object of both prompts published (a resumed request may find its own store still
    # draining and store a chunk again: the server keeps the first copy and answers "present").
    assert w["chunks_stored"] >= sum(objects(x) for x in P)
    b = runs.need("Bsync-P")
    assert b["cached"] == [offered(x) for x in P] and b["delta"]["load_errors"] == 0
    assert_same(b, r, n=MAX_TOKENS)


def test_async_hits_arriving_together_with_one_head_load_it_once(runs: Runs) -> None:
    """S: one head of 5 chunks and 20 tokens, four tails. The first request loads all of its
    offer; the other three wait for vLLM's prefix cache to hold the head (its whole blocks), then
    load only their own part beyond it."""
    r, ref = runs.need("Basync-S"), runs.need("A-S-hit")
    head_blocks = len(HEAD) // BS * BS
    assert r["cached"] == [offered(x) for x in S]
    want = offered(S[0]) + sum(offered(x) - head_blocks for x in S[1:])
    assert r["delta"]["tokens_loaded"] == want and r["delta"]["load_errors"] == 0
    assert r["sched"]["async_loads_shared"] >= 3
    assert_same(r, ref)
