"""``MaruHandler``'s API promises, against a real ``maru server`` in its own process."""

from __future__ import annotations

import os
import random
import threading
from pathlib import Path
from typing import Any

import pytest

from maru import MaruHandler
from maru.client import Allocation, CommitResult
from maru.errors import HandlerClosedError, PoolError, PoolFullError, ServerError
from maru.protocol import MAX_BATCH, MAX_KEY_BYTES
from tests.helpers import ServerProcess, wait_until


@pytest.fixture
def h(maru_server: ServerProcess):
    with MaruHandler(maru_server.url) as handler:
        yield handler


def put(h: MaruHandler, key: str, data: bytes) -> CommitResult:
    obj = h.alloc(len(data))
    obj.buf[:] = data
    return h.store(key, obj)


def test_the_readme_example_round_trips_bytes(h: MaruHandler) -> None:
    data = os.urandom(12345)
    obj = h.alloc(len(data))
    obj.buf[:] = data
    assert h.store("key", obj) == CommitResult.STORED
    r = h.retrieve("key")
    assert r is not None and r.view == data and len(r) == len(data)
    r.release()
    assert h.exists(["key", "other"]) == [True, False]


def test_a_key_is_invisible_until_store_and_its_bytes_are_frozen_after(h: MaruHandler) -> None:
    obj = h.alloc(100)
    obj.buf[:] = b"x" * 100
    assert h.exists(["k"]) == [False]
    assert h.retrieve("k") is None
    h.store("k", obj)
    assert obj.buf is None  # released: a published object cannot be written through the handle
    r = h.retrieve("k")
    assert r is not None and r.view.readonly
    with pytest.raises(TypeError):
        r.view[0] = 0  # type: ignore[index]
    r.release()


def test_a_second_store_of_a_key_reports_present_keeps_the_first_bytes_and_frees_its_space(
    h: MaruHandler,
) -> None:
    assert put(h, "dup", b"first" * 1000) == CommitResult.STORED
    used = h.usage()["used"]
    assert put(h, "dup", b"other" * 1000) == CommitResult.PRESENT
    assert h.usage()["used"] == used
    with h.retrieve("dup") as r:
        assert r.view == b"first" * 1000


def test_release_unpins_is_idempotent_and_drops_the_view(h: MaruHandler) -> None:
    put(h, "p", b"abc")
    r = h.retrieve("p")
    assert r is not None and h.usage()["pinned"] == 1
    r.release()
    r.release()
    assert r.view is None and r.released
    assert h.usage()["pinned"] == 0
    with pytest.raises(ValueError, match="released"):
        r.tobytes()
    with h.retrieve("p") as r2:
        assert h.usage()["pinned"] == 1
    assert h.usage()["pinned"] == 0 and r2.view is None
    unpinned = h.retrieve("p", pin=False)
    assert unpinned is not None and h.usage()["pinned"] == 0 and unpinned.tobytes() == b"abc"


def test_batch_calls_match_keys_to_results_in_order(h: MaruHandler) -> None:
    rng = random.Random(3)
    datas = {f"b{i}": rng.randbytes(rng.choice([1, 4096, 9000])) for i in range(50)}
    objs = h.batch_alloc([len(d) for d in datas.values()])
    for o, d in zip(objs, datas.values(), strict=True):
        o.buf[:] = d
    assert h.batch_store(list(datas), objs) == [CommitResult.STORED] * 50
    keys = ["b3", "missing", "b49", "b0"]
    rs = h.batch_retrieve(keys)
    assert [None if r is None else r.tobytes() for r in rs] == [datas["b3"], None, datas["b49"], datas["b0"]]
    h.batch_release(rs)
    assert h.usage()["pinned"] == 0
    assert h.exists_prefix(["b0", "b1", "missing", "b2"]) == 2
    assert h.exists_prefix(["missing", "b0"]) == 0


def test_a_release_without_waiting_is_applied_before_the_next_request(maru_server: ServerProcess) -> None:
    with MaruHandler(maru_server.url) as h, MaruHandler(maru_server.url) as other:
        for i in range(20):
            put(h, f"nw{i}", bytes([i]) * 100)
        for _ in range(30):
            rs = h.batch_retrieve([f"nw{i}" for i in range(20)])
            assert other.usage()["pinned"] == 20
            h.batch_release(rs, wait=False)
            assert all(r.released and r.view is None for r in rs)
            # The same connection: the server answers in order, so the next request sees no pin.
            assert h.usage()["pinned"] == 0
            assert not h._rpc._posted  # its reply was read (and checked) by that request
        assert h._pending_unpins == []


