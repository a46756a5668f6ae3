"""``maru keys``: create and show CurveZMQ key pairs for ``maru server`` and its clients.

``maru keys generate --out DIR --name NAME`` writes ``DIR/NAME.key`` (public: copy it to the other
side) and ``DIR/NAME.key_secret`` (mode 0600: stays on this host). ``maru keys show FILE`` prints
the z85 public key of a key file. See docs/security.md for the two-host setup.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keys_command", metavar="ACTION")
    gen = sub.add_parser("generate", help="write a new key pair NAME.key and NAME.key_secret (0600)")
    gen.add_argument("--out", required=True, metavar="DIR", help="directory to write the key files to")
    gen.add_argument("--name", default="maru", help="file name stem, e.g. server or host-b (default maru)")
    show = sub.add_parser("show", help="print the z85 public key of a .key or .key_secret file")
    show.add_argument("file", metavar="FILE")


def run(args: argparse.Namespace) -> int:
    from maru.errors import ConfigError
    from maru.server.auth import load_public_key, write_key_pair

    try:
        if args.keys_command == "generate":
            public, secret = write_key_pair(Path(args.out), args.name)
            print(f"public key  {public}  ({load_public_key(public).decode()})")
            print(f"secret key  {secret}  (mode 0600; keep it on this host)")
            return 0
        if args.keys_command == "show":
            print(load_public_key(args.file).decode())
            return 0
    except ConfigError as e:
        print(f"maru keys: error: {e}", file=sys.stderr)
        return 2
    print("maru keys: say what to do: generate or show (maru keys --help)", file=sys.stderr)
    return 2
