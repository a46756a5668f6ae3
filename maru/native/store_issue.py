"""The staged store's per-chunk libcudart calls in one C call (``store_issue.c``).

``load()`` builds the library as ``maru.native`` builds the checksum (the system C compiler, a
per-user cache, one build per source, compiler and CPU) and checks it before use: the loop run
with recording stand-ins for libcudart's functions must make exactly the calls, in the order and
with the arguments, that ``reference_calls`` (the Python definition, the same sequence as
``PacedStores._queue_chunks_raw``) makes for random rows, and stop at a failing call saying which.
A build that disagrees is refused with the difference.

``StoreIssue.queue`` calls it through ``ctypes.CDLL`` (the GIL released once for the whole batch:
for the write-behind drain thread, beside vLLM's loop) or ``ctypes.PyDLL`` (kept: for a caller on
vLLM's forward thread, where taking the GIL back could wait for another thread's switch interval).

Measured in real vLLM on an H100 (bench/RESULTS.md, fifty-ninth pass): no faster than the Python
loop (storing 1.117x a cold round against 1.111x, the loop over it 1.017, 95% CI 0.971-1.071), so
``MARU_NATIVE_STORE_ISSUE`` stays off by default.
"""

from __future__ import annotations

import ctypes
import os
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from maru import native

SOURCE = Path(__file__).with_name("store_issue.c")
ABI = 1
ROW = 13  # int64 words a chunk (store_issue.c's MARU_ISSUE_ROW)
WAIT_FREE, CHECKSUM, YIELD = 1, 2, 4  # a row's flags
# Each step of a row, as store_issue.c numbers them: what a failure there names.
STEPS = (
    "cudaStreamWaitEvent (the slot's last copy)",
    "cudaMemcpyAsync (the chunk's slot mapping)",
    "cudaGraphLaunch (the gather)",
    "cudaGraphLaunch (the checksum)",
    "cudaMemcpyAsync (the chunk's sum)",
    "cudaEventRecord (slot ready)",
    "cudaStreamWaitEvent (the copy stream on the slot)",
    "cudaGraphLaunch (the yield kernel)",
    "cudaMemcpyAsync (the chunk to the pool)",
    "cudaEventRecord (slot free)",
)

Call = tuple  # ("wait", stream, event) | ("record", event, stream) | ("launch", exe, stream) | ("copy", dst, src, n, kind, stream)


def reference_calls(
    rows: Sequence[Sequence[int]], gather: int, copy: int, yield_exec: int, d2d: int, d2h: int
) -> list[Call]:
    """The calls the loop makes for ``rows``, in order (the definition the build is checked against)."""
    out: list[Call] = []
    for r in rows:
        flags, free, ready = r[0], r[1], r[2]
        if flags & WAIT_FREE:
            out.append(("wait", gather, free))
        out.append(("copy", r[3], r[4], r[5], d2d, gather))
        out.append(("launch", r[6], gather))
        if flags & CHECKSUM:
            out.append(("launch", r[7], gather))
            out.append(("copy", r[8], r[9], 8, d2d, gather))
        out.append(("record", ready, gather))
        out.append(("wait", copy, ready))
        if flags & YIELD:
            out.append(("launch", yield_exec, copy))
        out.append(("copy", r[10], r[11], r[12], d2h, copy))
        out.append(("record", free, copy))
    return out


class IssueFailed(RuntimeError):
    """A libcudart call of the loop failed: the calls before it were queued, none after it."""

    def __init__(self, row: int, step: int, err: int) -> None:
        self.row, self.step, self.err = row, step, err
        super().__init__(f"{STEPS[step]} of chunk {row} failed: cudaError {err}")


