"""The GPU data path on a real GPU: a CUDA-registered shared-memory pool and the transfer engine.

Real shapes (32 layers, 8 KV heads, head size 128, bf16, block size 16; MLA ``[NB, 64, 576]``),
FlashAttention ``[2, NB, BS, NH, HS]`` and FlashInfer ``[NB, 2, BS, NH, HS]`` orders, each NHD and
HND (HND allocated physically and permuted back, as vLLM does, so it shows only in the strides).
Random slots, poisoned pool pages and caches, and every comparison is on the raw bits of the whole
cache storage against the kv_ops reference placement (itself checked against a per-token oracle).
Skipped where no CUDA device is visible (CI).
"""

from __future__ import annotations

import mmap
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

pytestmark = [
    pytest.mark.gpu,
]

from maru import kv_ops  # noqa: E402
from maru.checksum import checksum  # noqa: E402
from maru.client import cuda_host  # noqa: E402
from maru.kv_ops import device_pipeline as pl  # noqa: E402

L, NH, HS, BS, NB = 32, 8, 128, 16, 512
# The engine's placement backend (None: kv_ops's best, triton on a GPU); MARU_TEST_BACKEND=reference
# separates an engine bug from a kernel bug.
BACKEND = os.environ.get("MARU_TEST_BACKEND") or None
CHUNK = 256

# (name, logical axes, physical axes); "c" is MLA's latent width
FORMATS = {
    "flash_attn_NHD": (["kv", "nb", "bs", "nh", "hs"], ["kv", "nb", "bs", "nh", "hs"]),
    "flash_attn_HND": (["kv", "nb", "bs", "nh", "hs"], ["kv", "nb", "nh", "bs", "hs"]),
    "flashinfer_NHD": (["nb", "kv", "bs", "nh", "hs"], ["nb", "kv", "bs", "nh", "hs"]),
    "flashinfer_HND": (["nb", "kv", "bs", "nh", "hs"], ["nb", "kv", "nh", "bs", "hs"]),
    "mla": (["nb", "bs", "hs"], ["nb", "bs", "hs"]),
}


@dataclass
class Caches:
    """Per-layer caches as views of one physical buffer, plus the model facts detection needs."""

    name: str
    buffer: torch.Tensor  # the whole physical storage (all layers)
    layers: list[torch.Tensor]
    block_size: int
    num_kv_heads: int
    head_size: int

    def layout(self) -> kv_ops.KVLayout:
        return kv_ops.detect_layouts(
            self.layers, block_size=self.block_size, num_kv_heads=self.num_kv_heads, head_size=self.head_size
        )

    def bits(self) -> torch.Tensor:
        return self.buffer.view(torch.int16)

    def clone(self) -> Caches:
        return _views(self.name, self.buffer.clone(), self.block_size, self.num_kv_heads, self.head_size)


