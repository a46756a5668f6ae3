"""What the GPU end-to-end modules with real vLLM share: stages run in order, their results by
name, the connector counters a generate moved, and the output comparison of a GPU run."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import pytest

from bench.vllm_harness import Engine, delta, same_greedy


class Runs(dict):
    """Results by stage; a stage that raised leaves its traceback under ``errors`` and the rest
    still run (each test then fails on the stage it needs, naming the errors)."""

    def __init__(self) -> None:
        super().__init__(errors=[])

    def stage(self, key: str, fn: Callable[[], Any]) -> None:
        try:
            self[key] = fn()
        except Exception:
            self["errors"].append(f"{key}: {traceback.format_exc()}")

    def need(self, key: str) -> Any:
        if key not in self:
            pytest.fail(f"stage {key!r} did not run; errors: {self.get('errors')}")
        return self[key]


def generate_counted(e: Engine, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """One greedy batch with top-5 log-probabilities, and ``delta``: the worker counters it moved."""
    before = e.stats()
    r = e.generate(prompts, max_tokens=max_tokens, logprobs=5)
    r["delta"] = delta(e.stats(), before)
    return r


def assert_same(out: dict[str, Any], ref: dict[str, Any], n: int | None = None) -> None:
    """Each output is ``ref``'s, or differs first at a bf16 near-tie (``same_greedy``); the first
    ``n`` tokens only, if given."""
    for i in range(len(out["tokens"])):
        a, b = out["tokens"][i][:n], ref["tokens"][i][:n]
        verdict = same_greedy(a, out["logprobs"][i], b, ref["logprobs"][i])
        assert verdict in ("identical", "close"), (i, a, b)
    assert len({t for seq in ref["tokens"] for t in seq}) > 4  # not one repeated token: the check can fail
