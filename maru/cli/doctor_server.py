"""``maru doctor``'s checks of the server's own health, from its STATS: the state disk, the key
index, quarantined space, and what the serving clients report (warn only: the server serves, but
less than it could)."""

from __future__ import annotations

import os

from maru.cli.doctor_base import OK, SKIP, WARN, CheckResult, DoctorContext, stats_for, stats_section
from maru.config import format_size
from maru.errors import MaruError


def check_state_disk(ctx: DoctorContext) -> CheckResult:
    """Does the server's state database take writes? A full disk refuses stores (``state_unwritable``)."""
    name = "server state disk"
    state = stats_section(ctx, name, "state", "its state disk")
    if isinstance(state, CheckResult):
        return state
    path = state.get("path", "?")
    if state.get("writable", True):
        return CheckResult(name, OK, f"{path} takes writes")
    return CheckResult(
        name,
        WARN,
        f"the state database {path} refuses writes ({state.get('error') or 'no error text'}): every store "
        "and delete is refused with state_unwritable, so nothing new is shared; lookups, loads and "
        "heartbeats still work",
        f"free space on the filesystem of {os.path.dirname(path) or path} (or move --state-dir to a "
        "larger disk and restart); the server retries by itself and resumes writes without a restart "
        "(docs/reliability.md, A full state disk)",
    )


def check_key_index(ctx: DoctorContext) -> CheckResult:
    """Can clients answer EXISTS (vLLM's prefix probe of each new request) without a round trip?"""
    name = "key index"
    ki = stats_section(ctx, name, "key_index", "a key index")
    if isinstance(ki, CheckResult):
        return ki
    if not ki.get("on"):
        why = str(ki.get("why_off") or "no reason given")
        fix = (
            "restart the server without --no-key-index"
            if "--no-key-index" in why
            else "see the server's log for why it could not make the index"
        )
        return CheckResult(
            name, WARN, f"off ({why}): every EXISTS, one per new vLLM request, is a server round trip", fix
        )
    where, keys, slots = ki.get("where"), int(ki.get("keys", 0)), int(ki.get("slots", 0))
    if ki.get("full"):
        return CheckResult(
            name,
            WARN,
            f"full: {keys:,} keys for {slots:,} slots ({where}); clients ask the server until keys are "
            "deleted or evicted",
            "store fewer, larger objects (a larger maru_kv_chunk_tokens), or use a larger --alignment",
        )
    why = _key_index_unreadable(ctx)
    if why is not None:
        return CheckResult(
            name,
            WARN,
            f"the server publishes it ({where}) but this process cannot use it: {why}; its EXISTS go to "
            "the server, one round trip each",
            _key_index_fix(why),
        )
    whom = (
        "clients answer EXISTS from it for the namespaces they may read (fingerprints keyed per namespace)"
        if ki.get("keyed")
        else "clients answer EXISTS from it"
    )
    return CheckResult(name, OK, f"{keys:,} keys in {slots:,} slots ({where}); {whom}")


def _key_index_fix(why: str) -> str:
    """The fix for a key index this process cannot read, by what went wrong."""
    if "No such file" in why:
        return (
            "a client looks for the index file beside its own path of the pool: map the pool under the "
            "server's path, or make the file reachable there (a link in the same directory)"
        )
    if "no secrets" in why:
        return (
            "upgrade this client and the server together (a keyed index needs the secrets from the handshake)"
        )
    return (
        "run clients as the server's user, or start the server with --group GROUP for a group they are "
        "in (the index file gets the pool's mode and group)"
    )


def _key_index_unreadable(ctx: DoctorContext) -> str | None:
    """Why a client here could not read the server's key index (the client's own code decides)."""
    from maru.client.local_exists import LocalExists
    from maru.client.mapping import PoolMapping

    hs = ctx.handshake
    if hs is None:
        return None
    try:
        m = PoolMapping(
            ctx.pool_path or hs["pool_path"], hs["pool_uuid"], int(hs["pool_size"]), int(hs["data_offset"])
        )
    except MaruError:
        return None  # the pool check says why
    local = LocalExists()
    try:
        local.update(hs, m, hs["pool_path"])
        return local.why_remote
    finally:
        local.close()
        m.close()


