"""The write-behind store on CUDA caches (``-m gpu``; skipped without CUDA).

Real geometry (32 layers, 8 KV heads of 128, bf16, block size 16 != heads), NHD and HND, a real
server. The store is issued the way the worker issues it after a forward (``issue_store``: only
a CUDA event recorded on the forward's stream), then either the preemption barrier
(``wait_store_read``: gathers on the calling thread and waits) runs before the source blocks are
overwritten, as the next forward would, or the drain side (``complete_store``, on another thread)
reserves, gathers and publishes. The forward runs on a stream of its own and writes the source
behind a device-side sleep right before the issue, so a gather not ordered after the event reads
the old bytes. A fresh poisoned cache loads the chunks; every placed token must equal the source
as the forward left it when the store was issued, byte for byte.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from maru import kv_ops
from maru.client import MaruHandler
from maru.kv_ops.testing import CacheCase, bits
from maru.transfer.engine import KVTransferEngine
from maru.transfer.records import RequestTransfer
from tests.helpers import ServerProcess
from tests.pool_fixtures import release_pool, stop_worker
from tests.transfer.helpers import engine, make_case, ready_helper, requests

pytestmark = [
    pytest.mark.gpu,
]

GEOM = dict(
    device="cuda",
    num_blocks=96,
    block_size=16,
    num_kv_heads=8,
    head_size=128,
    num_layers=32,
    dtype=torch.bfloat16,
)
CHUNK = 256
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(GEOM["num_layers"])]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = ServerProcess(tmp_path_factory.mktemp("write-behind-gpu"), pool_size="2G")
    srv.start()
    try:
        yield srv
    finally:
        srv.cleanup()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[MaruHandler]:
    h = MaruHandler(server.url, timeout_s=10)
    try:
        yield h
    finally:
        release_pool(h)
        h.close()


def slots_of(req: RequestTransfer, bs: int) -> torch.Tensor:
    """The slot of every token each chunk places (request order)."""
    out = []
    for c in req.chunks:
        pb, pe = c.placed()
        out += [req.block_ids[t // bs] * bs + t % bs for t in range(c.start + pb, c.start + pe)]
    return torch.tensor(out, dtype=torch.int64)


def read(case: CacheCase, slots: torch.Tensor) -> torch.Tensor:
    """Every layer's K and V at ``slots`` through the PyTorch reference gather: ``[L, KV, T, ROW]``."""
    layout = kv_ops.detect_layouts(case.caches, **case.detect_kwargs())
    return kv_ops.gather(case.caches, layout, slots.to(case.caches[0].device), backend="reference")


