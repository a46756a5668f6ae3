"""``maru_store_helper``: the write-behind drain in a process of its own (``maru.vllm.store_helper``).

The real worker connector, a real server and shared-memory pool, the helper a real spawned process
reading the worker's caches (on CPU: caches in shared memory, as CUDA IPC shares them on a GPU;
the GPU path is in ``tests/vllm/test_write_behind_gpu.py``). A helper is stalled with SIGSTOP and
crashed with SIGKILL, so nothing depends on timing. What must hold:

- a batch goes to the helper, its bytes are published right, and vLLM gets the request's blocks
  back (``finished_sending``) only after the helper replied;
- a preempted request's blocks are reused only once nothing reads them: a helper that does not
  answer within the timeout is stopped (its stores lost, never published), said in the log and in
  ``maru doctor``'s slow paths, and later stores run on the drain thread, bytes right;
- a helper that cannot start, or dies, leaves the stores on the drain thread, said with the reason;
- shutdown publishes the batches in flight and the helper process exits.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from maru.client import MaruHandler
from maru.kv_ops.testing import CacheCase
from maru.transfer.records import RequestTransfer
from tests.helpers import ServerProcess
from tests.pool_fixtures import module_server, pool_client, release_pool, stop_worker
from tests.transfer.helpers import CHUNK, assert_loads_back, case, ready_helper, request

pytest.importorskip("vllm")  # the metadata class derives from vLLM's

from maru.vllm.metadata import MaruConnectorMetadata as Meta  # noqa: E402
from maru.vllm.store_helper import HelperSpec, StoreHelper, helper_for, mps_control, time_slice_note  # noqa: E402
from tests.vllm.test_write_behind import finished_sending, worker  # noqa: E402

server = module_server("store-helper")
client = pool_client()


def shared(c: CacheCase) -> CacheCase:
    for t in c.caches:
        t.share_memory_()  # what a helper process can read on CPU (CUDA IPC on a GPU)
    return c


def cpu_spec(src: CacheCase, server: ServerProcess) -> HelperSpec:
    """A helper's spec over ``src``'s shared CPU caches, storing to ``server``."""
    from maru import kv_ops

    return HelperSpec(
        caches=list(src.caches),
        layout=kv_ops.detect_layouts(src.caches, **src.detect_kwargs()),
        server_url=server.url,
        timeout_s=5.0,
        chunk_tokens=CHUNK,
        paced_store=True,
        device=None,
        events=None,
    )


def assert_stored(client: MaruHandler, req: RequestTransfer, original: CacheCase) -> None:
    assert_loads_back(client, req, original, tuple(range(15, 15 - len(req.block_ids), -1)), seed=98)


def test_the_helper_stores_a_batch_and_the_blocks_come_back_only_after_its_reply(
    server: ServerProcess, client: MaruHandler
) -> None:
    src, original = shared(case("kv_first", "NHD", 61)), case("kv_first", "NHD", 61)
    req = request("helper-a", [5, 9, 1, 3], 2 * CHUNK)
    keys = [c.key for c in req.chunks]
    w = worker(server.url, src, store_helper=True)
    try:
        h = ready_helper(w)
        paths = w.data_paths()["paths"]
        assert paths["store_helper"] == f"helper process, ready (pid {h.pid})"
        # The hold for a step without prefill is the drain thread's: the helper's batches go at once.
        assert paths["store"].endswith(", drain-thread batches yield to prefill")
        os.kill(h.pid, signal.SIGSTOP)  # the helper holds the batch: its blocks must stay vLLM's
        try:
            w.wait_for_save(Meta(stores=[req]))
            assert (w.stats.helper_batches, w.stats.helper_missed) == (1, 0)
            assert w.write_behind.on_device()  # the batch still reads its blocks
            assert w.get_finished({req.req_id}) == (None, None)
            assert w.stats.sending_held == 1 and client.exists(keys) == [False, False]
        finally:
            os.kill(h.pid, signal.SIGCONT)
        assert finished_sending(w, set()) == {req.req_id}  # the id given earlier was kept
        assert w.stats.chunks_stored == 2 and w.stats.store_failures == 0
        assert_stored(client, req, original)
        pid = h.pid
    finally:
        stop_worker(w)
    assert h.state == "closed" and not _alive(pid)


def test_a_preemption_waits_for_the_helper_s_reply_and_keeps_the_helper(
    server: ServerProcess, client: MaruHandler
) -> None:
    src, original = shared(case("kv_first", "NHD", 67)), case("kv_first", "NHD", 67)
    req = request("helper-preempted", [11, 2, 7, 4], 2 * CHUNK)
    w = worker(server.url, src, store_helper=True, timeout_s=20.0)
    try:
        h = ready_helper(w)
        os.kill(h.pid, signal.SIGSTOP)
        w.wait_for_save(Meta(stores=[req]))
        ((batch, _),) = w.write_behind._batches
        resume = threading.Timer(0.3, os.kill, (h.pid, signal.SIGCONT))
        resume.start()
        w.handle_preemptions(Meta(preempted_req_ids={req.req_id}))  # returns once the helper replied
        resume.join()
        assert batch.reading_done() and w.stats.preemption_waits == 1
        assert h.state == "ready" and _alive(h.pid)  # answered in time: kept
        w.write_behind.collect()
        assert w.stats.chunks_stored == 2
        assert_stored(client, req, original)
    finally:
        stop_worker(w)


def test_a_stalled_helper_is_stopped_at_a_preemption_and_the_stores_go_to_the_drain_thread(
    server: ServerProcess, client: MaruHandler, caplog: pytest.LogCaptureFixture
) -> None:
    src, original = shared(case("kv_first", "NHD", 62)), case("kv_first", "NHD", 62)
    stuck = request("helper-stuck", [5, 9, 1, 3], 2 * CHUNK)
    later = request("helper-later", [2, 8, 6, 0], 2 * CHUNK)
    w = worker(server.url, src, store_helper=True, timeout_s=1.0)
    try:
        h = ready_helper(w)
        os.kill(h.pid, signal.SIGSTOP)  # stalled: it will never answer
        w.wait_for_save(Meta(stores=[stuck]))
        with caplog.at_level(logging.WARNING, logger="maru.vllm"):
            t0 = time.monotonic()
            w.handle_preemptions(Meta(preempted_req_ids={stuck.req_id}))
        assert time.monotonic() - t0 < 30
        assert h.state == "failed" and not _alive(h.pid)  # nothing of it can read the blocks now
        assert "did not finish reading its blocks within 1.0 s" in (h.why or "")
        assert any(
            "store helper" in r.getMessage() and "drain thread" in r.getMessage() for r in caplog.records
        )
        w.write_behind.collect()
        assert w.stats.store_failures == 2  # the stalled batch's chunks: never published
        assert client.exists([c.key for c in stuck.chunks]) == [False, False]
        paths = w.data_paths()
        assert paths["paths"]["store_helper"] == "drain thread (the store helper failed)"
        assert any("did not finish reading" in s for s in paths["slow"])  # maru doctor shows it
        w.wait_for_save(Meta(stores=[later]))  # on the drain thread now
        assert w.stats.helper_missed == 1
        w.flush_stores()
        assert_stored(client, later, original)
    finally:
        stop_worker(w)


def test_a_helper_killed_with_a_batch_in_flight_fails_that_batch_and_frees_its_blocks(
    server: ServerProcess, client: MaruHandler
) -> None:
    src = shared(case("kv_first", "NHD", 63))
    req = request("helper-killed", [4, 7, 10, 12], 2 * CHUNK)
    w = worker(server.url, src, store_helper=True)
    try:
        h = ready_helper(w)
        os.kill(h.pid, signal.SIGSTOP)
        w.wait_for_save(Meta(stores=[req]))
        os.kill(h.pid, signal.SIGKILL)
        assert finished_sending(w, {req.req_id}) == {req.req_id}  # the helper is gone: blocks free
        assert h.state == "failed" and "exited" in (h.why or "")
        assert w.stats.store_failures == 2 and client.exists([c.key for c in req.chunks]) == [False, False]
    finally:
        stop_worker(w)


def test_caches_a_process_cannot_share_keep_the_drain_thread_said_with_the_reason(
    server: ServerProcess, client: MaruHandler, caplog: pytest.LogCaptureFixture
) -> None:
    src, original = case("kv_first", "NHD", 64), case("kv_first", "NHD", 64)  # not in shared memory
    req = request("helper-unshared", [3, 14, 6, 1], 2 * CHUNK)
    with caplog.at_level(logging.WARNING, logger="maru.vllm"):
        w = worker(server.url, src, store_helper=True)
    try:
        assert w.write_behind.helper is not None and not w.write_behind.helper.takes()
        assert any("CPU KV caches not in shared memory" in r.getMessage() for r in caplog.records)
        paths = w.data_paths()  # maru doctor shows why
        assert paths["paths"]["store_helper"] == "drain thread (the store helper cannot run here)"
        assert any("CPU KV caches not in shared memory" in s for s in paths["slow"])
        w.wait_for_save(Meta(stores=[req]))
        w.flush_stores()
        assert_stored(client, req, original)
    finally:
        stop_worker(w)


def test_a_helper_that_does_not_report_ready_in_time_is_stopped(server: ServerProcess) -> None:
    src = shared(case("kv_first", "NHD", 65))
    spec = cpu_spec(src, server)
    h = StoreHelper(spec, start_timeout_s=0.0)
    pid = h.pid
    assert pid is not None
    assert not h.ready() and not h.takes()
    assert h.state == "failed" and "did not report ready" in (h.why or "")
    assert not _alive(pid)
    h.close(1.0)


def test_the_helper_is_off_unless_asked_and_needs_write_behind(server: ServerProcess) -> None:
    from maru.vllm.config import MaruConnectorConfig

    src = shared(case("kv_first", "NHD", 66))
    off = MaruConnectorConfig(server_url=server.url, kv_chunk_tokens=CHUNK)
    assert off.store_helper is False and helper_for(list(src.caches), None, off) is None
    sync = MaruConnectorConfig(
        server_url=server.url, kv_chunk_tokens=CHUNK, store_helper=True, async_store=False
    )
    refused = helper_for(list(src.caches), None, sync)  # said, and shown where a failure is
    assert refused is not None and refused.state == "refused" and not refused.takes()
    assert "maru_async_store is off" in (refused.why or "")
    cfg = MaruConnectorConfig.from_extra_config({"maru_store_helper": True})
    assert cfg.store_helper is True and "store_helper" in cfg.data_path()


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers signal 0: its state in /proc says it is gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_stalled_helper_never_blocks_the_forward_thread_however_much_is_queued(
    server: ServerProcess,
) -> None:
    """Batches are tens of KiB pickled; a stalled helper lets its socket fill. The forward thread
    only queues them (a sender thread writes them): every submit returns, up to the ring."""
    from maru.transfer.records import ChunkRef
    from maru.vllm.store_helper import RING

    src = shared(case("kv_first", "NHD", 68))
    spec = cpu_spec(src, server)
    h = StoreHelper(spec)
    try:
        deadline = time.monotonic() + 90
        while not h.ready():
            assert h.state == "starting" and time.monotonic() < deadline, h.why
            time.sleep(0.05)
        os.kill(h.pid, signal.SIGSTOP)
        big = [
            RequestTransfer(f"r{i}", (1, 2, 3, 4), (ChunkRef(f"stall/{i}/{'k' * 200}", 0, CHUNK),))
            for i in range(300)
        ]  # ~80 KiB pickled: a few of them fill the socket
        done = threading.Event()
        sent: list[Any] = []

        def forward() -> None:
            for _ in range(RING):
                assert h.takes()
                sent.append(h.submit(big))
            done.set()

        threading.Thread(target=forward, daemon=True).start()
        assert done.wait(60), "a submit blocked the forward thread"
        assert all(b is not None for b in sent) and h.in_flight() == RING and not h.takes()
        os.kill(h.pid, signal.SIGKILL)
        lost = []
        while len(lost) < RING and time.monotonic() < deadline + 60:
            lost += h.poll()
            time.sleep(0.01)
        assert len(lost) == RING and all(rep.failed == 300 for _, rep in lost)
        assert all(b.reading_done() for b, _ in lost) and h.state == "failed"
    finally:
        h.close(1.0)


def _start_in_daemon(spec: HelperSpec, out: Any) -> None:
    """A daemonic process's body (vLLM's tensor-parallel workers are such): start a helper."""
    h = StoreHelper(spec)
    deadline = time.monotonic() + 90
    while not h.ready() and h.state == "starting" and time.monotonic() < deadline:
        time.sleep(0.05)
    out.put((h.state, h.why))
    h.close(5.0)
    out.put((h.state, None))


def test_a_daemonic_worker_process_starts_its_helper(server: ServerProcess) -> None:
    import multiprocessing

    src = shared(case("kv_first", "NHD", 69))
    spec = cpu_spec(src, server)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_start_in_daemon, args=(spec, out), daemon=True)
    p.start()
    try:
        assert out.get(timeout=120) == ("ready", None)  # not "daemonic processes are not allowed..."
        assert out.get(timeout=60) == ("closed", None)
    finally:
        p.join(30)
    assert p.exitcode == 0


def test_after_a_server_restart_the_helper_stores_again(tmp_path: Any) -> None:
    """The helper's client re-handshakes with a restarted server (its own session, as the worker's):
    a batch in the gap may fail (a cache miss, counted), the stores after it land, bytes right."""
    srv = ServerProcess(tmp_path, pool_size="64M")
    srv.start()
    src, original = shared(case("kv_first", "NHD", 70)), case("kv_first", "NHD", 70)
    w = worker(srv.url, src, store_helper=True, timeout_s=5.0)
    try:
        h = ready_helper(w)
        first = request("helper-before-restart", [5, 9, 1, 3], 2 * CHUNK)
        w.wait_for_save(Meta(stores=[first]))
        w.flush_stores(30)
        assert w.stats.chunks_stored == 2
        srv.restart()
        stored = 0
        for i in range(5):  # a few steps' stores: the helper's client finds the new server
            req = request(f"helper-after-restart-{i}", [2, 8, 6, 0], 2 * CHUNK)
            before = w.stats.chunks_stored
            w.wait_for_save(Meta(stores=[req]))
            w.flush_stores(30)
            if w.stats.chunks_stored > before:
                stored += 1
                with MaruHandler(srv.url, timeout_s=5) as c:
                    assert_stored(c, req, original)
                    release_pool(c)
                break
        assert stored == 1 and h.state == "ready" and w.stats.helper_missed == 0
    finally:
        stop_worker(w)
        srv.cleanup()


def test_a_helper_on_a_gpu_without_mps_is_said_to_take_turns_with_vllm(tmp_path: Any) -> None:
    gpu, cpu = [SimpleNamespace(is_cuda=True)], [SimpleNamespace(is_cuda=False)]
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    note = time_slice_note(gpu, env)  # no daemon's pipe there
    assert note is not None and str(tmp_path) in note and "maru_store_helper false" in note
    (tmp_path / "control").write_text("")  # a file of that name is not a daemon's pipe
    assert mps_control(env) is None and time_slice_note(gpu, env) is not None
    (tmp_path / "control").unlink()
    os.mkfifo(tmp_path / "control")  # a named pipe
    assert mps_control(env) == str(tmp_path / "control")
    assert time_slice_note(gpu, env) is None
    (tmp_path / "control").unlink()
    sock = socket.socket(socket.AF_UNIX)  # what the daemon leaves on driver 580 (H100, seen)
    try:
        sock.bind(str(tmp_path / "control"))
        assert mps_control(env) == str(tmp_path / "control") and time_slice_note(gpu, env) is None
    finally:
        sock.close()
    assert (
        time_slice_note(cpu, {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")}) is None
    )  # no GPU to share


def test_maru_doctor_shows_a_running_helper_s_note_as_a_slow_path(server: ServerProcess) -> None:
    src = shared(case("kv_first", "NHD", 67))
    w = worker(server.url, src, store_helper=True)
    try:
        h = w.write_behind.helper
        assert isinstance(h, StoreHelper) and h.note is None  # CPU caches: nothing to take turns with
        assert not any("takes turns" in s for s in w.data_paths()["slow"])
        h.note = time_slice_note([SimpleNamespace(is_cuda=True)], {"CUDA_MPS_PIPE_DIRECTORY": "/nonexistent"})
        paths = w.data_paths()
        assert paths["paths"]["store_helper"].startswith("helper process")
        assert any("takes turns with vLLM's kernels" in s for s in paths["slow"])
    finally:
        stop_worker(w)
