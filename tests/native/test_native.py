"""``maru.native``: the compiled checksum loop is built once per source, compiler and CPU, checked
against its definition before use, and never replaced by numpy without saying why and how to fix it
(the log once, ``slow_reasons`` for the client info, ``maru doctor``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from maru import native
from maru.checksum import numpy_words_sum
from tests.helpers import REPO_ROOT

PROBE = """
import json, logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
import numpy as np
from maru import checksum, native
data = np.random.default_rng(7).integers(0, 256, 3 * 8 * (1 << 15) + 13, dtype=np.uint8)
values = [checksum.checksum(data), checksum.checksum(data)]
print(json.dumps({"impl": checksum.implementation(), "reason": native.load().reason,
                  "library": native.load().library, "slow": checksum.slow_reasons(),
                  "same": values[0] == values[1] == checksum.reference_checksum(data.tobytes())}))
"""


def probe(tmp_path: Path, **env: str) -> tuple[dict, str]:
    full = {**os.environ, "MARU_NATIVE_CACHE": str(tmp_path / "cache"), "PYTHONPATH": str(REPO_ROOT), **env}
    res = subprocess.run([sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


def test_the_compiled_loop_is_built_once_into_the_cache_and_used(tmp_path: Path) -> None:
    first, _ = probe(tmp_path)
    assert first["impl"] == "native" and first["same"] and first["slow"] == [], first
    lib = Path(first["library"])
    assert lib.parent == tmp_path / "cache" and lib.exists()
    built = lib.stat().st_mtime_ns
    second, _ = probe(tmp_path)  # another process: it finds the build, compiles nothing
    assert second["library"] == first["library"] and lib.stat().st_mtime_ns == built
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [lib.name]  # no temporary file left


def test_without_a_compiler_numpy_runs_and_says_why_once(tmp_path: Path) -> None:
    got, log = probe(tmp_path, CC=str(tmp_path / "no-such-cc"))
    assert got["impl"] == "numpy" and got["same"], got
    assert "cannot run the C compiler" in got["reason"] and "no-such-cc" in got["reason"]
    assert len(got["slow"]) == 1 and "apt install gcc" in got["slow"][0]
    warned = [line for line in log.splitlines() if "checksums run in numpy" in line]
    assert len(warned) == 1 and "Fix:" in warned[0], log  # two checksums, one announcement


def test_a_compiler_error_is_reported_with_its_message(tmp_path: Path) -> None:
    cc = tmp_path / "broken-cc"
    cc.write_text("#!/bin/sh\necho 'broken-cc: internal error 42' >&2\nexit 3\n")
    cc.chmod(0o755)
    got, _ = probe(tmp_path, CC=str(cc))
    assert got["impl"] == "numpy" and "internal error 42" in got["reason"], got
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left to be loaded later


def test_a_compiler_that_hangs_is_a_failed_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cc = tmp_path / "hung-cc"
    cc.write_text("#!/bin/sh\nexec sleep 30\n")
    cc.chmod(0o755)
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setenv("MARU_NATIVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "BUILD_TIMEOUT_S", 0.5)
    with pytest.raises(RuntimeError, match="did not finish within 0.5 s"):
        native.build()
    assert not list((tmp_path / "cache").glob("*.so"))


def test_maru_native_0_turns_it_off_and_the_fix_says_so(tmp_path: Path) -> None:
    got, log = probe(tmp_path, MARU_NATIVE="0")
    assert got["impl"] == "numpy" and got["same"] and got["reason"].startswith("MARU_NATIVE=0")
    assert "unset MARU_NATIVE" in got["slow"][0] and "checksums run in numpy" in log


def test_the_self_check_refuses_a_loop_that_differs_from_the_definition() -> None:
    assert native.self_check(lambda address, begin, end: 0) is not None
    good = native.load().words_sum
    assert good is not None and native.self_check(good) is None
    parallel = native.load().words_sum_parallel
    assert parallel is not None and native.self_check(lambda a, b, e: parallel(a, b, e, 5)) is None
    # An off-by-one in the word index (the bug the absolute indices guard against) is caught too.
    assert native.self_check(lambda a, b, e: good(a, b + 1, e + 1) if e > b else 0) is not None


@pytest.mark.parametrize("begin,end", [(0, 0), (0, 1), (1, 2), (13, 99_991), (65_536, 100_000)])
def test_ranges_of_the_compiled_loop_equal_numpy(begin: int, end: int) -> None:
    fn, parallel = native.load().words_sum, native.load().words_sum_parallel
    assert fn is not None and parallel is not None
    data = np.random.default_rng(end).integers(0, 256, 8 * 100_000, dtype=np.uint8)
    words = data.view("<u8")
    want = numpy_words_sum(words, begin, end)
    assert int(fn(data.ctypes.data, begin, end)) == want
    # Threaded in C: any thread count (more than the parts can use, more than its cap) adds up the same.
    assert [int(parallel(data.ctypes.data, begin, end, t)) for t in (1, 2, 3, 7, 100)] == [want] * 5
    # Sums of adjacent ranges add up (threads split a buffer this way).
    mid = (begin + end) // 2
    split = int(fn(data.ctypes.data, begin, mid)) + int(fn(data.ctypes.data, mid, end))
    assert split % (1 << 64) == numpy_words_sum(words, begin, end)


def test_maru_doctor_shows_which_checksum_runs(tmp_path: Path) -> None:
    from maru.cli.doctor import OK, WARN, DoctorContext, check_checksum

    assert check_checksum(DoctorContext(url="tcp://127.0.0.1:9")).status == OK
    env = {**os.environ, "MARU_NATIVE": "0", "PYTHONPATH": str(REPO_ROOT)}
    code = (
        "from maru.cli.doctor import DoctorContext, check_checksum;"
        "r = check_checksum(DoctorContext(url='tcp://127.0.0.1:9'));"
        "print(r.status, '|', r.detail, '|', r.fix)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith(WARN) and "MARU_NATIVE=0" in out.stdout and "unset MARU_NATIVE" in out.stdout


def test_an_unusable_loop_switches_every_checksum_to_numpy_with_the_same_values(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import maru.checksum as ck

    data = np.random.default_rng(3).integers(0, 256, 100_003, dtype=np.uint8)
    want = ck.checksum(data)
    monkeypatch.setattr(native, "_loaded", native.Native(None, "a test said so"))
    assert ck.implementation() == "numpy" and ck.checksum(data) == want
    assert ck.slow_reasons() == [
        "checksums run in numpy, 2-4x slower and stalled by busy Python threads (a test said so). "
        f"Fix: {native.FIX}"
    ]


def test_a_build_removes_other_builds_untouched_for_30_days_and_keeps_recent_ones(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    old, recent, other = (
        cache / "maru-checksum-0ld.so",
        cache / "maru-checksum-recent.so",
        cache / "notes.txt",
    )
    for p in (old, recent, other):
        p.write_bytes(b"x")
    month_ago = os.path.getmtime(old) - native.STALE_S - 60
    os.utime(old, (month_ago, month_ago))
    os.utime(other, (month_ago, month_ago))
    first, _ = probe(tmp_path)
    assert first["impl"] == "native", first
    names = sorted(p.name for p in cache.iterdir())
    assert names == sorted([Path(first["library"]).name, recent.name, other.name]), names


def test_the_segment_sums_are_checked_against_the_checked_loop() -> None:
    nat = native.load()
    assert nat.segment_sums is not None and nat.words_sum is not None
    assert native.self_check_segments(nat.segment_sums, nat.words_sum) is None
    assert native.self_check_segments(lambda *args: None, nat.words_sum) is not None  # leaves zeros

    def off_by_one_segment(addr, planes, tokens, row_words, seg, only, raws) -> None:  # noqa: ANN001
        nat.segment_sums(addr, planes, tokens, row_words, seg + 1, only, raws)

    assert native.self_check_segments(off_by_one_segment, nat.words_sum) is not None
