"""What the connector reads of vLLM's config: its key space, which model runner runs (and so what
a failed load may do), the load-failure policy it sets, and whether this vLLM is a release Maru ran
on. Plain functions over the config's attributes (no vLLM import), so a test builds the config from
the few attributes they read."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import TYPE_CHECKING, Any

from maru.versions import vllm_untested, vllm_version
from maru.vllm.config import MaruConnectorConfig
from maru.vllm.keys import KeySpace
from maru.vllm.model_runner import runs_v2_runner

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger("maru.vllm")


def compute_overrides(mc: Any, kv_dtype: str, speculative: Any = None) -> str:
    """What makes this engine's KV differ from another's of the same checkpoint (model id and
    revision), as canonical JSON; "" when nothing does. Weight quantization (``quantization``,
    ``quantization_config``), vLLM's ``hf_overrides`` (a RoPE scaling changes every K), the
    model's dtype where the KV cache has a dtype of its own (an fp8 cache of a bf16 and of an fp16
    model holds different values), and a speculative decoder with a draft model (EAGLE, MTP, a
    draft model: its layers' KV is in the engine's cache and so in every stored chunk, which an
    engine without it, or with another, could not place), and the engine-wide multimodal
    processing settings (``mm_processor_kwargs``, ``media_io_kwargs``). A callable ``hf_overrides`` counts by its
    qualified name; a config object by its fields (one whose fields are all unset counts as none)."""
    parts: dict[str, Any] = {}
    draft = _draft_model(speculative)
    if draft is not None:
        parts["speculative"] = {
            "method": str(getattr(speculative, "method", "")),
            "draft": str(getattr(speculative, "model", None) or getattr(draft, "model", "")),
            "revision": str(getattr(draft, "revision", None) or ""),
            "quantization": _plain(getattr(draft, "quantization", None)),
        }
    for name in ("quantization", "quantization_config"):
        value = _plain(getattr(mc, name, None))
        if value:
            parts[name] = value
    overrides = getattr(mc, "hf_overrides", None)
    if callable(overrides):
        parts["hf_overrides"] = (
            f"{getattr(overrides, '__module__', '')}.{getattr(overrides, '__qualname__', '')}"
        )
    elif overrides:
        parts["hf_overrides"] = _plain(overrides)
    if _dtype_name(mc.dtype) != _dtype_name(kv_dtype):
        parts["model_dtype"] = _dtype_name(mc.dtype)
    # Engine-wide multimodal processing (merged after vLLM hashed an input: its identifier does
    # not say it, and another resizing is other image tokens' KV for the same identifier).
    mm = getattr(mc, "multimodal_config", None)
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        value = _plain(getattr(mm, name, None)) if mm is not None else None
        if value:
            parts[name] = value
    return json.dumps(parts, sort_keys=True, default=str) if parts else ""


# Speculative methods without a draft model of their own: no KV layers beside the target's (vLLM
# sets ``draft_model_config`` to the target's for some of them).
_NO_DRAFT_KV = frozenset({"ngram", "ngram_gpu", "suffix", "custom_class", "medusa", "mlp_speculator"})


def _draft_model(speculative: Any) -> Any:
    """The draft model's config of a speculative decoder whose layers have KV in the engine's cache
    (EAGLE, MTP, a draft model), or None."""
    if speculative is None:
        return None
    draft = getattr(speculative, "draft_model_config", None)
    method = str(getattr(speculative, "method", "") or "")
    if draft is None or draft is getattr(speculative, "target_model_config", None) or method in _NO_DRAFT_KV:
        return None
    return draft


def _dtype_name(dtype: Any) -> str:
    """``torch.bfloat16`` and ``bfloat16`` alike: the name without the module."""
    return str(dtype).removeprefix("torch.")


def _plain(value: Any) -> Any:
    """``value`` as plain data for the digest: a config object (dataclass, pydantic model) by its
    set fields (None when none is set); a user's dict whole (an override to None is an override);
    containers element by element."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.asdict(value)
    elif hasattr(value, "model_dump"):
        fields = value.model_dump()
    else:
        fields = None
    if fields is not None:
        kept = {str(k): _plain(v) for k, v in fields.items() if v is not None}
        return kept or None
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def key_space(vllm_config: VllmConfig, cfg: MaruConnectorConfig) -> KeySpace:
    """The key namespace of this engine: everything that makes its KV bytes differ."""
    mc = vllm_config.model_config
    pc = vllm_config.parallel_config
    cache_dtype = str(vllm_config.cache_config.cache_dtype)
    # A KV cache dtype given as the model's own is "auto": the same bytes, the same keys.
    same = cache_dtype == "auto" or _dtype_name(cache_dtype) == _dtype_name(mc.dtype)
    kv_dtype = str(mc.dtype) if same else cache_dtype
    return KeySpace(
        model=cfg.model_id or str(mc.model),
        revision=cfg.model_revision or str(getattr(mc, "revision", None) or ""),
        kv_dtype=kv_dtype,
        num_layers=int(mc.get_num_layers(pc)),
        num_kv_heads=int(mc.get_num_kv_heads(pc)),
        head_size=int(mc.get_head_size()),
        chunk_tokens=cfg.kv_chunk_tokens,
        tp_rank=0,  # ranks are told apart by a per-rank key suffix (see keys.rank_keys)
        tp_size=int(pc.tensor_parallel_size),
        tenant=cfg.namespace,
        compute=compute_overrides(mc, kv_dtype, getattr(vllm_config, "speculative_config", None)),
    )


