"""Make a patched copy of ``maru/`` in ``.ab/<name>`` for an A/B run in real vLLM.

``bench/gpu_vllm_e2e.py --api-stores alt-<name>`` (``API_STORES=alt-<name>`` in
``bench/gpu_vllm_pass.sh``) runs one more cold, storing API instance from that tree, taking turns with
the others (``api_workload.store_env``). ``.ab/`` is ignored by git: this script makes the trees a
diagnosis needs, on the machine that runs it (the device has the working tree, not ``.ab/``, unless
it is carried).

Presets (``--preset``):

* ``switch-<us>``: the engine process's GIL switch interval set to ``<us>`` microseconds when
  ``maru.vllm`` is imported (CPython's default is 5000). A test of whether the storing instance's
  host cost is threads waiting for the GIL (bench/RESULTS.md, thirty-eighth pass): vLLM's loop, its
  input thread and Maru's drain thread share one interpreter.

* ``nodevice``: a write-behind store reserves its pool objects and hands them back (abort) without
  any device work (no gather, no copies, no segment sums) and publishes nothing; the forward
  thread's part and the delayed free are unchanged. Against the default storing instance: what the
  store's device work costs the requests beside it.
* ``nodrain``: the drain thread does nothing for a store (no round trip, no device work, nothing
  published); only the forward thread's part and the delayed free remain. Against ``nodevice``:
  what the drain's host work costs; against the idle connector: what the bookkeeping costs.

* ``burn-<ms>``: the drain thread runs ``<ms>`` ms of pure Python (on its CPU clock) before each
  write-behind store batch, then stores as the default does. Against the default storing
  instance: whether the drain's CPU costs the round's TTFT by its amount (the drain takes ~3.1 ms
  CPU a batch of 32 chunks on the H100 host, ``bench/drain_cpu.py``): if it does, ``burn-3``
  adds about that much a batch; if not, cutting the drain's CPU cannot meet the target.

* ``noarrival``: vLLM's ``on_new_request`` (a request's arrival) does nothing: its keys and probe
  (and any pins) run at its offer inside the step's ``schedule`` instead. vLLM calls the hook in
  ``Scheduler.add_request`` before it stamps the request QUEUED, so in a burst each request's
  "rest" holds the hooks of the requests added before it, its "queue" those after it (RESULTS,
  sixty-first pass). Against the default: whether the arrival work costs the round by where it
  runs or by its amount. This tree's stores are published, under the instance's own namespace.

* ``inline``: the write-behind store's RESERVE round trip and its gather's issue run on vLLM's
  forward thread again (in ``wait_for_save``, ``PipelinedPath.defers_store_gather`` off); the drain
  thread only waits for the copies and publishes. Against the default: whether the drain's Python,
  which lands in the next step's preparation (fiftieth pass: 2.3-3.0 ms of other threads' CPU there,
  the step starting ~2.5 ms later), costs vLLM's loop more than the same issue on its own thread.
  This tree's stores are published, under the instance's own namespace.

The store presets nodevice and nodrain publish nothing; every alt instance stores under a namespace
of its own (``api-alt-<name>``), so no other instance's hits depend on it.

``--kv JSON`` writes ``.ab/<name>/kv.json``: Maru config keys the ``alt-<name>`` instance runs with,
over the default configuration's (``api_workload.store_variant``), e.g. a store preset with the
store helper on: ``python bench/ab_tree.py helper-nodevice --preset nodevice --kv
'{"maru_store_helper": true}'`` (the spawned helper imports the same patched tree).

``--rev REV`` makes the tree from ``maru/`` at a git revision instead (no preset): an A/B of the
working tree against a commit (``python bench/ab_tree.py head --rev HEAD`` before changing code).

Usage: python bench/ab_tree.py switch-500 [--preset switch-500]   (the name is the preset by default)
       python bench/ab_tree.py head --rev HEAD
       python bench/ab_tree.py helper-nodevice --preset nodevice --kv '{"maru_store_helper": true}'
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def preset_appends(preset: str) -> list[tuple[str, str]]:
    """(file under the tree, line appended to it) for ``preset``; ValueError for an unknown one."""
    if preset.startswith("switch-") and preset[len("switch-") :].isdigit():
        us = int(preset[len("switch-") :])
        if us <= 0:
            raise ValueError("switch-<us> needs a positive interval")
        line = f"import sys as _s; _s.setswitchinterval({us}e-6)  # ab_tree {preset}"
        return [("maru/vllm/__init__.py", line)]
    if preset.startswith("burn-") and preset[len("burn-") :].isdigit():
        ms = int(preset[len("burn-") :])
        if ms <= 0:
            raise ValueError("burn-<ms> needs a positive time")
        return [("maru/transfer/store_side.py", BURN.replace("MS", str(ms)))]
    if preset in STORE_PRESETS:
        return [("maru/transfer/store_side.py", STORE_PRESETS[preset])]
    if preset == "noarrival":
        return [("maru/vllm/load_plan.py", NOARRIVAL)]
    if preset == "inline":
        line = (
            "PipelinedPath.defers_store_gather = False  # ab_tree inline: reserve and issue at wait_for_save"
        )
        return [("maru/transfer/device_path.py", line)]
    raise ValueError(
        f"unknown preset {preset!r}: switch-<us>, burn-<ms>, inline, noarrival, {', '.join(STORE_PRESETS)}"
    )


# Appended to maru/transfer/store_side.py for ``burn-<ms>``: before each write-behind store batch, the
# drain thread runs MS ms of pure Python (bytecode: the GIL held as the drain's own Python holds it),
# then the store as usual (published, under the instance's own namespace).
BURN = """
_ab_complete_store_real = StoreSide.complete_store


