"""The key space an engine derives from vLLM's config (``maru.vllm.engine_config.key_space``): whatever
makes its KV differ from another engine's for the same tokens must give other keys; nothing else
may (instances of one model must share)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import ChunkKeyer, KeySpace

pytest.importorskip("vllm")

from maru.vllm.engine_config import key_space  # noqa: E402

TOKENS = list(range(3, 300))


def config(cache_dtype: str = "auto", speculative: Any = None, **model: Any) -> SimpleNamespace:
    mc = SimpleNamespace(
        model="org/model",
        revision=None,
        dtype=model.pop("dtype", "torch.bfloat16"),
        get_num_layers=lambda pc: 4,
        get_num_kv_heads=lambda pc: 2,
        get_head_size=lambda: 64,
        **model,
    )
    return SimpleNamespace(
        model_config=mc,
        parallel_config=SimpleNamespace(tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype=cache_dtype),
        speculative_config=speculative,
    )


def keys(vc: SimpleNamespace) -> list[str]:
    return ChunkKeyer(key_space(vc, MaruConnectorConfig(kv_chunk_tokens=64))).prompt_keys(TOKENS).full


def rope(factor: float) -> dict[str, Any]:
    return {"rope_scaling": {"rope_type": "yarn", "factor": factor}}


def test_a_plain_engine_keeps_the_keys_it_had_before_compute_overrides_existed() -> None:
    space = key_space(config(quantization=None, hf_overrides={}), MaruConnectorConfig(kv_chunk_tokens=64))
    assert space.compute == ""
    plain = KeySpace("org/model", "", "torch.bfloat16", 4, 2, 64, 64)
    assert keys(config()) == ChunkKeyer(plain).prompt_keys(TOKENS).full


@pytest.mark.parametrize(
    "other",
    [
        config(quantization="fp8"),  # the weights quantized at load
        config(quantization_config={"weight_block_size": [128, 128]}),
        config(hf_overrides=rope(4.0)),  # a RoPE scaling: every K rotated otherwise
        config(hf_overrides=rope(2.0)),
        config("fp8", dtype="torch.float16"),  # an fp8 cache of an fp16 model ...
        # A draft model's layers are in the engine's KV cache, so in every chunk it stores.
        config(speculative=SimpleNamespace(method="eagle3", model="org/eagle", draft_model_config=object())),
        config(
            speculative=SimpleNamespace(
                method="mtp", model=None, draft_model_config=SimpleNamespace(model="org/model")
            )
        ),
        config(hf_overrides={"rope_scaling": None}),  # an override to None is an override
        # Engine-wide image processing, merged after vLLM hashed each image (not in its identifier).
        config(multimodal_config=SimpleNamespace(mm_processor_kwargs={"num_crops": 4}, media_io_kwargs={})),
        config(
            multimodal_config=SimpleNamespace(
                mm_processor_kwargs=None, media_io_kwargs={"video": {"num_frames": 8}}
            )
        ),
    ],
)
def test_what_changes_the_kv_of_the_same_checkpoint_changes_every_key(other: SimpleNamespace) -> None:
    base = config("fp8") if other.cache_config.cache_dtype == "fp8" else config()  # ... of a bf16 one
    assert not set(keys(base)) & set(keys(other))
    assert keys(other) == keys(other)  # and is the same in every process (no address, no order)


def test_settings_that_change_nothing_keep_a_plain_engines_keys() -> None:
    """An explicit KV cache dtype equal to the model's, and a quantization config whose fields are
    all unset, compute what a plain engine computes: the same keys."""
    from dataclasses import dataclass

    @dataclass
    class QuantArgs:  # the shape of vLLM's QuantizationConfigArgs
        weight_block_size: list[int] | None = None
        activation_scheme: str | None = None

    plain = keys(config())
    assert keys(config("bfloat16")) == plain  # the model's own dtype, named: the same bytes
    assert keys(config(quantization_config=QuantArgs())) == plain
    assert keys(config(quantization_config=QuantArgs(activation_scheme="dynamic"))) != plain
    # n-gram speculation has no KV layers of its own: the plain engine's keys. (vLLM gives it the
    # target's model config as its "draft".)
    vc = config()
    vc.speculative_config = SimpleNamespace(
        method="ngram", model=None, draft_model_config=vc.model_config, target_model_config=vc.model_config
    )
    assert keys(vc) == plain
    # A multimodal model with its default processing: the plain keys.
    assert (
        keys(config(multimodal_config=SimpleNamespace(mm_processor_kwargs=None, media_io_kwargs={}))) == plain
    )


def test_a_draft_models_revision_changes_every_key() -> None:
    def eagle(revision: str | None) -> SimpleNamespace:
        draft = SimpleNamespace(model="org/eagle", revision=revision, quantization=None)
        return config(
            speculative=SimpleNamespace(method="eagle", model="org/eagle", draft_model_config=draft)
        )

    assert keys(eagle("v1")) == keys(eagle("v1"))
    assert not set(keys(eagle("v1"))) & set(keys(eagle("v2")))


def test_equal_overrides_share_keys_whatever_their_order_and_a_callable_counts_by_name() -> None:
    a = config(
        hf_overrides={"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "max_position_embeddings": 8}
    )
    b = config(
        hf_overrides={"max_position_embeddings": 8, "rope_scaling": {"factor": 4.0, "rope_type": "yarn"}}
    )
    assert keys(a) == keys(b)

    def override(cfg: Any) -> Any:
        return cfg

    named = key_space(config(hf_overrides=override), MaruConnectorConfig(kv_chunk_tokens=64)).compute
    assert "test_key_space" in named and "override" in named and "0x" not in named
