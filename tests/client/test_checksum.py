"""``maru.checksum``: the compiled and the numpy versions equal the word-by-word definition, and it
notices the changes a stale writer makes (a changed, zeroed or moved word, a different length)."""

from __future__ import annotations

import numpy as np
import pytest

from maru.checksum import checksum, reference_checksum


@pytest.fixture(params=["native", "numpy"])
def impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test with the compiled loop (required here: CI has a C compiler) and with numpy."""
    import maru.checksum as ck

    if request.param == "numpy":
        monkeypatch.setattr(ck, "_native", lambda: None)
    else:
        assert ck.implementation() == "native", ck.native.load().reason
    return request.param


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 8 * (1 << 15) + 3, 2 * 8 * (1 << 15) + 17])
def test_checksum_equals_the_reference_definition_on_random_bytes(n: int, impl: str) -> None:
    data = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8).tobytes()
    assert checksum(data) == reference_checksum(data)
    assert checksum(memoryview(data)) == checksum(np.frombuffer(data, dtype=np.uint8)) == checksum(data)
    # A view that starts off an 8-byte boundary (an object at an odd offset of a buffer).
    odd = np.frombuffer(b"\x00" + data, dtype=np.uint8)[1:]
    assert checksum(odd) == reference_checksum(data)


def test_checksum_changes_when_a_word_changes_moves_or_the_length_differs(impl: str) -> None:
    data = bytearray(np.random.default_rng(0).integers(0, 256, 70_000, dtype=np.uint8).tobytes())
    base = checksum(data)
    changed = bytearray(data)
    changed[40_000] ^= 1
    swapped = bytearray(data)
    swapped[0:8], swapped[8:16] = data[8:16], data[0:8]
    zeroed = bytes(len(data))
    assert len({base, checksum(changed), checksum(swapped), checksum(zeroed), checksum(data + b"\0")}) == 5


def test_checksum_refuses_a_non_contiguous_buffer() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        checksum(np.zeros((4, 4), dtype=np.uint8)[:, ::2])


@pytest.mark.parametrize("threads", [2, 3, 8])
def test_checksum_split_over_threads_equals_one_thread(
    monkeypatch: pytest.MonkeyPatch, threads: int, impl: str
) -> None:
    import maru.checksum as ck

    rng = np.random.default_rng(threads)
    # Not a multiple of a block nor of 8: the last part is short and a tail word remains.
    data = rng.integers(0, 256, size=5 * 8 * (1 << 15) + 8 * 1000 + 5, dtype=np.uint8)
    one = checksum(data)  # below PARALLEL_BYTES: one thread
    monkeypatch.setattr(ck, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(ck, "_threads", lambda: threads)
    monkeypatch.setattr(ck, "_POOL", None)
    assert ck.checksum(data) == one
    flipped = data.copy()
    flipped[-5000] ^= 1
    assert ck.checksum(flipped) != one


def test_a_forked_child_computes_with_its_own_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A child forked after the parent made its thread pool must not wait on the parent's threads."""
    import multiprocessing as mp

    import maru.checksum as ck

    monkeypatch.setattr(ck, "PARALLEL_BYTES", 1)
    monkeypatch.setattr(ck, "_threads", lambda: 2)
    data = np.random.default_rng(5).integers(0, 256, size=3 * 8 * (1 << 15) + 11, dtype=np.uint8)
    want = ck.checksum(data)  # the parent's pool exists now
    ctx = mp.get_context("fork")
    with ctx.Pool(1) as pool:
        assert pool.apply_async(ck.checksum, (data,)).get(timeout=30) == want
