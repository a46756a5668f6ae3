"""The ``maru`` command: ``maru server | doctor | stats | demo | keys``.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``;
``SUBCOMMANDS`` wires them up (add one there). Those modules import their heavy dependencies
(zmq, rich, torch, vLLM) inside ``run``, so ``maru --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from maru import __version__

# name -> (module with add_arguments/run, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "server": (
        "maru.server.cli",
        "run the metadata server (owns the pool; default: emulated pool in /dev/shm)",
    ),
    "doctor": (
        "maru.cli.doctor",
        "check the server, the pool mapping and the optional components; say how to fix",
    ),
    "stats": ("maru.cli.stats", "live view of hits, misses, stores, evictions, bytes and pool use"),
    "demo": ("maru.cli.demo", "run Maru's main job end to end on the embedded default"),
    "keys": ("maru.cli.keys", "create CurveZMQ key pairs for an authenticated server and its clients"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maru", description="Maru: share KV cache between LLM serving instances through one memory pool."
    )
    parser.add_argument("--version", action="version", version=f"maru {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(importlib.import_module(args._module).run(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
