"""``IssuedScatter.group_by_chunk``: the items of one chunk several requests want become adjacent
(so the GPU path copies it once), every item keeping its own object, slots, handle and owner."""

from __future__ import annotations

import random

import torch

from maru.transfer.loads import IssuedScatter


class _Handle:
    def __init__(self, key: str) -> None:
        self.key = key


def test_grouping_makes_repeats_adjacent_and_keeps_each_item_whole() -> None:
    rng = random.Random(5)
    for _ in range(200):
        handles = [_Handle(f"k{i}") for i in range(rng.randint(1, 6))]
        batch = IssuedScatter()
        items = []
        for owner in range(rng.randint(1, 5)):
            for h in rng.sample(handles, rng.randint(1, len(handles))):
                obj, slots = torch.empty(1), torch.tensor([rng.randint(0, 99)])
                batch.objs.append(obj)
                batch.slots.append(slots)
                batch.placed.append(h)
                batch.owner.append(owner)
                items.append((id(obj), id(slots), h, owner))
        repeats = batch.group_by_chunk()
        assert repeats == len(items) - len({id(t[2]) for t in items})
        after = list(zip(map(id, batch.objs), map(id, batch.slots), batch.placed, batch.owner, strict=True))
        assert sorted(after, key=str) == sorted(items, key=str)  # the same items, none split
        keys = [h.key for h in batch.placed]
        seen: list[str] = []
        for k in keys:  # each key's items form one run, runs in first-seen order
            if not seen or seen[-1] != k:
                assert k not in seen
                seen.append(k)
        assert seen == list(dict.fromkeys(t[2].key for t in items))
        for key in seen:  # within a key, the original order (stable)
            want = [t[3] for t in items if t[2].key == key]
            assert [o for h, o in zip(batch.placed, batch.owner, strict=True) if h.key == key] == want
