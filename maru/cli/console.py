"""The rich console every ``maru`` subcommand prints through."""

from __future__ import annotations

import sys
from typing import Any


def make_console() -> Any:
    """A rich Console; wide when not on a terminal, so logs and tests do not get lines folded."""
    from rich.console import Console

    return Console() if sys.stdout.isatty() else Console(width=200)
