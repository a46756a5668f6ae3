"""Lookups posted now and read later (``MaruHandler.post_lookup``): the round trips of several
lookups overlap, and the caller does other work while the server answers.

Why: vLLM's scheduler side pins what it offers. Pinned one request at a time, on vLLM's scheduling
thread, a burst of 16 new requests waited for 16 round trips in a row (~0.4-0.5 ms each on an H200
host). Posted when each request arrives, their round trips overlap with each other and with
whatever the engine does before it schedules them; the offer then reads a reply already there.

Invariants:

- A posted lookup's pins are this handler's like a ``batch_retrieve``'s from the moment its reply
  is read (whichever thread's exchange reads it): counted in the session's pins, released through
  the handles (``batch_release``), fenced with the session.
- A lookup given up before its reply came (``abandon``) leaves nothing pinned: a reply read later
  has its pins sent back with the next heartbeat's UNPIN, and never becomes handles.
- A reply from a session that ended since the post (a restart, an expired lease) yields no
  handles: those pins ended with it. ``result`` then raises, as it does for a lost connection or
  a refused request: the caller pins the usual way.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from maru.client import frames
from maru.client.objects import Retrieved
from maru.client.replies import MAX_BATCH, check_keys, error_from_reply, reply_list
from maru.errors import MaruError, MaruTimeoutError, NotConnectedError
from maru.protocol import Op

log = logging.getLogger("maru.client")


class PostedLookup:
    """One LOOKUP sent without waiting. ``result`` gives its handles once the reply was read."""

    def __init__(self, owner: Any, keys: list[str], segments: bool) -> None:
        self.keys = keys
        self.segments = segments
        self.req_id = 0  # the channel's request id, once sent
        self._owner = owner
        self._token = owner._token  # the session the pins would belong to
        # Set once, by a callback run under the handler's lock; read without it. A bool, not a
        # threading.Event (nobody waits on it: ``result`` reads the channel): a post is ~15 us
        # cheaper on the CI machine without the Event's Condition.
        self._done = False
        self._handles: list[Retrieved | None] | None = None
        self._error: str | None = None
        self._abandoned = False
        # Set without the handler's lock (``abandon`` while another thread's exchange holds it);
        # ``on_reply`` and the settling (both under the lock) read it.
        self._abandon_requested = False
        self._taken = False

    @property
    def done(self) -> bool:
        """True once the reply was read or the request was lost (never blocks)."""
        return self._done

    def result(self, timeout_s: float) -> list[Retrieved | None]:
        """The handles (None where the key is absent), reading replies for up to ``timeout_s``.
        Raises a ``MaruError`` when the lookup failed, was lost with its connection or session, or
        got no reply in time (the handles are then never made: see ``abandon``). Once only."""
        if self._taken or self._abandoned:
            raise RuntimeError("a posted lookup's result is taken once, and not after abandon()")
        if not self._done:
            self._owner._wait_posted(self, timeout_s)
        if not self._done:
            self.abandon()
            raise MaruTimeoutError(
                f"no reply to a posted lookup of {len(self.keys)} keys within {timeout_s:g} s from "
                f"maru server at {self._owner.url}; check `maru doctor`"
            )
        self._taken = True
        if self._error is not None:
            raise MaruError(self._error)
        assert self._handles is not None
        return self._handles

    def abandon(self) -> None:
        """Give the lookup up: handles already made are released (one UNPIN, not waited for); a
        reply still to come has its pins sent back (``_pending_unpins``). Idempotent. Never waits
        for the connection: while another thread's exchange holds it (a heartbeat stuck on a server
        that stopped answering), the lookup is settled by the handler's next heartbeat instead
        (``settle_abandoned``), and a reply read meanwhile has its pins sent back."""
        owner = self._owner
        if self._abandoned or self._taken:
            return
        self._abandon_requested = True
        if not owner._lock.acquire(timeout=0):
            owner._abandoned_posts.append(self)  # list.append: atomic; settled under the lock
            return
        try:
            handles = self._abandon_locked()
        finally:
            owner._lock.release()
        if handles:
            owner.batch_release(handles, wait=False)

    def _abandon_locked(self) -> list[Retrieved | None] | None:
        """Mark it given up; the handles to release, if its reply was read already. Call with the
        handler's lock held."""
        if self._abandoned or self._taken:
            return None
        self._abandoned = True
        handles, self._handles = self._handles, None
        return handles

    # ------------------------------------------------------------------ the channel's callbacks
    # They run in the thread whose exchange read the reply, with the handler's lock held.
    def on_reply(self, op: int, reply: Mapping[str, Any]) -> None:
        owner = self._owner
        entries: list[Any] = []
        if self._done:  # answered already (lost, then read after all): pins go back
            if reply.get("ok"):
                owner._pending_unpins += [
                    k for k, e in zip(self.keys, reply.get("entries") or (), strict=False) if e
                ]
            return
        try:
            if not reply.get("ok"):
                self._error = str(error_from_reply(op, dict(reply), owner.url))
                return
            entries = reply_list(dict(reply), "entries", len(self.keys))
            if self._token is not owner._token:  # the session ended since the post: so did its pins
                self._error = "the session of a posted lookup ended before its reply was read"
                return
            if self._abandoned or self._abandon_requested:
                owner._pending_unpins += [k for k, e in zip(self.keys, entries, strict=True) if e]
                return
            self._handles = owner._lookup_handles(self.keys, reply, entries, True, self.segments)
        except Exception as e:  # an unreadable reply: the caller pins the usual way
            self._error = f"reading a posted lookup's reply failed: {type(e).__name__}: {e}"
            # What the server pinned goes back (no handle was made for it).
            owner._pending_unpins += [k for k, e in zip(self.keys, entries, strict=False) if e]
        finally:
            self._done = True

    def on_lost(self, op: int, body: Mapping[str, Any]) -> None:
        self._error = "the connection to the maru server was replaced before a posted lookup's reply"
        self._done = True
        if self._token is self._owner._token:  # it may have been applied: its pins are this session's
            self._owner._lost_pin(self.keys)


