"""Configuration shared by the server, the client and the command line.

``parse_size`` turns "4G", "500M", "64KiB" or a plain integer into bytes (powers of 1024:
a memory pool is sized in binary units). ``MaruConfig`` holds the server's settings with
the embedded defaults; every field is also a ``maru server`` flag.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from maru.errors import ConfigError

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 5555
DEFAULT_SERVER_URL = f"tcp://{DEFAULT_HOST}:{DEFAULT_PORT}"
DEFAULT_POOL_SIZE = 1 << 30
DEFAULT_ALIGNMENT = 4096
DEFAULT_LEASE_TIMEOUT_S = 30.0
# Space of an expired lease on another host is reused this long after expiry (0: never by time).
DEFAULT_QUARANTINE_TIMEOUT_S = 600.0
DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_REQUEST_TIMEOUT_S = 5.0
DEFAULT_MAX_CLIENTS = 1024
# How a GPU layer-by-layer load reads the pool (``kv_ops.device_pipeline``, docs/gpu.md): auto is
# the direct kernel; copied, the copy engines (kv_ops.layer_copies); staged, per-chunk copies.
LAYER_PATHS = ("auto", "copied", "direct", "staged")

_UNITS = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 1 << 40,
    "TIB": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Return the number of bytes that ``value`` names.

    Accepts an int (bytes) or a string such as ``"4G"``, ``"500M"``, ``"1.5GiB"``, ``"4096"``.
    Units are binary (``1K == 1024``). Raises ``ConfigError`` naming the bad value.
    """
    if isinstance(value, bool):
        raise ConfigError(f"size must be a number of bytes or a string like '4G', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"size must not be negative, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(
            f"cannot parse size {value!r}: use a number with an optional unit "
            "K, M, G or T (binary), for example '4G' or '512M'"
        )
    n = float(m.group(1)) * _UNITS[m.group(2).upper()]
    return int(n)


def check_lease_timeout(value: float) -> float:
    """``value`` if it is a usable lease timeout in seconds (finite, positive); else ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"lease timeout must be a number of seconds, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(
            f"--lease-timeout {value} must be a finite number of seconds above 0 (for example 30): a "
            "silent client's reservations and pins are reclaimed after it"
        )
    return float(value)


def format_size(n: int | float) -> str:
    """Format a byte count the way ``parse_size`` reads it back, e.g. ``"4.0 GiB"``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def default_state_dir() -> Path:
    """Where the server keeps its SQLite state when ``--state-dir`` is not given."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "maru"


def default_pool_path(port: int = DEFAULT_PORT) -> str:
    """The emulated pool file used when no device is given (one per server port)."""
    return f"/dev/shm/maru-pool-{port}"


# After each request the server polls for the next one this long before it sleeps in the kernel:
# a request that lands on a sleeping server waits for its thread to be woken, which on a
# virtualised host cost more than the request itself (a lookup-and-pin round trip 0.95 ms inside a
# serving vLLM against 0.24 ms back to back, H200 host; with 0.5 ms between requests 288 -> 211 us
# at the p50 on this project's 2-core machine, bench/server_spin.py). Only where the host has the
# cores for it: a polling server takes one while requests keep coming.
DEFAULT_SPIN_US = 2000
MIN_CPUS_TO_SPIN = 8  # also the vLLM scheduler's reply polling (maru.vllm.config): each takes a core
MAX_SPIN_US = 100_000


def usable_cpus() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


@dataclass
class MaruConfig:
    """Settings of one ``maru server``. Defaults are the embedded single-machine setup."""

    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    pool_path: str | None = None  # None: emulated pool under /dev/shm
    pool_size: int = DEFAULT_POOL_SIZE
    state_dir: Path = field(default_factory=default_state_dir)
    lease_timeout_s: float = DEFAULT_LEASE_TIMEOUT_S
    quarantine_timeout_s: float = DEFAULT_QUARANTINE_TIMEOUT_S
    alignment: int = DEFAULT_ALIGNMENT
    max_object_size: int | None = None  # None: the whole usable pool
    metrics_port: int | None = None
    sysfs_root: str = "/sys"
    log_level: str = "INFO"
    # Authentication, tenants and limits (docs/security.md).
    curve_secret_key: str | None = None  # the server's .key_secret file: CURVE on
    allowed_clients: str | None = None  # a client .key file or a directory of them
    insecure: bool = False  # allow a non-loopback address without CURVE
    tenants: str | None = None  # JSON file: namespaces, rights per client key, quotas
    max_clients: int = DEFAULT_MAX_CLIENTS  # live leases at most
    group: str | None = None  # None: files 0600; a group name: files 0660 owned by that group
    key_index: bool = True  # publish the committed keys for round-trip-free EXISTS (maru.pool.key_index)
    spin_us: int | None = None  # None: DEFAULT_SPIN_US on MIN_CPUS_TO_SPIN cores or more, else 0

    def __post_init__(self) -> None:
        self.lease_timeout_s = check_lease_timeout(self.lease_timeout_s)
        if self.spin_us is not None and not 0 <= self.spin_us <= MAX_SPIN_US:
            raise ConfigError(f"--spin-us {self.spin_us} must be within 0..{MAX_SPIN_US} (0: never poll)")

    def resolved_spin_us(self, cpus: int | None = None) -> int:
        """How long the server polls for the next request before sleeping (``spin_us``, or the
        default for this host: ``cpus`` usable cores, this process's when None)."""
        if self.spin_us is not None:
            return self.spin_us
        return DEFAULT_SPIN_US if (cpus if cpus is not None else usable_cpus()) >= MIN_CPUS_TO_SPIN else 0

    @property
    def url(self) -> str:
        return f"tcp://{self.host}:{self.port}"

    def resolved_pool_path(self) -> str:
        return self.pool_path or default_pool_path(self.port)
