"""Reading the server's replies on the client: the handshake record, batch slicing, reply fields,
and the exception a refused request stands for."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from maru import protocol
from maru.config import format_size
from maru.errors import MaruError, PoolFullError, ProtocolError, ServerError
from maru.protocol import MAX_BATCH, ErrorCode, Op


@dataclass(frozen=True)
class ServerInfo:
    """What the server announced in the handshake of the current session."""

    server_id: str
    pool_path: str
    pool_uuid: str
    pool_size: int
    data_offset: int
    data_size: int
    alignment: int
    max_object_size: int
    lease_timeout_s: float
    protocol_version: int

    @classmethod
    def from_reply(cls, reply: dict[str, Any]) -> ServerInfo:
        try:
            return cls(
                server_id=str(reply["server_id"]),
                pool_path=str(reply["pool_path"]),
                pool_uuid=str(reply["pool_uuid"]),
                pool_size=int(reply["pool_size"]),
                data_offset=int(reply["data_offset"]),
                data_size=int(reply["data_size"]),
                alignment=int(reply["alignment"]),
                max_object_size=int(reply["max_object_size"]),
                lease_timeout_s=float(reply["lease_timeout_s"]),
                protocol_version=int(reply["protocol_version"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ProtocolError(
                f"handshake reply lacks or mangles field {e}; client and server versions differ"
            ) from None


def chunks(items: list[Any], n: int = MAX_BATCH) -> Iterable[list[Any]]:
    """``items`` in slices of at most ``n`` (the protocol's batch limit); one slice when it fits."""
    if len(items) <= n:
        yield items
        return
    for i in range(0, len(items), n):
        yield items[i : i + n]


def check_keys(keys: Sequence[str]) -> list[str]:
    """``keys`` as a list. A bare string is refused (it would be read as one key per character).

    Each key's type and length (str, at most MAX_KEY_BYTES UTF-8 bytes) is checked by the server,
    which answers a clear ``ServerError``; checking it here too would cost more than the rest of an
    ``exists`` call on the client.
    """
    if isinstance(keys, (str, bytes)):
        raise TypeError(f"pass a list of keys, not one key ({keys!r}): e.g. exists([{keys!r}])")
    return list(keys)


def reply_list(reply: dict[str, Any], name: str, n: int) -> list[Any]:
    """Field ``name`` of a reply, which must be a list of one item per request item."""
    value = reply.get(name)
    if not isinstance(value, list) or len(value) != n:
        raise ProtocolError(f"server reply field {name!r} should list {n} items, got {value!r:.200}")
    return value


INFO_REFUSALS = (ErrorCode.BAD_REQUEST.value, ErrorCode.TOO_LARGE.value)


def plain_info(value: Any, depth: int = 0) -> Any:
    """A deep copy of ``value`` as plain types (Mapping -> dict, tuple -> list, str/int/float
    subclasses such as enums -> the base type), so later changes by the caller do not leak in.
    Stops copying past the protocol's depth limit (the check then names the problem)."""
    if depth > protocol.MAX_CLIENT_INFO_DEPTH:
        return value
    if isinstance(value, Mapping):
        return {k: plain_info(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_info(v, depth + 1) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    for base in (str, int, float):
        if isinstance(value, base):
            return base(value)
    return value


def pool_full_error(info: ServerInfo, missing: int, total: int, reply: dict[str, Any]) -> PoolFullError:
    """What a RESERVE that left ``missing`` of ``total`` objects without space stands for (the
    reply's ``quarantined`` bytes, when some, say how much expired clients hold)."""
    held = int(reply.get("quarantined", 0) or 0)
    quarantine = (
        f"; {format_size(held)} is held in quarantine for clients whose lease expired "
        "while they may still touch it (released when they are known dead or fenced, or "
        "after `maru server --quarantine-timeout`)"
        if held
        else ""
    )
    return PoolFullError(
        f"pool {info.pool_path} ({format_size(info.data_size)}) is full: {missing} of "
        f"{total} objects do not fit even after evicting every unpinned entry"
        f"{quarantine}; raise `maru server --pool-size`, store smaller objects, or release "
        "retrieved handles sooner (pinned entries cannot be evicted)"
    )


def error_from_reply(op: int, reply: dict[str, Any], url: str) -> MaruError:
    """The exception that a failed reply (``ok`` False) stands for."""
    code = str(reply.get("code", ErrorCode.INTERNAL.value))
    message = str(reply.get("message", "(no message)"))
    what = f"maru server at {url} refused {Op(op).name}: {message}"
    if code == ErrorCode.POOL_FULL.value:
        return PoolFullError(what)
    if code == ErrorCode.VERSION.value:
        return ProtocolError(
            f"{what} (this client speaks protocol {protocol.PROTOCOL_VERSION}; use matching versions)"
        )
    return ServerError(what, code)
