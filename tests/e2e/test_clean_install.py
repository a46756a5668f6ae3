"""A clean virtual environment with only Maru's declared dependencies runs the Triton kernels.

Creates a fresh venv (no system site-packages), installs the torch build this interpreter runs
(from pip's usual sources: this machine's wheel folder, the package index, pip's cache), then a copy
of the package with its ``gpu`` extra, and runs a gather and a scatter through the Triton kernels
under ``TRITON_INTERPRET=1`` against the PyTorch reference, plus the direct-load table builder
(numpy), and the compiled checksum (its C source is package data). A dependency the code imports but ``pyproject.toml`` does not declare fails here with its
ImportError. Skipped, with the reason, when pip cannot reach a package index.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
from pathlib import Path

import pytest

from tests.helpers import REPO_ROOT

pytestmark = [pytest.mark.slow]

CHECK = r"""

import torch

import maru
from maru import kv_ops
from maru.kv_ops import direct_kernel
from maru.kv_ops.ops import as_bits
from maru.kv_ops.testing import make_cache, random_slots

assert "site-packages" in maru.__file__, maru.__file__
gen = torch.Generator().manual_seed(0)
case = make_cache("kv_first", "HND", num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3,
                  head_size=8, dtype=torch.bfloat16, generator=gen)
layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
slots = torch.tensor(random_slots(layout.num_slots, 11, negatives=2, generator=gen))
want = kv_ops.gather(case.caches, layout, slots, backend="reference")
got = kv_ops.gather(case.caches, layout, slots, backend="triton")
assert torch.equal(as_bits(got), as_bits(want)), "triton gather differs from the reference"
kv_ops.scatter(want.flip(2).contiguous(), case.caches, layout, slots, backend="triton")
back = kv_ops.gather(case.caches, layout, slots, backend="reference")
assert torch.equal(as_bits(back)[:, :, slots >= 0], as_bits(want.flip(2))[:, :, slots >= 0])
tab = direct_kernel.direct_table_host([(4096, 8), (8192, 3)], torch.arange(11), layout.row_size, 2)
assert tab.shape == (direct_kernel.DIRECT_ROWS, 12) and int(tab[0, 11]) == 8
# The checksum's C source ships with the package (package data) and builds here.
from maru import checksum, native
assert checksum.implementation() == "native", native.load().reason
print("clean install ok:", maru.__file__)
"""


def _pip(py: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(py), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout, cwd="/"
    )


def test_a_clean_venv_with_the_declared_dependencies_runs_the_triton_kernels(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    torch_version = torch.__version__
    env_dir = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True, system_site_packages=False, clear=True).create(env_dir)
    py = env_dir / "bin" / "python"

    probe = _pip(py, "download", "--no-deps", "--dest", str(tmp_path / "probe"), "msgpack", timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"no package index reachable from pip: {probe.stderr.strip().splitlines()[-1:]}")

    torch_pin = f"torch=={torch_version}"
    r = _pip(py, "install", "--quiet", torch_pin)
    if r.returncode != 0:
        pytest.skip(f"{torch_pin} (the torch this suite runs) is not installable here: {r.stderr[-500:]}")

    # Install a copy: building in the checkout would leave build/ and *.egg-info behind.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    shutil.copytree(REPO_ROOT / "maru", src / "maru", ignore=shutil.ignore_patterns("__pycache__"))
    r = _pip(py, "install", "--quiet", f"{src}[gpu]")
    assert r.returncode == 0, f"pip install maru[gpu] failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["TRITON_INTERPRET"] = "1"
    run = subprocess.run(
        [str(py), "-c", CHECK], capture_output=True, text=True, timeout=600, cwd=str(tmp_path), env=env
    )
    assert run.returncode == 0, f"{run.stdout[-2000:]}\n{run.stderr[-4000:]}"
    assert "clean install ok:" in run.stdout, run.stdout
    frozen = _pip(py, "freeze").stdout
    assert "numpy" in frozen.lower() and "triton" in frozen.lower(), frozen