def assert_loaded(
    client: MaruHandler, physical: str, src_req: RequestTransfer, dst_req: RequestTransfer, want: CacheCase
) -> None:
    """Load ``dst_req`` into a fresh poisoned cache; its placed tokens must equal ``want``'s source tokens."""
    dst = make_case(physical, 7, GEOM)
    rep = engine(dst, client).load([dst_req])
    assert rep.loaded_req_ids == [dst_req.req_id] and not rep.failed, rep
    torch.cuda.synchronize()
    bs = GEOM["block_size"]
    src_slots = torch.tensor(
        [
            src_req.block_ids[t // bs] * bs + t % bs
            for c in dst_req.chunks
            for t in range(c.start + c.placed()[0], c.start + c.placed()[1])
        ],
        dtype=torch.int64,
    )
    assert torch.equal(bits(read(dst, slots_of(dst_req, bs))), bits(read(want, src_slots)))


def overwrite_behind_a_device_sleep(case: CacheCase, new: CacheCase) -> None:
    """Queue new contents into ``case`` on the current stream behind ~50 ms of device sleep."""
    torch.cuda._sleep(100_000_000)
    for dst, src in zip(case.caches, new.caches, strict=True):
        dst.copy_(src, non_blocking=True)


def warm_up(eng: KVTransferEngine) -> None:
    """One store: an engine's first transfer allocates its staging ring and compiles its kernels,
    which synchronizes the device (and would hide a missing barrier or a missing stream order)."""
    warm, _ = requests(f"wb-gpu-warm-{id(eng)}", GEOM["block_size"], CHUNK, GEOM["num_blocks"])
    assert eng.complete_store(eng.issue_store([warm])).failed == 0


def on_drain(eng: KVTransferEngine, pending: Any) -> Any:
    """``complete_store`` on a thread of its own (the worker's drain thread); its report."""
    done: dict[str, Any] = {}
    drain = threading.Thread(target=lambda: done.update(rep=eng.complete_store(pending)))
    drain.start()
    drain.join(60)
    return done["rep"]


@pytest.mark.parametrize("paced", [True, False], ids=["paced", "queued-at-once"])
@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_write_behind_store_survives_block_reuse_after_the_preemption_barrier(
    physical: str, paced: bool, client: MaruHandler
) -> None:
    src_req, dst_req = requests(f"wb-gpu-{physical}-{paced}", GEOM["block_size"], CHUNK, GEOM["num_blocks"])
    src, want = make_case(physical, 1, GEOM), make_case(physical, 3, GEOM)
    eng = engine(src, client)
    eng.paced_store = paced
    assert eng.data_path == "pipelined" and eng.path.defers_store_gather
    warm_up(eng)
    forward = torch.cuda.Stream()  # vLLM's forward may run on a stream of its own
    with torch.cuda.stream(forward):
        overwrite_behind_a_device_sleep(src, want)  # the forward's writes, still queued
        pending = eng.issue_store([src_req])  # forward thread: only an event on its stream
    assert pending.issued is None and pending.after is not None and not pending.read_done.is_set()
    assert not pending.after.query(), "the forward's work finished before the test could check the order"
    assert client.exists([c.key for c in src_req.chunks]) == [False] * 4  # nothing published yet
    with torch.cuda.stream(forward):
        assert eng.wait_store_read(pending, 30)  # the preemption barrier: gathers here, waits for it
        assert pending.read_done.is_set()
        for t in src.caches:  # the next forward reuses the blocks
            t.fill_(-1.0)
    rep = on_drain(eng, pending)  # publishes what the barrier gathered; gathers nothing again
    assert (rep.stored, rep.failed, rep.error) == (4, 0, None)
    assert bool(getattr(eng.path.pipeline, "_paced_state", None)) == paced  # the lane the store took
    assert_loaded(client, physical, src_req, dst_req, want)


def test_the_drain_thread_gather_reads_what_the_forward_queued_before_the_store(client: MaruHandler) -> None:
    src_req, dst_req = requests("wb-gpu-order", GEOM["block_size"], CHUNK, GEOM["num_blocks"])
    src, want = make_case("NHD", 31, GEOM), make_case("NHD", 33, GEOM)
    eng = engine(src, client)
    warm_up(eng)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        overwrite_behind_a_device_sleep(src, want)  # the forward's writes, still queued
        pending = eng.issue_store([src_req])
    assert not pending.after.query()
    # The drain thread's own current stream is the default stream: only the mark orders the
    # gather after the forward's writes.
    rep = on_drain(eng, pending)
    assert (rep.stored, rep.failed) == (4, 0) and pending.read_done.is_set()
    assert_loaded(client, "NHD", src_req, dst_req, want)


def test_barrier_for_one_of_two_stores_in_flight_then_the_drain_thread_publishes_both(
    client: MaruHandler,
) -> None:
    """What the worker does on CUDA, without vLLM: two steps' stores queued, the second request
    preempted (barrier on its store only), its blocks reused, both completed on a drain thread."""
    from maru.transfer.background import BackgroundRunner

    bs = GEOM["block_size"]
    a_src, a_dst = requests("wb-gpu-two-a", bs, CHUNK, GEOM["num_blocks"])
    b_src, b_dst = requests("wb-gpu-two-b", bs, CHUNK, GEOM["num_blocks"])
    src, want = make_case("HND", 21, GEOM), make_case("HND", 23, GEOM)
    eng = engine(src, client)
    warm_up(eng)
    forward = torch.cuda.Stream()
    with torch.cuda.stream(forward):
        overwrite_behind_a_device_sleep(src, want)  # the forward's writes, still queued
        pa = eng.issue_store([a_src])
        pb = eng.issue_store([b_src])
        assert eng.wait_store_read(pb, 30)
        assert pb.read_done.is_set() and not pa.read_done.is_set()  # a's is left to the drain
        freed = torch.tensor(sorted(set(b_src.block_ids) - set(a_src.block_ids)), device="cuda")
        for t in src.caches:
            t.index_fill_(1, freed, -2.0)  # kv_first: [2, num_blocks, ...] in logical order
    drain = BackgroundRunner("test-drain")
    drain.submit("a", eng.complete_store, pa)
    drain.submit("b", eng.complete_store, pb)
    out = dict(drain.close(timeout=60))
    assert [(r.stored, r.failed) for r in (out["a"], out["b"])] == [(4, 0), (4, 0)]
    assert_loaded(client, "HND", a_src, a_dst, want)
    assert_loaded(client, "HND", b_src, b_dst, want)


@pytest.mark.parametrize("inference", [True, False], ids=["inference-mode", "grad-mode"])
@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_worker_write_behind_on_cuda_reports_after_the_drain_and_waits_at_preemption(
    physical: str, inference: bool, server: ServerProcess, client: MaruHandler
) -> None:
    """vLLM builds the engine and runs every hook under inference mode; the drain thread must work
    in the same mode (in-place updates of the engine's buffers, the barrier gathering on the forward
    thread into a staging lane the drain thread made). Without a mode: the same, in grad mode."""
    with torch.inference_mode(inference):
        _worker_write_behind_case(f"{physical}-{inference}", physical, server, client)


@pytest.mark.parametrize("physical", ["NHD", "HND"])
def test_the_store_helper_stores_what_the_forward_wrote_and_waits_at_preemption(
    physical: str, server: ServerProcess, client: MaruHandler
) -> None:
    """``maru_store_helper``: the same, the drain in a helper process that reaches the caches and
    each forward's event through CUDA IPC (``maru.vllm.store_helper``)."""
    with torch.inference_mode():
        _worker_write_behind_case(f"{physical}-helper", physical, server, client, store_helper=True)


def _worker_write_behind_case(
    tag: str, physical: str, server: ServerProcess, client: MaruHandler, *, store_helper: bool = False
) -> None:
    pytest.importorskip("vllm")
    from maru.vllm.config import MaruConnectorConfig
    from maru.vllm.metadata import MaruConnectorMetadata as Meta
    from maru.vllm.worker import MaruWorkerConnector

    bs = GEOM["block_size"]
    # Keys of their own per case: the server is the module's, and a key stored before is "present".
    a_src, a_dst = requests(f"wb-gpu-w-a-{tag}", bs, CHUNK, GEOM["num_blocks"])
    b_src, b_dst = requests(f"wb-gpu-w-b-{tag}", bs, CHUNK, GEOM["num_blocks"])
    a_src = RequestTransfer("a", a_src.block_ids, a_src.chunks)  # finishes
    b_src = RequestTransfer("b", b_src.block_ids, b_src.chunks)  # is preempted
    src, want = make_case(physical, 11, GEOM), make_case(physical, 13, GEOM)
    cfg = MaruConnectorConfig(
        server_url=server.url, kv_chunk_tokens=CHUNK, async_store=True, store_helper=store_helper
    )
    w = MaruWorkerConnector(
        cfg,
        block_size=bs,
        num_kv_heads=GEOM["num_kv_heads"],
        head_size=GEOM["head_size"],
        client_factory=lambda: MaruHandler(server.url, timeout_s=10),
    )
    assert isinstance(src.caches, list)
    w.register_kv_caches(dict(zip(NAMES, src.caches, strict=True)))
    try:
        assert w.engine is not None and w.engine.data_path == "pipelined"
        assert "yielding the copy engine between chunks" in (w.write_behind_mode or "")  # paced: the default
        assert w.data_paths()["paths"]["store"] == "write-behind, paced"
        helper = ready_helper(w) if store_helper else None
        overwrite_behind_a_device_sleep(src, want)
        w.wait_for_save(Meta(stores=[a_src]))
        w.wait_for_save(Meta(stores=[b_src]))
        assert w.stats.helper_batches == (2 if store_helper else 0) and w.stats.helper_missed == 0
        w.handle_preemptions(Meta(preempted_req_ids={"b"}))  # before the next forward
        # The next forward writes b's freed blocks (a's stay held by vLLM until finished_sending).
        freed = torch.tensor(sorted(set(b_src.block_ids) - set(a_src.block_ids)), device="cuda")
        for t in src.caches:
            t.index_fill_(1, freed, -2.0)  # kv_first: [2, num_blocks, ...] in logical order
        w.flush_stores(60)
        sending, _ = w.get_finished({"a", "b"})
        assert sending == {"a"}  # b was preempted: no report owed
        assert (w.stats.store_failures, w.stats.chunks_stored, w.stats.chunks_present) == (0, 8, 0)
        assert helper is None or helper.state == "ready"
    finally:
        stop_worker(w)
    assert_loaded(client, physical, a_src, RequestTransfer("a", a_dst.block_ids, a_dst.chunks), want)
    assert_loaded(client, physical, b_src, RequestTransfer("b", b_dst.block_ids, b_dst.chunks), want)