def test_a_release_without_waiting_lost_with_its_connection_is_sent_again(
    maru_server: ServerProcess,
) -> None:
    with MaruHandler(maru_server.url, heartbeat_interval_s=0.2) as h:
        put(h, "lost", b"x" * 64)
        rs = h.batch_retrieve(["lost"])
        with h._lock:  # no heartbeat may read the reply before the socket goes
            h.batch_release(rs, wait=False)
            assert list(h._rpc._posted.values())[0][1]["keys"] == ["lost"]
            h._rpc._drop_socket()  # what a timed-out request does
            assert h._pending_unpins == ["lost"]  # it may or may not have arrived
        wait_until(lambda: not h._pending_unpins, 10.0, "the heartbeat to send the lost UNPIN")
        assert h.usage()["pinned"] == 0


def test_a_refused_posted_request_reaches_its_callback_and_the_exchange_goes_on(h: MaruHandler) -> None:
    from maru.client.rpc import RpcChannel
    from maru.protocol import Op

    put(h, "posted", b"p" * 10)
    assert h.retrieve("posted") is not None  # pinned, not released: the good UNPIN has work to do
    me = {"client_id": h.client_id}
    got: list[tuple[int, dict]] = []
    with h._lock:  # the channel alone, as the session uses it
        ch = h._rpc
        assert ch.post(Op.UNPIN, {"keys": 5, **me}, lambda op, b: got.append((op, b)), lambda op, b: None)
        assert ch.post(
            Op.UNPIN, {"keys": ["posted"], **me}, lambda op, b: got.append((op, b)), lambda op, b: None
        )
        usage = ch.request(Op.USAGE, dict(me), 5.0)
        assert usage["ok"] and usage["pinned"] == 0, usage  # its own reply, after both posts applied
        assert [(op, b["ok"]) for op, b in got] == [(Op.UNPIN, False), (Op.UNPIN, True)]
        assert got[0][1]["code"] == "bad_request" and got[1][1]["unpinned"] == [True]
        assert not ch._posted
    # Nothing listening: a post sends nothing and says so (the caller then waits the usual way).
    idle = RpcChannel("tcp://127.0.0.1:9")
    try:
        assert idle.post(Op.UNPIN, {"keys": ["k"]}, lambda op, b: None, lambda op, b: None) is None
    finally:
        idle.close()


def test_batches_over_the_protocol_limit_are_split_transparently(h: MaruHandler) -> None:
    put(h, "last", b"z")
    keys = [f"absent-{i}" for i in range(MAX_BATCH + 5)] + ["last"]
    assert h.exists(keys) == [False] * (MAX_BATCH + 5) + [True]
    assert h.exists_prefix(["last"] * (MAX_BATCH + 3)) == MAX_BATCH + 3
    rs = h.batch_retrieve(keys, pin=False)
    assert rs[:-1] == [None] * (MAX_BATCH + 5) and rs[-1] is not None


def test_delete_hides_a_key_at_once_but_a_pinned_reader_keeps_its_bytes(h: MaruHandler) -> None:
    put(h, "d", b"keep me" * 100)
    r = h.retrieve("d")
    assert h.delete(["d", "never"]) == [True, False]
    assert h.exists(["d"]) == [False] and h.retrieve("d") is None
    assert r is not None and r.view == b"keep me" * 100
    used = h.usage()["used"]
    r.release()
    assert h.usage()["used"] < used  # the space went back when the last reader let go


def test_abort_gives_the_reservation_back(h: MaruHandler) -> None:
    free = h.usage()["free"]
    objs = h.batch_alloc([1 << 20, 1 << 20])
    assert h.usage()["free"] == free - 2 * (1 << 20)
    assert h.abort(objs) == 2
    assert h.usage()["free"] == free and all(o.buf is None for o in objs)
    with pytest.raises(ValueError, match="already aborted"):
        h.store("aborted", objs[0])
    assert h.exists(["aborted"]) == [False]


def test_batch_alloc_that_cannot_fit_reserves_nothing(tmp_path: Path) -> None:
    with ServerProcess(tmp_path, pool_size="8M") as server, MaruHandler(server.url) as h:
        with pytest.raises(PoolFullError, match="pool .* is full"):
            h.batch_alloc([3 << 20, 3 << 20, 3 << 20])
        u = h.usage()
        assert u["reservations"] == 0 and u["reserved"] == 0


