"""Who may open the files Maru creates: the owner only, or the owner and one named group.

``FileAccess()`` gives files 0600 and directories 0700; ``FileAccess.for_group("maru")`` gives
files 0660 and directories 0770 owned by that group (for clients that run as other users of the
group). Modes are set with ``fchmod`` after creation, so the umask cannot widen or narrow them.
"""

from __future__ import annotations

import grp
import os
from dataclasses import dataclass

from maru.errors import ConfigError, PoolError


@dataclass(frozen=True)
class FileAccess:
    """The mode and group of every file the server creates (pool file, state database, locks)."""

    gid: int | None = None  # None: owner only
    group: str | None = None  # the name given, for messages

    @classmethod
    def for_group(cls, name: str | None) -> FileAccess:
        """Owner-only for None; else owner and group ``name`` (a group name or a numeric gid)."""
        if not name:
            return cls()
        try:
            gid = grp.getgrnam(name).gr_gid
        except KeyError:
            if not name.isdigit():
                raise ConfigError(
                    f"--group {name!r}: no such group on this host; create it or name an existing one"
                ) from None
            gid = int(name)
        return cls(gid, name)

    @property
    def file_mode(self) -> int:
        return 0o600 if self.gid is None else 0o660

    @property
    def dir_mode(self) -> int:
        return 0o700 if self.gid is None else 0o770

    def apply_fd(self, fd: int, path: str) -> None:
        """Give the open file ``fd`` (named ``path`` in errors) this mode and group."""
        try:
            if self.gid is not None:
                os.fchown(fd, -1, self.gid)
            os.fchmod(fd, self.file_mode)
        except OSError as e:
            raise PoolError(self._failure(path, e)) from None

    def apply(self, path: str, directory: bool = False) -> None:
        """Give the existing file (or directory) ``path`` this mode and group."""
        try:
            if self.gid is not None:
                os.chown(path, -1, self.gid)
            os.chmod(path, self.dir_mode if directory else self.file_mode)
        except OSError as e:
            raise PoolError(self._failure(path, e)) from None

    def _failure(self, path: str, e: OSError) -> str:
        if self.gid is not None:
            return (
                f"cannot give {path} mode {self.file_mode:o} and group {self.group}: {e.strerror}; "
                "run the server as a member of that group (or as its owner)"
            )
        return f"cannot make {path} mode {self.file_mode:o}: {e.strerror}"
