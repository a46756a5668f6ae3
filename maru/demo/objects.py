"""Two processes share objects through one pool, without vLLM (``maru demo objects``).

Starts an embedded ``maru server``, then process A stores N objects of random bytes and process B,
a separate process, retrieves them through its own mapping of the pool and checks every SHA-256.
Prints a table, stops the server and removes the pool file.

This module is also the two worker processes: ``python -m maru.demo.objects write|read URL ...``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
import time
from typing import Any

from maru.config import format_size
from maru.demo.server import EmbeddedServer
from maru.errors import MaruError

BATCH = 64


# -- the two worker processes ---------------------------------------------------------------------


def _write(url: str, count: int, seed: int, max_size: int) -> dict[str, Any]:
    from maru import MaruHandler

    rng = random.Random(seed)
    sizes = [rng.randint(4096, max_size) for _ in range(count)]
    datas = [os.urandom(s) for s in sizes]  # made before timing: the demo times Maru, not urandom
    keys = [f"demo/{seed}/{i}" for i in range(count)]
    with MaruHandler(url) as h:
        t0 = time.perf_counter()
        for i in range(0, count, BATCH):
            objs = h.batch_alloc(sizes[i : i + BATCH])
            for o, d in zip(objs, datas[i : i + BATCH], strict=True):
                o.buf[:] = d  # straight into the shared pool: the only copy
            h.batch_store(keys[i : i + BATCH], objs)
        seconds = time.perf_counter() - t0
    return {
        "sha256": {k: hashlib.sha256(d).hexdigest() for k, d in zip(keys, datas, strict=True)},
        "bytes": sum(sizes),
        "seconds": seconds,
        "pid": os.getpid(),
    }


def _read(url: str, expected: dict[str, str]) -> dict[str, Any]:
    from maru import MaruHandler

    keys = list(expected)
    matched, mismatched, missing, nbytes = 0, [], [], 0
    with MaruHandler(url) as h:
        t0 = time.perf_counter()
        for i in range(0, len(keys), BATCH):
            chunk = keys[i : i + BATCH]
            handles = h.batch_retrieve(chunk)  # pinned while we read
            for k, r in zip(chunk, handles, strict=True):
                if r is None:
                    missing.append(k)
                    continue
                nbytes += r.size
                if hashlib.sha256(r.view).hexdigest() == expected[k]:  # hashes the pool memory itself
                    matched += 1
                else:
                    mismatched.append(k)
            h.batch_release(handles)
        seconds = time.perf_counter() - t0
    return {
        "matched": matched,
        "mismatched": mismatched,
        "missing": missing,
        "bytes": nbytes,
        "seconds": seconds,
        "pid": os.getpid(),
    }


def _worker_main(argv: list[str]) -> int:
    if argv[:1] == ["write"]:
        url, count, seed, max_size = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        print(json.dumps(_write(url, count, seed, max_size)))
        return 0
    if argv[:1] == ["read"]:
        print(json.dumps(_read(argv[1], json.load(sys.stdin))))
        return 0
    print(
        "usage: python -m maru.demo.objects write URL COUNT SEED MAX_SIZE | read URL < expected.json",
        file=sys.stderr,
    )
    return 2


def _run_worker(args: list[str], stdin: str | None = None) -> dict[str, Any]:
    p = subprocess.run(
        [sys.executable, "-m", "maru.demo.objects", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if p.returncode != 0:
        raise MaruError(
            f"demo worker `{' '.join(args[:2])}` failed (exit {p.returncode}):\n{p.stderr.strip()}"
        )
    return json.loads(p.stdout.strip().splitlines()[-1])


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"


def run(console: Any, count: int, max_size: int, seed: int = 0, port: int | None = None) -> int:
    """Run the demo, printing through the rich ``console``; 0 when every object read back identical."""
    from rich.table import Table

    pool = max(64 << 20, 2 * count * max_size)  # room for every object, never evicting
    server = EmbeddedServer(port=port, pool_size=str(pool))
    try:
        with console.status("starting maru server"):
            server.start()
        console.print(f"[dim]{server.ready_line}[/]")
        with console.status(f"process A: storing {count} objects"):
            wrote = _run_worker(["write", server.url, str(count), str(seed), str(max_size)])
        with console.status(f"process B: retrieving {count} objects"):
            read = _run_worker(["read", server.url], stdin=json.dumps(wrote["sha256"]))
    except MaruError as e:
        console.print(f"[bold red]maru demo: {e}[/]")
        return 1
    finally:
        server.cleanup()
    ok = read["matched"] == count and not read["mismatched"] and not read["missing"]
    table = Table(title="maru demo objects: two processes share objects through one pool")
    table.add_column("")
    table.add_column(f"process A (pid {wrote['pid']}): store", justify="right")
    table.add_column(f"process B (pid {read['pid']}): retrieve", justify="right")
    table.add_row("objects", f"{count}", f"{read['matched'] + len(read['mismatched'])}")
    table.add_row("bytes", format_size(wrote["bytes"]), format_size(read["bytes"]))
    table.add_row(
        "throughput", _rate(wrote["bytes"], wrote["seconds"]), _rate(read["bytes"], read["seconds"])
    )
    table.add_row("SHA-256", "of the bytes written", "all match" if ok else "MISMATCH")
    console.print(table)
    if ok:
        console.print(
            f"[green]all {count} objects read back identical by another process; "
            f"pool {server.pool_path} removed, server stopped[/]"
        )
        return 0
    console.print(
        f"[bold red]{len(read['mismatched'])} objects differ, {len(read['missing'])} missing "
        f"(e.g. {(read['mismatched'] + read['missing'])[:3]})[/]"
    )
    return 1


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
