"""``PoolObjects``: chunk objects over one tensor of a whole pool, checked together, made on first use.

Against the objects made one by one over the same bytes (``host_object``), on a real /dev/shm
mapping with random contents: the same bytes, shapes, addresses and token counts; a made object
is one tensor however it is reached (``take``, ``joined``); what does not fit is refused; a
pipeline takes them without making one (the direct layer load reads only addresses) and loads
them byte for byte as the plain list. Block size 4 != 3 heads.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")

from maru.kv_ops.geometry import ObjectGeometry, host_object  # noqa: E402
from maru.kv_ops.pool_objects import PoolObjects  # noqa: E402
from maru.kv_ops.testing import bits, random_slots  # noqa: E402
from tests.kv_ops.test_device_pipeline_cpu import (  # noqa: E402
    GEOM,
    ShmPool,
    _case,
    _engine,
    _same_storage,
)

L, KV, ROW = GEOM["num_layers"], 2, GEOM["num_kv_heads"] * GEOM["head_size"]
KEY = ObjectGeometry(L, KV, ROW, torch.bfloat16)


@pytest.fixture
def pool() -> Iterator[ShmPool]:
    p = ShmPool(1 << 20)
    yield p
    p.close()


def _base(pool: ShmPool) -> torch.Tensor:
    """The whole mapping as one bf16 tensor, random bytes (as ``PoolMapping.read_tensor``)."""
    base = torch.frombuffer(pool.mm, dtype=torch.bfloat16)
    base.view(torch.int16).copy_(torch.randint(-(2**15), 2**15, (base.numel(),), dtype=torch.int16))
    return base


def _per_token() -> int:
    return L * KV * ROW * 2


def test_objects_are_the_pages_at_their_offsets_and_one_tensor_each(pool: ShmPool) -> None:
    base = _base(pool)
    parts = [(0, 8), (5 * 4096, 3), (2 * 4096 + 2, 5), (40 * 4096, 8)]  # any element-aligned offset
    objs = PoolObjects.make(base, KEY, parts)
    assert len(objs) == 4 and objs.tokens == [8, 3, 5, 8]
    assert objs.ptrs == [base.data_ptr() + off for off, _ in parts]
    assert all(o is None for o in objs._cache)  # nothing made yet
    for obj, (off, t) in zip(objs, parts, strict=True):
        ref = host_object(pool.mm, (L, KV, t, ROW), torch.bfloat16, off)
        assert obj.is_contiguous() and list(obj.shape) == [L, KV, t, ROW]
        assert obj.data_ptr() == ref.data_ptr() and torch.equal(bits(obj), bits(ref))
    assert objs[1] is objs[1] and objs[-1] is objs[3]
    assert objs[1:3] == [objs[1], objs[2]]
    # A request's chunks out of the step's keys, and requests joined: the same tensors.
    a, b = objs.take([2, 0]), objs.take([3])
    assert a.tokens == [5, 8] and a.ptrs == [objs.ptrs[2], objs.ptrs[0]]
    assert a[0] is objs[2] and a[1] is objs[0]
    j = PoolObjects.joined([a, b])
    assert j is not None and j.tokens == [5, 8, 8] and [o for o in j] == [objs[2], objs[0], objs[3]]
    fresh = objs.take([1]).take([0])
    assert fresh[0] is objs[1]
    # Over a base that does not start its storage (a slice): still the bytes at its own offsets.
    sliced = base[4096:]
    inner = PoolObjects.make(sliced, KEY, [(2 * 4096, 3)])
    ref = host_object(pool.mm, (L, KV, 3, ROW), torch.bfloat16, 2 * 4096 + 4096 * 2)
    assert inner.ptrs[0] == inner[0].data_ptr() == ref.data_ptr() and torch.equal(bits(inner[0]), bits(ref))
    # Sets made apart do not join (their objects are not one cache); one set is itself.
    other = PoolObjects.make(base, KEY, parts[:1])
    assert PoolObjects.joined([a, other]) is None and PoolObjects.joined([a]) is a
    assert PoolObjects.joined([]) is None


def test_what_does_not_fit_is_refused(pool: ShmPool) -> None:
    base = _base(pool)
    size = base.numel() * 2
    t = 4
    last = size - t * _per_token()
    assert len(PoolObjects.make(base, KEY, [(last, t)])) == 1  # ends exactly at the end: fits
    with pytest.raises(ValueError, match="does not fit"):
        PoolObjects.make(base, KEY, [(0, 1), (last + 2, t)])
    with pytest.raises(ValueError, match="multiple of the element size"):
        PoolObjects.make(base, KEY, [(3, 1)])
    with pytest.raises(ValueError, match="multiple of the element size"):
        PoolObjects.make(base, KEY, [(-2, 1)])
    with pytest.raises(ValueError, match="contiguous 1-D host tensor of torch.bfloat16"):
        PoolObjects.make(base.view(torch.float16), KEY, [(0, 1)])
    with pytest.raises(ValueError, match="contiguous 1-D host tensor"):
        PoolObjects.make(base[: 4096 * 4].view(4, 4096), KEY, [(0, 1)])


def test_a_pipeline_takes_them_checked_without_making_one_and_refuses_another_geometry(pool: ShmPool) -> None:
    engine = _engine(_case("kv_first", "HND", 8))
    base = _base(pool)
    objs = PoolObjects.make(base, KEY, [(0, 8), (8 * 4096, 3)])
    checked = engine._objects(objs)
    assert checked is objs and all(o is None for o in objs._cache)
    listed = engine._objects(list(objs))  # the same objects as tensors: the same reads
    assert listed.tokens == objs.tokens and listed.ptrs == objs.ptrs
    with pytest.raises(ValueError, match="no chunk objects"):
        engine._objects(objs.take([]))
    wrong = PoolObjects.make(base, ObjectGeometry(L, KV, ROW // 2, torch.bfloat16), [(0, 8)])
    with pytest.raises(ValueError, match=r"expected \[5, 2, T, 24\]"):
        engine._objects(wrong)


@pytest.mark.parametrize("path", ["load", "load_layers"])
def test_a_load_from_them_places_what_the_listed_objects_place(pool: ShmPool, path: str) -> None:
    src = _case("blocks_first", "HND", 2)
    sizes = [8, 3, 8]
    offsets = [0, 16 * 4096, 4 * 4096]
    objs = PoolObjects.make(_base(pool), KEY, list(zip(offsets, sizes, strict=True)))
    slots = torch.tensor(
        random_slots(48, sum(sizes), negatives=2, generator=torch.Generator().manual_seed(7))
    )
    _engine(src).store(list(objs), slots).wait()
    got, want, poison = (_case("blocks_first", "HND", 3) for _ in range(3))
    for case, given in ((got, objs), (want, list(objs))):
        eng = _engine(case)
        (eng.load(given, slots) if path == "load" else eng.load_layers(given, slots)).wait()
    assert _same_storage(got, want) and not _same_storage(got, poison)