def check_quarantine(ctx: DoctorContext) -> CheckResult:
    """Pool space held for clients whose lease expired (quarantine: reservations and pins they may still touch)."""
    name = "quarantined space"
    snap = stats_for(ctx, name)
    if isinstance(snap, CheckResult):
        return snap
    g = snap.get("gauges", {})
    if "quarantined_bytes" not in g:
        return CheckResult(name, SKIP, "this maru server does not report quarantine (an older version)")
    nbytes, n_clients = int(g["quarantined_bytes"]), int(g.get("quarantined_clients", 0))
    if nbytes == 0 and n_clients == 0:
        return CheckResult(name, OK, "none (no expired client holds pool space)")
    q = snap.get("quarantine") if isinstance(snap.get("quarantine"), dict) else {}
    lines = [
        f"{format_size(nbytes)} in {int(g.get('quarantined_extents', 0)):,} extents held for {n_clients} "
        "client(s) whose lease expired: unusable (never evicted) until released"
    ]
    for h in q.get("holders", []):
        where = "exit watched" if h.get("local") else "exit not watchable: another host or PID namespace"
        lines.append(
            f"{h.get('host', '?')} pid {h.get('pid', '?')} ({where}), held {float(h.get('held_s', 0)):.0f} s"
        )
    timeout = q.get("timeout_s")
    if timeout is None:
        when = "after --quarantine-timeout"
    elif timeout == 0:
        when = "never by timeout (--quarantine-timeout 0)"
    else:
        when = f"after --quarantine-timeout ({float(timeout):g} s)"
    fix = (
        "the space returns by itself when a watched holder exits, when the holder reconnects (it "
        f"fences its old session first), or {when}. To free it sooner, stop the stalled holder "
        "process; one whose exit is not watchable is released only by a reconnect, the timeout or "
        "a server restart (docs/reliability.md, Quarantine)"
    )
    return CheckResult(name, WARN, "\n".join(lines), fix)


# -- optional checks (components that may be absent; they never fail the doctor) -------------------


def check_client_paths(ctx: DoctorContext) -> CheckResult:
    """Which data paths the serving processes run, as they report it (client info, see maru.protocol).

    The doctor runs in its own process, so it cannot see whether a vLLM worker registered its pool
    mapping with CUDA or fell back to a staged path; workers report that through
    ``MaruHandler.set_client_info`` and the server lists it in STATS. OK when no client reports a
    ``slow`` path, WARN (the fixes are the clients' own sentences) when one does, SKIP when no
    client reports anything.
    """
    from maru.cli.stats import slow_reports

    name = "serving clients' data paths"
    snap = stats_for(ctx, name)
    if isinstance(snap, CheckResult):
        return snap
    clients = snap.get("clients")
    if clients is None:
        return CheckResult(
            name,
            SKIP,
            "this maru server does not list its clients (an older version)",
            "upgrade the server to see the serving processes' data paths here",
        )
    reporting = [c for c in clients if isinstance(c, dict) and c.get("info")]
    if not reporting:
        return CheckResult(
            name,
            SKIP,
            f"none of the {snap.get('clients_total', len(clients))} connected clients reports its data "
            "paths (vLLM workers using the Maru connector do, once serving)",
        )
    lines: list[str] = []
    fixes: list[str] = []
    for c in reporting:
        info = c["info"] if isinstance(c["info"], dict) else {}
        who = f"{info.get('role', 'client')} {c.get('host', '?')} pid {c.get('pid', '?')}"
        paths = info.get("paths")
        if isinstance(paths, dict) and paths:
            shown = ", ".join(f"{k}={v}" for k, v in paths.items())
        else:
            shown = "no paths reported"
        slow = slow_reports(info)
        lines.append(f"{who}: {shown}" + (f" ({len(slow)} slow)" if slow else ""))
        fixes += [f"{who}: {s}" for s in slow]
    if snap.get("clients_truncated"):
        lines.append(f"(the server listed {len(clients)} of {snap.get('clients_total')} clients)")
    detail = "\n".join(lines)
    if fixes:
        return CheckResult(name, WARN, detail, "\n".join(fixes))
    return CheckResult(name, OK, detail + "\nevery reported data path is the fast one")
