"""Where this process runs, as the server needs to know it: the kernel's boot id, the PID
namespace and a process's start time. Two processes with the same boot id and PID namespace see
the same /proc, so one can tell whether the other (pid + start time) is still alive."""

from __future__ import annotations

import os


def read_boot_id() -> str:
    """This kernel's boot id ('' where there is none): equal on two processes of one running kernel."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def read_pid_ns() -> str:
    """This process's PID namespace (e.g. 'pid:[4026531836]'); '' where unknown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def process_start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/<pid>/stat); None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ')'.
    fields = stat[stat.rfind(b")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None
