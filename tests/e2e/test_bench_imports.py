"""Every script under ``bench/`` still imports against today's ``maru`` (its top level, not its
``main``): a renamed or removed name breaks the benchmark the next device pass or a user runs,
where it costs a machine start to find out (``bench/kv_ops_cpu.py`` imported ``ops._bits`` for a
while after it became ``ops.as_bits``). One subprocess imports them all, on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import REPO_ROOT

PROBE = """
import importlib.util, json, sys, traceback
failed = {}
for path in sys.argv[1:]:
    name = "bench_" + path.rsplit("/", 1)[-1][:-3]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # dataclasses look their module up while the module runs
    try:
        spec.loader.exec_module(mod)
    except BaseException as e:  # SystemExit included: a script must not run at import
        failed[path] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


def test_every_bench_script_imports() -> None:
    scripts = sorted(str(p) for p in (REPO_ROOT / "bench").glob("*.py"))
    assert len(scripts) > 30  # the probe reads the real folder
    res = subprocess.run(
        [sys.executable, "-c", PROBE, *scripts],
        cwd=REPO_ROOT,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    failed = json.loads(res.stdout.strip().splitlines()[-1])
    assert failed == {}, failed
