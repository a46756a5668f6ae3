"""``maru server`` / ``python -m maru.server``: flags and the entry point.

``add_arguments(parser)`` adds the flags to any argparse parser (the ``maru`` command wires its
``server`` subcommand to it); ``run(args)`` starts the server and returns the exit code:
0 after a clean stop (SIGTERM/SIGINT), 2 for a configuration or pool error (message on stderr).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from maru.config import (
    DEFAULT_HOST,
    DEFAULT_LEASE_TIMEOUT_S,
    DEFAULT_MAX_CLIENTS,
    DEFAULT_POOL_SIZE,
    DEFAULT_PORT,
    DEFAULT_QUARANTINE_TIMEOUT_S,
    DEFAULT_SPIN_US,
    MIN_CPUS_TO_SPIN,
    MaruConfig,
    check_lease_timeout,
    default_pool_path,
    default_state_dir,
    format_size,
    parse_size,
)
from maru.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``maru server`` flags to ``parser``."""
    parser.add_argument(
        "--pool-path",
        metavar="PATH",
        help=f"DAX device (/dev/daxX.Y) or pool file; default: an emulated pool {default_pool_path(0)[:-1]}<port>",
    )
    parser.add_argument(
        "--pool-size",
        metavar="SIZE",
        help=f"size of a new pool file, e.g. 4G (default {format_size(DEFAULT_POOL_SIZE)}); an existing pool "
        "keeps its size; a DAX device's size comes from sysfs",
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"TCP port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--state-dir",
        metavar="DIR",
        help=f"where the SQLite state lives (default {default_state_dir()}/<port>)",
    )
    parser.add_argument(
        "--lease-timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_LEASE_TIMEOUT_S,
        help=f"a client silent this long loses its reservations and pins (default {DEFAULT_LEASE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--quarantine-timeout",
        metavar="SECONDS",
        type=float,
        default=DEFAULT_QUARANTINE_TIMEOUT_S,
        help="space of an expired lease is reused only once its holder is known dead or fenced, or this "
        f"long after expiry (0: never by time; default {DEFAULT_QUARANTINE_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--max-object-size",
        metavar="SIZE",
        help="largest object a client may reserve (default: the whole pool)",
    )
    parser.add_argument(
        "--alignment",
        metavar="SIZE",
        help="allocation unit of a new pool (power of two; default 4K for a file, the device align for DAX)",
    )
    parser.add_argument(
        "--group",
        metavar="NAME",
        help="make the pool file and the state files 0660 and owned by this group (default: 0600, owner only)",
    )
    parser.add_argument(
        "--metrics-port", type=int, metavar="PORT", help="serve Prometheus metrics on 127.0.0.1:PORT"
    )
    sec = parser.add_argument_group("authentication, tenants and limits (docs/security.md)")
    sec.add_argument(
        "--curve-secret-key",
        metavar="FILE",
        help="the server's .key_secret file (`maru keys generate`): CurveZMQ encryption and client keys",
    )
    sec.add_argument(
        "--allowed-clients",
        metavar="FILE_OR_DIR",
        help="client public .key file, or a directory of them: only these keys may connect",
    )
    sec.add_argument(
        "--tenants",
        metavar="FILE",
        help="JSON file of namespaces, rights per client key and quotas (needs --curve-secret-key)",
    )
    sec.add_argument(
        "--insecure",
        action="store_true",
        help="allow a non-loopback --host without authentication (any host that reaches it has full access)",
    )
    sec.add_argument(
        "--max-clients",
        metavar="N",
        type=int,
        default=DEFAULT_MAX_CLIENTS,
        help=f"most live client leases; more handshakes get too_many_clients (default {DEFAULT_MAX_CLIENTS})",
    )
    parser.add_argument(
        "--no-key-index",
        dest="key_index",
        action="store_false",
        help="do not publish the committed keys in shared memory: every client EXISTS (the vLLM "
        "scheduler's prefix probe) is then a round trip to this server",
    )
    parser.add_argument(
        "--spin-us",
        type=int,
        default=None,
        help="after each request, poll for the next one this many microseconds before sleeping: a "
        "request to a sleeping server waits for its thread to wake (0: never poll; default "
        f"{DEFAULT_SPIN_US} on a host of {MIN_CPUS_TO_SPIN} cores or more, else 0)",
    )
    parser.add_argument(
        "--sysfs-root", default="/sys", help="where sysfs is mounted (default /sys; tests fake it)"
    )
    parser.add_argument(
        "--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="default INFO"
    )


def config_from_args(args: argparse.Namespace) -> tuple[MaruConfig, int | None, int | None]:
    """Build the config; returns ``(config, pool_size or None, alignment or None)``."""
    if not 0 < args.port < 65536:
        raise ConfigError(f"--port {args.port} is not a TCP port (1-65535)")
    check_lease_timeout(args.lease_timeout)
    if args.quarantine_timeout < 0:
        raise ConfigError(f"--quarantine-timeout {args.quarantine_timeout} must be 0 (never) or positive")
    if args.max_clients < 1:
        raise ConfigError(f"--max-clients {args.max_clients} must be at least 1")
    pool_size = parse_size(args.pool_size) if args.pool_size is not None else None
    alignment = parse_size(args.alignment) if args.alignment is not None else None
    state_dir = Path(args.state_dir) if args.state_dir else default_state_dir() / str(args.port)
    cfg = MaruConfig(
        host=args.host,
        port=args.port,
        pool_path=args.pool_path,
        pool_size=pool_size or DEFAULT_POOL_SIZE,
        state_dir=state_dir,
        lease_timeout_s=args.lease_timeout,
        quarantine_timeout_s=args.quarantine_timeout,
        max_object_size=parse_size(args.max_object_size) if args.max_object_size else None,
        metrics_port=args.metrics_port,
        sysfs_root=args.sysfs_root,
        log_level=args.log_level,
        curve_secret_key=args.curve_secret_key,
        allowed_clients=args.allowed_clients,
        insecure=args.insecure,
        tenants=args.tenants,
        max_clients=args.max_clients,
        group=args.group,
        key_index=args.key_index,
        spin_us=args.spin_us,
    )
    if alignment is not None:
        cfg.alignment = alignment
    # A new emulated pool without --pool-size gets the default size; an existing one keeps its own.
    import os

    from maru.pool.backing import is_dax_path

    path = cfg.resolved_pool_path()
    if pool_size is None and not is_dax_path(path) and not os.path.exists(path):
        pool_size = DEFAULT_POOL_SIZE
    return cfg, pool_size, alignment


def run(args: argparse.Namespace) -> int:
    """Run ``maru server`` with parsed ``args``; returns the process exit code."""
    logging.basicConfig(
        level=getattr(logging, args.log_level, logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    from maru.server.server import run_server

    try:
        cfg, pool_size, alignment = config_from_args(args)
    except ConfigError as e:
        print(f"maru server: error: {e}", file=sys.stderr, flush=True)
        return 2
    return run_server(cfg, pool_size, alignment)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="maru server", description="Run the Maru metadata server.")
    add_arguments(parser)
    return run(parser.parse_args(argv))
