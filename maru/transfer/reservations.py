"""Reserving pool objects for a store's chunks: at once, or ahead of the gather.

A store writes each chunk into an object the server reserved for it (RESERVE, one round trip
for a batch), then publishes them (COMMIT). A GPU gather needs its objects' addresses before it
can be issued, so on vLLM's forward thread the reservation was a round trip in front of every
write-behind store. ``reserve_ahead`` makes the reservation before the gather is due (the worker
runs it on a helper thread while the forward computes the KV it will store) and
``take_reserved`` hands the objects to the gather.

Invariants: every reserved object ends up in exactly one gather or is aborted (here the
leftovers go to ``PendingStore.unused``, which the drain thread aborts: off the forward
thread); a failed reservation is reported as the store's failure, never as a partial store.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from maru.errors import CONNECTION_LOST, MaruError
from maru.transfer.records import RequestTransfer, StoreReport
from maru.transfer.stores import PendingStore, StoreReservation

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


def reserve_ahead(client: Any, geometry: Any, requests: Sequence[RequestTransfer]) -> StoreReservation:
    """``reserve_chunks`` into a ``StoreReservation`` (keyed by chunk key); never raises for
    Maru-side problems: they are its ``error``."""
    rep = StoreReport()
    res = StoreReservation()
    reserved = reserve_chunks(client, geometry, requests, rep)
    if reserved is not None:
        res.objects = {c.key: obj for (_, c), obj in zip(*reserved, strict=True)}
    elif rep.error is not None:
        res.error, res.server_lost = rep.error, rep.server_lost
    return res


def take_reserved(
    client: Any,
    geometry: Any,
    requests: Sequence[RequestTransfer],
    res: StoreReservation,
    pending: PendingStore,
) -> Reserved | None:
    """``reserve_chunks`` served from ``res``: each chunk takes its key's object (when big
    enough); only chunks without one are reserved now (one round trip, only then). What ``res``
    holds beyond the chunks goes to ``pending.unused``; ``res`` is empty afterwards."""
    rep = pending.prep.report
    todo = unique_chunks(requests)
    held, res.objects = res.objects, {}
    if res.error is not None:
        pending.unused.extend(held.values())
        if todo:
            _failed(rep, len(todo), res.error, res.server_lost)
        return None
    objs: list[Any] = []
    missing: list[int] = []
    for i, (_, c) in enumerate(todo):
        obj = held.pop(c.key, None)
        if obj is not None and obj.size < geometry.nbytes(c.num_tokens):
            pending.unused.append(obj)
            obj = None
        if obj is None:
            missing.append(i)
        objs.append(obj)
    pending.unused.extend(held.values())
    if missing:
        try:
            more = client.batch_alloc([geometry.nbytes(todo[i][1].num_tokens) for i in missing])
        except (MaruError, ValueError) as e:
            pending.unused.extend(o for o in objs if o is not None)
            _failed(rep, len(todo), str(e), isinstance(e, _LOST))
            return None
        for i, obj in zip(missing, more, strict=True):
            objs[i] = obj
    return (todo, objs) if todo else None
