"""Who is on the other end of a connection: CurveZMQ keys, the bind policy, the caller of a request.

Two kinds of server, one type each:

- ``OpenAuth``: no keys, loopback only (or a non-loopback address with ``--insecure``, said
  loudly). Every connection is anonymous.
- ``CurveAuth``: the socket is a CURVE server with the server's secret key; a ZAP handler (pyzmq's
  thread authenticator) lets in only client public keys on the allow list and stamps each
  message with its connection's key as the ZeroMQ ``User-Id``.

Either way the server decides who a request comes from, never the request body: a ``Caller`` is
the connection's ``User-Id`` (the client's public key, or "" when anonymous) and its routing id
(unique among live connections: a ROUTER refuses a second peer claiming one in use). Sessions,
reservations and pins belong to ``(user, routing id, client_id)``, so another connection that
sends a victim's ``client_id`` or allocation ids reaches nothing of the victim's.
"""

from __future__ import annotations

import ipaddress
import logging
import os
from pathlib import Path
from typing import Any, NamedTuple

import zmq

from maru.errors import ConfigError

log = logging.getLogger("maru.server")

ZAP_DOMAIN = "maru"


class Caller(NamedTuple):
    """The owner of a session: who (key), which connection, which client id on it."""

    user: str  # the client's z85 public key under CURVE; "" when anonymous
    conn: bytes  # the connection's routing id
    client_id: Any  # the body's client_id (several sessions may share one connection)


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# -- key files ---------------------------------------------------------------------------------


def write_key_pair(out_dir: Path, name: str) -> tuple[Path, Path]:
    """Write a new CURVE key pair as ``NAME.key`` (public) and ``NAME.key_secret`` (mode 0600).

    The files use the ZeroMQ certificate format (what pyzmq's ``zmq.auth.load_certificate`` and
    czmq read). Refuses to overwrite: a lost secret key is replaced by a new pair, on purpose.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.curve_keypair()
    pub_path, sec_path = out_dir / f"{name}.key", out_dir / f"{name}.key_secret"
    for p in (pub_path, sec_path):
        if p.exists():
            raise ConfigError(f"{p} exists; pick another --name or remove the old key pair first")
    head = "#   ZeroMQ CURVE {} certificate written by `maru keys generate`\n"
    pub_text = (
        f'{head.format("public")}metadata\n    name = "{name}"\ncurve\n    public-key = "{public.decode()}"\n'
    )
    sec_text = (
        f"{head.format('**secret**')}#   keep this file private (mode 0600); never copy it to another host\n"
        f'metadata\n    name = "{name}"\ncurve\n    public-key = "{public.decode()}"\n'
        f'    secret-key = "{secret.decode()}"\n'
    )
    # O_EXCL + mode at creation: the secret is never readable by others, not even for a moment.
    fd = os.open(sec_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(sec_text)
    fd = os.open(pub_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    with os.fdopen(fd, "w") as f:
        f.write(pub_text)
    return pub_path, sec_path


def _load(path: Path) -> tuple[bytes, bytes | None]:
    from zmq.auth import load_certificate

    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"cannot read CURVE key file {path}: {e}; create one with `maru keys generate`"
        ) from None
    if public is None or len(public) != 40:
        raise ConfigError(f"{path} holds no valid public-key; create one with `maru keys generate`")
    return public, secret


def load_secret_key(path: str | Path) -> tuple[bytes, bytes]:
    """``(public, secret)`` z85 keys from a ``.key_secret`` file; refuses a file others can read."""
    p = Path(path)
    public, secret = _load(p)
    if secret is None or len(secret) != 40:
        raise ConfigError(f"{p} holds no secret-key: pass the .key_secret file, not the public .key")
    mode = p.stat().st_mode & 0o077
    if mode:
        raise ConfigError(
            f"secret key {p} is readable by others (mode {p.stat().st_mode & 0o777:o}); chmod 600 {p}"
        )
    return public, secret


def load_public_key(value: str | Path) -> bytes:
    """A z85 public key given inline (40 characters) or as a key file (public or secret)."""
    text = str(value)
    if len(text) == 40 and not os.path.exists(text):
        try:
            zmq.utils.z85.decode(text.encode())
        except Exception:
            raise ConfigError(f"{text!r} is neither a key file nor a z85 public key") from None
        return text.encode()
    return _load(Path(text))[0]


def load_allowed_keys(path: str | Path) -> set[bytes]:
    """Public keys from a ``.key`` file or a directory of them (every ``*.key`` in it)."""
    p = Path(path)
    if p.is_dir():
        files = sorted(p.glob("*.key"))
        if not files:
            raise ConfigError(
                f"--allowed-clients {p} holds no *.key files; copy each client's public .key there"
            )
        return {_load(f)[0] for f in files}
    if not p.exists():
        raise ConfigError(
            f"--allowed-clients {p} does not exist; pass a client's .key file or a directory of them"
        )
    return {_load(p)[0]}


# -- the two kinds of server -------------------------------------------------------------------


class OpenAuth:
    """No authentication: anonymous connections (loopback, or ``--insecure`` said loudly)."""

    enabled = False
    public_key: bytes | None = None

    def __init__(self, host: str, insecure: bool) -> None:
        if not is_loopback(host):
            if not insecure:
                raise ConfigError(
                    f"refusing to listen on {host} without authentication: any host that reaches it could "
                    "read, delete and pin every key. Pass --curve-secret-key and --allowed-clients "
                    "(see `maru keys generate` and docs/security.md), or --insecure on a network you trust"
                )
            log.warning(
                "listening on %s WITHOUT authentication (--insecure): any host that reaches this port can "
                "read, delete and pin every key; use --curve-secret-key and --allowed-clients instead",
                host,
            )

    def apply(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        pass

    def close(self) -> None:
        pass


class CurveAuth:
    """CURVE server: only the allowed client keys connect; each message carries its key as User-Id."""

    enabled = True

    def __init__(self, secret_key_file: str, allowed_clients: str | None) -> None:
        if not zmq.has("curve"):
            raise ConfigError("this libzmq has no CURVE support; install pyzmq's wheel (it bundles one)")
        if not allowed_clients:
            raise ConfigError(
                "--curve-secret-key needs --allowed-clients FILE_OR_DIR (the client public keys)"
            )
        self.public_key, self._secret = load_secret_key(secret_key_file)
        self.allowed = load_allowed_keys(allowed_clients)
        self._authenticator: Any = None

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP credentials check (pyzmq calls it with the client's z85 public key)."""
        return key in self.allowed

    def apply(self, ctx: zmq.Context, sock: zmq.Socket) -> None:
        """Start the ZAP handler on ``ctx`` and make ``sock`` a CURVE server. Call before bind."""
        from zmq.auth.thread import ThreadAuthenticator

        auth = self._authenticator = ThreadAuthenticator(ctx, log=logging.getLogger("maru.server.zap"))
        auth.start()
        auth.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=self)
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self._secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt_string(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        log.info("CURVE authentication on: %d allowed client keys", len(self.allowed))

    def close(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


def auth_from_config(host: str, secret_key_file: str | None, allowed_clients: str | None, insecure: bool):
    """The server's authentication for these settings; raises ``ConfigError`` for a bad combination."""
    if secret_key_file:
        return CurveAuth(secret_key_file, allowed_clients)
    if allowed_clients:
        raise ConfigError("--allowed-clients needs --curve-secret-key (the server's .key_secret file)")
    return OpenAuth(host, insecure)
