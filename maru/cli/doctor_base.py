"""What ``maru doctor``'s checks share: results, the context, and the server's STATS asked once."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maru import protocol
from maru.config import DEFAULT_REQUEST_TIMEOUT_S, DEFAULT_SERVER_URL
from maru.errors import MaruError

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


def request(ctx: DoctorContext, op: int, body: dict[str, Any]) -> dict[str, Any]:
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


def server_stats(ctx: DoctorContext) -> dict[str, Any]:
    """The server's STATS reply, asked once per doctor run (raises a MaruError that says what to do)."""
    if "stats" not in ctx.found:
        ctx.found["stats"] = request(ctx, protocol.Op.STATS, {})
    return ctx.found["stats"]


def stats_for(ctx: DoctorContext, name: str) -> dict[str, Any] | CheckResult:
    """``server_stats``, or the result check ``name`` gives when there is none (no server, an error)."""
    if ctx.handshake is None:
        return CheckResult(name, SKIP, "needs the server")
    try:
        return server_stats(ctx)
    except MaruError as e:
        return CheckResult(name, WARN, str(e), "check the server's log")


def stats_section(ctx: DoctorContext, name: str, key: str, what: str) -> dict[str, Any] | CheckResult:
    """Section ``key`` of the server's STATS, or the result check ``name`` gives without it."""
    snap = stats_for(ctx, name)
    if isinstance(snap, CheckResult):
        return snap
    section = snap.get(key)
    if not isinstance(section, dict):
        return CheckResult(name, SKIP, f"this maru server does not report {what} (an older version)")
    return section