def test_bad_input_gets_a_clear_error(h: MaruHandler) -> None:
    with pytest.raises(TypeError, match="list of keys"):
        h.exists("key")  # type: ignore[arg-type]
    with pytest.raises(ServerError, match="over the 512-byte limit") as ei:
        h.exists(["k" * (MAX_KEY_BYTES + 1)])
    assert ei.value.code == "too_large"
    with pytest.raises(ServerError, match="keys must be strings"):
        h.exists([b"bytes-key"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="max object size"):
        h.alloc(h.server_info.max_object_size + 1)
    with pytest.raises(ValueError, match="positive"):
        h.alloc(0)
    with pytest.raises(ValueError, match="2 keys but 1 objects"):
        h.batch_store(["a", "b"], [h.alloc(1)])
    with pytest.raises(TypeError, match="Allocation"):
        h.store("a", b"bytes")  # type: ignore[arg-type]
    with MaruHandler(h.url) as other:
        theirs = other.alloc(8)
        with pytest.raises(ValueError, match="another MaruHandler"):
            h.store("not-mine", theirs)
    obj = h.alloc(1)
    obj.buf[:] = b"1"
    h.store("once", obj)
    with pytest.raises(ValueError, match="already stored"):
        h.store("twice", obj)


def test_a_pool_path_that_holds_another_pool_is_refused(maru_server: ServerProcess, tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "other", pool_size="64M") as other:
        with pytest.raises(PoolError, match="has UUID .* but the server serves pool"):
            MaruHandler(maru_server.url, pool_path=other.pool_path)


def test_the_whole_pool_mapping_is_exposed_for_device_registration(h: MaruHandler) -> None:
    info = h.server_info
    assert len(h.pool_buffer) == info.pool_size
    assert h.pool_address != 0
    obj = h.alloc(64)
    obj.buf[:] = bytes(range(64))
    # buf is a view of that very mapping: the bytes are there at obj.offset.
    assert h.pool_buffer[obj.offset : obj.offset + 64] == bytes(range(64))
    h.abort(obj)


def test_the_pool_as_one_tensor_reads_what_a_retrieved_view_reads(h: MaruHandler) -> None:
    """``read_tensor``: the whole mapping as one tensor a dtype (made once), so that a step's
    objects are made by offset; its bytes at an object's offset are the retrieved view's."""
    torch = pytest.importorskip("torch")
    data = bytes(range(256)) * 4
    put(h, "whole-tensor/a", data)
    mapping = h.pool_mapping
    base = mapping.read_tensor(torch.bfloat16)
    assert mapping.read_tensor(torch.bfloat16) is base  # once a dtype
    assert base.numel() * 2 == mapping.size
    with h.retrieve("whole-tensor/a") as r:
        off = r.offset
        got = base[off // 2 : (off + len(data)) // 2].view(torch.uint8).numpy().tobytes()
        assert got == r.tobytes() == data
    u8 = mapping.read_tensor(torch.uint8)
    assert u8.data_ptr() == base.data_ptr() == mapping.address


def test_a_closed_mapping_makes_no_tensor(tmp_path: Path, maru_server: ServerProcess) -> None:
    torch = pytest.importorskip("torch")
    other = MaruHandler(maru_server.url)
    mapping = other.pool_mapping
    kept = mapping.read_tensor(torch.float16)  # a tensor a caller still holds
    other.close()
    with pytest.raises(PoolError, match="closed"):
        mapping.read_tensor(torch.float32)
    assert kept.numel() * 2 == mapping.size  # still readable: the OS unmaps when it goes
    del kept


def test_threads_sharing_one_handler_each_read_back_their_own_bytes(h: MaruHandler) -> None:
    errors: list[str] = []

    def work(t: int) -> None:
        rng = random.Random(t)
        for i in range(60):
            key, data = f"t{t}/{i}", rng.randbytes(rng.randint(1, 20000))
            put(h, key, data)
            with h.retrieve(key) as r:
                if r.tobytes() != data:
                    errors.append(key)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert h.exists_prefix([f"t{t}/{i}" for t in range(4) for i in range(60)]) == 240
    assert h.usage()["pinned"] == 0


def test_a_closed_handler_refuses_calls_and_close_is_idempotent(maru_server: ServerProcess) -> None:
    h = MaruHandler(maru_server.url)
    obj = h.alloc(4096)
    h.close()
    h.close()
    assert obj.buf is None  # its reservation was given back
    with pytest.raises(HandlerClosedError):
        h.exists(["a"])
    with MaruHandler(maru_server.url) as h2:
        assert h2.usage()["reservations"] == 0


def test_allocation_reports_its_state(h: MaruHandler) -> None:
    obj = h.alloc(10)
    assert isinstance(obj, Allocation) and obj.reserved and "reserved" in repr(obj)
    obj.buf[:] = b"0123456789"
    h.store("state", obj)
    assert not obj.reserved and "stored" in repr(obj)


def test_a_handler_inherited_through_fork_refuses_to_share_the_parents_socket(h: MaruHandler) -> None:
    import multiprocessing as mp

    q = mp.get_context("fork").Queue()

    def child() -> None:
        try:
            h.exists(["a"])
            q.put("no error")
        except HandlerClosedError as e:
            q.put(str(e))

    p = mp.get_context("fork").Process(target=child)
    p.start()
    msg = q.get(timeout=30)
    p.join(30)
    assert "create a new MaruHandler in the child" in msg
    assert h.exists(["a"]) == [False]  # the parent's handler still works


def test_heartbeats_keep_an_idle_clients_reservations_past_the_lease_timeout(tmp_path: Path) -> None:
    import time

    with ServerProcess(tmp_path, pool_size="16M", lease_timeout=2.0) as server:
        # Asking for 10 s beats against a 2 s lease: the handler beats every 2/3 s instead.
        with MaruHandler(server.url, heartbeat_interval_s=10.0) as h:
            obj = h.alloc(4096)
            obj.buf[:] = b"\x07" * 4096
            time.sleep(5.0)  # two and a half lease timeouts of silence from the caller
            assert h.store("kept", obj) == CommitResult.STORED
            assert h.stats()["counters"]["leases_expired"] == 0


def test_pool_path_override_maps_the_same_pool_under_another_name(maru_server: ServerProcess) -> None:
    alias = maru_server.pool_path + "-alias"
    os.link(maru_server.pool_path, alias)  # another path to the same pool, like another host's /dev/daxX.Y
    try:
        with MaruHandler(maru_server.url) as writer, MaruHandler(maru_server.url, pool_path=alias) as reader:
            put(writer, "via-alias", b"same bytes")
            with reader.retrieve("via-alias") as r:
                assert r.tobytes() == b"same bytes"
    finally:
        os.unlink(alias)


class RecordingRuntime:
    """Stands in for cudart's host registration: records (call, address); ``on_unregister`` runs
    inside each unregister call (to look at the mapping while the driver lets go of it)."""

    def __init__(self, on_unregister: Any = None) -> None:
        self.calls: list[tuple[str, int]] = []
        self.on_unregister = on_unregister

    def register(self, address: int, size: int, flags: int) -> int:
        self.calls.append(("register", address))
        return 0

    def unregister(self, address: int) -> int:
        self.calls.append(("unregister", address))
        if self.on_unregister is not None:
            self.on_unregister()
        return 0

    def error_name(self, code: int) -> str:
        return f"cudaError {code}"


def test_closing_a_handler_ends_the_cuda_registration_of_its_pool_before_unmapping(
    maru_server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A registration left behind by an unmapped pool keeps the driver's DMA on the old pages, so a
    pool mapped later at the same address would have GPU copies go elsewhere (seen on the H200: a
    put of CUDA memory stored zeros, with a checksum that matched them). Closing must unregister,
    and the range is unregistered before it is unmapped."""
    from maru.client import cuda_host

    def still_mapped() -> None:
        assert mapping._view is not None, "unregistered after the unmap"

    rt = RecordingRuntime(still_mapped)
    monkeypatch.setattr(cuda_host, "_DEFAULT", cuda_host.CudaHostRegistry(lambda: rt))
    h = MaruHandler(maru_server.url)
    mapping = h.pool_mapping
    record = cuda_host.register_host_mapping(mapping)
    assert record.state == "registered" and rt.calls == [("register", mapping.address)]
    address = mapping.address
    h.close()
    assert rt.calls == [("register", address), ("unregister", address)]
    assert record.state == "unregistered"
    with MaruHandler(maru_server.url) as again:  # the next mapping registers afresh
        assert cuda_host.register_host_mapping(again.pool_mapping).state == "registered"
        assert rt.calls[-1] == ("register", again.pool_mapping.address)


def test_a_pool_mapping_nobody_closed_ends_its_cuda_registration_when_collected(
    h: MaruHandler, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    from maru.client import cuda_host
    from maru.client.mapping import PoolMapping

    rt = RecordingRuntime()
    monkeypatch.setattr(cuda_host, "_DEFAULT", cuda_host.CudaHostRegistry(lambda: rt))
    own = h.pool_mapping
    extra = PoolMapping(own.path, own.uuid, own.size, own.data_offset)
    address = extra.address
    assert cuda_host.register_host_mapping(extra).state == "registered"
    del extra
    gc.collect()
    assert rt.calls == [("register", address), ("unregister", address)]
    extra = PoolMapping(own.path, own.uuid, own.size, own.data_offset)
    extra.close()
    extra.close()  # idempotent, and nothing was registered: nothing to end
    assert rt.calls == [("register", address), ("unregister", address)]
