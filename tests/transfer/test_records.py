"""``maru.transfer.records``: what a chunk reference says it places."""

from __future__ import annotations

import pytest

from maru.transfer.records import ChunkRef, RequestTransfer


@pytest.mark.parametrize(
    ("begin", "end", "span"),
    [
        (0, -1, (0, 16)),
        (0, 16, (0, 16)),
        (5, -1, (5, 16)),
        (5, 9, (5, 9)),
        (9, 9, (9, 9)),
        (16, -1, (16, 16)),
    ],
)
def test_places_agrees_with_the_placed_span(begin: int, end: int, span: tuple[int, int]) -> None:
    c = ChunkRef("k", 32, 16, begin, end)
    assert c.placed() == span
    assert c.places() == (span[1] > span[0])


def test_a_request_counts_only_the_tokens_it_places() -> None:
    chunks = (ChunkRef("a", 0, 16, 4), ChunkRef("b", 16, 16, 0, 0), ChunkRef("c", 32, 8))
    rt = RequestTransfer("r", tuple(range(3)), chunks)
    assert [c.places() for c in chunks] == [True, False, True]
    assert rt.num_placed_tokens() == 12 + 0 + 8
