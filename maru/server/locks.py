"""The server's exclusive hold on its pool and state dir (one server per pool)."""

from __future__ import annotations

import errno
import fcntl
import os

from maru.errors import PoolError


class FileLock:
    """An exclusive, non-blocking flock held for the server's lifetime (one server per pool/state)."""

    def __init__(self, path: str, what: str) -> None:
        self.fd = (
            os.open(path, os.O_RDONLY | os.O_CREAT, 0o600) if what == "state" else os.open(path, os.O_RDONLY)
        )
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self.fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PoolError(
                    f"{what} {path} is in use by another maru server; stop it, or give this one its own "
                    f"--pool-path and --state-dir"
                ) from None
            if e.errno not in (errno.ENOTSUP, errno.EINVAL):
                raise

    def close(self) -> None:
        os.close(self.fd)
