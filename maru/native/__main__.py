"""``python -m maru.native``: build (or find) the compiled checksum, and say whether it runs."""

from __future__ import annotations

import sys

from maru import native


def main() -> int:
    nat = native.load()
    if nat.words_sum is None:
        print(f"maru: compiled checksum unavailable: {nat.reason}\n  fix: {nat.fix}", file=sys.stderr)
        return 1
    print(f"maru: compiled checksum ready: {nat.library}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
