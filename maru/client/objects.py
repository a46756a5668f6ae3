"""The two handles a client holds on pool memory: a reservation to fill, and a retrieved entry.

``Allocation`` (from ``alloc``): space reserved for this client, not yet visible to anyone.
Write ``buf`` completely, then ``store`` it under a key; or ``abort`` it. Once stored (or
aborted) ``buf`` is released: the bytes of a published key never change.

``Retrieved`` (from ``retrieve``): a committed entry's bytes, ``view`` a read-only slice of the
pool. While it is pinned (the default) the server will not evict the entry. ``release()``
unpins it and releases ``view``; using ``view`` (or a slice of it) after that is a bug, because
the space may be evicted and reused for another object.

Revocation. Both handles belong to one session of their handler (a ``SessionToken``). When the
session is lost (the lease expired while the process was stalled, or the server restarted) the
handler fences their pool ranges (``PoolMapping.fence``) and kills the token: ``valid`` turns
False at once for every handle of that session, ``verify()`` fails, ``check()`` raises.
A reader that held a view across a stall learns it before it trusts the bytes.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable
from dataclasses import dataclass

from maru.checksum import checksum as _checksum
from maru.errors import IntegrityError, StaleViewError
from maru.segments import SegmentSums


class SessionToken:
    """One session of a handler with its server; ``alive`` turns False once, when it is lost."""

    __slots__ = ("number", "alive")

    def __init__(self, number: int) -> None:
        self.number = number
        self.alive = True


def _release_view(view: memoryview | None) -> None:
    if view is None:
        return
    # A live export (numpy/torch array over the view) forbids release; the caller's own
    # object then keeps the memory mapped, which is safe for the mapping, not for the data.
    with contextlib.suppress(BufferError):
        view.release()


class AllocState(str, enum.Enum):
    RESERVED = "reserved"
    STORED = "stored"
    PRESENT = "present"  # the key existed already; this reservation was freed
    ABORTED = "aborted"


@dataclass(eq=False)
class Allocation:
    """Space reserved in the pool for one object.

    ``buf`` is a writable memoryview of exactly ``size`` bytes at ``offset`` in the pool.
    ``session`` is the handler's session number at reservation time: a reservation belongs to
    one server session and cannot be stored after the server restarted or the lease expired.
    """

    alloc_id: int
    offset: int
    size: int
    session: int
    buf: memoryview | None
    state: AllocState = AllocState.RESERVED
    owner: str = ""  # client_id of the handler that reserved it (only that handler can store it)

    @property
    def reserved(self) -> bool:
        return self.state is AllocState.RESERVED

    def _finish(self, state: AllocState) -> None:
        self.state = state
        _release_view(self.buf)
        self.buf = None

    def __repr__(self) -> str:
        return f"Allocation(id={self.alloc_id}, offset={self.offset}, size={self.size}, state={self.state.value})"


class Retrieved:
    """A committed entry's bytes. ``view`` is a read-only memoryview into the pool.

    Release it (``release()`` or ``with``) as soon as the bytes are copied out; ``release`` is
    idempotent. After release ``view`` is None. (A plain class with slots: batch lookups make
    thousands of these, so construction cost matters.)
    """

    __slots__ = (
        "key",
        "offset",
        "view",
        "size",
        "pinned",
        "released",
        "checksum",
        "session",
        "segments",
        "_on_release",
    )

    def __init__(
        self,
        key: str,
        offset: int,
        view: memoryview,
        pinned: bool,
        on_release: Callable[[Retrieved], None] | None = None,
        checksum: int | None = None,
        session: SessionToken | None = None,
        segments: SegmentSums | None = None,
    ) -> None:
        self.key = key
        self.offset = offset  # absolute offset in the pool: pool_address + offset is the first byte
        self.view: memoryview | None = view
        self.size = view.nbytes
        self.pinned = pinned
        self.released = False
        self.checksum = checksum  # what the writer committed (maru.checksum); None: not known
        self.session = session
        # The committed segment sums (``maru.segments``), when retrieved with ``segments=True`` and
        # the writer committed them; they add up to ``checksum`` (the server checked). None: a
        # reader verifies the whole object.
        self.segments = segments
        self._on_release = on_release

    @property
    def valid(self) -> bool:
        """Not released, and the session that pinned it is still alive (its view was not revoked)."""
        return not self.released and (self.session is None or self.session.alive)

    def verify(self) -> bool:
        """True iff ``valid`` and the bytes in ``view`` now match the committed checksum.

        Reads the whole object once (``maru.checksum``). An entry committed without a checksum
        cannot be verified: False.
        """
        if not self.valid or self.checksum is None or self.view is None:
            return False
        return _checksum(self.view) == self.checksum

    def check(self) -> None:
        """Raise ``StaleViewError`` if the view was revoked or released, ``IntegrityError`` if the
        bytes do not match the committed checksum (or none was committed); else return."""
        if not self.valid:
            raise StaleViewError(
                f"view of key {self.key!r} was {'released' if self.released else 'revoked'}: "
                "this client's session with the server was lost; retrieve the key again"
            )
        if not self.verify():
            raise IntegrityError(
                f"bytes of key {self.key!r} at offset {self.offset} do not match "
                + (
                    "any checksum (none was committed)"
                    if self.checksum is None
                    else "their committed checksum"
                )
                + "; treat it as a miss"
            )

    def __repr__(self) -> str:
        state = "released" if self.released else ("pinned" if self.pinned else "unpinned")
        return f"Retrieved(key={self.key!r}, offset={self.offset}, size={self.size}, {state})"

    def release(self) -> None:
        """Unpin the entry (if pinned) and release ``view``. Safe to call twice."""
        if self.released:
            return
        self.released = True
        _release_view(self.view)
        self.view = None
        if self._on_release is not None:
            cb, self._on_release = self._on_release, None
            cb(self)

    def tobytes(self) -> bytes:
        """A copy of the entry's bytes (convenience; the zero-copy way is ``view``)."""
        if self.view is None:
            raise ValueError(f"retrieve handle of key {self.key!r} was released; retrieve the key again")
        return self.view.tobytes()

    def __enter__(self) -> Retrieved:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __len__(self) -> int:
        return self.size
