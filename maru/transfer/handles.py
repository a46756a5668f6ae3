"""Handles of transfers issued on a data path: one interface, whatever the path.

A handle covers a list of *items* (the chunks of a gather or scatter, or the per-request chunk
groups of a layer-by-layer scatter). ``done()`` never blocks. ``wait()`` blocks until every item
completed and raises when the whole transfer failed; ``failed_items()`` (after ``wait()``) names
the items that failed alone, the others are complete. A handle keeps the tensors over pool pages
alive until it completed: drop it only after ``done()`` or ``wait()``.

Integrity (after ``wait()``): a scatter given the committed checksums of its objects names in
``mismatched()`` the objects (flat index over every chunk, groups in order) whose bytes, as the
path placed them, do not match; a gather may give ``checksums()`` of the bytes it wrote.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from maru.transfer.paths import DataPath


class TransferHandle(ABC):
    """One issued gather or scatter (see the module docstring)."""

    @abstractmethod
    def done(self) -> bool: ...

    @abstractmethod
    def wait(self) -> None: ...

    def failed_items(self) -> dict[int, str]:
        return {}

    def mismatched(self) -> list[int]:
        """Objects whose placed bytes failed their committed checksum (flat indices)."""
        return []

    def checksums(self) -> list[int | None] | None:
        """``maru.checksum`` of each gathered object's bytes, where the path computed it."""
        return None

    def segment_sums(self) -> list[Any] | None:
        """Each gathered object's ``maru.segments.SegmentSums``, where the path computed them."""
        return None

    # Of the bytes a verifying scatter moved, those of segments it neither placed nor read
    # (``maru.segments``); known once the handle is.
    unread_bytes: int = 0

    @property
    def copies_shared(self) -> int:
        """Items placed from another item's copy (the same pool entry): bus bytes not moved."""
        return 0


def compare(got: list[int] | None, expected: list[int] | None) -> list[int]:
    """Indices where ``got`` differs from ``expected``; every index when ``got`` is missing (a
    transfer asked to verify that computed nothing must not pass as verified)."""
    if expected is None:
        return []
    if got is None or len(got) != len(expected):
        return list(range(len(expected)))
    return [i for i, (g, e) in enumerate(zip(got, expected, strict=True)) if g != e]


class CompletedHandle(TransferHandle):
    """A transfer that ran to its end on the calling thread (CPU and staged paths)."""

    def __init__(
        self,
        failed: dict[int, str] | None = None,
        mismatched: list[int] | None = None,
        sums: list[int | None] | None = None,
        segments: list[Any] | None = None,
    ) -> None:
        self._failed = failed or {}
        self._mismatched = mismatched or []
        self._sums = sums
        self._segments = segments

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None

    def failed_items(self) -> dict[int, str]:
        return dict(self._failed)

    def mismatched(self) -> list[int]:
        return list(self._mismatched)

    def checksums(self) -> list[int | None] | None:
        return self._sums

    def segment_sums(self) -> list[Any] | None:
        return self._segments


class DeviceHandle(TransferHandle):
    """A transfer queued on a ``DevicePipeline`` (its ``Transfer``); errors surface at done()/wait().
    ``expected``: the committed checksums of a verifying load's objects."""

    def __init__(self, transfer: Any, expected: list[int] | None = None) -> None:
        self.transfer = transfer
        self.expected = expected

    def done(self) -> bool:
        return bool(self.transfer.done())

    def wait(self) -> None:
        self.transfer.wait()

    def mismatched(self) -> list[int]:
        return compare(self.transfer.checksums(), self.expected)

    def checksums(self) -> list[int | None] | None:
        got = self.transfer.checksums()
        return None if got is None else list(got)

    def segment_sums(self) -> list[Any] | None:
        got = self.transfer.segment_sums()
        return None if got is None else list(got)

    @property
    def unread_bytes(self) -> int:  # type: ignore[override]
        return int(getattr(self.transfer, "unread_bytes", 0) or 0)

    @property
    def copies_shared(self) -> int:
        return int(getattr(self.transfer, "copies_shared", 0))


class LayerHandle(TransferHandle):
    """A layer-by-layer scatter: layer i of every item can be waited for alone.

    ``wait_for_layer(i)`` and ``wait_all()`` make the *caller* wait: its CUDA stream where the
    path runs on the device (the host does not block), the host otherwise. ``host_seconds`` is the
    host time the placement itself took (0 where it runs on the device).
    """

    num_layers: int
    host_seconds: float = 0.0

    @abstractmethod
    def wait_for_layer(self, layer: int) -> None: ...

    @abstractmethod
    def wait_all(self) -> None: ...

    @abstractmethod
    def layer_done(self, layer: int) -> bool: ...


