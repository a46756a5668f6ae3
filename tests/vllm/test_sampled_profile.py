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


def test_two_threads_profile_at_once_each_its_own_calls() -> None:
    """What stopped an engine on Python 3.12 (one profiler per interpreter): here each thread's
    table holds its own function only."""
    import threading

    a, b = SampledProfile("a", every=1), SampledProfile("b", every=1)
    errors: list[BaseException] = []

    def loop(p: SampledProfile, fn: object) -> None:
        try:
            for _ in range(200):
                p.run(fn, 200)  # type: ignore[arg-type]
        except BaseException as e:
            errors.append(e)

    ts = [
        threading.Thread(target=loop, args=(a, profiled_work_alpha)),
        threading.Thread(target=loop, args=(b, plain_work_beta)),
    ]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors and a.profiled == b.profiled == 200
    assert "profiled_work_alpha" in a.table() and "plain_work_beta" not in a.table()
    assert "plain_work_beta" in b.table() and "profiled_work_alpha" not in b.table()


def _raises() -> None:
    raise KeyError("from the profiled code")


def _generator_work() -> int:
    def g() -> object:
        for i in range(5):
            yield profiled_work_alpha(i)

    try:
        _raises()
    except KeyError:
        pass
    return sum(g())  # type: ignore[call-overload]


def test_the_profiled_codes_exceptions_and_generators_pass_through_unchanged() -> None:
    import sys

    p = SampledProfile("e", every=1)
    with pytest.raises(KeyError, match="from the profiled code"):
        p.run(_raises)
    assert p.run(_generator_work) == 0 + 0 + 1 + 3 + 6
    assert sys.getprofile() is None  # taken off again, raised or not
    table = p.table()
    assert "_generator_work" in table and "profiled_work_alpha" in table and "_raises" in table


def test_a_thread_with_a_profile_function_already_set_runs_the_call_plainly() -> None:
    import sys

    seen: list[str] = []

    def other(frame: object, event: str, arg: object) -> None:
        seen.append(event)

    p = SampledProfile("busy", every=1)
    sys.setprofile(other)
    try:
        assert p.run(profiled_work_alpha, 5) == 10
    finally:
        sys.setprofile(None)
    assert p.profiled == 0 and seen  # the other tool kept its place and saw the call


def test_the_event_function_never_raises_on_unpaired_events() -> None:
    from maru.vllm.sampled_profile import _ThreadProfiler

    prof = _ThreadProfiler()
    prof.event(None, "return", None)  # a return before any call (set inside a function)
    prof.event(None, "c_return", len)
    prof.event(object(), "call", None)  # a frame without f_code: swallowed, not raised
    assert prof.totals == {}


def test_profiling_is_a_slow_path_maru_doctor_shows_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sampled_profile.slow_note() is None  # unset: nothing to report
    sampled_profile.reset()
    monkeypatch.setenv(sampled_profile.ENV, "4:drain")
    note = sampled_profile.slow_note()
    assert note is not None and "one call in 4 of drain" in note and "Fix: unset MARU_PROFILE" in note


def test_the_scheduler_reports_profiling_to_the_server(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object
) -> None:
    """Through a real server: the scheduler side's client info lists it as slow (``maru doctor``)."""
    from maru.client import MaruHandler
    from maru.vllm.config import MaruConnectorConfig
    from maru.vllm.keys import ChunkKeyer, KeySpace
    from maru.vllm.scheduler import MaruSchedulerConnector
    from tests.helpers import ServerProcess
    from tests.vllm.helpers import BS, C, req, tokens
    from tests.vllm.test_vllm_scheduler import _scheduler_infos

    monkeypatch.setenv(sampled_profile.ENV, "3")
    with ServerProcess(tmp_path, pool_size="4M") as srv:  # type: ignore[arg-type]
        with MaruHandler(srv.url, timeout_s=2) as h:
            keyer = ChunkKeyer(KeySpace("model-profiled", "", "float32", 2, 2, 32, C))
            conf = MaruConnectorConfig(server_url=srv.url, kv_chunk_tokens=C)
            s = MaruSchedulerConnector(conf, keyer, BS, client_factory=lambda: h)
            assert s.get_num_new_matched_tokens(req("r", tokens(300)), 0) == (0, False)
            (info,) = _scheduler_infos(srv.url)
    assert any(n.startswith("MARU_PROFILE profiles one call in 3 of every hook") for n in info["slow"])
