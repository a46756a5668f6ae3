"""``HostScratch``: a buffer is handed out again only after the upload that read it completed.

The CUDA events are a recording stand-in (no GPU here); the ring logic is what is tested.
"""

from __future__ import annotations

from maru.kv_ops.host_scratch import HostScratch


class FakeSync:
    """Events that complete when the test says so; records what the ring asked for."""

    def __init__(self) -> None:
        self.complete: dict[int, bool] = {}
        self.synced: list[int] = []
        self.recorded: list[tuple[int, int]] = []

    def event(self) -> int:
        ev = len(self.complete) + 1
        self.complete[ev] = False
        return ev

    def record_on(self, ev: int, stream: int) -> None:
        self.complete[ev] = False  # a new recording: not reached yet
        self.recorded.append((ev, stream))

    def query(self, ev: int) -> bool:
        return self.complete[ev]

    def synchronize(self, ev: int) -> None:
        self.synced.append(ev)
        self.complete[ev] = True


def test_a_buffer_comes_back_only_after_its_upload_completed() -> None:
    sync = FakeSync()
    ring = HostScratch(sync, size=2, pin=False)
    t0, b0 = ring.take(10)
    b0.numpy()[:] = 7
    ring.uploaded(t0, stream=5)
    t1, b1 = ring.take(10)
    assert t1 != t0 and b1.data_ptr() != b0.data_ptr()  # the other buffer, no wait
    ring.uploaded(t1, stream=5)
    assert sync.synced == []
    # A lap: buffer 0's upload has not completed, so take waits for it before handing it out.
    t2, b2 = ring.take(10)
    assert t2 == t0 and b2.data_ptr() == b0.data_ptr()
    assert sync.synced == [sync.recorded[0][0]]
    ring.uploaded(t2, stream=6)
    # Completed uploads cost no wait.
    sync.complete[sync.recorded[1][0]] = True
    ring.take(10)
    assert len(sync.synced) == 1


def test_a_buffer_grows_for_a_larger_request_and_is_never_shared() -> None:
    sync = FakeSync()
    ring = HostScratch(sync, size=1, pin=False)
    _, small = ring.take(16)
    assert small.numel() == 16 and small.dtype.is_floating_point is False
    _, big = ring.take(HostScratch.MIN_WORDS * 3)  # never uploaded: no wait
    assert big.numel() == HostScratch.MIN_WORDS * 3
    assert sync.synced == []


def test_a_taken_buffer_that_was_never_uploaded_is_handed_out_without_waiting() -> None:
    sync = FakeSync()
    ring = HostScratch(sync, size=1, pin=False)
    ring.take(8)  # the caller failed before queueing any copy from it
    ring.take(8)
    assert sync.synced == [] and sync.recorded == []


def test_slot_rows_are_int64_with_the_skipped_prefix_masked() -> None:
    import torch

    ring = HostScratch(FakeSync(), size=2, pin=False)
    mapping = torch.tensor([7, 3, 11, 5, 2], dtype=torch.int32)
    _, rows = ring.take_slots(mapping, skip_tokens=2)
    assert rows.dtype == torch.int64 and rows.tolist() == [-1, -1, 11, 5, 2]
    assert mapping.tolist() == [7, 3, 11, 5, 2]  # the caller's mapping is untouched
    strided = torch.arange(10, dtype=torch.int64)[::2]  # a view: not contiguous
    _, rows = ring.take_slots(strided)
    assert rows.tolist() == [0, 2, 4, 6, 8]