class DeviceLayerHandle(LayerHandle):
    """``DevicePipeline.load_layers``' ``LayerLoad``: one event per layer; all items fail together.
    ``expected``: the committed checksums of every object, flat (a verifying load)."""

    def __init__(self, load: Any, num_layers: int, expected: list[int] | None = None) -> None:
        self.load = load
        self.num_layers = num_layers
        self.expected = expected

    def mismatched(self) -> list[int]:
        return compare(self.load.checksums(), self.expected)

    @property
    def unread_bytes(self) -> int:  # type: ignore[override]
        return int(getattr(self.load, "unread_bytes", 0) or 0)

    def wait_for_layer(self, layer: int) -> None:
        self.load.wait_for_layer(layer)

    def wait_all(self) -> None:
        self.load.wait_on()

    def layer_done(self, layer: int) -> bool:
        return bool(self.load.layer_done(layer))

    def done(self) -> bool:
        return bool(self.load.done())

    def wait(self) -> None:
        self.load.wait()


class ThreadedLayerHandle(LayerHandle):
    """Places every item layer by layer on a daemon thread (``path.place_layer``), in layer order.

    Invariants: layer i's event is set only after layer i of every item still alive is placed
    (and, on a device, ran); an item whose placement raised is skipped from then on and named by
    ``failed_items()``; every event is set when the thread ends, so a waiter never hangs. With
    ``expected`` (committed checksums per group), after the last layer the path checks the bytes
    it placed from (``path.placed_checksums``; only the segments it placed, given ``segments``)
    before ``done()`` turns true.
    """

    def __init__(
        self,
        path: DataPath,
        groups: list[list[tuple[Any, Any]]],
        num_layers: int,
        expected: list[list[int]] | None = None,
        segments: list[list[Any]] | None = None,
    ) -> None:
        self.num_layers = num_layers
        self._path = path
        self._groups = groups
        self._expected = expected
        self._segments = segments  # per group, the committed segment sums of its objects (or None)
        self._events = [threading.Event() for _ in range(num_layers)]
        self._done = threading.Event()
        self._failed: dict[int, str] = {}
        self._mismatched: list[int] = []
        self._error: BaseException | None = None
        # The caller's autograd mode: vLLM makes its caches (and runs its hooks) under inference
        # mode, and an inference tensor may be written in place only inside it.
        self._inference = torch.is_inference_mode_enabled()
        self._thread = threading.Thread(target=self._run, name="maru-layer-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with torch.inference_mode(self._inference):
            self._place_all()

    def _place_all(self) -> None:
        t0 = time.perf_counter()
        try:
            for i in range(self.num_layers):
                for g, parts in enumerate(self._groups):
                    if g in self._failed:
                        continue
                    try:
                        for obj, slots in parts:
                            self._path.place_layer(obj, slots, i)
                    except Exception as e:  # this item fails alone: vLLM recomputes its request
                        self._failed[g] = f"placing layer {i} failed: {type(e).__name__}: {e}"
                self._path.sync()  # queued kernels are not placed layers
                self._events[i].set()
            if self._expected is not None:
                self._verify()
        except BaseException as e:  # the device itself failed: every item fails
            self._error = e
        finally:
            self._groups = []
            for ev in self._events:
                ev.set()
            self.host_seconds = time.perf_counter() - t0
            self._done.set()

    def _verify(self) -> None:
        flat = 0
        for g, parts in enumerate(self._groups):
            want = self._expected[g] if self._expected is not None else []
            if g not in self._failed:
                segs = self._segments[g] if self._segments is not None else None
                got, unread = self._path.placed_checksums(parts, segs)
                self.unread_bytes += unread
                self._mismatched += [flat + i for i in compare(got, want)]
            flat += len(parts)

    def mismatched(self) -> list[int]:
        return list(self._mismatched)

    def wait_for_layer(self, layer: int) -> None:
        self._events[layer].wait()

    def wait_all(self) -> None:
        self._done.wait()

    def layer_done(self, layer: int) -> bool:
        return self._events[layer].is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self) -> None:
        self._done.wait()
        self._thread.join()
        if self._error is not None:
            raise self._error

    def failed_items(self) -> dict[int, str]:
        return dict(self._failed)
