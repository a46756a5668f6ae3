"""The generated test models: the same spec gives byte-identical files (tests on different machines
run one model), shaped as vLLM loads them."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from maru.demo.tiny_model import build_tiny_lora, build_tiny_model  # noqa: E402
from maru.demo.tiny_vlm import TinyVlmSpec, build_tiny_llava  # noqa: E402


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def test_a_lora_adapter_is_the_same_on_every_build_and_targets_every_attention_projection(
    tmp_path: Path,
) -> None:
    from safetensors import safe_open

    model = build_tiny_model(tmp_path / "model")
    a1, a2 = build_tiny_lora(tmp_path / "a1", model, seed=1), build_tiny_lora(tmp_path / "a2", model, seed=1)
    b = build_tiny_lora(tmp_path / "b", model, seed=2)
    assert digests(a1) == digests(a2) and digests(a1) != digests(b)
    config = json.loads((a1 / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    with safe_open(str(a1 / "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        kv_width = f.get_tensor("base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight").shape[0]
    assert len(keys) == 2 * 4 * 2  # layers x projections x (A, B)
    assert kv_width == 2 * 32  # the tiny model's 2 KV heads of 32: != its 4 query heads


def test_the_tiny_llava_is_the_same_on_every_build_and_loads_as_vllms_llava(tmp_path: Path) -> None:
    one, two = build_tiny_llava(tmp_path / "one"), build_tiny_llava(tmp_path / "two")
    assert digests(one) == digests(two)
    config = json.loads((one / "config.json").read_text())
    assert config["architectures"] == ["LlavaForConditionalGeneration"]  # else vLLM runs a pooling model
    spec = TinyVlmSpec()
    assert spec.image_tokens == 16 and config["image_seq_length"] == 16
    tokenizer = json.loads((one / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in tokenizer["added_tokens"]}
    assert added["<image>"] == config["image_token_index"] < config["text_config"]["vocab_size"]
    from safetensors import safe_open

    with safe_open(str(one / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    # The published llava-hf layout, which vLLM's loader maps (transformers 5 writes another).
    assert any(n.startswith("model.vision_tower.vision_model.") for n in names)
    assert not any(n.startswith("model.vision_tower.embeddings") for n in names)