@dataclass(frozen=True)
class StoreIssue:
    """The bound loop: ``queue`` one run of chunk rows on two raw streams."""

    library: str
    _held: Callable[..., int]
    _free: Callable[..., int]

    def queue(
        self,
        fns: ctypes.Array,
        rows: ctypes.Array,
        n: int,
        gather: int,
        copy: int,
        yield_exec: int,
        d2d: int,
        d2h: int,
        *,
        release_gil: bool,
    ) -> None:
        """Queue ``n`` rows (``ROW`` int64 words each in ``rows``) with libcudart's functions ``fns``
        (four addresses: wait, record, launch, copy). Raises ``IssueFailed`` at a failing call."""
        err = ctypes.c_int(0)
        fn = self._free if release_gil else self._held
        at = fn(fns, rows, n, gather, copy, yield_exec, d2d, d2h, ctypes.byref(err))
        if at:
            raise IssueFailed(at // 16 - 1, at % 16, err.value)


@dataclass(frozen=True)
class Loaded:
    """``load()``'s outcome: the loop, or why there is none (and ``fix``)."""

    issue: StoreIssue | None
    reason: str = ""

    @property
    def fix(self) -> str:
        if self.reason.startswith("MARU_NATIVE=0"):
            return "unset MARU_NATIVE (or set it to 1), or unset MARU_NATIVE_STORE_ISSUE"
        return "install a C compiler (or set $CC to one), or unset MARU_NATIVE_STORE_ISSUE"


_lock = threading.Lock()
_loaded: Loaded | None = None


def load() -> Loaded:
    """The checked store-issue loop of this process (built and checked at the first call)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> Loaded:
    if os.environ.get(native.ENV_DISABLE, "1").strip() == "0":
        return Loaded(None, "MARU_NATIVE=0 turns the compiled code off")
    try:
        path = native.build(SOURCE, "maru-store-issue")
        issue = _bind(path)
    except (OSError, RuntimeError) as e:
        return Loaded(None, str(e))
    problem = self_check(issue)
    if problem is not None:
        return Loaded(None, f"the compiled store issue {path} disagrees with its definition ({problem})")
    return Loaded(issue)


def _bind(path: Path) -> StoreIssue:
    held, free = ctypes.PyDLL(str(path)), ctypes.CDLL(str(path))
    if held.maru_issue_abi() != ABI or held.maru_issue_row_words() != ROW:
        raise RuntimeError(
            f"{path} has ABI {held.maru_issue_abi()} / {held.maru_issue_row_words()} words a row"
        )
    fns = []
    for lib in (held, free):
        f = lib.maru_queue_store_chunks
        vp = ctypes.c_void_p
        f.argtypes = [
            vp,
            vp,
            ctypes.c_int64,
            vp,
            vp,
            vp,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_int),
        ]
        f.restype = ctypes.c_int64
        fns.append(f)
    return StoreIssue(str(path), fns[0], fns[1])


WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
COPY = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p
)


class Recorder:
    """Stand-ins for libcudart's four functions that record each call (``calls``, as
    ``reference_calls`` writes them) and fail the ``fail_at``-th call (0-based) with error 700."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.calls: list[Call] = []
        self.fail_at = fail_at

        def note(call: Call) -> int:
            self.calls.append(call)
            return 700 if self.fail_at is not None and len(self.calls) - 1 == self.fail_at else 0

        v = lambda x: int(x or 0)  # noqa: E731  (ctypes passes a NULL void* as None)
        self._keep = (
            WAIT(lambda s, e, f: note(("wait", v(s), v(e)))),
            RECORD(lambda e, s: note(("record", v(e), v(s)))),
            LAUNCH(lambda x, s: note(("launch", v(x), v(s)))),
            COPY(lambda d, src, n, k, s: note(("copy", v(d), v(src), int(n), int(k), v(s)))),
        )
        self.fns = function_table([ctypes.cast(f, ctypes.c_void_p).value or 0 for f in self._keep])


def function_table(addresses: Sequence[int]) -> ctypes.Array:
    """The ``fns`` argument of ``StoreIssue.queue``: wait, record, launch, copy."""
    return (ctypes.c_void_p * 4)(*addresses)


def row_table(rows: Sequence[Sequence[int]]) -> ctypes.Array:
    """The ``rows`` argument of ``StoreIssue.queue`` (each row ``ROW`` ints)."""
    flat = [int(x) for r in rows for x in r]
    return (ctypes.c_int64 * max(len(flat), 1))(*flat)


def random_rows(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(8)] + [rng.randrange(1, 1 << 47) for _ in range(ROW - 1)] for _ in range(n)]


def self_check(issue: StoreIssue) -> str | None:
    """None if the loop makes ``reference_calls``' calls for random rows (GIL kept and released),
    and stops at an injected failure naming its row and step; else what differed."""
    rng = random.Random(0x697373)
    for n in (0, 1, 2, 7):
        rows = random_rows(rng, n)
        g, c, y = (rng.randrange(1, 1 << 47) for _ in range(3))
        want = reference_calls(rows, g, c, y, 3, 2)
        for release in (False, True):
            rec = Recorder()
            issue.queue(rec.fns, row_table(rows), n, g, c, y, 3, 2, release_gil=release)
            if rec.calls != want:
                return (
                    f"{n} rows: {len(rec.calls)} calls, not the {len(want)} of the definition, or other ones"
                )
        if want:
            stop = rng.randrange(len(want))
            rec = Recorder(fail_at=stop)
            try:
                issue.queue(rec.fns, row_table(rows), n, g, c, y, 3, 2, release_gil=True)
                return f"{n} rows: a failure at call {stop} was not reported"
            except IssueFailed as e:
                if rec.calls != want[: stop + 1] or e.err != 700:
                    return f"{n} rows: a failure at call {stop} did not stop the loop there"
    return None
