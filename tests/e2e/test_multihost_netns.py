"""Several hosts, emulated with network namespaces over one pool file.

Host A runs ``maru server`` bound to its own address; host B (writer) and host C (reader)
reach it only over a veth link, never over loopback, and map the same pool: B through the path
the server announces, C through another path to the same memory (a hard link, standing in for a
DAX device that has another name on that host). Every address lives inside namespaces this
test creates and removes; nothing leaves the machine.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import ServerProcess

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None, reason="needs root and iproute2 (network namespaces)"
)

SUBNET = "10.213.77"
PORT = 5599


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@pytest.fixture
def three_hosts():
    """Namespaces a (server), b and c on one bridge-less star: a<->b and a<->c veth pairs."""
    tag = uuid.uuid4().hex[:6]
    ns = {h: f"maru-{h}-{tag}" for h in "abc"}
    try:
        for name in ns.values():
            _ip("netns", "add", name)
            _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        addrs = {}
        for i, h in enumerate("bc", start=1):
            va, vh = f"m{h}a{tag}"[:15], f"m{h}h{tag}"[:15]
            _ip("link", "add", va, "type", "veth", "peer", "name", vh)
            _ip("link", "set", va, "netns", ns["a"])
            _ip("link", "set", vh, "netns", ns[h])
            a_addr, h_addr = f"{SUBNET}.{4 * i + 1}", f"{SUBNET}.{4 * i + 2}"
            _ip("netns", "exec", ns["a"], "ip", "addr", "add", f"{a_addr}/30", "dev", va)
            _ip("netns", "exec", ns[h], "ip", "addr", "add", f"{h_addr}/30", "dev", vh)
            _ip("netns", "exec", ns["a"], "ip", "link", "set", va, "up")
            _ip("netns", "exec", ns[h], "ip", "link", "set", vh, "up")
            addrs[h] = a_addr  # the server's address as seen from host h
        yield ns, addrs
    finally:
        for name in ns.values():
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=20)


CLIENT = r"""
import hashlib, json, os, sys
from maru import MaruHandler
url, mode, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
pool_path = sys.argv[4] if len(sys.argv) > 4 else None
out = {}
with MaruHandler(url, timeout_s=10.0, pool_path=pool_path) as h:
    if mode == "write":
        for i in range(n):
            data = hashlib.sha256(f"obj-{i}".encode()).digest() * (64 + 97 * i)
            obj = h.alloc(len(data))
            obj.buf[:] = data
            h.store(f"netns/obj-{i}", obj)
            out[f"netns/obj-{i}"] = hashlib.sha256(data).hexdigest()
    else:
        for i in range(n):
            r = h.retrieve(f"netns/obj-{i}")
            out[f"netns/obj-{i}"] = None if r is None else hashlib.sha256(r.view).hexdigest()
            if r is not None:
                r.release()
print(json.dumps(out))
"""


def _client(ns: str, *args: str) -> dict[str, str | None]:
    import json

    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", CLIENT, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_hosts_in_other_network_namespaces_share_objects_over_tcp(three_hosts, tmp_path):
    ns, addrs = three_hosts
    server = ServerProcess(
        tmp_path,
        pool_size="32M",
        port=PORT,
        host="0.0.0.0",
        extra_args=["--insecure"],  # a private test network; docs/security.md shows the CURVE setup
        prefix=["ip", "netns", "exec", ns["a"]],
    )
    with server:
        # Host b writes through the path the server announces.
        written = _client(ns["b"], f"tcp://{addrs['b']}:{PORT}", "write", "40")
        # Host c sees the same memory under another name and reads everything back.
        other_name = f"/dev/shm/maru-hostc-view-{uuid.uuid4().hex[:8]}"
        os.link(server.pool_path, other_name)
        try:
            read = _client(ns["c"], f"tcp://{addrs['c']}:{PORT}", "read", "40", other_name)
        finally:
            os.unlink(other_name)
    assert len(written) == 40
    assert read == written
    # And loopback inside host c does not reach the server: the test really crossed the link.
    lone = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns["c"],
            sys.executable,
            "-c",
            f"import socket; s=socket.socket(); s.settimeout(2);print(s.connect_ex(('127.0.0.1', {PORT})))",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert lone.stdout.strip() != "0"
