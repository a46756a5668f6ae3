"""Fixtures of the server tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

STATE_FS_SIZE = "2m"


@pytest.fixture
def small_state_fs(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs mounted for the state dir (skips where mounting is not permitted)."""
    mnt = tmp_path / "statefs"
    mnt.mkdir()
    try:
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={STATE_FS_SIZE}", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
    except FileNotFoundError:
        pytest.skip("cannot mount a small tmpfs for the state dir: no mount command on this host")
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs for the state dir (needs root): {res.stderr.strip()}")
    try:
        yield mnt
    finally:
        # Lazy: a server killed a moment ago may not have released its files yet.
        subprocess.run(["umount", "-l", str(mnt)], check=False)
