"""Shared pytest fixtures."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ServerProcess


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip every test marked ``gpu`` where no CUDA device is visible (CI): one place, one reason.

    Select them on a GPU host with ``pytest -m gpu``.
    """
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on a GPU host)")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def maru_server(tmp_path: Path) -> Iterator[ServerProcess]:
    """A started ``maru server`` (64 MiB pool under /dev/shm, own port and state dir)."""
    server = ServerProcess(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


def _shm_in_use() -> tuple[set[str], set[int]]:
    """Names and inodes of /dev/shm files some live process still maps or holds open.

    Inodes matter: glibc's ``sem_open`` maps a temporary file and then links it under the final
    name (multiprocessing's ``sem.mp-*``), so the maps show the temporary name, never the final one.
    """
    names: set[str] = set()
    inodes: set[int] = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    if "/dev/shm/" in line:
                        names.add(line.rsplit("/dev/shm/", 1)[1].split()[0])
                        fields = line.split()
                        if len(fields) >= 5 and fields[4].isdigit():
                            inodes.add(int(fields[4]))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    names.add(target[len("/dev/shm/") :].split()[0])
                    try:
                        inodes.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
                    except OSError:
                        pass
        except OSError:
            continue
    return names, inodes


_LEAKY_PREFIXES = ("psm_", "sem.mp-", "maru-test-", "vllm_dist_")
_SHM_BEFORE = pytest.StashKey[set[str]]()


_SHM = "/dev/shm"


def _xdist_worker(config: pytest.Config) -> bool:
    """Whether this process is one of pytest-xdist's workers (``make test`` runs two)."""
    return hasattr(config, "workerinput")


def pytest_sessionstart(session: pytest.Session) -> None:
    if not _xdist_worker(session.config):
        session.config.stash[_SHM_BEFORE] = set(os.listdir(_SHM)) if os.path.isdir(_SHM) else set()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Remove shared-memory files the run's processes leaked into /dev/shm.

    vLLM's engine processes create ``psm_*`` ring buffers (hundreds of MiB each) that a killed
    engine never unlinks (and, with tensor parallelism on the CPU build, ``vllm_dist_*`` buffers),
    and a test server killed with SIGKILL leaves its pool file. Left
    alone they would eat the machine's memory run after run. Only files created during this
    run that no live process maps or holds open are removed.

    Runs once, in the process that ends last: pytest itself, or xdist's controller after every
    worker finished. A worker cleaning up when *it* ends would remove a pool file another worker
    keeps between two server starts (the crash and restart tests), which no process maps then.
    """
    if _xdist_worker(session.config) or not os.path.isdir(_SHM):
        return
    before = session.config.stash.get(_SHM_BEFORE, None)
    if before is None:
        return
    new = {n for n in os.listdir(_SHM) if n not in before and n.startswith(_LEAKY_PREFIXES)}
    if not new:
        return
    names, inodes = _shm_in_use()
    for name in new - names:
        path = os.path.join(_SHM, name)
        try:
            if os.stat(path).st_ino in inodes:
                continue  # mapped under another name (a semaphore of a live process)
            os.unlink(path)
        except OSError:
            pass
