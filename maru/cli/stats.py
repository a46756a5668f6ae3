"""``maru stats``: a live view of one server's counters, pool use and rates.

Reads the STATS reply (no pool mapping needed, so it works from any host that reaches the
server). Rates are the counter deltas between two refreshes divided by the time between them.
The clients table lists the live clients and what each reports about itself (its ``info``: role,
data paths, slow paths; convention in ``maru.protocol``). ``--json`` prints the raw reply once.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

from maru import protocol
from maru.config import DEFAULT_SERVER_URL, format_size
from maru.errors import MaruError

# (label, counter, is_bytes): the rows of the counter table, in display order.
COUNTER_ROWS = [
    ("lookup hits", "hits", False),
    ("lookup misses", "misses", False),
    ("exists hits", "exists_hits", False),
    ("exists misses", "exists_misses", False),
    ("stores", "stores", False),
    ("duplicates (already present)", "duplicates", False),
    ("evictions", "evictions", False),
    ("bytes stored", "bytes_stored", True),
    ("bytes served", "bytes_served", True),
    ("reservations that did not fit", "reserve_failures", False),
    ("leases expired", "leases_expired", False),
    ("leases quarantined", "quarantines", False),
    ("quarantines released: holder dead", "quarantine_released_dead", False),
    ("quarantines released: holder fenced", "quarantine_released_fenced", False),
    ("quarantines released: timed out", "quarantine_released_timed_out", False),
    ("integrity failures (checksum mismatch)", "integrity_failures", False),
]


def fetch(url: str, timeout_s: float) -> dict[str, Any]:
    """One STATS reply from the server at ``url`` (raises a MaruError that says what to do)."""
    from maru.client.replies import error_from_reply
    from maru.client.rpc import RpcChannel

    ch = RpcChannel(url)
    try:
        reply = ch.request(protocol.Op.STATS, {"client_id": f"stats-{uuid.uuid4().hex[:12]}"}, timeout_s)
    finally:
        ch.close()
    if not reply.get("ok"):
        raise error_from_reply(protocol.Op.STATS, reply, url)
    return reply


def _hit_rate(hits: int, misses: int) -> str:
    return f"{100 * hits / (hits + misses):.1f}%" if hits + misses else "-"


def render(snap: dict[str, Any], prev: dict[str, Any] | None, dt: float | None) -> Any:
    """A rich renderable of one snapshot (with per-second rates when ``prev`` is given)."""
    from rich.console import Group
    from rich.table import Table

    c, g = snap["counters"], snap["gauges"]
    pc = prev["counters"] if prev else None
    counters = Table(title="counters (since server start)", title_justify="left")
    counters.add_column("counter")
    counters.add_column("total", justify="right")
    counters.add_column("per second", justify="right")
    for label, name, is_bytes in COUNTER_ROWS:
        total = int(c.get(name, 0))
        rate = "-"
        if pc is not None and dt:
            r = (total - int(pc.get(name, 0))) / dt
            rate = f"{format_size(r)}/s" if is_bytes else f"{r:,.1f}"
        counters.add_row(label, format_size(total) if is_bytes else f"{total:,}", rate)
    hits, misses = int(c.get("hits", 0)), int(c.get("misses", 0))
    recent = "-"
    if pc is not None:
        recent = _hit_rate(hits - int(pc.get("hits", 0)), misses - int(pc.get("misses", 0)))
    counters.add_row("hit rate (lookups)", _hit_rate(hits, misses), recent)

    data = max(1, int(g["pool_data_bytes"]))
    pool = Table(title="pool", title_justify="left")
    pool.add_column("gauge")
    pool.add_column("value", justify="right")
    used = int(g["pool_used_bytes"])
    pool.add_row("used", f"{format_size(used)} ({100 * used / data:.1f}%)")
    pool.add_row("free", format_size(int(g["pool_free_bytes"])))
    pool.add_row("largest free extent", format_size(int(g["pool_largest_free_bytes"])))
    pool.add_row("reserved (not yet stored)", format_size(int(g["pool_reserved_bytes"])))
    pool.add_row("entries", f"{int(g['entries']):,}")
    pool.add_row("pinned entries", f"{int(g['pinned_entries']):,}")
    if "quarantined_bytes" in g:  # absent from older servers
        pool.add_row(
            "quarantined (expired holders)",
            f"{format_size(int(g['quarantined_bytes']))} in {int(g['quarantined_extents']):,} extents, "
            f"{int(g['quarantined_clients']):,} clients",
        )
    pool.add_row("clients", f"{int(g['clients']):,}")
    ki = snap.get("key_index")
    if isinstance(ki, dict):  # absent from older servers
        pool.add_row("key index (EXISTS without a round trip)", _key_index_text(ki))
    if "spin_us" in snap:  # absent from older servers
        us = int(snap["spin_us"])
        pool.add_row(
            "polls for the next request",
            f"{us} us before sleeping (--spin-us)"
            if us
            else "no: sleeps at once (--spin-us 0, or under 8 cores)",
        )
    header = (
        f"maru server {snap.get('url', '')}  pool {snap.get('pool_path', '?')} ({snap.get('pool_kind', '?')}, "
        f"{format_size(int(snap.get('pool_size', 0)))})  uptime {float(snap.get('uptime_s', 0)):.0f} s"
    )
    parts: list[Any] = [header, counters, pool]
    ops = render_service(snap)
    if ops is not None:
        parts.append(ops)
    clients = render_clients(snap)
    if clients is not None:
        parts.append(clients)
    return Group(*parts)


def render_service(snap: dict[str, Any]) -> Any:
    """Requests by op with the server's mean time on one (None for a server older than that).

    The server's time is decoding, handling and encoding; a client's round trip minus it is the
    transport, the server waking up, and the client itself (docs/server.md)."""
    from rich.table import Table

    from maru.server.stats import service_us

    rows = service_us(snap)
    if not rows:
        return None
    t = Table(title="requests by op (since server start)", title_justify="left")
    t.add_column("op")
    t.add_column("requests", justify="right")
    t.add_column("server time, mean", justify="right")
    for op, (n, us) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        t.add_row(op, f"{n:,}", f"{us:,.1f} us")
    return t


def _key_index_text(ki: dict[str, Any]) -> str:
    if not ki.get("on"):
        return f"off: {ki.get('why_off', '?')}"
    full = " FULL: clients ask the server" if ki.get("full") else ""
    keyed = ", keyed per namespace" if ki.get("keyed") else ""
    return f"{int(ki.get('keys', 0)):,} keys in {int(ki.get('slots', 0)):,} slots{keyed}{full}"


def _info_cells(info: Any) -> tuple[str, str, str]:
    """(role, paths, slow) cells of one client's info; anything off-convention is shown as given."""
    if not isinstance(info, dict) or not info:
        return "-", "-", "-"
    role = str(info.get("role", "-"))
    paths = info.get("paths")
    if isinstance(paths, dict):
        paths_text = "\n".join(f"{k}={v}" for k, v in paths.items()) or "-"
    else:
        paths_text = "-" if paths is None else str(paths)
    extra = {k: v for k, v in info.items() if k not in ("role", "paths", "slow")}
    if extra:
        paths_text += "\n" + "\n".join(f"{k}={v}" for k, v in extra.items())
    slow = slow_reports(info)
    return role, paths_text, "\n".join(slow) if slow else "none"


