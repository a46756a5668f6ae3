"""Layout detection: every layout of the table, NHD/HND from strides, padding, and clear refusals."""

from __future__ import annotations

import dataclasses

import pytest

from maru.errors import UnsupportedLayout
from maru.kv_ops import KVLayout, detect_layout, detect_layouts


@dataclasses.dataclass
class FakeTensor:
    """Shape and strides only: detection must not need torch."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]

    def stride(self) -> tuple[int, ...]:
        return self.strides


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, run = [], 1
    for size in reversed(shape):
        out.append(run)
        run *= size
    return tuple(reversed(out))


def permuted(physical_shape: tuple[int, ...], order: tuple[int, ...]) -> FakeTensor:
    """A contiguous tensor of ``physical_shape`` viewed with axes ``order`` (vLLM's permute back)."""
    st = contiguous_strides(physical_shape)
    return FakeTensor(tuple(physical_shape[i] for i in order), tuple(st[i] for i in order))


NB, BS, NH, HS = 7, 16, 4, 8
GEOM = dict(block_size=BS, num_kv_heads=NH, head_size=HS)


def test_kv_first_nhd_is_detected_from_a_contiguous_tensor_without_torch() -> None:
    lay = detect_layout(permuted((2, NB, BS, NH, HS), (0, 1, 2, 3, 4)), **GEOM)
    assert (lay.format, lay.physical, lay.num_blocks) == ("kv_first", "NHD", NB)
    assert lay.kv_stride == NB * BS * NH * HS and lay.k_token_stride == NH * HS and lay.head_stride == HS


def test_hnd_shows_only_in_strides_and_is_detected_from_them() -> None:
    # vLLM allocates [2, NB, NH, BS, HS] and permutes back to the logical [2, NB, BS, NH, HS].
    cache = permuted((2, NB, NH, BS, HS), (0, 1, 3, 2, 4))
    assert cache.shape == (2, NB, BS, NH, HS)
    lay = detect_layout(cache, **GEOM)
    assert (lay.format, lay.physical) == ("kv_first", "HND")
    assert lay.k_token_stride == HS and lay.head_stride == BS * HS


def test_blocks_first_nhd_and_hnd() -> None:
    nhd = detect_layout(permuted((NB, 2, BS, NH, HS), (0, 1, 2, 3, 4)), **GEOM)
    hnd = detect_layout(permuted((NB, 2, NH, BS, HS), (0, 1, 3, 2, 4)), **GEOM)
    assert (nhd.format, nhd.physical, hnd.format, hnd.physical) == (
        "blocks_first",
        "NHD",
        "blocks_first",
        "HND",
    )
    assert nhd.kv_stride == BS * NH * HS and nhd.block_stride == 2 * BS * NH * HS


def test_packed_layout_fuses_k_and_v_in_the_last_dim() -> None:
    lay = detect_layout(FakeTensor((NB, NH, BS, 2 * HS), contiguous_strides((NB, NH, BS, 2 * HS))), **GEOM)
    assert (lay.format, lay.physical, lay.kv_stride, lay.k_token_stride) == ("packed", "HND", HS, 2 * HS)


def test_packed_layout_with_nhd_memory_is_detected_from_strides() -> None:
    lay = detect_layout(permuted((NB, BS, NH, 2 * HS), (0, 2, 1, 3)), **GEOM)
    assert (lay.format, lay.physical, lay.k_token_stride, lay.head_stride) == (
        "packed",
        "NHD",
        NH * 2 * HS,
        2 * HS,
    )


def test_cpu_backend_layout_needs_the_backend_name_and_stores_k_transposed() -> None:
    cache = FakeTensor((NB, NH, BS, 2 * HS), contiguous_strides((NB, NH, BS, 2 * HS)))
    lay = detect_layout(cache, **GEOM, attn_backend="CPU_ATTN")
    assert lay.format == "cpu_attn"
    assert (lay.k_token_stride, lay.k_dim_stride) == (1, BS)  # K^T [HS, BS]
    assert (lay.v_token_stride, lay.v_dim_stride, lay.kv_stride) == (HS, 1, BS * HS)  # then V [BS, HS]


def test_mla_is_one_plane() -> None:
    lay = detect_layout(
        FakeTensor((NB, BS, 576), contiguous_strides((NB, BS, 576))),
        block_size=BS,
        num_kv_heads=1,
        head_size=576,
    )
    assert (lay.format, lay.num_kv, lay.row_size) == ("mla", 1, 576)


def test_cross_layer_tensor_carries_the_layer_stride() -> None:
    lay = detect_layout(permuted((NB, 3, 2, NH, BS, HS), (0, 1, 2, 4, 3, 5)), **GEOM)
    assert (lay.format, lay.physical, lay.num_layers) == ("cross_layer", "HND", 3)
    assert lay.layer_stride == 2 * NH * BS * HS and lay.block_stride == 3 * lay.layer_stride


def test_padded_block_stride_is_accepted_and_reported() -> None:
    content = BS * NH * HS
    cache = FakeTensor((2, NB, BS, NH, HS), (NB * (content + 64), content + 64, NH * HS, HS, 1))
    lay = detect_layout(cache, **GEOM)
    assert lay.is_padded and lay.block_stride == content + 64
    assert not detect_layout(permuted((2, NB, BS, NH, HS), (0, 1, 2, 3, 4)), **GEOM).is_padded


def test_equal_block_size_and_heads_is_decided_by_strides() -> None:
    geom = dict(block_size=8, num_kv_heads=8, head_size=HS)
    nhd = detect_layout(permuted((2, NB, 8, 8, HS), (0, 1, 2, 3, 4)), **geom)
    hnd = detect_layout(permuted((2, NB, 8, 8, HS), (0, 1, 3, 2, 4)), **geom)
    assert (nhd.physical, hnd.physical) == ("NHD", "HND")
    assert hnd.k_token_stride == HS and nhd.k_token_stride == 8 * HS


def test_equal_block_size_and_heads_with_undecidable_strides_raises() -> None:
    geom = dict(block_size=8, num_kv_heads=8, head_size=HS)
    cache = FakeTensor((2, NB, 8, 8, HS), (NB * 8 * 8 * HS, 8 * 8 * HS, 8 * HS, 8 * HS, 1))
    with pytest.raises(UnsupportedLayout, match="cannot be decided"):
        detect_layout(cache, **geom)


def test_old_cpu_backend_shape_is_head_major_in_the_shape() -> None:
    # vLLM's older CPU backend: [2, NB, NH, BS, HS], HND in the shape itself.
    lay = detect_layout(FakeTensor((2, NB, NH, BS, HS), contiguous_strides((2, NB, NH, BS, HS))), **GEOM)
    assert lay.physical == "HND" and lay.k_token_stride == HS


@pytest.mark.parametrize(
    ("shape", "geom", "needle"),
    [
        ((NB, BS, NH, HS), GEOM, "4-D cache is packed"),
        ((2, NB, BS, NH, HS + 1), GEOM, "head_size"),
        ((2, NB, BS + 1, NH, HS), GEOM, "expected block_size"),
        ((3, NB, BS, NH, HS), GEOM, "K/V axis"),
        ((NB, BS, HS), GEOM, "MLA"),
        ((NB, BS), GEOM, "2-D tensors"),
        ((2, 2, BS, NH, HS), GEOM, "exactly 2 blocks"),
    ],
)
def test_unknown_layouts_raise_naming_shape_strides_and_expectation(shape, geom, needle) -> None:
    with pytest.raises(UnsupportedLayout) as err:
        detect_layout(FakeTensor(shape, contiguous_strides(shape)), **geom)
    msg = str(err.value)
    assert needle in msg and str(list(shape)) in msg and str(list(contiguous_strides(shape))) in msg
    assert "expected one of" in msg


def test_overlapping_strides_are_refused() -> None:
    cache = FakeTensor((2, NB, BS, NH, HS), (NB * BS * NH * HS, BS * NH * HS, NH * HS, 1, 1))
    with pytest.raises(UnsupportedLayout, match="overlap"):
        detect_layout(cache, **GEOM)


def test_cpu_backend_slab_must_be_contiguous() -> None:
    cache = permuted((NB, BS, NH, 2 * HS), (0, 2, 1, 3))
    with pytest.raises(UnsupportedLayout, match="slabs must be contiguous"):
        detect_layout(cache, **GEOM, attn_backend="CPU_ATTN")


def test_object_without_strides_is_refused_clearly() -> None:
    with pytest.raises(UnsupportedLayout, match="cannot read shape and strides"):
        detect_layout([1, 2, 3], **GEOM)


def test_detect_layouts_accepts_a_uniform_set_and_names_the_odd_layer() -> None:
    good = permuted((2, NB, BS, NH, HS), (0, 1, 2, 3, 4))
    hnd = permuted((2, NB, NH, BS, HS), (0, 1, 3, 2, 4))
    assert isinstance(detect_layouts([good, good, good], **GEOM), KVLayout)
    assert detect_layouts({"a": good, "b": good}, **GEOM).format == "kv_first"
    with pytest.raises(UnsupportedLayout, match="layer 2"):
        detect_layouts([good, good, hnd], **GEOM)
    with pytest.raises(UnsupportedLayout, match="no KV caches"):
        detect_layouts([], **GEOM)


def test_detect_layouts_takes_the_cross_layer_tensor_alone() -> None:
    cross = permuted((NB, 3, 2, BS, NH, HS), (0, 1, 2, 3, 4, 5))
    assert detect_layouts(cross, **GEOM).num_layers == 3
    with pytest.raises(UnsupportedLayout, match="per-layer layout"):
        detect_layouts(permuted((2, NB, BS, NH, HS), (0, 1, 2, 3, 4)), **GEOM)


def test_detection_does_not_import_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from maru.kv_ops import detect_layout\n"
        "class T:\n"
        "    shape = (2, 7, 16, 4, 8)\n"
        "    def stride(self):\n"
        "        return (3584, 512, 32, 8, 1)\n"
        "lay = detect_layout(T(), block_size=16, num_kv_heads=4, head_size=8)\n"
        "assert lay.physical == 'NHD', lay\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
