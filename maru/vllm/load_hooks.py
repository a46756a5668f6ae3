"""What the worker lends its load modes (``LayerLoads``, ``AsyncLoads``): one bundle, one meaning."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from maru.transfer.engine import KVTransferEngine
from maru.transfer.records import LoadReport, RequestTransfer


@dataclass(frozen=True)
class LoadHooks:
    """The worker's side of a load mode.

    ``connect()``: the transfer engine (connecting first where needed), or why there is none.
    ``rank(rt)``: the request as this tensor-parallel rank stores it.
    ``fail(rt, why)``: report a request's blocks for recompute (vLLM's load-error path).
    ``lost(why)``: drop the connection to a server that went away.
    ``account(report, how, under_forward)``: count a load; ``how`` labels the timing line, a load
    ``under_forward`` has no rate of its own (its host time is not transfer time).
    ``done(rts)``: nothing reads these requests' held chunks any more (``RequestTransfer.held``):
    their tickets go back to the scheduler side, which releases the pins. Called once per request
    handed to the mode, after its last transfer completed (or when it never started).
    """

    connect: Callable[[], KVTransferEngine | str]
    rank: Callable[[RequestTransfer], RequestTransfer]
    fail: Callable[[RequestTransfer, str], None]
    lost: Callable[[str], None]
    account: Callable[[LoadReport, str, bool], None]
    done: Callable[[Iterable[RequestTransfer]], None]
