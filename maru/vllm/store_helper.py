"""``maru_store_helper``: the write-behind drain in a process of its own.

Why: the drain thread's Python (the reserve, the gather's and copies' issue, the wake-up after the
copies, the publish: 3.1-3.3 ms of CPU a 32-chunk batch on an H100 host, ``bench/drain_cpu.py``)
runs in vLLM's interpreter, and vLLM's loop, host-bound with CUDA graphs, pays for it by its amount
or more: +5 ms of drain CPU a batch cost +5.5 ms of TTFT, +10 ms cost +16 ms (bench/RESULTS.md,
fifty-seventh pass). In a process of its own that CPU is another interpreter's: a host-bound step
beside a drain thread took 1.32x its time alone, beside a helper process 1.011x
(``bench/store_helper_probe.py``, H100).

Measured in real vLLM since (bench/RESULTS.md, fifty-eighth pass): it takes the host work out, but
without MPS its device work, in a second CUDA context, takes turns with vLLM's kernels by time
slices, and its storing instance paid what the drain thread's did. Under MPS (fifty-ninth pass) it
paid 1.047x a cold round against the drain thread's 1.069x in the same runs: ahead, not clearly
(the drain thread over it 1.017, 95% CI 0.997-1.039). So it is off by default, and a helper on a
GPU where CUDA finds no MPS daemon says so (``time_slice_note``).

How: the worker spawns the helper with its KV caches (CUDA IPC through torch's reductions; CPU
caches must be in shared memory), a ring of interprocess CUDA events, and what the helper needs
to build its own server client and ``KVTransferEngine``. For each store batch the forward thread
records a free event of the ring on its current stream (after the forward that wrote the blocks)
and sends the batch (its ``RequestTransfer``s, pickled) with the event's index; the helper makes
its stream wait for that event, stores exactly as the drain thread would (``issue_store`` under
that stream, then ``complete_store``: reserve, gather, copies, publish) and replies with the
``StoreReport``.

Invariants:

* A batch reads its blocks until its reply arrives (``HelperBatch.reading_done``): the helper
  replies after the store completed (its copies ran; published, or its objects aborted), so the
  cache is not read for it after the reply. vLLM frees a finished request's blocks only then
  (``WriteBehind.finished_sending``), a preempted request's blocks only after the barrier
  (``wait_store_read``).
* An event of the ring is recorded again only after the batch that used it replied; with every
  event in use (``RING`` batches in flight) a batch goes to the drain thread instead (counted).
* The helper never reads blocks the worker reuses: when a batch the preemption barrier waits for
  does not reply within the timeout, or the helper's pipe breaks, the worker kills the helper and
  waits for its exit. A dead process's device work ends with its CUDA context, so its batches'
  blocks are safe then; those batches count as failed (never published: the helper publishes
  only after its copies completed), and every later store runs on the drain thread, said once as
  a warning with the reason and in ``maru doctor`` (``slow``).
* Nothing silent: a helper that cannot start (caches it cannot share, a failed spawn, no ready
  report within ``START_TIMEOUT_S``) leaves the stores on the drain thread, said once with the
  reason and the fix. Until it is ready (its pool registration takes seconds) stores go to the
  drain thread, said once at info level.

The helper exits when the worker closes it (``close``) or when its pipe reaches end of file (the
worker died).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from maru.transfer.records import RequestTransfer, StoreReport

logger = logging.getLogger("maru.vllm")

RING = 32  # interprocess events, so store batches in flight to the helper at most
START_TIMEOUT_S = 180.0  # spawn, CUDA init, pool registration (2 GiB/s: ~5 s for 10 GiB), warm-up
FIX = "Fix: see the reason; maru_store_helper false keeps the drain thread (docs/vllm.md, maru_store_helper)"


@dataclass
class HelperBatch:
    """A store batch sent to the helper: ``read_done`` is set once its reply arrived (or the helper
    is known dead), after which the cache is not read for it."""

    batch_id: int
    slot: int
    requests: list[RequestTransfer]
    read_done: threading.Event = field(default_factory=threading.Event)

    @property
    def req_ids(self) -> frozenset[str]:
        return frozenset(r.req_id for r in self.requests)

    @property
    def chunks(self) -> int:
        return sum(len(r.chunks) for r in self.requests)

    def reading_done(self) -> bool:
        return self.read_done.is_set()


@dataclass
class HelperSpec:
    """What the helper builds its side from (pickled into it at spawn: the caches through torch's
    reductions, the events as interprocess handles)."""

    caches: list[Any]
    layout: Any
    server_url: str
    timeout_s: float
    chunk_tokens: int | None
    paced_store: bool
    device: int | None  # the CUDA device index; None: CPU caches in shared memory
    events: list[Any] | None  # RING interprocess CUDA events (None on CPU)


def share_blocker(caches: list[Any]) -> str | None:
    """Why these caches cannot reach a helper process (None: they can, as far as can be told here;
    CUDA IPC itself is tried at spawn)."""
    if not caches:
        return "no KV caches"
    if caches[0].is_cuda:
        if "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", ""):
            return "PYTORCH_CUDA_ALLOC_CONF has expandable_segments:True, whose memory CUDA IPC cannot share"
        return None
    if not all(c.is_shared() for c in caches):
        return "CPU KV caches not in shared memory (vLLM's are not): a helper process cannot read them"
    return None


MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"  # CUDA's MPS pipe directory where CUDA_MPS_PIPE_DIRECTORY is unset


def mps_pipe_dir(environ: Any = os.environ) -> str:
    """Where this process's CUDA looks for an MPS daemon."""
    return environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT


