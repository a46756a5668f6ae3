"""bench/ab_tree.py: a patched copy of maru/ for an A/B instance, the working tree untouched."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.ab_tree import make_tree, preset_appends, tree_at

REPO = Path(__file__).resolve().parents[2]


def test_the_switch_preset_sets_the_interval_when_maru_vllm_is_imported(tmp_path: Path) -> None:
    (tmp_path / "maru").symlink_to(REPO / "maru")  # a root whose maru/ is the real one, read only
    tree = make_tree("switch-500", preset_appends("switch-500"), root=tmp_path)
    assert (tree / "maru" / "vllm" / "__init__.py").read_text() != (
        REPO / "maru/vllm/__init__.py"
    ).read_text()
    assert "ab_tree" not in (REPO / "maru/vllm/__init__.py").read_text()
    code = "import sys, maru.vllm, maru; print(sys.getswitchinterval(), maru.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env={"PYTHONPATH": str(tree)}, capture_output=True,
        text=True, check=True,
    ).stdout.split()  # fmt: skip
    assert float(out[0]) == pytest.approx(500e-6) and out[1].startswith(str(tree))
    # Made again: a fresh copy, the line once.
    tree = make_tree("switch-500", preset_appends("switch-500"), root=tmp_path)
    assert (tree / "maru/vllm/__init__.py").read_text().count("setswitchinterval") == 1


def test_unknown_or_bad_presets_are_refused() -> None:
    for bad in ("switch-", "switch-0", "switch-x", "burn-0", "burn-x", "other"):
        with pytest.raises(ValueError):
            preset_appends(bad)


def _preset_tree(root: Path, preset: str) -> Path:
    """The tree of ``preset`` under ``root``, whose maru/ is the real one (read only)."""
    (root / "maru").symlink_to(REPO / "maru")
    return make_tree(preset, preset_appends(preset), root=root)


def _run_in(tree: Path, code: str) -> str:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=tree, env={"PYTHONPATH": str(tree)}, capture_output=True,
        text=True, check=True,
    ).stdout.strip()  # fmt: skip


# Each store preset, run in its tree: what it does to a store (no vLLM, no server: the patched
# methods are called with what they read).
STORE_CHECKS = {
    # reserve and hand back: every reserved object goes back, no gather was issued
    "nodevice": (
        "from maru.transfer.store_side import StoreSide\n"
        "ig = StoreSide.issue_gather(None, [('r', 'c')] * 2, ['o1', 'o2'], None)\n"
        "print(StoreSide.issue_gather.__name__, ig.bad, ig.ok, ig.handle)",
        "_ab_issue_gather ['o1', 'o2'] [] None",
    ),
    # the drain does nothing: the blocks are free at once, nothing stored or failed
    "nodrain": (
        "from maru.transfer.store_side import StoreSide\n"
        "from maru.transfer.stores import PendingStore, PreparedStore\n"
        "from maru.transfer.records import StoreReport\n"
        "p = PendingStore(requests=[], prep=PreparedStore(report=StoreReport()))\n"
        "rep = StoreSide.complete_store(None, p)\n"
        "print(p.reading_done(), rep.stored, rep.failed, rep.tokens)",
        "True 0 0 0",
    ),
    # the drain burns its CPU (40 ms here), then stores as before
    "burn-40": (
        "import time\n"
        "from maru.transfer import store_side\n"
        "from maru.transfer.store_side import StoreSide\n"
        "seen = []\n"
        "store_side._ab_complete_store_real = lambda self, p: seen.append(p) or 'stored'\n"
        "c0 = time.thread_time()\n"
        "out = StoreSide.complete_store(None, 'pending')\n"
        "print(StoreSide.complete_store.__name__, out, seen, time.thread_time() - c0 >= 0.04)",
        "_ab_complete_store stored ['pending'] True",
    ),
}


@pytest.mark.parametrize("preset", sorted(STORE_CHECKS))
def test_the_store_presets_patch_the_trees_store_side_alone(tmp_path: Path, preset: str) -> None:
    tree = _preset_tree(tmp_path, preset)
    code, expected = STORE_CHECKS[preset]
    assert _run_in(tree, code) == expected
    assert "ab_tree" not in (REPO / "maru/transfer/store_side.py").read_text()


# The presets that patch one class of the tree: (code run in the tree, what it prints, the file patched).
PATCH_CHECKS = {
    # the pipelined path reserves and issues at the store (wait_for_save), not on the drain thread
    "inline": (
        "from maru.transfer.device_path import PipelinedPath\n"
        "from maru.transfer.paths import DataPath\n"
        "print(PipelinedPath.defers_store_gather, DataPath.defers_store_gather)",
        "False False",
        "maru/transfer/device_path.py",
    ),
    # a request's arrival does nothing (its keys and probe wait for its offer), touching nothing
    "noarrival": (
        "from maru.vllm.load_plan import LoadPlanning\n"
        "from maru.vllm.scheduler import MaruSchedulerConnector\n"
        "print(MaruSchedulerConnector.on_new_request.__name__, LoadPlanning.on_new_request(None, object()))",
        "_ab_on_new_request None",
        "maru/vllm/load_plan.py",
    ),
}


@pytest.mark.parametrize("preset", sorted(PATCH_CHECKS))
def test_the_class_presets_patch_the_tree_alone(tmp_path: Path, preset: str) -> None:
    tree = _preset_tree(tmp_path, preset)
    code, expected, patched = PATCH_CHECKS[preset]
    assert _run_in(tree, code) == expected
    assert "ab_tree" not in (REPO / patched).read_text()


def test_a_tree_at_a_revision_is_maru_as_committed_then(tmp_path: Path) -> None:
    root = tmp_path / "repo"
    root.mkdir()
    git = ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (root / "maru").mkdir()
    (root / "maru" / "__init__.py").write_text("V = 1\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    (root / "maru" / "__init__.py").write_text("V = 2\n")  # the working tree moved on
    (root / "maru" / "new.py").write_text("")
    tree = tree_at("then", "HEAD", root=root)
    assert (tree / "maru" / "__init__.py").read_text() == "V = 1\n"
    assert not (tree / "maru" / "new.py").exists()
    assert _run_in(tree, "import maru; print(maru.V)") == "1"
    with pytest.raises(subprocess.CalledProcessError):
        tree_at("bad", "no-such-rev", root=root)
