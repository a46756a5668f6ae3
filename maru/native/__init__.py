"""Maru's one piece of C: the checksum's inner loop, built on first use and loaded with ctypes.

Why C: numpy gives the GIL up and takes it back at every operation (nine per 256 KiB block of a
checksum). Beside a Python thread that never sleeps (vLLM's engine loop while requests wait) each
take-back waits for that thread: numpy checksums ran at 0.01 GB/s instead of 2-4.6 GB/s on this
project's 2-core machine (bench/checksum.py). One ctypes call takes no GIL round trips inside,
and the compiled loop is itself 2-4x faster than numpy's.

Releasing the GIL is not free either: taking it back beside a busy thread waits for that thread
to give it up (up to ``sys.getswitchinterval()``, 5 ms). So ``maru.checksum`` calls the one-thread
loop through ``PyDLL`` (GIL kept; a 16 MiB object takes about 2 ms) below ``PARALLEL_BYTES``, and
from there on ``maru_words_sum_parallel`` through ``CDLL``: the GIL is released once, the threads
are started in C (pthreads), and it is taken back once.

How: ``checksum.c`` next to this file is compiled with the system C compiler (``$CC``, else
``cc``) at ``-O3 -march=native`` into a per-user cache (``$MARU_NATIVE_CACHE``, else
``$XDG_CACHE_HOME/maru``, else ``~/.cache/maru``), named by a hash of the source, the compiler
command, the machine and this CPU's feature flags (a home directory shared by hosts with other
CPUs gets one build per CPU kind, never an illegal instruction). A build goes to a temporary file
and is renamed into place, so concurrent processes never load half a library. Before it is used,
the loaded function is checked against the numpy definition on random data (several lengths and
start offsets); a difference refuses it.

``load()`` returns ``Native`` (the function, or why there is none and how to fix it). Nothing here
falls back silently: ``maru.checksum`` announces the numpy path once, with the reason and the fix,
and it shows in ``maru doctor`` and in the client info of the connector and the LMCache backend.
``MARU_NATIVE=0`` turns the C path off on purpose (still announced).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("checksum.c")
ABI = 3
ENV_DISABLE = "MARU_NATIVE"
ENV_CACHE = "MARU_NATIVE_CACHE"
FIX = (
    "install a C compiler (Debian/Ubuntu: apt install gcc) or set $CC to one, then check "
    "`maru doctor` (line 'checksum'); MARU_NATIVE_CACHE must be a writable directory"
)

WordsSum = Callable[[int, int, int], int]  # (address of the words, begin, end) -> sum mod 2**64
ParallelSum = Callable[[int, int, int, int], int]  # (address, begin, end, threads) -> the same sum
# (address, planes, tokens, row words, segment tokens, address of one byte a segment or 0, address of
# the uint64 raws to add into) -> None: every segment's raw sum of an object in one call.
SegmentSums = Callable[[int, int, int, int, int, int, int], None]


@dataclass(frozen=True)
class Native:
    """The outcome of ``load()``: ``words_sum`` or the ``reason`` there is none (and ``fix``)."""

    words_sum: WordsSum | None  # one thread, keeps the GIL (ctypes.PyDLL): small objects
    reason: str = ""
    library: str = ""
    words_sum_parallel: ParallelSum | None = None  # releases the GIL once, threads in C (ctypes.CDLL)
    segment_sums: SegmentSums | None = None  # an object's segment sums in one call (GIL kept)

    @property
    def fix(self) -> str:
        return "unset MARU_NATIVE (or set it to 1)" if self.reason.startswith("MARU_NATIVE=0") else FIX


_lock = threading.Lock()
_loaded: Native | None = None


def load() -> Native:
    """The compiled checksum loop of this process (built and checked at the first call)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> Native:
    if os.environ.get(ENV_DISABLE, "1").strip() == "0":
        return Native(None, "MARU_NATIVE=0 turns the compiled checksum off")
    if sys.byteorder != "little":
        return Native(None, "this host is big-endian; the checksum reads little-endian words")
    try:
        path = build()
        one, parallel, segments = _bind(path)
    except (OSError, RuntimeError) as e:
        return Native(None, str(e))
    problem = (
        self_check(one)
        or self_check(lambda a, b, e: parallel(a, b, e, 3))
        or self_check_segments(segments, one)
    )
    if problem is not None:
        return Native(None, f"the compiled checksum {path} disagrees with its definition ({problem})")
    return Native(one, library=str(path), words_sum_parallel=parallel, segment_sums=segments)


def cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "maru"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compilers() -> list[list[str]]:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler found ($CC unset, no cc, gcc or clang on PATH)")
    base = [*cc.split(), "-O3", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing"]
    # -march=native: vector 64-bit multiplies where the CPU has them; without it where the compiler
    # or the CPU refuses the flag.
    return [[*base, "-march=native"], base]


BUILD_TIMEOUT_S = 120.0  # a compiler that hangs is a build that failed, said as the others


def build(src: Path = SOURCE, stem: str = "maru-checksum") -> Path:
    """Compile ``src`` (``checksum.c``) into the cache as ``<stem>-<tag>.so`` unless a build for
    this source, compiler and CPU is there; returns the library's path. Raises ``RuntimeError``
    saying why it could not."""
    source = src.read_bytes()
    errors = []
    for cmd in _compilers():
        tag = hashlib.sha256(
            b"\0".join([source, " ".join(cmd).encode(), platform.machine().encode(), _cpu_flags().encode()])
        ).hexdigest()[:16]
        out = cache_dir() / f"{stem}-{tag}.so"
        if out.exists():
            return out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RuntimeError(f"cannot create the build cache {out.parent}: {e}") from None
        fd, tmp = tempfile.mkstemp(prefix=".build-", suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            res = subprocess.run(
                [*cmd, "-o", tmp, str(src)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S
            )
            if res.returncode == 0:
                os.replace(tmp, out)  # atomic: another process loads the old or the whole new file
                _prune(out, stem)
                return out
            errors.append(f"`{' '.join(cmd)}` failed: {res.stderr.strip()[-400:] or res.returncode}")
        except FileNotFoundError as e:
            errors.append(f"cannot run the C compiler: {e}")
        except subprocess.TimeoutExpired:
            errors.append(f"`{' '.join(cmd)}` did not finish within {BUILD_TIMEOUT_S:g} s")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    what = "the compiled checksum" if src == SOURCE else f"the compiled {src.name}"
    raise RuntimeError(f"cannot build {what}: " + "; ".join(errors))


STALE_S = 30 * 86400


def _prune(keep: Path, stem: str = "maru-checksum") -> None:
    """Remove other builds in the cache not modified for ``STALE_S`` (older sources, compilers or
    CPUs; a build in use by a running process stays mapped in it). Best effort."""
    cutoff = time.time() - STALE_S
    for old in keep.parent.glob(f"{stem}-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:
            pass


def _bind(path: Path) -> tuple[WordsSum, ParallelSum, SegmentSums]:
    """(one-thread sum keeping the GIL, threaded sum releasing it, segment sums keeping it) from the
    library at ``path``."""
    held, free = ctypes.PyDLL(str(path)), ctypes.CDLL(str(path))  # PyDLL keeps the GIL, CDLL not
    if held.maru_native_abi() != ABI:
        raise RuntimeError(f"{path} has ABI {held.maru_native_abi()}, expected {ABI}")
    one = held.maru_words_sum
    one.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64]
    one.restype = ctypes.c_uint64
    parallel = free.maru_words_sum_parallel
    parallel.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int]
    parallel.restype = ctypes.c_uint64
    segments = held.maru_segment_sums
    segments.argtypes = [ctypes.c_void_p, *[ctypes.c_uint64] * 4, ctypes.c_void_p, ctypes.c_void_p]
    segments.restype = None
    return one, parallel, segments


def self_check_segments(fn: SegmentSums, words_sum: WordsSum) -> str | None:
    """None if ``fn`` gives each segment the sum of its pieces by ``words_sum`` (itself checked
    first), with and without ``only``, on shapes whose last segment is shorter; else what differed."""
    import numpy as np

    rng = np.random.default_rng(0x736567)
    for planes, tokens, row_words, seg in ((1, 1, 1, 1), (3, 13, 3, 4), (4, 16, 2, 16), (2, 40, 5, 7)):
        data = rng.integers(0, 256, 8 * planes * tokens * row_words, dtype=np.uint8)
        nseg = -(-tokens // seg)
        only = (rng.random(nseg) < 0.6).astype(np.uint8)
        for mask in (None, only):
            want = [0] * nseg
            for p in range(planes):
                for s in range(nseg):
                    if mask is None or mask[s]:
                        a = (p * tokens + s * seg) * row_words
                        b = (p * tokens + min((s + 1) * seg, tokens)) * row_words
                        want[s] = (want[s] + int(words_sum(data.ctypes.data, a, b))) & ((1 << 64) - 1)
            got = np.zeros(nseg, dtype=np.uint64)
            fn(
                data.ctypes.data, planes, tokens, row_words, seg,
                0 if mask is None else mask.ctypes.data, got.ctypes.data,
            )  # fmt: skip
            if got.tolist() != want:
                return (
                    f"segment sums of {planes}x{tokens}x{row_words} words by {seg}: {got.tolist()} != {want}"
                )
    return None


def self_check(fn: WordsSum) -> str | None:
    """None if ``fn`` equals the numpy definition on random words (lengths around the vector
    widths, ranges starting past 0, an unaligned buffer); else what differed."""
    import numpy as np

    from maru.checksum import numpy_words_sum

    rng = np.random.default_rng(0x6D617275)
    n = 40_009  # enough words for the threaded sum to use threads (4096 words a thread at least)
    raw = rng.integers(0, 256, 8 * n + 1, dtype=np.uint8)
    for offset in (0, 1):  # offset 1: words that start off an 8-byte boundary
        data = raw[offset : offset + 8 * n]
        words = data.view("<u8") if offset == 0 else np.frombuffer(data.tobytes(), dtype="<u8")
        for begin, end in ((0, 0), (0, 1), (0, 7), (3, 64), (5, 1027), (0, n), (4000, n), (17, 39_000)):
            want = numpy_words_sum(words, begin, end)
            got = int(fn(data.ctypes.data, begin, end))
            if got != want:
                return f"words {begin}..{end} at offset {offset}: {got:#x} != {want:#x}"
    return None
