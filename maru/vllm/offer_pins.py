"""Pins on what the scheduler side offers to vLLM, from the offer until the workers placed it.

Why: between the probe that finds a prefix in the pool and the worker's copy, another client's
store may evict it. Without a pin the worker finds the chunk gone and vLLM must recompute, which
vLLM's V2 model runner cannot do for a request it already runs (vLLM issue #49250), and the
worker pays a lookup-and-pin round trip on the load's path before its first copy. Pinned at the
offer, the chunk cannot go; the worker gets its location and committed checksum with the load
(``RequestTransfer.held``) and places it without asking the server.

Life of a pin set (one per request, ``OfferPins``):

1. Where a failed same-step load cannot be recomputed (vLLM's V2 runner), ``hold`` in
   ``get_num_new_matched_tokens``: pins the offered chunks' keys (every tensor-parallel rank's
   shard) in one round trip, reusing pins the request already holds from an earlier offer or
   that another request holds (one server pin per key, shared: 16 requests arriving with one
   system prompt pin it once, and a request whose offer is all shared pays no round trip); the
   offer is cut to the leading chunks it really holds, so a miss can never reach a load.
   Elsewhere ``hold_many`` in ``build_connector_meta``: one round trip pins every load of the
   step (a round trip per request on vLLM's scheduling thread cost a burst of 16 new requests
   ~8 ms on an H200 host); a chunk gone by then fails its load, which vLLM recomputes.
2. ``hand_over`` (in ``build_connector_meta``): the set goes to the workers with the load under
   a fresh ticket. From then on only the workers' word releases it: ``worker_done`` counts the
   ticket once per worker (``MaruWorkerMeta``, aggregated by vLLM) and releases the set when
   every tensor-parallel rank has reported it, after its last read of those pages.
3. ``drop``: a set never handed over (the request finished, or vLLM took none of the offer) is
   released at once.

Pins posted at arrival (``prefetch``, from vLLM's ``on_new_request``): when a request arrives, before
vLLM schedules it, the keys its probe found are pinned by a lookup posted without waiting
(``MaruHandler.post_lookup``); live pins other requests hold are shared at once. ``hold`` and
``hold_many`` first read the replies their request waits for (already there, usually: a burst of
requests arriving together has its round trips in flight together, and overlapped with the
engine's step), then pin what is still missing the usual way. A post that fails (a lost
connection, no reply in the client's timeout) only sends its keys down that usual way. A reply
whose request went meanwhile is released at the next ``flush``.

Requests arriving together share their posts: a request's keys are posted at once when no post is
in flight (a lone request, the first of a burst), else queued with those of the requests arriving
after it, and the queue goes as one lookup once it holds ``POST_BATCH`` requests, at the next
``hold``/``hold_many`` (the burst's first offer: the requests offered before the queued ones give
its reply time to come) or at the next ``flush``, whichever comes first. A burst of 16 sends 3
lookups instead of 16 (each post and each reply costs vLLM's scheduling thread its own encoding,
send, receive and decoding: ~40 + ~50 us on the CI machine, 2-3x that on a GPU host).

Invariants: a server pin is released only when no set (open or handed over) refers to it any
more; a handed-over set is released only after all ``tp_size`` workers reported its ticket,
or, as a guard against a lost report, ``STALE_S`` seconds after the hand-over (logged, counted:
the worker's checksum check still catches any page reused after that). Releases are batched
into one UNPIN sent without waiting (``flush``). A session lost with the server takes its pins
with it (the server quarantines them); their handles are dropped without a round trip.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from maru.errors import MaruError
from maru.protocol import MAX_BATCH
from maru.transfer.records import HeldChunk
from maru.vllm.keys import rank_keys

logger = logging.getLogger("maru.vllm")

STALE_S = 300.0  # a ticket no worker reported after this long is released (see the invariants)
POST_BATCH = 8  # requests whose arrival keys one posted lookup carries at most (see "posted at arrival")


@dataclass(eq=False)
class _Pin:
    """One server pin on a rank key, shared by every set (open or handed over) that refers to it.

    ``refs`` counts those sets; the pin is released when the last one lets go."""

    key: str
    handle: Any
    refs: int = 0


@dataclass(eq=False)
class _Post:
    """A lookup-and-pin posted at requests' arrival (``prefetch``), not read yet; or, with no
    ``lookup`` yet, the queue of keys the next post carries (``OfferPins._queued``)."""

    lookup: Any  # the client's PostedLookup (None while queued)
    rks: list[str]
    reqs: int = 0  # requests whose keys it carries


@dataclass
class _Handed:
    pins: list[_Pin]
    since: float
    reports: int = 0


@dataclass
class OfferPinStats:
    pin_trips: int = 0  # lookup-and-pin round trips (one per offer or step that needed new pins)
    pin_trip_ms: float = 0.0  # their wall time, summed (with pin_at_offer: on vLLM's scheduling thread)
    pins_shared: int = 0  # rank keys held through a pin another set already had: no round trip
    offers_cut: int = 0  # offers cut short: a chunk the probe found was gone when pinned
    handed: int = 0  # pin sets handed to the workers with a load
    released: int = 0  # ... released after every worker reported them
    dropped: int = 0  # sets released without a load (request finished, offer not taken)
    pin_posts: int = 0  # lookups posted at requests' arrival (``prefetch``), not waited for
    pins_posted: int = 0  # rank keys asked in them
    post_waits: int = 0  # offers (or steps) that waited for a posted reply still on its way
    post_wait_ms: float = 0.0  # their wait, summed (on vLLM's scheduling thread)
    posts_failed: int = 0  # posts lost or not answered in time: their keys were pinned the usual way
    # Offers (or steps) that read posted replies, and that reading's wall and thread CPU time, summed
    # (the replies decoded and made handles; a wait for one still on its way included)
    post_reads: int = 0
    post_read_ms: float = 0.0
    post_read_cpu_ms: float = 0.0
    stale: int = 0  # handed sets released by the STALE_S guard (no worker report)
    open_now: int = 0
    handed_now: int = 0
    pinned_now: int = 0  # rank keys this scheduler holds a server pin on


class OfferPins:
    """The scheduler side's pins, per request until handed over, per ticket after.

    One server pin per rank key, however many requests want it: a request whose offer covers
    chunks another request holds (a shared system prompt, 16 users arriving together) takes a
    reference on that pin instead of a round trip. A pin goes to the server's UNPIN only when the
    last set referring to it is released, so sharing never shortens what any set holds."""

    def __init__(self, tp_size: int = 1) -> None:
        self.tp_size = tp_size
        self._pins: dict[str, _Pin] = {}  # rank key -> the live pin every set shares
        self._open: dict[str, dict[str, _Pin]] = {}  # req_id -> rank key -> its pin
        self._handed: dict[str, _Handed] = {}  # ticket -> the pins the workers may still read
        self._release: list[Any] = []  # handles to unpin at the next flush
        self._posts: list[_Post] = []  # posted at arrival, not read yet
        self._posting: dict[str, _Post] = {}  # rank key -> the unread (or queued) post that pins it
        self._queued: _Post | None = None  # keys of arrivals not posted yet (see "posted at arrival")
        self._awaiting: dict[str, set[str]] = {}  # req_id -> rank keys it takes when their post is read
        self.post_failure: str | None = None  # why the first post failed (``failing_posts``)
        self._seq = itertools.count(1)
        self.stats = OfferPinStats()

    # ------------------------------------------------------------------ shared pins
    def _live(self, rk: str) -> _Pin | None:
        p = self._pins.get(rk)
        if p is not None and not p.handle.valid:
            del self._pins[rk]  # its session was lost (server restart, lease): the pin went with it
            return None
        return p

    def _acquire(self, client: Any, rks: list[str]) -> list[_Pin | None]:
        """A reference on a pin of each rank key (None where the key is gone): a live shared pin
        where there is one, else a new one; the new ones in one round trip. Raises what
        ``client.batch_retrieve`` raises, before taking any reference."""
        ask = list(dict.fromkeys(rk for rk in rks if self._live(rk) is None))
        for rk, h in zip(ask, self._pin(client, ask), strict=True):
            if h is not None:
                self._pins[rk] = _Pin(rk, h)
        self.stats.pins_shared += len(rks) - len(ask)
        out: list[_Pin | None] = []
        for rk in rks:
            p = self._pins.get(rk)
            if p is not None:
                p.refs += 1
            out.append(p)
        return out

    def _let_go(self, pins: Any) -> None:
        """Drop one reference on each pin; a pin no set refers to any more is unpinned at the next
        flush (a pin replaced after a lost session is not the live one: only its handle goes)."""
        for p in pins:
            p.refs -= 1
            if p.refs <= 0:
                if self._pins.get(p.key) is p:
                    del self._pins[p.key]
                self._release.append(p.handle)

    # ------------------------------------------------------------------ offer
    def hold(self, client: Any, req_id: str, keys: Sequence[str]) -> int:
        """Pin ``keys`` (chunk keys in prompt order) for ``req_id``; how many leading keys are held
        (every rank's shard). Pins past the first key not held are released (``flush``). Raises
        what ``client.batch_retrieve`` raises (nothing is held then beyond what was before)."""
        self._settle([req_id], client)
        have = self._open.setdefault(req_id, {})
        for rk in [rk for rk, p in have.items() if not p.handle.valid]:
            self._let_go([have.pop(rk)])  # lost with its session: asked for again below
        want = [rk for k in keys for rk in rank_keys(k, self.tp_size) if rk not in have]
        for rk, p in zip(want, self._acquire(client, want), strict=True):
            if p is not None:
                have[rk] = p
        n = 0
        for k in keys:
            if not all(rk in have for rk in rank_keys(k, self.tp_size)):
                break
            n += 1
        if n < len(keys):  # the offer ends before key n: what it held after that goes at the next flush
            self.stats.offers_cut += 1
            self._let_go(
                p for k in keys[n:] for rk in rank_keys(k, self.tp_size) if (p := have.pop(rk, None))
            )
        return n

    def hold_many(self, client: Any, wants: dict[str, Sequence[str]]) -> None:
        """Pin, in one round trip, the chunk keys each request of ``wants`` (req_id -> keys) does
        not hold yet: the step's loads, at ``build_connector_meta``. Nothing is cut here (the offer
        was made already): a key found gone is simply not held, and the worker looks it up itself
        (and fails the load, which vLLM recomputes). Raises what ``client.batch_retrieve`` raises."""
        self._settle(list(wants), client)
        asks: list[tuple[str, str]] = []
        for req_id, keys in wants.items():
            have = self._open.setdefault(req_id, {})
            asks += [(req_id, rk) for k in keys for rk in rank_keys(k, self.tp_size) if rk not in have]
        # Requests sharing a key share its one pin (each holds a reference, released on its own).
        for (req_id, rk), p in zip(asks, self._acquire(client, [rk for _, rk in asks]), strict=True):
            if p is not None:
                self._open[req_id][rk] = p

    # ------------------------------------------------------------------ posted at arrival
    def prefetch(self, client: Any, req_id: str, keys: Sequence[str]) -> int:
        """At ``req_id``'s arrival: a reference on the live pin of each of ``keys``' rank keys, and
        a lookup-and-pin posted (not waited for) for the others, or queued for the post of the
        requests arriving with it (see "posted at arrival"); ``hold``/``hold_many`` read it. How
        many rank keys were posted or queued. Never raises: what is not posted is pinned later."""
        have = self._open.setdefault(req_id, {})
        waits = self._awaiting.setdefault(req_id, set())
        ask: list[str] = []
        for k in keys:
            for rk in rank_keys(k, self.tp_size):
                if rk in have or rk in waits:
                    continue
                p = self._live(rk)
                if p is not None:
                    p.refs += 1
                    have[rk] = p
                    self.stats.pins_shared += 1
                elif rk in self._posting:
                    waits.add(rk)  # another request's post pins it: taken when that is read
                elif rk not in ask:
                    ask.append(rk)
        # Queued, then posted with the arrivals after it (or at once); False: pinned at its offer.
        taken = bool(ask) and getattr(client, "post_lookup", None) is not None
        if taken:
            q = self._queued
            if q is not None and len(q.rks) + len(ask) > MAX_BATCH:
                self._send_queued(client)  # one lookup takes at most MAX_BATCH keys
                q = None
            if q is None:
                q = self._queued = _Post(None, [])
            q.rks += ask
            q.reqs += 1
            for rk in ask:
                self._posting[rk] = q
            waits.update(ask)
            if not self._posts or q.reqs >= POST_BATCH:  # nothing in flight to overlap, or a full batch
                taken = self._send_queued(client)
        if not self._awaiting.get(req_id):
            self._awaiting.pop(req_id, None)
        if not have:
            del self._open[req_id]
        return len(ask) if taken else 0

    def _send_queued(self, client: Any) -> bool:
        """Post the queued keys as one lookup (nothing to do with none queued). False where it
        could not be posted: the requests waiting for those keys pin them at their offer."""
        q, self._queued = self._queued, None
        if q is None:
            return True
        lookup = None
        post = getattr(client, "post_lookup", None)
        if post is not None:
            try:
                lookup = post(q.rks, segments=True)
            except Exception as e:  # its keys are already queued and awaited: undone below, never left
                logger.info(
                    "Maru: posting the pins of %d arriving requests failed (%s); pinned at their offers",
                    q.reqs,
                    e,
                )
        if lookup is None:
            for rk in q.rks:
                if self._posting.get(rk) is q:
                    del self._posting[rk]
            asked = set(q.rks)
            for req_id in list(self._awaiting):
                self._awaiting[req_id] -= asked
                if not self._awaiting[req_id]:
                    del self._awaiting[req_id]
            return False
        q.lookup = lookup
        self._posts.append(q)
        self.stats.pin_posts += 1
        self.stats.pins_posted += len(q.rks)
        return True

    def _settle(self, req_ids: Sequence[str], client: Any) -> None:
        """Read the posts ``req_ids`` wait for, all within one client timeout: a stalled server
        holds vLLM's scheduling thread for one timeout, not one per post (the posts not answered
        by then fail, and their keys are pinned the usual way). The queued keys are posted first:
        the requests offered after these give its reply time to come."""
        if self._queued is not None:
            self._send_queued(client)
        posts = {
            id(pp): pp
            for r in req_ids
            for rk in self._awaiting.get(r, ())
            if (pp := self._posting.get(rk)) is not None
        }
        if not posts:
            return
        timeout = float(getattr(client, "timeout_s", 5.0))
        t0, c0 = time.perf_counter(), time.thread_time()
        read = getattr(client, "read_posted", None)
        if read is not None and not all(pp.lookup.done for pp in posts.values()):
            read()  # replies already here (the server answers in order): no wait for those
        waited = not all(pp.lookup.done for pp in posts.values())
        deadline = t0 + timeout
        for pp in posts.values():
            self._read(pp, max(0.0, deadline - time.perf_counter()))
        wall = (time.perf_counter() - t0) * 1e3
        if waited:
            self.stats.post_waits += 1
            self.stats.post_wait_ms += wall
        self.stats.post_reads += 1
        self.stats.post_read_ms += wall
        self.stats.post_read_cpu_ms += (time.thread_time() - c0) * 1e3

    def _read(self, pp: _Post, timeout_s: float) -> None:
        """Take one post's reply: its pins join the shared ones, and each request waiting for one
        of its keys takes a reference; a pin no request waits for any more is released (``flush``)."""
        self._posts.remove(pp)
        for rk in pp.rks:
            if self._posting.get(rk) is pp:
                del self._posting[rk]
        try:
            handles = pp.lookup.result(timeout_s)
        except (MaruError, RuntimeError) as e:
            self.stats.posts_failed += 1
            if self.post_failure is None:  # said once; ``failing_posts`` puts it in `maru doctor`
                self.post_failure = str(e)
                logger.warning(
                    "Maru: a lookup-and-pin posted at a request's arrival failed (%s); its offer is "
                    "pinned with a round trip of its own instead (slower, never wrong). If it keeps "
                    "happening, check the server with `maru doctor`",
                    e,
                )
            handles = [None] * len(pp.rks)
        for rk, h in zip(pp.rks, handles, strict=True):
            if h is None:
                continue
            if h.checksum is None or self._live(rk) is not None:  # unverifiable, or pinned meanwhile
                self._release.append(h)
                continue
            self._pins[rk] = _Pin(rk, h)
        asked = set(pp.rks)
        for req_id in list(self._awaiting):
            waits = self._awaiting[req_id]
            got = waits & asked
            if not got:
                continue
            waits -= got
            have = self._open.setdefault(req_id, {})
            for rk in got:
                p = self._live(rk)
                if p is not None and rk not in have:
                    p.refs += 1
                    have[rk] = p
            if not waits:
                del self._awaiting[req_id]
            if not have:
                del self._open[req_id]
        for rk in pp.rks:
            p = self._pins.get(rk)
            if p is not None and p.refs <= 0:  # its request went before the reply was read
                del self._pins[rk]
                self._release.append(p.handle)

    def _read_arrived(self, client: Any) -> None:
        """Post the queued keys; take the replies of posts already here (none waited for)."""
        if self._queued is not None:
            self._send_queued(client)
        if not self._posts:
            return
        read = getattr(client, "read_posted", None)
        if read is not None:
            read()
        for pp in [pp for pp in self._posts if pp.lookup.done]:
            self._read(pp, 0.0)

    def _pin(self, client: Any, keys: list[str]) -> list[Any]:
        """One lookup-and-pin round trip (none for no keys): a handle per key, None where the key
        is gone or was committed without a checksum (no load could vouch for its bytes: that pin
        goes at the next flush). ``verify=False``: the worker checks what it places."""
        if not keys:
            return []
        if client is None:
            raise MaruError("no connection to the maru server")
        self.stats.pin_trips += 1
        t0 = time.perf_counter()
        try:
            out = client.batch_retrieve(keys, pin=True, verify=False, segments=True)
        finally:
            self.stats.pin_trip_ms += (time.perf_counter() - t0) * 1e3
        for i, h in enumerate(out):
            if h is not None and h.checksum is None:
                self._release.append(h)
                out[i] = None
        return out

    @property
    def posting(self) -> bool:
        """Whether a post of arrivals' pins is in flight (sent, not read) or queued."""
        return bool(self._posts) or self._queued is not None

    def failing_posts(self) -> bool:
        """Whether posts at arrival mostly fail (at least 4, and half of them): offers are then
        pinned one round trip each again, the slower path ``maru doctor`` should show."""
        n = self.stats.posts_failed
        return n >= 4 and 2 * n >= self.stats.pin_posts

    def holds_all(self, req_id: str, keys: Sequence[str]) -> bool:
        """Whether ``req_id``'s set holds every rank key of ``keys`` (no post of them unread)."""
        have = self._open.get(req_id) or {}
        return all(rk in have for k in keys for rk in rank_keys(k, self.tp_size))

    def hand_over(self, req_id: str, keys: Sequence[str]) -> tuple[tuple[HeldChunk, ...], str]:
        """Give the request's set to the workers with its load of ``keys``: (the locations of those
        keys' shards, the ticket). Pins of other keys in the set ride along and go with the ticket.
        ``((), "")`` when the request holds nothing (the worker then looks the chunks up itself).
        A post still unread for the request (keys outside this load) is released when read."""
        self._awaiting.pop(req_id, None)
        have = self._open.pop(req_id, None) or {}
        lost = [rk for rk, p in have.items() if not p.handle.valid]
        self._let_go(have.pop(rk) for rk in lost)  # a session lost since: the worker looks them up
        if not have:
            return (), ""
        ticket = f"{req_id}#{next(self._seq)}"
        self._handed[ticket] = _Handed(list(have.values()), time.monotonic())
        self.stats.handed += 1
        held = tuple(
            HeldChunk(rk, p.handle.offset, p.handle.size, p.handle.checksum, p.handle.segments)
            for k in keys
            for rk in rank_keys(k, self.tp_size)
            if (p := have.get(rk)) is not None
        )
        return held, ticket

    def drop(self, req_id: str) -> None:
        """Release a set never handed over (a handed one waits for its workers); what a post not
        read yet would have given it is released when that is read."""
        self._awaiting.pop(req_id, None)
        have = self._open.pop(req_id, None)
        if have:
            self.stats.dropped += 1
            self._let_go(have.values())

    # ------------------------------------------------------------------ workers
    def worker_done(self, done: dict[str, int]) -> None:
        """Count workers' reports (ticket -> how many workers); release the sets all ranks reported."""
        for ticket, n in done.items():
            h = self._handed.get(ticket)
            if h is None:
                continue  # released already (stale guard), or not ours
            h.reports += int(n)
            if h.reports >= self.tp_size:
                del self._handed[ticket]
                self.stats.released += 1
                self._let_go(h.pins)

    def take_back(self, ticket: str) -> None:
        """Release a handed set whose load never reached the workers (the step's plan was lost:
        ``MaruSchedulerConnector._failed_plan``), instead of holding it until ``STALE_S``."""
        h = self._handed.pop(ticket, None)
        if h is not None:
            self.stats.released += 1
            self._let_go(h.pins)

    def expire(self, now: float | None = None) -> None:
        """The guard against a lost worker report (see the module docstring)."""
        now = time.monotonic() if now is None else now
        stale = [t for t, h in self._handed.items() if now - h.since > STALE_S]
        for t in stale:
            h = self._handed.pop(t)
            self.stats.stale += 1
            self._let_go(h.pins)
            logger.warning(
                "Maru: no worker reported the load %s done within %.0f s (%d of %d ranks did); its "
                "pins are released now (pins other loads share stay). Placed bytes are still checked "
                "against their checksums.",
                t,
                STALE_S,
                h.reports,
                self.tp_size,
            )

    def flush(self, client: Any) -> None:
        """Send the pending releases (one UNPIN, not waited for); never raises."""
        if client is not None:
            try:
                self._read_arrived(client)  # posts whose requests went meanwhile: released now
            except Exception as e:  # never raises: a post not read stays for the next flush
                logger.info("Maru: reading posted pins failed (%s)", e)
        elif self._queued is not None:  # no connection: those requests pin at their offers
            self._send_queued(None)
        rel, self._release = self._release, []
        if not rel or client is None:
            for h in rel:  # no connection: the session (and its pins) is gone already
                h.release()
            return
        try:
            client.batch_release(rel, wait=False)
        except Exception as e:  # the client retries lost unpins, the lease frees the rest
            logger.info("Maru: releasing %d offer pins failed (%s)", len(rel), e)

    def close(self, client: Any) -> None:
        """Release everything (shutdown)."""
        for pp in self._posts:
            pp.lookup.abandon()
        self._posts.clear()
        self._queued = None
        self._posting.clear()
        self._awaiting.clear()
        self._release += [p.handle for p in self._pins.values()]
        self._pins.clear()
        self._open.clear()
        self._handed.clear()
        self.flush(client)

    def snapshot(self) -> dict[str, int | float]:
        self.stats.open_now = len(self._open)
        self.stats.handed_now = len(self._handed)
        self.stats.pinned_now = len(self._pins)
        out: dict[str, int | float] = dict(self.stats.__dict__)
        out["pin_trip_ms"] = round(self.stats.pin_trip_ms, 3)
        out["post_wait_ms"] = round(self.stats.post_wait_ms, 3)
        out["posts_unread"] = len(self._posts)
        out["posts_queued"] = self._queued.reqs if self._queued is not None else 0
        return out
