"""``bench/store_helper_probe.py`` on the CPU: a smoke run of the probe a device pass will run.

The cache reaches the helper process through torch's reductions (shared memory here, CUDA IPC on
a GPU) and is rewritten before every batch; each batch's digest from the drain thread and from the
helper is compared with the engine side's own gather of the same blocks. A helper that read a copy
of the cache instead of the shared one would digest stale bytes and fail.
"""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import REPO_ROOT


def test_the_probe_reads_the_engine_s_cache_from_a_helper_process_and_a_drain_thread() -> None:
    cmd = [sys.executable, "bench/store_helper_probe.py", "--device", "cpu", "--batches", "2",
           "--host-ms", "1", "--drain-python-ms", "0.5"]  # fmt: skip
    p = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {ln.split("|")[1].strip(): ln for ln in p.stdout.splitlines() if ln.startswith("| ")}
    assert set(rows) >= {"none", "thread", "helper"}
    assert rows["thread"].rstrip(" |").endswith("0 of 2") and rows["helper"].rstrip(" |").endswith("0 of 2")


def test_the_digest_samples_the_batch_and_tells_a_stale_copy_from_the_fresh_one() -> None:
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("probe", REPO_ROOT / "bench/store_helper_probe.py")
    probe = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(probe)  # type: ignore[union-attr]
    g = torch.Generator().manual_seed(3)
    fresh = torch.randint(-(2**15), 2**15 - 1, (3, 5000, 7), dtype=torch.int16, generator=g).view(
        torch.bfloat16
    )
    assert probe.digest(fresh) == probe.digest(fresh.clone())
    stale = fresh.clone().view(torch.int16)
    stale += 1  # every forward writes new values everywhere: a stale copy differs at every element
    assert probe.digest(stale.view(torch.bfloat16)) != probe.digest(fresh)
    one = fresh.clone().view(torch.int16).reshape(-1)
    one[probe.DIGEST_STRIDE * 7] += 1  # a sampled element
    assert probe.digest(one.view(torch.bfloat16)) != probe.digest(fresh)
