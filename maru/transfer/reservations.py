"""Reserving pool objects for a store's chunks (RESERVE, one round trip for a batch).

A store writes each chunk into an object the server reserved for it, then publishes them
(COMMIT). Invariants: every reserved object ends up in exactly one gather or is aborted (the
engine's ``finish_gather``); a failed reservation is reported as the store's failure, never as a
partial store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from maru.errors import CONNECTION_LOST, MaruError
from maru.transfer.records import RequestTransfer, StoreReport

_LOST = CONNECTION_LOST

Reserved = tuple[list[tuple[RequestTransfer, Any]], list[Any]]


def unique_chunks(requests: Sequence[RequestTransfer]) -> list[tuple[RequestTransfer, Any]]:
    """(request, chunk) for every chunk of ``requests``, each key once (the first request's)."""
    todo: list[tuple[RequestTransfer, Any]] = []
    seen: set[str] = set()
    for req in requests:
        for c in req.chunks:
            if c.key not in seen:
                seen.add(c.key)
                todo.append((req, c))
    return todo


def _failed(rep: StoreReport, n: int, why: str, lost: bool) -> None:
    rep.failed = n
    rep.error = f"reserving {n} objects failed: {why}"
    rep.server_lost = lost


def reserve_chunks(
    client: Any, geometry: Any, requests: Sequence[RequestTransfer], rep: StoreReport
) -> Reserved | None:
    """Every unique chunk of ``requests`` and a reserved object for each (one round trip).

    None when there is nothing to store or the reservation failed (recorded in ``rep``).
    """
    todo = unique_chunks(requests)
    if not todo:
        return None
    try:
        objs = client.batch_alloc([geometry.nbytes(c.num_tokens) for _, c in todo])
    except (MaruError, ValueError) as e:
        _failed(rep, len(todo), str(e), isinstance(e, _LOST))
        return None
    return todo, list(objs)
