"""Maru's exception hierarchy.

Every failure a user can meet is one of these, and every message says what happened,
with which value, and what to do about it. Nothing in Maru raises a bare ``Exception``
across a public API, and no call blocks without a timeout.
"""

from __future__ import annotations


class MaruError(Exception):
    """Base class of every error Maru raises on purpose."""


class ConfigError(MaruError):
    """A configuration value is malformed or inconsistent (bad size string, unknown key)."""


class PoolError(MaruError):
    """The memory pool cannot be created, opened, validated or mapped."""


class PoolFullError(PoolError):
    """No space can be reserved, even after evicting every unpinned entry."""


class ProtocolError(MaruError):
    """A frame is malformed, of the wrong version, or too large."""


class ServerError(MaruError):
    """The server answered a request with an error.

    ``code`` is the machine-readable error code from the reply (see ``maru.protocol.ErrorCode``).
    """

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code


class NotConnectedError(MaruError):
    """The client could not reach the server (refused, unreachable, or not yet started)."""


class MaruTimeoutError(MaruError, TimeoutError):
    """A request got no reply within its timeout. The server may be down or overloaded."""


class HandlerClosedError(MaruError):
    """The handler was closed; create a new ``MaruHandler``."""


class UnsupportedLayout(MaruError):
    """A KV-cache tensor's shape or strides match no layout Maru knows.

    Maru refuses it rather than guessing: a wrong guess writes scrambled KV that
    still "works". The message names the shape, the strides and what was expected.
    """


class BackendUnavailable(MaruError):
    """A requested kernel backend (for example ``"triton"``) cannot run here."""


class StaleAllocationError(MaruError):
    """An object reserved with ``alloc`` can no longer be stored.

    Its reservation was lost: the server restarted, or this client's lease expired, since
    ``alloc``. Nothing was published under its key. Call ``alloc`` again and rewrite the bytes.
    """


class StaleViewError(MaruError):
    """A retrieved view was revoked: its handler's session with the server was lost (the lease
    expired while the process was stalled, or the server restarted). Retrieve the key again."""


class IntegrityError(MaruError):
    """An object's bytes do not match the checksum its writer committed: another process wrote
    into its space. The object is treated as a miss (and reported to the server)."""


# The errors after which the server is to be taken as gone (reconnect before the next call).
CONNECTION_LOST: tuple[type[MaruError], ...] = (NotConnectedError, MaruTimeoutError, HandlerClosedError)
