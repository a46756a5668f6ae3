"""The scheduler side of the connector imports neither torch nor vLLM: a scheduler process (and
the records it sends to workers) stays light, and the layering says so."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(stmt: str) -> set[str]:
    code = f"import sys; {stmt}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(out.stdout.split())


def test_the_scheduler_side_imports_no_torch() -> None:
    mods = _modules_after("import maru.vllm.scheduler, maru.vllm.metadata, maru.transfer.records")
    assert "maru.vllm.scheduler" in mods
    assert "torch" not in mods
    assert not any(m == "vllm" or m.startswith("vllm.") for m in mods)


def test_transfer_and_kv_ops_never_import_vllm() -> None:
    mods = _modules_after(
        "import maru.transfer.engine, maru.transfer.background, maru.kv_ops.device_pipeline, maru.kv_ops.ops"
    )
    assert "maru.transfer.engine" in mods
    assert not any(m == "vllm" or m.startswith("vllm.") for m in mods)