def _sizes(name: str) -> dict[str, int]:
    if name == "mla":
        return {"nb": NB // 4, "bs": 64, "hs": 576}
    return {"kv": 2, "nb": NB, "bs": BS, "nh": NH, "hs": HS}


def _views(name: str, buffer: torch.Tensor, bs: int, nh: int, hs: int) -> Caches:
    logical, physical = FORMATS[name]
    sizes = _sizes(name)
    phys = buffer.view(L, *[sizes[a] for a in physical])
    perm = [physical.index(a) for a in logical]
    layers = [phys[i].permute(*perm) for i in range(L)]
    return Caches(name, buffer, layers, bs, nh, hs)


def make_caches(name: str, seed: int) -> Caches:
    sizes = _sizes(name)
    numel = L
    for v in sizes.values():
        numel *= v
    g = torch.Generator(device="cuda").manual_seed(seed)
    buffer = torch.randint(-(2**15), 2**15 - 1, (numel,), dtype=torch.int16, device="cuda", generator=g)
    buffer = buffer.view(torch.bfloat16)
    if name == "mla":
        return _views(name, buffer, 64, 1, 576)
    return _views(name, buffer, BS, NH, HS)


class RegisteredPool:
    """A pool file under /dev/shm, mmapped and registered with CUDA, like a client's pool mapping."""

    def __init__(self, size: int) -> None:
        self.path = f"/dev/shm/maru-gpu-test-{uuid.uuid4().hex[:12]}"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            self.mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.registry = cuda_host.CudaHostRegistry()
        self.record = cuda_host.register_host_mapping(
            self.mm, name=f"pool {self.path}", registry=self.registry
        )
        self.next = 0

    def alloc(self, engine: pl.DevicePipeline, tokens: int) -> torch.Tensor:
        offset = self.next
        self.next += (engine.object_bytes(tokens) + 4095) // 4096 * 4096
        obj = engine.host_object(self.mm, tokens, offset)
        obj.view(torch.uint8).fill_(0xA5)  # poison
        return obj

    def close(self) -> None:
        self.registry.close()
        try:
            self.mm.close()
        except BufferError:
            pass
        os.unlink(self.path)


@pytest.fixture(scope="module")
def pool() -> Iterator[RegisteredPool]:
    p = RegisteredPool(1 << 30)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def _rewind(pool: RegisteredPool) -> None:
    pool.next = 0


def _slots(caches: Caches, count: int, seed: int, negatives: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    slots = torch.randperm(caches.layout().num_slots, generator=g)[:count]
    if negatives:
        slots[torch.randperm(count, generator=g)[:negatives]] = -1
    return slots


def _reference_gather(caches: Caches, slots: torch.Tensor) -> torch.Tensor:
    return kv_ops.gather(caches.layers, caches.layout(), slots.cuda(), backend="reference")


def test_pool_mapping_registers_and_its_pages_are_pinned_for_torch(pool: RegisteredPool) -> None:
    assert pool.record.registered, pool.record.describe()
    assert pool.record.registered_bytes == 1 << 30 and pool.record.seconds > 0
    obj = torch.frombuffer(pool.mm, dtype=torch.uint8, count=4096, offset=12345 * 4096)
    assert obj.is_pinned()  # torch asks CUDA: the copy engine will DMA from it
    again = cuda_host.register_host_mapping(pool.mm, registry=pool.registry)
    assert again is pool.record  # idempotent: registered once


def test_reference_placement_agrees_with_the_per_token_definition_on_hnd() -> None:
    """The oracle the other tests lean on reads HND caches by their logical indexing."""
    caches = make_caches("flashinfer_HND", 11)
    slots = _slots(caches, 64, 1)
    obj = _reference_gather(caches, slots)
    for t in (0, 17, 63):
        b, o = divmod(int(slots[t]), BS)
        for layer in (0, 31):
            for kv in (0, 1):  # compare bits: random bit patterns include NaNs
                want = caches.layers[layer][b, kv, o].reshape(-1).view(torch.int16)
                assert torch.equal(obj[layer, kv, t].view(torch.int16), want)


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize(
    "path",
    [
        "sync",
        "pipelined",
        "pipelined_directstore",
        "layers",
        "pipelined_eager",
        "layers_eager",
        "pipelined_torch",
        "layers_torch",
        "layers_staged",
        "layers_staged_eager",
        "layers_copied",
        "layers_copied_eager",
    ],
)
def test_store_then_load_into_a_fresh_cache_reproduces_it_byte_for_byte(
    pool: RegisteredPool, name: str, path: str
) -> None:
    src = make_caches(name, 1)
    layout = src.layout()
    # _eager: kv_ops launches instead of graph replays; _torch: copies and events through torch, not ctypes
    # _staged: the layer path through staging copies instead of the direct (zero-copy) kernel;
    # _directstore: the store written in place by the gather kernel instead of through the ring
    graphs, raw = not path.endswith("_eager"), not path.endswith("_torch")
    # _copied: the layer path through the copy engines (kv_ops.layer_copies), not read by the SMs
    layer_path = "staged" if "_staged" in path else "copied" if "_copied" in path else "auto"
    if layer_path == "copied" and BACKEND == "reference":
        pytest.skip("the copied layer way places with the Triton kernel")
    store_path = "direct" if "_directstore" in path else "staged"
    path = path.split("_")[0]
    kw = dict(
        ring_slots=2,
        backend=BACKEND,
        use_graphs=graphs,
        raw_cuda=raw,
        layer_path=layer_path,
        store_path=store_path,
    )
    engine = pl.DevicePipeline(src.layers, layout, **kw)
    chunk = CHUNK if name != "mla" else 64 * 4
    sizes = [chunk, chunk, chunk, 100]  # a short last chunk
    slots = _slots(src, sum(sizes), 2, negatives=5)
    objs = [pool.alloc(engine, t) for t in sizes]

    store = engine.store(objs, slots, pipelined=path != "sync")
    if path != "sync":
        assert store.path == ("direct" if store_path == "direct" else "pipelined")
    if path != "sync" and raw:  # the drain thread sleeps on a store's event; a load's spins
        assert store._event in engine._done_rings[True][0]
    store.wait()
    expected_obj = _reference_gather(src, slots).cpu()
    token0 = 0
    for obj, t in zip(objs, sizes, strict=True):
        valid = (slots[token0 : token0 + t] >= 0).nonzero().reshape(-1)  # rows of skipped slots: unspecified
        got = obj.view(torch.int16)[:, :, valid]
        assert torch.equal(got, expected_obj[:, :, token0 : token0 + t].view(torch.int16)[:, :, valid])
        token0 += t

    fresh = make_caches(name, 3)
    expected = fresh.clone()
    kv_ops.scatter(expected_obj.cuda(), expected.layers, layout, slots.cuda(), backend="reference")
    loader = pl.DevicePipeline(fresh.layers, fresh.layout(), **kw)
    if path == "layers":
        handle = loader.load_layers(objs, slots)
        if layer_path == "copied":
            assert handle.path == "layers-copied"
        else:
            assert handle.graphed == (graphs and BACKEND != "reference")
            direct = layer_path == "auto" and BACKEND != "reference"
            assert handle.path == ("layers-direct" if direct else "layers")
        for i in range(L):
            handle.wait_for_layer(i)
    else:
        handle = loader.load(objs, slots, pipelined=path == "pipelined")
        if path == "pipelined" and raw:
            assert handle._event in loader._done_rings[False][0]
        handle.wait_on()
    torch.cuda.current_stream().synchronize()
    assert handle.done()
    assert torch.equal(fresh.bits(), expected.bits())
    assert not torch.equal(fresh.bits(), make_caches(name, 3).bits())  # the load wrote something


def test_single_chunk_layer_load_and_skip_tokens(pool: RegisteredPool) -> None:
    src = make_caches("flash_attn_HND", 4)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    slots = _slots(src, CHUNK, 5)
    obj = pool.alloc(engine, CHUNK)
    engine.store([obj], slots).wait()
    fresh = make_caches("flash_attn_HND", 6)
    expected = fresh.clone()
    kv_ops.scatter(
        obj.cuda(), expected.layers, fresh.layout(), slots.cuda(), backend="reference", skip_tokens=40
    )
    pl.DevicePipeline(fresh.layers, fresh.layout(), backend=BACKEND).load_layers(
        [obj], slots, skip_tokens=40
    ).wait()
    assert torch.equal(fresh.bits(), expected.bits())


@pytest.mark.parametrize("layer_path", ["auto", "staged"])
@pytest.mark.parametrize("graphs", [True, False])
def test_layer_load_with_a_device_slot_mapping_and_skip_tokens(
    pool: RegisteredPool, layer_path: str, graphs: bool
) -> None:
    src = make_caches("flashinfer_NHD", 21)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    sizes = [CHUNK, 37]
    slots = _slots(src, sum(sizes), 22, negatives=3)
    objs = [pool.alloc(engine, t) for t in sizes]
    engine.store(objs, slots).wait()
    fresh = make_caches("flashinfer_NHD", 23)
    expected = fresh.clone()
    kv_ops.scatter(
        _reference_gather(src, slots), expected.layers, fresh.layout(), slots.cuda(), backend="reference",
        skip_tokens=70,
    )  # fmt: skip
    loader = pl.DevicePipeline(
        fresh.layers, fresh.layout(), backend=BACKEND, use_graphs=graphs, layer_path=layer_path
    )
    for _ in range(2):  # the second call reuses the bucket's static table (and its graphs)
        handle = loader.load_layers(objs, slots.cuda(), skip_tokens=70)
        handle.wait()
    assert torch.equal(fresh.bits(), expected.bits())


def test_layer_graphs_without_lazy_capture_replay_only_warmed_buckets(pool: RegisteredPool) -> None:
    """The layer path of what the connector builds: layer graphs warmed at start, no capture later."""
    src = make_caches("flash_attn_HND", 26)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    slots = _slots(src, 3 * CHUNK, 27, negatives=4)
    objs = [pool.alloc(engine, CHUNK) for _ in range(3)]
    engine.store(objs, slots).wait()
    fresh = make_caches("flash_attn_HND", 28)
    loader = pl.DevicePipeline(
        fresh.layers, fresh.layout(), backend=BACKEND, use_graphs=False, layer_graphs=True,
        lazy_capture=False, layer_path="direct",
    )  # fmt: skip
    loader.warm(0, layer_tokens=[2 * CHUNK])  # bucket 512: two chunks fit, three do not
    expected = fresh.clone()
    kv_ops.scatter(
        _reference_gather(src, slots), expected.layers, fresh.layout(), slots.cuda(), backend="reference"
    )
    warm = loader.load_layers(objs[:2], slots[: 2 * CHUNK])
    cold = loader.load_layers(objs[2:], slots[2 * CHUNK :])  # bucket 256: never warmed
    cold.wait()
    warm.wait()
    assert warm.graphed == (BACKEND != "reference")
    assert not cold.graphed
    assert torch.equal(fresh.bits(), expected.bits())
    # Warming again after loads must not re-place the last call's table (its slots are cleared first).
    # The blocks are reused by other requests: overwrite them, warm, and nothing may change.
    fresh.buffer.copy_(make_caches("flash_attn_HND", 29).buffer)
    snapshot = fresh.clone()
    loader.warm(0, layer_tokens=[2 * CHUNK])
    torch.cuda.synchronize()
    assert torch.equal(fresh.bits(), snapshot.bits())


@pytest.mark.parametrize("checksums", [False, True])
def test_chunk_graphs_without_lazy_capture_replay_the_warmed_size_and_capture_nothing_later(
    pool: RegisteredPool, checksums: bool
) -> None:
    """What the connector builds now: the chunk size's graphs (and its block multiples') warmed at
    start; other sizes (100 tokens: no whole blocks) eager."""
    src = make_caches("flashinfer_HND", 41)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    sizes = [CHUNK, CHUNK, 100, CHUNK]  # 100 tokens: never warmed
    slots = _slots(src, sum(sizes), 42, negatives=6)
    objs = [pool.alloc(engine, t) for t in sizes]
    engine.store(objs, slots).wait()
    fresh = make_caches("flashinfer_HND", 43)
    expected = fresh.clone()
    kv_ops.scatter(
        _reference_gather(src, slots), expected.layers, fresh.layout(), slots.cuda(), backend="reference",
        skip_tokens=30,
    )  # fmt: skip
    loader = pl.DevicePipeline(
        fresh.layers, fresh.layout(), backend=BACKEND, use_graphs=True, lazy_capture=False
    )
    from maru.kv_ops import checksum as ck

    launchers = [ck._CHECKSUM, ck._CHECKSUM_PIECES] if BACKEND != "reference" else []
    for lau in launchers:
        lau._kernels.clear()  # as in a fresh process: the warm-up must get them again
    loader.warm(CHUNK)
    compiled = [lau.triton_calls for lau in launchers]
    assert all(lau._kernels for lau in launchers), "warm() gets the checksum kernels"
    placers = [slot.placer for slot in loader._ring if slot.placer is not None]
    captured = [len(p._graphs) for p in placers]
    for _ in range(2):  # the second pass replays the same graphs over a placed cache
        h = loader.load(objs, slots, skip_tokens=30, checksums=checksums)
        h.wait()
    assert torch.equal(fresh.bits(), expected.bits())
    assert [len(p._graphs) for p in placers] == captured  # nothing captured while serving
    assert [lau.triton_calls for lau in launchers] == compiled, "no kernel compiled while serving"
    if BACKEND != "reference":
        assert placers and all(p.has_chunk_graphs(CHUNK) and not p.has_chunk_graphs(100) for p in placers)
    if checksums:
        want = [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
        assert h.checksums() == want


def test_direct_layer_path_refuses_pageable_objects_and_auto_falls_back(pool: RegisteredPool) -> None:
    src = make_caches("flash_attn_NHD", 24)
    layout = src.layout()
    pageable = [torch.zeros(pl.DevicePipeline(src.layers, layout).object_shape(CHUNK), dtype=torch.bfloat16)]
    slots = _slots(src, CHUNK, 25)
    if BACKEND != "reference":
        with pytest.raises(RuntimeError, match="pageable"):
            pl.DevicePipeline(src.layers, layout, backend=BACKEND, layer_path="direct").load_layers(
                pageable, slots
            )
    handle = pl.DevicePipeline(src.layers, layout, backend=BACKEND).load_layers(pageable, slots)
    handle.wait()
    assert handle.path == "layers"
    want = torch.zeros_like(_reference_gather(src, slots))
    assert torch.equal(_reference_gather(src, slots).view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("named", [True, False], ids=["stream_given", "current_stream"])
def test_wait_for_layer_orders_a_reader_stream_after_that_layers_placement(
    pool: RegisteredPool, named: bool
) -> None:
    """Given the reader stream, or (as vLLM's forward calls it) with none, inside the reader's stream
    context: the raw calls then take the current stream's handle themselves (``current_raw_stream``)."""
    src = make_caches("flashinfer_HND", 7)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    slots = _slots(src, 4 * CHUNK, 8)
    objs = [pool.alloc(engine, CHUNK) for _ in range(4)]
    engine.store(objs, slots).wait()
    fresh = make_caches("flashinfer_HND", 9)
    handle = pl.DevicePipeline(fresh.layers, fresh.layout(), backend=BACKEND).load_layers(objs, slots)
    reader = torch.cuda.Stream()
    seen = []
    for i in (0, 13, 31):
        with torch.cuda.stream(reader):
            handle.wait_for_layer(i, reader if named else None)
            torch.cuda._sleep(2_000_000)  # the reader would read too early if the wait were elsewhere
            seen.append(
                kv_ops.gather_layer(fresh.layers[i], fresh.layout(), slots.cuda(), backend="reference")
            )
    reader.synchronize()
    want = _reference_gather(src, slots)
    for got, i in zip(seen, (0, 13, 31), strict=True):
        assert torch.equal(got.view(torch.int16), want[i].view(torch.int16))


@pytest.mark.parametrize("checksums", [False, True])
def test_one_launch_layer_loads_order_each_layer_and_reuse_their_graphs_in_turn(
    pool: RegisteredPool, checksums: bool
) -> None:
    """A warmed size loads every layer with one graph launch whose event-record nodes stand for the
    per-layer events: a reader stream that waits for layer i sees layer i placed. Six loads in a row
    over different blocks use all four graphs and come round again; each is checked."""
    src = make_caches("flashinfer_HND", 61)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    loads = []
    for k in range(6):
        slots = _slots(src, 2 * CHUNK, 62 + k)
        objs = [pool.alloc(engine, CHUNK) for _ in range(2)]
        engine.store(objs, slots).wait()
        loads.append((objs, slots))
    fresh = make_caches("flashinfer_HND", 70)
    loader = pl.DevicePipeline(
        fresh.layers, fresh.layout(), backend=BACKEND, use_graphs=False, layer_graphs=True,
        lazy_capture=False, layer_checksums=checksums, layer_path="direct",
    )  # fmt: skip
    loader.warm(0, layer_tokens=[2 * CHUNK])
    reader = torch.cuda.Stream()
    last = L - 1
    for objs, slots in loads:
        handle = loader.load_layers(objs, slots, checksums=checksums)
        if BACKEND != "reference" and loader._sync.raw:
            assert handle.one_launch
        seen = []
        for i in (0, 13, last):
            handle.wait_for_layer(i, reader)
            with torch.cuda.stream(reader):
                seen.append(
                    kv_ops.gather_layer(fresh.layers[i], fresh.layout(), slots.cuda(), backend="reference")
                )
        reader.synchronize()
        handle.wait()
        want = _reference_gather(src, slots)
        for got, i in zip(seen, (0, 13, last), strict=True):
            assert torch.equal(got.view(torch.int16), want[i].view(torch.int16)), f"layer {i}"
        if checksums:
            sums = [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
            assert handle.checksums() == sums


def test_an_hnd_cache_read_in_its_logical_order_would_be_caught(pool: RegisteredPool) -> None:
    """The seed issue's trap: treating an HND cache as if its shape were its memory order writes other
    bytes. A loader given such a view must fail the comparison the tests above make."""
    src = make_caches("flash_attn_HND", 12)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    slots = _slots(src, CHUNK, 13)
    obj = pool.alloc(engine, CHUNK)
    engine.store([obj], slots).wait()
    fresh = make_caches("flash_attn_HND", 14)
    expected = fresh.clone()
    kv_ops.scatter(obj.cuda(), expected.layers, fresh.layout(), slots.cuda(), backend="reference")
    # The wrong view: logical shape [2, NB, BS, NH, HS] laid contiguously over the HND memory.
    wrong = [
        torch.as_strided(t, t.shape, torch.empty(t.shape, device="meta").stride(), t.storage_offset())
        for t in fresh.layers
    ]
    wrong_layout = kv_ops.detect_layouts(wrong, block_size=BS, num_kv_heads=NH, head_size=HS)
    assert wrong_layout.physical == "NHD" and fresh.layout().physical == "HND"
    pl.DevicePipeline(wrong, wrong_layout, backend=BACKEND).load([obj], slots).wait()
    assert not torch.equal(fresh.bits(), expected.bits())


@pytest.mark.parametrize("layers", [False, True])
def test_checksum_host_buffers_are_reused_only_after_their_load_was_read(
    pool: RegisteredPool, layers: bool
) -> None:
    """Loads with checksums share a few pinned host buffers (``HostSums``): one load's handle kept
    unread while later loads run must still read its own objects' sums, and a buffer comes back
    (and is reused) only after its handle read it once the load completed."""
    src = make_caches("flash_attn_NHD", 81)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    fresh = make_caches("flash_attn_NHD", 82)
    loader = pl.DevicePipeline(fresh.layers, fresh.layout(), backend=BACKEND, layer_checksums=True)
    loader.warm(CHUNK, layer_tokens=[2 * CHUNK] if layers else ())
    batches = []
    for k in range(4):
        slots = _slots(src, 2 * CHUNK, 83 + k)
        objs = [pool.alloc(engine, CHUNK) for _ in range(2)]
        engine.store(objs, slots).wait()
        want = [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
        batches.append((objs, slots, want))

    def issue(objs: list[torch.Tensor], slots: torch.Tensor) -> pl.Transfer:
        if layers:
            return loader.load_layers(objs, slots, checksums=True)
        return loader.load(objs, slots, checksums=True)

    kept = issue(*batches[0][:2])  # read only at the end
    for objs, slots, want in batches[1:]:
        h = issue(objs, slots)
        h.wait()
        before = len(loader._host_sums._free)
        assert h.checksums() == want
        assert len(loader._host_sums._free) == min(before + 1, 8)  # given back once read
    kept.wait()
    assert kept.checksums() == batches[0][2]


@pytest.mark.parametrize("graphs", [True, False])
def test_consecutive_loads_of_one_page_share_a_copy_and_each_lands_at_its_slots(
    pool: RegisteredPool, graphs: bool
) -> None:
    """A step where several requests want the same chunk (a shared prefix): consecutive objects over
    one pool page are copied once and placed once per object (a ring of 2 slots, so groups wrap
    around it); a page that comes back later is copied again. Every object lands at its own slots,
    byte for byte against the reference placement, and each keeps its own checksum."""
    src = make_caches("flashinfer_HND", 91)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    pages = []
    for k in range(3):
        obj = pool.alloc(engine, CHUNK)
        engine.store([obj], _slots(src, CHUNK, 92 + k)).wait()
        pages.append(obj)
    a, b, c = pages
    over = [a, a, a, b, a, c, c]  # a x3, b, a again (a new copy), c x2
    base = torch.frombuffer(pool.mm, dtype=torch.uint8, count=1).data_ptr()
    objs = [engine.host_object(pool.mm, CHUNK, o.data_ptr() - base) for o in over]  # new tensors
    assert objs[0].data_ptr() == objs[1].data_ptr() and objs[0] is not objs[1]
    fresh = make_caches("flashinfer_HND", 93)
    expected = fresh.clone()
    slots = _slots(fresh, CHUNK * len(objs), 94)
    for k, o in enumerate(objs):
        part = slots[k * CHUNK : (k + 1) * CHUNK].cuda()
        kv_ops.scatter(o.cuda(), expected.layers, fresh.layout(), part, backend="reference")
    loader = pl.DevicePipeline(fresh.layers, fresh.layout(), backend=BACKEND, ring_slots=2, use_graphs=graphs)
    handle = loader.load(objs, slots, checksums=True)
    handle.wait()
    assert handle.copies_shared == 3  # a twice, c once
    assert torch.equal(fresh.bits(), expected.bits())
    sums = {o.data_ptr(): checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in pages}
    assert handle.checksums() == [sums[o.data_ptr()] for o in objs]


@pytest.mark.parametrize("mode", ["chunks", "layers", "layers_copied"])
def test_loads_issued_back_to_back_past_the_scratch_ring_each_land_their_own_slots(
    pool: RegisteredPool, mode: str
) -> None:
    """Twelve loads issued without waiting, more than the pinned scratch ring holds (8): each
    load's slot mapping (chunks) or direct table (layers) is written into a reused pinned buffer
    and uploaded on the placement stream, so a buffer handed out again while its upload is still
    queued would place a later load's tokens at an earlier one's slots. Each load has its own
    slots and skipped prefix; the whole cache against the reference placement, and every checksum."""
    src = make_caches("flash_attn_HND", 101)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    n = 12
    objs = [pool.alloc(engine, CHUNK) for _ in range(n)]
    all_slots = _slots(src, n * CHUNK, 102)
    for k, obj in enumerate(objs):
        engine.store([obj], all_slots[k * CHUNK : (k + 1) * CHUNK]).wait()
    fresh = make_caches("flash_attn_HND", 103)
    expected = fresh.clone()
    skips = [(17 * k) % 60 for k in range(n)]
    for k, obj in enumerate(objs):
        part = all_slots[k * CHUNK : (k + 1) * CHUNK].cuda()
        kv_ops.scatter(
            obj.cuda(), expected.layers, fresh.layout(), part, backend="reference", skip_tokens=skips[k]
        )
    way = "copied" if mode == "layers_copied" else "direct"  # copied: the staging ring reused too
    if way == "copied" and BACKEND == "reference":
        pytest.skip("the copied layer way places with the Triton kernel")
    loader = pl.DevicePipeline(
        fresh.layers, fresh.layout(), backend=BACKEND, layer_checksums=True, layer_path=way
    )
    loader.warm(CHUNK, layer_tokens=[CHUNK])
    handles = []
    for k, obj in enumerate(objs):
        part = all_slots[k * CHUNK : (k + 1) * CHUNK]  # a host mapping: the pinned scratch way
        if mode.startswith("layers"):
            handles.append(loader.load_layers([obj], part, skip_tokens=skips[k], checksums=True))
        else:
            handles.append(loader.load([obj], part, skip_tokens=skips[k], checksums=True))
    for h in handles:
        h.wait()
    torch.cuda.synchronize()
    assert torch.equal(fresh.bits(), expected.bits())
    want = [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
    assert [h.checksums()[0] for h in handles] == want
    if mode == "layers":
        assert all(h.one_launch for h in handles)  # the lean raw issue ran
    if mode == "layers_copied":
        assert all(h.path == "layers-copied" for h in handles)


@pytest.mark.parametrize("graphs,raw", [(True, True), (False, True), (True, False)])
def test_a_mapping_given_as_a_function_is_made_after_the_first_copy_and_places_the_same(
    pool: RegisteredPool, graphs: bool, raw: bool
) -> None:
    """``load(objs, fn)``: the mapping is asked for once, right after the first chunk's copy was
    queued (the engine's ``DeferredSlots``), more chunks than the ring holds; the placement and every
    checksum equal the reference. A function that raises fails that load only: the next load of
    the same pipeline (its ring advanced past the abandoned copy) places correctly."""
    src = make_caches("flashinfer_HND", 111)
    engine = pl.DevicePipeline(src.layers, src.layout(), backend=BACKEND)
    sizes = [CHUNK, CHUNK, CHUNK, CHUNK, 70]
    objs = [pool.alloc(engine, t) for t in sizes]
    slots = _slots(src, sum(sizes), 112, negatives=9)
    engine.store(objs, slots).wait()
    want_sums = [checksum(o.contiguous().view(-1).view(torch.uint8).cpu().numpy()) for o in objs]
    fresh = make_caches("flashinfer_HND", 113)
    expected = fresh.clone()
    kv_ops.scatter(
        _reference_gather(src, slots), expected.layers, fresh.layout(), slots.cuda(), backend="reference"
    )
    loader = pl.DevicePipeline(
        fresh.layers, fresh.layout(), backend=BACKEND, ring_slots=2, use_graphs=graphs, raw_cuda=raw
    )
    copies: list[int] = []
    real_h2d = loader._h2d
    loader._h2d = lambda stage, host: (copies.append(1), real_h2d(stage, host))[1]  # type: ignore[method-assign]
    asked: list[int] = []

    def broken() -> torch.Tensor:
        raise RuntimeError("no mapping")

    with pytest.raises(RuntimeError, match="no mapping"):
        loader.load(objs[:2], broken, checksums=True)
    loader.synchronize()  # as the data path settles after a failed issue
    copies.clear()

    def mapping() -> torch.Tensor:
        asked.append(len(copies))
        return slots

    handle = loader.load(objs, mapping, checksums=True)
    handle.wait()
    assert asked == [1]  # once, after exactly the first copy
    assert len(copies) == len(objs)
    assert torch.equal(fresh.bits(), expected.bits())
    assert handle.checksums() == want_sums
