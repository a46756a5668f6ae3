"""The server's exclusive hold on its pool and state dir (one server per pool)."""

from __future__ import annotations

import errno
import fcntl
import os

from maru.errors import PoolError
from maru.pool.perms import FileAccess


class FileLock:
    """An exclusive, non-blocking flock held for the server's lifetime (one server per pool/state).

    ``create``: make the lock file if it is missing, with that access (``created`` says whether
    this call made it); None: the file must exist (the pool itself).
    """

    def __init__(self, path: str, what: str, create: FileAccess | None = None) -> None:
        self.path = path
        self.created = False
        if create is None:
            self.fd = os.open(path, os.O_RDONLY)
        else:
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o600)
                self.created = True
            except FileExistsError:
                self.fd = os.open(path, os.O_RDONLY)
            try:
                create.apply_fd(self.fd, path)
            except BaseException:
                self._give_up()
                raise
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.ENOTSUP, errno.EINVAL):
                return  # a filesystem without flock: nothing to hold
            self._give_up()
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise PoolError(
                    f"{what} {path} is in use by another maru server; stop it, or give this one its own "
                    f"--pool-path and --state-dir"
                ) from None
            raise

    def _give_up(self) -> None:
        os.close(self.fd)
        if self.created:
            os.unlink(self.path)
            self.created = False

    def close(self) -> None:
        os.close(self.fd)