def _ab_complete_store(self, pending):  # ab_tree burn-MS
    import time as _t

    end = _t.thread_time() + MS / 1e3  # CPU time: a wait for the GIL does not count toward it
    n = 0
    while _t.thread_time() < end:
        n += 1
    return _ab_complete_store_real(self, pending)


StoreSide.complete_store = _ab_complete_store
"""


# Appended to maru/vllm/load_plan.py for ``noarrival``: vLLM's ``on_new_request`` does nothing, so a
# request's keys and probe run at its offer (``get_num_new_matched_tokens``, inside the step's
# schedule, after every request of the burst was stamped QUEUED) instead of at its arrival.
NOARRIVAL = """

def _ab_on_new_request(self, request):  # ab_tree noarrival
    return None


LoadPlanning.on_new_request = _ab_on_new_request
"""


# Appended to maru/transfer/store_side.py (the tree's copy): the write-behind store's drain work cut down.
STORE_PRESETS = {
    "nodevice": """
def _ab_issue_gather(self, todo, objs, prep, *, paced=False, after=None):  # ab_tree nodevice
    ig = IssuedGather()
    ig.bad.extend(objs)  # finish_gather hands them back: no device work, nothing published
    return ig


StoreSide.issue_gather = _ab_issue_gather
""",
    "nodrain": """
def _ab_complete_store(self, pending):  # ab_tree nodrain
    pending.finish_reading()  # the blocks are free at once: nothing read them
    return StoreReport()


StoreSide.complete_store = _ab_complete_store
""",
}


def make_tree(name: str, appends: list[tuple[str, str]], root: Path = ROOT) -> Path:
    """``root/.ab/<name>/maru``: a fresh copy of ``root/maru`` with each line appended to its file.
    Returns the tree (the directory holding ``maru/``)."""
    tree = root / ".ab" / name
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(root / "maru", tree / "maru", ignore=shutil.ignore_patterns("__pycache__"))
    for rel, line in appends:
        path = tree / rel
        text = path.read_text()
        path.write_text(text + ("" if text.endswith("\n") else "\n") + line.strip("\n") + "\n")
    return tree


KV_FILE = "kv.json"  # beside the tree's maru/: config keys of its alt instance (api_workload.tree_kv)


def write_kv(tree: Path, kv: str | None) -> None:
    """Write (or, with None, remove) the tree's ``kv.json`` from ``kv`` (a JSON object of Maru
    config keys); ValueError for JSON that is not an object of ``maru_`` keys."""
    path = tree / KV_FILE
    if kv is None:
        path.unlink(missing_ok=True)
        return
    obj = json.loads(kv)
    if not isinstance(obj, dict) or not all(isinstance(k, str) and k.startswith("maru_") for k in obj):
        raise ValueError(f"--kv needs a JSON object of maru_* keys, got {kv!r}")
    path.write_text(json.dumps(obj, sort_keys=True) + "\n")


def tree_at(name: str, rev: str, root: Path = ROOT) -> Path:
    """``root/.ab/<name>/maru``: ``maru/`` as committed at ``rev`` (``git archive``), nothing appended.
    Returns the tree; CalledProcessError (git's message) for an unknown revision."""
    tree = root / ".ab" / name
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", "--format=tar", rev, "maru"], capture_output=True, check=True
    ).stdout
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        if hasattr(tarfile, "data_filter"):  # Python 3.10.12+/3.11.4+: plain files, nothing outside
            tar.extractall(tree, filter="data")
        else:  # git's own archive of maru/, nothing else
            tar.extractall(tree)  # noqa: S202
    return tree


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help="the tree's name: .ab/<name>, run as --api-stores alt-<name>")
    ap.add_argument("--preset", help="the patch (default: the name)")
    ap.add_argument("--rev", help="maru/ as committed at this git revision instead, unpatched")
    ap.add_argument("--kv", help="Maru config keys (a JSON object) the tree's alt instance runs with")
    a = ap.parse_args()
    if a.rev:
        tree = tree_at(a.name, a.rev)
    else:
        tree = make_tree(a.name, preset_appends(a.preset or a.name))
    write_kv(tree, a.kv)
    print(f"{tree}: run it with API_STORES=alt-{a.name} bash bench/gpu_vllm_pass.sh (carry .ab/{a.name})")


if __name__ == "__main__":
    main()
