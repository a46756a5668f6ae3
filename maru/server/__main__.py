"""``python -m maru.server [flags]``: the same as ``maru server``."""

from __future__ import annotations

import sys

from maru.server.cli import main

if __name__ == "__main__":
    sys.exit(main())
