"""A client process for the stalled-client tests (``python -m tests.client.stall_child ROLE URL ...``).

Roles (each prints one JSON line per step on stdout and reads its cue lines from stdin):

- ``writer URL SIZE MODE``: reserves SIZE bytes, prints ``{"offset": ...}``, keeps a view of the
  reservation the way a writer thread does (MODE ``buf``: a slice of ``obj.buf``; ``numpy``: a
  numpy array over it), waits for a line on stdin, then writes 0xEE through that view for
  ``WRITE_S`` seconds (as a writer that resumed from a stall would), tries to store, prints the
  outcome and its integrity counters.
- ``reader URL KEY``: retrieves KEY (pinned, verified), prints ``{"ready": true}``, waits for a
  line, then for ``WRITE_S`` seconds copies the bytes out of the view it holds and asks the
  handle whether they can be trusted (``verify()``); prints every distinct (trusted, sha256).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import numpy as np

from maru.client import MaruHandler
from maru.errors import StaleAllocationError

WRITE_S = 3.0


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def writer(url: str, size: int, mode: str) -> None:
    h = MaruHandler(url, heartbeat_interval_s=0.2)
    obj = h.alloc(size)
    view = obj.buf[:] if mode == "buf" else np.frombuffer(obj.buf, dtype=np.uint8)
    say(offset=obj.offset)
    sys.stdin.readline()
    junk = b"\xee" * size
    writes = 0
    end = time.monotonic() + WRITE_S
    while time.monotonic() < end:
        if mode == "buf":
            view[:] = junk
        else:
            view[:] = 0xEE
        writes += 1
        time.sleep(0.005)
    try:
        h.store("written-by-the-stalled-writer", obj)
        outcome = "stored"
    except StaleAllocationError:
        outcome = "stale"
    say(outcome=outcome, writes=writes, integrity=h.integrity())
    h.close()


def reader(url: str, key: str) -> None:
    h = MaruHandler(url, heartbeat_interval_s=0.2)
    r = h.retrieve(key)
    assert r is not None, key
    arr = np.frombuffer(r.view, dtype=np.uint8)  # the view a reader keeps while it works
    say(ready=True)
    sys.stdin.readline()
    # Read through the held view again and again from the moment the process runs again, asking
    # each time whether the copy can be trusted: before and after the handler notices its lost session.
    samples: set[tuple[bool, str]] = set()
    end = time.monotonic() + WRITE_S
    while time.monotonic() < end:
        copied = arr.tobytes()
        samples.add((r.verify(), hashlib.sha256(copied).hexdigest()))
    say(samples=sorted(samples), valid=r.valid, integrity=h.integrity())
    del arr
    h.close()


if __name__ == "__main__":
    role, url = sys.argv[1], sys.argv[2]
    if role == "writer":
        writer(url, int(sys.argv[3]), sys.argv[4])
    else:
        reader(url, sys.argv[3])