def slow_reports(info: Any) -> list[str]:
    """The ``slow`` sentences of one client's info (convention in ``maru.protocol``)."""
    if not isinstance(info, dict):
        return []
    slow = info.get("slow")
    if not slow:
        return []
    return [str(x) for x in slow] if isinstance(slow, list) else [str(slow)]


def render_clients(snap: dict[str, Any]) -> Any:
    """A rich table of the live clients (None when the server is too old to list them)."""
    from rich.markup import escape
    from rich.table import Table

    clients = snap.get("clients")
    if clients is None:
        return None
    total = int(snap.get("clients_total", len(clients)))
    title = f"clients ({total} live)"
    if snap.get("clients_truncated"):
        title += f", showing the first {len(clients)} (those reporting info first)"
    table = Table(title=title, title_justify="left")
    table.add_column("client")
    table.add_column("host:pid")
    table.add_column("age / idle", justify="right")
    table.add_column("role")
    table.add_column("data paths", overflow="fold")
    table.add_column("slow paths (reason, fix)", overflow="fold")
    for c in clients:
        role, paths, slow = _info_cells(c.get("info"))
        # What clients report is text, never markup ("maru[gpu]" must print as it is).
        table.add_row(
            escape(str(c.get("client_id", "?"))[:12]),
            escape(f"{c.get('host', '?')}:{c.get('pid', '?')}"),
            f"{float(c.get('age_s', 0)):.0f} s / {float(c.get('idle_s', 0)):.1f} s",
            escape(role),
            escape(paths),
            f"[yellow]{escape(slow)}[/]" if slow not in ("-", "none") else slow,
        )
    return table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_SERVER_URL, help=f"server URL (default {DEFAULT_SERVER_URL})"
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default 1)")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per request (default 3)")
    parser.add_argument(
        "--json", action="store_true", help="print one raw STATS reply as JSON (with the clients) and exit"
    )


def run(args: argparse.Namespace) -> int:
    from rich.live import Live

    from maru.cli.console import make_console

    console = make_console()
    if args.interval <= 0:
        console.print(f"[red]--interval must be > 0, got {args.interval}[/]")
        return 2
    try:
        snap = fetch(args.url, args.timeout)
    except MaruError as e:
        console.print(f"[bold red]maru stats: {e}[/]")
        return 1
    if args.json:
        snap.pop("ok", None)
        print(json.dumps(snap, indent=2, sort_keys=True))
        return 0
    if args.once:
        console.print(render(snap, None, None))
        return 0
    prev, t_prev = snap, time.monotonic()
    try:
        with Live(render(snap, None, None), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                try:
                    snap = fetch(args.url, args.timeout)
                except MaruError as e:
                    live.update(f"[bold red]{e}[/] (retrying every {args.interval:g} s; Ctrl-C to quit)")
                    continue
                now = time.monotonic()
                live.update(render(snap, prev, now - t_prev))
                prev, t_prev = snap, now
    except KeyboardInterrupt:
        return 0
