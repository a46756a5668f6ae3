"""``maru demo [vllm|objects]``: Maru's main job, end to end, on the embedded default.

The demos themselves live in ``maru.demo``; this module registers them in ``DEMOS`` and parses the
command line. ``DEFAULT_DEMO`` is what a bare ``maru demo`` runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable


def run_objects(args: argparse.Namespace) -> int:
    """Two processes share objects through maru server, no vLLM (maru.demo.objects)."""
    from maru.cli.console import make_console
    from maru.demo import objects

    return objects.run(make_console(), args.objects, args.max_size, seed=args.seed, port=args.port)


def run_vllm(args: argparse.Namespace) -> int:
    """Two vLLM instances share a long prompt's KV through Maru (maru.demo.two_instances)."""
    from maru.demo.two_instances import main as vllm_demo

    argv = ["--keep-logs"] if getattr(args, "keep_logs", False) else []
    if getattr(args, "port", None) is not None:
        argv += ["--port", str(args.port)]
    return vllm_demo(argv)


# Registered demos: name -> (help, runner).
DEMOS: dict[str, tuple[str, Callable[[argparse.Namespace], int]]] = {
    "vllm": ("two vLLM instances share a long prompt's KV cache through Maru", run_vllm),
    "objects": ("two processes share objects through maru server (no vLLM)", run_objects),
}
DEFAULT_DEMO = "vllm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "which",
        nargs="?",
        default=DEFAULT_DEMO,
        choices=sorted(DEMOS),
        help="; ".join(f"{k}: {v[0]}" for k, v in DEMOS.items()) + f" (default {DEFAULT_DEMO})",
    )
    parser.add_argument("--objects", type=int, default=256, help="objects to share (default 256)")
    parser.add_argument(
        "--max-size", type=int, default=1 << 20, help="largest object in bytes (default 1 MiB)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the object sizes (default 0)")
    parser.add_argument("--port", type=int, help="server port (default 5555, or a free one if that is busy)")
    parser.add_argument("--keep-logs", action="store_true", help="vllm demo: keep the engines' logs")


def run(args: argparse.Namespace) -> int:
    if args.which == "vllm":
        return DEMOS["vllm"][1](args)
    if args.objects <= 0 or args.max_size < 4096:
        print("maru demo: --objects must be > 0 and --max-size >= 4096", file=sys.stderr)
        return 2
    return DEMOS[args.which][1](args)
