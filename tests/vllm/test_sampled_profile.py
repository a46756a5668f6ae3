"""MARU_PROFILE's sampled profiles: which calls are profiled, what a table names, how the variable
is read, and a timed hook profiling itself (the real engine: tests/e2e/test_vllm_e2e.py)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from maru.vllm import sampled_profile
from maru.vllm.hook_times import HookTimes, timed
from maru.vllm.sampled_profile import Profiles, SampledProfile, profile_for


@pytest.fixture(autouse=True)
def fresh_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(sampled_profile.ENV, raising=False)
    sampled_profile.reset()
    yield
    sampled_profile.reset()


def profiled_work_alpha(n: int) -> int:
    return sum(range(n))


def plain_work_beta(n: int) -> int:
    return sum(range(n))


def test_one_call_in_n_is_profiled_and_the_table_names_what_ran() -> None:
    p = SampledProfile("site-y", every=3)
    assert "(nothing profiled yet)" in p.table()
    # Calls 3, 6 and 9 are the profiled ones: only they run the alpha function.
    got = [p.run(profiled_work_alpha if i % 3 == 2 else plain_work_beta, 10) for i in range(9)]
    assert got == [45] * 9  # the result comes back either way
    assert (p.calls, p.profiled) == (9, 3)
    table = p.table()
    assert table.startswith("profile of site-y: 3 of 9 calls")
    assert "profiled_work_alpha" in table and "plain_work_beta" not in table


def test_a_profiled_call_inside_another_runs_plainly_and_the_outer_table_stays_whole() -> None:
    inner = SampledProfile("inner", every=1)
    outer = SampledProfile("outer", every=1)

    def outer_fn() -> int:
        return inner.run(profiled_work_alpha, 50)

    assert outer.run(outer_fn) == 1225
    assert inner.profiled == 0 and inner.calls == 1  # ran, not profiled
    assert "profiled_work_alpha" in outer.table()  # the outer profiler saw it, not cut off
    assert inner.run(profiled_work_alpha, 5) == 10 and inner.profiled == 1  # alone: profiled


def test_the_first_and_every_dump_every_profiled_call_log_the_table(caplog: pytest.LogCaptureFixture) -> None:
    p = SampledProfile("logged", every=1)
    with caplog.at_level(logging.INFO, logger="maru.vllm"):
        for _ in range(2 * sampled_profile.DUMP_EVERY):
            p.run(profiled_work_alpha, 5)
    tables = [r.getMessage() for r in caplog.records if "profile of logged" in r.getMessage()]
    assert len(tables) == 3  # the first, then at DUMP_EVERY and 2 * DUMP_EVERY
    assert f"{2 * sampled_profile.DUMP_EVERY} of {2 * sampled_profile.DUMP_EVERY} calls" in tables[-1]


@pytest.mark.parametrize(
    ("raw", "every", "sites"),
    [("4", 4, None), (" 2:drain, on_new_request ", 2, {"drain", "on_new_request"}), ("3:", 3, None)],
)
def test_the_variable_is_n_or_n_and_sites(raw: str, every: int, sites: set[str] | None) -> None:
    got = Profiles.parse(raw)
    assert got is not None and got.every == every
    assert got.sites == (frozenset(sites) if sites else None)


@pytest.mark.parametrize("raw", ["x", "0", "-1:drain", "2.5"])
def test_a_bad_value_is_refused(raw: str) -> None:
    with pytest.raises(ValueError):
        Profiles.parse(raw)
    assert Profiles.parse("  ") is None


def test_profile_for_reads_the_environment_once_and_only_names_its_sites(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    assert profile_for("drain") is None  # unset: nothing, ever
    monkeypatch.setenv(sampled_profile.ENV, "2:drain")
    assert profile_for("drain") is None  # read once already (no per-call environment read)
    sampled_profile.reset()
    p = profile_for("drain")
    assert p is not None and p.every == 2 and profile_for("drain") is p
    assert profile_for("on_new_request") is None
    sampled_profile.reset()
    monkeypatch.setenv(sampled_profile.ENV, "often")
    with caplog.at_level(logging.WARNING, logger="maru.vllm"):
        assert profile_for("drain") is None
    assert any("MARU_PROFILE='often'" in r.getMessage() for r in caplog.records)


class _Hooks:
    def __init__(self) -> None:
        self.hook_times = HookTimes()

    @timed
    def some_hook(self, n: int) -> int:
        return profiled_work_alpha(n)


def test_a_timed_hook_profiles_a_sample_of_its_calls_and_still_counts_every_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(sampled_profile.ENV, "2:some_hook")
    h = _Hooks()
    assert [h.some_hook(10) for _ in range(4)] == [45] * 4
    assert h.hook_times.calls["some_hook"] == 4
    p = profile_for("some_hook")
    assert p is not None and (p.calls, p.profiled) == (4, 2)
    assert "profiled_work_alpha" in p.table()