def warn_if_untested_vllm() -> None:
    """Say once, at the scheduler side's start, where this vLLM is a release Maru never ran on."""
    found = vllm_version()
    untested = vllm_untested(found[1], found[0]) if found is not None else None
    if untested is not None:
        logger.warning("Maru: %s", untested)


def set_load_failure_policy(vllm_config: VllmConfig, policy: str) -> None:
    """Set what vLLM does with a request whose load failed: "recompute" its blocks, or "fail" it.

    "recompute" wherever vLLM can: for a cache a failed load is an ordinary miss (vLLM's default,
    "fail", suits a disaggregated prefill, where nobody else could compute the KV). "fail" where
    it cannot recompute a same-step load (``MaruConnectorConfig.failing_same_step_loads``): an
    error is better than KV that was never placed. The scheduler reads the policy right after
    creating this connector.
    """
    ktc = vllm_config.kv_transfer_config
    if getattr(ktc, "kv_load_failure_policy", None) == policy:
        return
    try:
        ktc.kv_load_failure_policy = policy
        logger.info("Maru: kv_load_failure_policy set to %r", policy)
    except Exception as e:
        logger.warning(
            "Maru: could not set kv_load_failure_policy to %r (%s). Pass kv_load_failure_policy=%r in "
            "--kv-transfer-config.",
            policy,
            e,
            policy,
        )


def runner_known(vllm_config: Any) -> bool:
    """Whether the engine says which model runner it runs (reading it raises on some platforms)."""
    try:
        runs_v2_runner(vllm_config)
    except Exception:
        return False
    return True


def same_step_load_failures_unrecoverable(vllm_config: Any) -> str | None:
    """Why vLLM cannot recompute a failed load of a request it is already running; None if it can.

    vLLM's V2 model runner (``vllm_config.use_v2_model_runner``; the default on GPUs for most
    models) keeps each running request's computed-token count on the device and only ever adds
    to it. When a load fails in the step that computes the request, the scheduler rewinds the
    request to recompute the missing blocks, but the runner does not rewind: the recompute reads
    tokens and positions after the prompt and the output is garbage (vLLM issue #49250, seen on
    vLLM 0.26 with an H200). Requests that wait for their load (asynchronous protocol) are added
    to the runner afresh after the load, from what was really placed, so they are unaffected.
    """
    try:
        v2 = runs_v2_runner(vllm_config)  # vLLM 0.34 has no flag: the V2 runner is its only one
    except Exception as e:  # cannot tell: take the protocol that is correct either way
        return f"could not tell which vLLM model runner runs ({type(e).__name__}: {e})"
    if not v2:
        return None
    return (
        "vLLM's V2 model runner (from vLLM 0.34 its only one) does not rewind a running request whose "
        "load failed, so its recompute would run on KV that was never placed (vLLM issue #49250)"
    )
