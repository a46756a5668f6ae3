"""``python -m maru.native``: build (or find) the compiled checksum and the compiled store issue,
and say which runs."""

from __future__ import annotations

import sys

from maru import native


def main() -> int:
    nat = native.load()
    if nat.words_sum is None:
        print(f"maru: compiled checksum unavailable: {nat.reason}\n  fix: {nat.fix}", file=sys.stderr)
        return 1
    print(f"maru: compiled checksum ready: {nat.library}")
    from maru.native import store_issue

    issue = store_issue.load()
    if issue.issue is None:  # opt-in (MARU_NATIVE_STORE_ISSUE): said, not a failure of the checksum
        print(f"maru: compiled store issue unavailable: {issue.reason}", file=sys.stderr)
    else:
        print(
            f"maru: compiled store issue ready: {issue.issue.library} (used with MARU_NATIVE_STORE_ISSUE=1)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