def mps_control(environ: Any = os.environ) -> str | None:
    """The control endpoint of the MPS daemon this process's CUDA would use, if there is one.

    ``nvidia-cuda-mps-control -d`` leaves ``control`` in its pipe directory: a UNIX socket on
    driver 580 (seen on the H100, fifty-ninth pass); a named pipe is taken too. A plain file of
    that name is not one. The daemon's pid file is not checked: in a container the daemon often
    runs in the host's pid namespace, where its pid means nothing here."""
    control = os.path.join(mps_pipe_dir(environ), "control")
    try:
        mode = os.stat(control).st_mode
    except OSError:
        return None
    return control if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode) else None


def time_slice_note(caches: list[Any], environ: Any = os.environ) -> str | None:
    """Why a helper on these caches costs vLLM about what it saves (None: CPU caches, or MPS).

    Two processes' kernels do not run side by side on a GPU without MPS: they take turns by time
    slices, and the helper's gathers, copies and pacing kernels took vLLM's forwards' turns. In
    real vLLM on an H100 (bench/RESULTS.md, fifty-eighth pass) the helper's storing instance paid
    as much as the drain thread's, 1.134x against 1.092x a cold round without a connector (not
    paced, 1.325x), while the same helper without device work paid 1.038x."""
    if not caches or not caches[0].is_cuda or mps_control(environ) is not None:
        return None
    return (
        f"the store helper's device work takes turns with vLLM's kernels (no MPS daemon's control "
        f"socket in {mps_pipe_dir(environ)}): measured no faster than the drain thread in real vLLM (bench/RESULTS.md, "
        "fifty-eighth pass). Fix: maru_store_helper false, or run vLLM under MPS "
        "(nvidia-cuda-mps-control -d first; docs/vllm.md, maru_store_helper)"
    )