class PostedLookups:
    """``post_lookup`` and the handle-making it shares with ``batch_retrieve`` (a mixin of
    ``MaruHandler``, whose connection, lock and pin counters it uses)."""

    url: str
    client_id: str
    _lock: Any
    _rpc: Any
    _token: Any
    _pins: Any
    _pinned_extents: Any
    _pending_unpins: list[str]
    _abandoned_posts: list[PostedLookup]
    _lost_pin: Callable[[list[str]], None]
    _closed: bool
    _connected: bool
    _pid: int

    timeout_s: float

    # MaruHandler's (declared, not defined here: this class comes first in its bases).
    _held: Callable[[], Any]
    _acquire: Callable[[float], None]
    _mapped: Callable[[], Any]
    _unpin_one: Callable[[Retrieved], None]
    batch_release: Callable[..., None]

    def post_lookup(self, keys: Sequence[str], *, segments: bool = False) -> PostedLookup | None:
        """Send a lookup-and-pin of ``keys`` (at most ``MAX_BATCH``) without waiting for the reply;
        ``PostedLookup.result`` reads it later. None (nothing sent) when not connected, or when
        there are more keys than one request takes: then ``batch_retrieve`` as usual.

        Unlike ``batch_retrieve``, the bytes are never checked here (``verify=False``): the caller
        checks what it places against ``Retrieved.checksum`` (and ``segments``)."""
        keys = check_keys(keys)
        if not keys or len(keys) > MAX_BATCH:
            return None
        with self._held():
            if self._closed or not self._connected or os.getpid() != self._pid:
                return None
            posted = PostedLookup(self, keys, segments)
            body: dict[str, Any] = {"keys": keys, "pin": True, "client_id": self.client_id}
            if segments:
                body["segments"] = True
            req_id = self._rpc.post(Op.LOOKUP, body, posted.on_reply, posted.on_lost)
            if req_id is None:
                return None
            posted.req_id = req_id
            return posted

    def settle_abandoned(self) -> None:
        """Settle the lookups given up while another thread held the connection (``abandon``):
        their handles, if their replies were read, are released. Call with ``_lock`` held (the
        heartbeat does, every beat)."""
        if not self._abandoned_posts:
            return
        posts, self._abandoned_posts = self._abandoned_posts, []
        handles = [h for p in posts for h in (p._abandon_locked() or ())]
        if handles:
            self.batch_release(handles, wait=False)

    def read_posted(self) -> None:
        """Read the replies of posted lookups already here (none waited for), so a lookup given up
        since has its pins sent back and ``PostedLookup.done`` is current. Never raises."""
        if not self._lock.acquire(blocking=False):
            return  # another thread is exchanging: it reads them
        try:
            if not self._closed:
                self._rpc.read_posted()
        except Exception as e:  # the next exchange (or ``result``) reads them instead
            log.info("reading posted replies failed (%s); a later call reads them", e)
        finally:
            self._lock.release()

    def _wait_posted(self, posted: PostedLookup, timeout_s: float) -> None:
        """Read replies for up to ``timeout_s`` in all: the wait for the connection (another thread's
        exchange, e.g. a heartbeat to a server that stopped answering) counts in it."""
        t0 = time.monotonic()
        try:
            self._acquire(max(0.0, min(timeout_s, self.timeout_s)))
        except (MaruTimeoutError, NotConnectedError):
            return  # result() reports it
        try:
            self._rpc.wait_posted(posted.req_id, max(0.0, timeout_s - (time.monotonic() - t0)))
        except (MaruTimeoutError, NotConnectedError):
            return
        finally:
            self._lock.release()

    def _lookup_handles(
        self, keys: list[str], reply: Mapping[str, Any], entries: list[Any], pin: bool, segments: bool
    ) -> list[Retrieved | None]:
        """A LOOKUP reply's handles (None where absent), its pins counted. Call with ``_lock`` held."""
        sums = frames.lookup_checksums(dict(reply), len(keys))
        segs = frames.lookup_segments(dict(reply), len(keys)) if segments else [None] * len(keys)
        views = self._mapped().read_views(entries)
        on_release = self._unpin_one if pin else None
        pins, extents, token = self._pins, self._pinned_extents, self._token
        out: list[Retrieved | None] = []
        for k, e, view, c, g in zip(keys, entries, views, sums, segs, strict=True):
            if view is None:
                out.append(None)
                continue
            if pin:  # .get, not Counter's += (its __missing__ is a Python call for each new key)
                pins[k] = pins.get(k, 0) + 1
                ext = (e[0], e[1])
                extents[ext] = extents.get(ext, 0) + 1
            out.append(Retrieved(k, e[0], view, pin, on_release, c, token, g))
        return out