class StoreHelper:
    """The worker's side of the helper process (see the module docstring). Used from vLLM's forward
    thread only (``submit``, ``poll``, ``wait_store_read``, ``close``), its messages sent by a thread
    of its own (``_send_loop``: a full socket blocks that thread, never the forward's); never
    raises into vLLM."""

    def __init__(self, spec: HelperSpec, *, start_timeout_s: float = START_TIMEOUT_S) -> None:
        import torch.multiprocessing as tmp  # registers the reductions that share tensors and events

        self.spec = spec
        self.state = "starting"  # starting | ready | failed | closed
        self.why: str | None = None  # why it failed (reason and fix)
        # Why it runs but costs vLLM about what it saves (``time_slice_note``): a slow path, said.
        self.note: str | None = None
        self.pid: int | None = None
        self._start_timeout_s = start_timeout_s
        self._deadline = time.monotonic() + start_timeout_s
        # Sends go through a thread of their own: a batch's message is tens of KiB (its block ids
        # and keys), and a helper that stalls lets the socket fill; a send would then block vLLM's
        # forward thread. The sender blocks instead, without the GIL (a socket write).
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._send_error: str | None = None
        self._sender: threading.Thread | None = None
        self._inflight: dict[int, HelperBatch] = {}
        self._done: list[tuple[HelperBatch, StoreReport]] = []
        self._next_id = 0
        ctx = tmp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=helper_main, args=(child, spec), name="maru-store-helper", daemon=True
        )
        try:
            with _may_have_children():
                self._proc.start()
        except Exception as e:  # the caches or events could not be pickled (no CUDA IPC), no spawn
            self._fail(f"the store helper process could not start ({type(e).__name__}: {e})", kill=False)
        finally:
            child.close()  # the worker's copy: the helper's exit then reads as end of file here
        if self.state == "starting":
            self.pid = self._proc.pid
            self._sender = threading.Thread(
                target=self._send_loop, name="maru-store-helper-send", daemon=True
            )
            self._sender.start()
            logger.info(
                "Maru: the store helper process (pid %s) is starting; write-behind stores run on the drain "
                "thread until it is ready",
                self.pid,
            )

    # -- state -----------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether the helper takes stores now (reads its start report without blocking)."""
        if self.state == "starting":
            self._read(0.0)
            if self.state == "starting" and time.monotonic() > self._deadline:
                self._fail(
                    f"the store helper process did not report ready within {self._start_timeout_s:.0f} s"
                )
        return self.state == "ready"

    def takes(self) -> bool:
        """Whether a batch submitted now goes to the helper: ready, and an event of the ring free."""
        return self.ready() and len(self._inflight) < RING

    def in_flight(self) -> int:
        return len(self._inflight)

    # -- stores ----------------------------------------------------------------------------------
    def submit(self, stores: list[RequestTransfer]) -> HelperBatch | None:
        """Send a store batch (forward thread, right after the forward that wrote its blocks); None
        when it could not be sent (the helper failed: the caller stores on the drain thread)."""
        used = {b.slot for b in self._inflight.values()}
        slot = next(i for i in range(RING) if i not in used)  # takes() said one is free
        batch = HelperBatch(self._next_id, slot, list(stores))
        self._next_id += 1
        try:
            if self.spec.events is not None:
                import torch

                # On the forward's stream, after the forward: the helper's gather waits for it.
                self.spec.events[slot].record(torch.cuda.current_stream(self.spec.device))
            self._outbox.put(("store", batch.batch_id, slot, batch.requests))
        except Exception as e:
            self._fail(f"sending a store batch to the store helper failed ({type(e).__name__}: {e})")
            return None
        self._inflight[batch.batch_id] = batch
        return batch

    def poll(self) -> list[tuple[HelperBatch, StoreReport]]:
        """Every batch that finished since the last call, with its report (never blocks)."""
        if self.state in ("ready", "starting"):
            self._read(0.0)
        done, self._done = self._done, []
        return done

    def wait_all(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for every batch in flight (their reports then come from ``poll``)."""
        deadline = time.monotonic() + timeout_s
        while self._inflight and self.state == "ready":
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._read(left)

    def wait_store_read(self, batch: HelperBatch, timeout_s: float) -> bool:
        """Block until ``batch`` no longer reads its blocks: its reply, or the helper stopped (killed
        when the reply does not come within ``timeout_s``). True: the blocks may be reused."""
        deadline = time.monotonic() + timeout_s
        while not batch.reading_done():
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(
                    f"a store batch of the store helper (pid {self.pid}) did not finish reading its blocks "
                    f"within {timeout_s:.1f} s while a preempted request's blocks waited for it; the helper "
                    "was stopped so that nothing reads them"
                )
                break
            self._read(left)
        return True

    def close(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the batches in flight, then stop the helper (killed if it does
        not exit); batches still in flight then count as failed."""
        deadline = time.monotonic() + timeout_s
        self.wait_all(timeout_s)
        if self.state in ("ready", "starting"):
            self._outbox.put(("stop",))
            self._proc.join(max(1.0, deadline - time.monotonic()))
        self._outbox.put(None)  # the sender's end (after any message still queued)
        self._stop_process()
        if self._sender is not None:
            self._sender.join(5.0)
        self._lose_inflight("the store helper was closed before the batch finished")
        if self.state != "failed":
            self.state = "closed"
        self._conn.close()

    # -- the pipe --------------------------------------------------------------------------------
    def _send_loop(self) -> None:
        """The sender thread: each queued message to the helper, in order, until the end marker or
        a failed send (the forward thread's next read then finds the helper failed)."""
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except Exception as e:
                self._send_error = f"{type(e).__name__}: {e}"
                return

    def _read(self, wait_s: float) -> None:
        """Read every message there is (waiting up to ``wait_s`` for the first); a broken pipe or a
        dead helper fails it."""
        try:
            first = True
            while self._conn.poll(wait_s if first else 0.0):
                first = False
                self._on_message(self._conn.recv())
        except (EOFError, OSError) as e:
            self._fail(
                f"the store helper process (pid {self.pid}) exited ({type(e).__name__}: {e or 'end of file'})"
            )
            return
        # A ready helper's death reads as end of file above; one that dies while starting may not
        # (its end of the pipe may still sit with multiprocessing's fd sharer), so ask the process.
        if self.state == "starting" and not self._proc.is_alive():
            self._fail(f"the store helper process (pid {self.pid}) exited with code {self._proc.exitcode}")
        elif self.state in ("ready", "starting") and self._send_error is not None:
            self._fail(f"sending to the store helper process (pid {self.pid}) failed ({self._send_error})")

    def _on_message(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "done":
            batch = self._inflight.pop(msg[1], None)
            if batch is not None:
                batch.read_done.set()
                self._done.append((batch, msg[2]))
        elif kind == "ready":
            self.state = "ready"
            logger.info(
                "Maru: write-behind stores run in the store helper process (pid %s, %s): vLLM's interpreter "
                "only records an event and sends each batch",
                self.pid,
                msg[1],
            )
        elif kind == "failed":
            self._fail(f"the store helper process could not set up: {msg[1]}")

    # -- failure ---------------------------------------------------------------------------------
    def _fail(self, why: str, *, kill: bool = True) -> None:
        if self.state in ("failed", "closed"):
            return
        self.state = "failed"
        self.why = f"{why}; write-behind stores run on the drain thread from now on. {FIX}"
        logger.warning("Maru: %s", self.why)
        if kill:
            self._stop_process()
        self._outbox.put(None)  # the sender ends (a send blocked on a dead helper fails first)
        self._lose_inflight(why)

    def _stop_process(self) -> None:
        """Kill the helper if it runs and wait for its exit: its device work ends with it."""
        proc = self._proc
        if proc.pid is None:
            return
        if proc.is_alive():
            proc.kill()
        proc.join(30.0)

    def _lose_inflight(self, why: str) -> None:
        """The batches in flight: failed, their blocks free (the helper is gone)."""
        for batch in self._inflight.values():
            batch.read_done.set()
            self._done.append((batch, StoreReport(failed=batch.chunks, error=f"store helper: {why}")))
        self._inflight.clear()


@contextlib.contextmanager
def _may_have_children() -> Iterator[None]:
    """Let this process start the helper even where it is a daemonic multiprocessing child (vLLM's
    multiprocess executor starts its tensor-parallel workers so). multiprocessing refuses children
    to daemonic processes lest they be orphaned when the daemon is terminated; the helper is not
    left behind: it exits when its pipe to the worker reaches end of file, which the worker's
    death causes. The flag is multiprocessing's own (``BaseProcess._config``), restored at once."""
    me = multiprocessing.current_process()
    config = getattr(me, "_config", None)
    daemonic = isinstance(config, dict) and bool(config.get("daemon"))
    if daemonic:
        config["daemon"] = False
    try:
        yield
    finally:
        if daemonic:
            config["daemon"] = True


# ------------------------------------------------------------------------------------ the helper
def helper_main(conn: Any, spec: HelperSpec) -> None:
    """The helper process: build a client and an engine over the shared caches, report ready, then
    store each batch received until told to stop or the pipe ends."""
    try:
        import torch

        from maru.client import MaruHandler
        from maru.transfer.engine import KVTransferEngine

        if spec.device is not None:
            torch.cuda.set_device(spec.device)
        client = MaruHandler(spec.server_url, timeout_s=spec.timeout_s)
        engine = KVTransferEngine(
            list(spec.caches),
            spec.layout,
            client,
            chunk_tokens=spec.chunk_tokens,
            paced_store=spec.paced_store,
        )
        stream = torch.cuda.Stream(spec.device) if spec.device is not None else None
        info = getattr(client, "set_client_info", None)
        if info is not None:
            info({"role": "vllm-store-helper", "paths": {"store": engine.data_path, "pid": os.getpid()}})
    except BaseException as e:
        try:
            conn.send(("failed", f"{type(e).__name__}: {e}"))
        finally:
            conn.close()
        return
    try:
        conn.send(("ready", f"{engine.data_path} data path"))
        while True:
            try:
                msg = conn.recv()
            except EOFError:  # the worker is gone
                break
            if msg[0] != "store":
                break
            _, batch_id, slot, stores = msg
            event = spec.events[slot] if spec.events is not None else None
            conn.send(("done", batch_id, store_batch(torch, engine, stores, stream, event)))
    except (BrokenPipeError, OSError):
        pass  # the worker is gone
    finally:
        engine.close()
        client.close()
        conn.close()


def store_batch(
    torch: Any, engine: Any, stores: list[RequestTransfer], stream: Any, event: Any
) -> StoreReport:
    """One batch as the drain thread stores it, its gather ordered after ``event`` (the worker's
    forward) on ``stream``; a failure is the batch's report, never an exception."""
    try:
        with torch.inference_mode():
            if stream is not None:
                with torch.cuda.stream(stream):
                    stream.wait_event(event)
                    pending = engine.issue_store(stores)
            else:
                pending = engine.issue_store(stores)
            return engine.complete_store(pending)  # type: ignore[no-any-return]
    except Exception as e:
        n = sum(len(r.chunks) for r in stores)
        return StoreReport(failed=n, error=f"store helper: {type(e).__name__}: {e}")


class RefusedHelper:
    """A store helper asked for that cannot run here (``helper_for``): it takes no batch, and says
    why where a failed helper does (the worker's slow paths: ``maru doctor``), once in the log."""

    state = "refused"
    pid = None

    def __init__(self, why: str) -> None:
        self.why = f"no store helper process: {why}; write-behind stores run on the drain thread. {FIX}"
        logger.warning("Maru: %s", self.why)

    def takes(self) -> bool:
        return False

    def poll(self) -> list[tuple[HelperBatch, StoreReport]]:
        return []

    def wait_all(self, timeout_s: float) -> None:
        return None

    def close(self, timeout_s: float) -> None:
        return None


def helper_for(caches: list[Any], layout: Any, cfg: Any) -> StoreHelper | RefusedHelper | None:
    """The store helper for a worker's caches under ``cfg`` (``maru_store_helper``), a
    ``RefusedHelper`` saying why where it cannot run (write-behind off, caches it cannot share), or
    None: not asked for."""
    if not cfg.store_helper:
        return None
    if not cfg.async_store:
        return RefusedHelper("maru_async_store is off, so stores run inline on the forward thread (no drain)")
    why = share_blocker(caches)
    if why is not None:
        return RefusedHelper(why)
    events = None
    device = None
    if caches[0].is_cuda:
        import torch

        device = caches[0].device.index if caches[0].device.index is not None else torch.cuda.current_device()
        events = [torch.cuda.Event(interprocess=True) for _ in range(RING)]
    spec = HelperSpec(
        caches=list(caches),
        layout=layout,
        server_url=cfg.server_url,
        timeout_s=cfg.timeout_s,
        chunk_tokens=cfg.kv_chunk_tokens,
        paced_store=cfg.paced_store,
        device=device,
        events=events,
    )
    helper = StoreHelper(spec)
    helper.note = time_slice_note(caches)
    if helper.note is not None and helper.state != "failed":
        logger.warning("Maru: %s", helper.note)
    return helper
