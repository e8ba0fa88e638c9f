"""The handshake listener as an attacker on the same network meets it: floods of bad connections
(random bytes, truncated, oversized, out of turn, slow senders that never finish), wrong secrets
and a replayed capture leave the device's fds where they were and never stop it serving a
legitimate peer; nothing it sends before the connector proved itself depends on the secret; the
listener listens on the device's own address alone. Each of these failed with UCX's sockaddr
listener, the device's endpoint before: junk left sockets in CLOSE-WAIT, a wrong-secret try
pinned two fds while its device lived, and the listening side sent the first MAC."""
from __future__ import annotations

import contextlib
import os
import random
import secrets
import socket
import struct
import threading
import time

import pytest
from conftest import local_device

import rdmaflow

MAGIC = 0x31484652  # "RFH1", csrc/wire.hpp
HELLO, CHALLENGE, AUTH, WELCOME, REJECT = 1, 2, 3, 4, 5
VERSION = 4
TIMEOUT = 1.0  # the peers' handshake timeout (RDMAFLOW_HANDSHAKE_TIMEOUT)

tcp_only = pytest.mark.parametrize("transport", ["tcp"], indirect=True)


def frame(kind: int, payload: bytes) -> bytes:
    return struct.pack("<III", MAGIC, kind, len(payload)) + payload


def hello(nonce: bytes, uuid: int = 7, endpoint: bytes = b"127.0.0.1:9") -> bytes:
    return frame(HELLO, struct.pack("<I16sQI", VERSION, nonce, uuid, len(endpoint)) + endpoint)


def addr(endpoint: str) -> tuple[str, int]:
    host, port = endpoint.rsplit(":", 1)
    return host, int(port)


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def read_all(s: socket.socket, within: float) -> bytes:
    """What the other side sends until it closes, or until `within` seconds passed."""
    s.settimeout(within)
    out = b""
    with contextlib.suppress(OSError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def read_frame(s: socket.socket, within: float = 5.0) -> tuple[int, bytes]:
    s.settimeout(within)
    head = b""
    while len(head) < 12:
        head += s.recv(12 - len(head)) or pytest.fail(f"closed after {len(head)} bytes of a frame")
    magic, kind, n = struct.unpack("<III", head)
    assert magic == MAGIC
    body = b""
    while len(body) < n:
        body += s.recv(n - len(body)) or pytest.fail("closed inside a frame")
    return kind, body


def round_trip(endpoint: str) -> None:
    """A new device's handshake with `endpoint`, then a WRITE and a READ of its region "r"."""
    with local_device() as dev:
        remote = dev.lookup_region(endpoint, "r", timeout=20)
        local = dev.alloc_region(8192)
        data = os.urandom(4096)
        memoryview(local)[:4096] = data
        ch = dev.channel(endpoint)
        ch.memcpy(local, 0, remote, 0, 4096, rdmaflow.WRITE).result(20)
        ch.memcpy(local, 4096, remote, 0, 4096, rdmaflow.READ).result(20)
        assert bytes(memoryview(local)[4096:]) == data


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


def settle_fds(pid: int, start: int, within: float) -> int:
    deadline = time.monotonic() + within
    while (n := num_fds(pid)) > start + 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    return n


def tcp_sockets(pid: int) -> list[tuple[str, str, int]]:
    """Process pid's tcp sockets: (state in /proc's hex, local address in its hex, local port)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    out = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for row in f.read().splitlines()[1:]:
                cols = row.split()
                if cols[9] in inodes:
                    local_addr, port = cols[1].split(":")
                    out.append((cols[3], local_addr, int(port, 16)))
    return out


def listening_ports(pid: int) -> dict[int, str]:
    """The tcp ports process pid listens on, each with its address in /proc's hex."""
    return {port: a for state, a, port in tcp_sockets(pid) if state == "0A"}  # LISTEN


def close_wait(pid: int) -> int:
    """Process pid's sockets whose peer closed and it did not (CLOSE-WAIT): a leak, if they stay."""
    return sum(state == "08" for state, _, _ in tcp_sockets(pid))


def bad_connection(target: tuple[str, int], rng: random.Random, i: int) -> None:
    """One of the attacker's connections, picked by i."""
    with contextlib.suppress(OSError), socket.create_connection(target, timeout=5) as s:
        kind = i % 6
        if kind == 0:    # random bytes, up to 8 KiB (UCX's listener leaked above about 2.5 KB)
            s.sendall(rng.randbytes(rng.randrange(1, 8192)))
        elif kind == 1:  # a truncated HELLO
            s.sendall(hello(rng.randbytes(16))[: rng.randrange(1, 40)])
        elif kind == 2:  # an oversized frame: a header announcing 1 GiB, then a little of it
            s.sendall(struct.pack("<III", MAGIC, HELLO, 1 << 30) + rng.randbytes(4096))
        elif kind == 3:  # out of turn: AUTH first
            s.sendall(frame(AUTH, rng.randbytes(64)))
        elif kind == 4:  # a valid HELLO, then a malformed AUTH
            s.sendall(hello(rng.randbytes(16)))
            s.sendall(frame(AUTH, b"\x01" * 7))
        else:            # HELLO of another version
            s.sendall(frame(HELLO, struct.pack("<I16sQI", 99, rng.randbytes(16), 1, 0)))


@pytest.fixture
def target(spawn_peer):
    peer = spawn_peer(RDMAFLOW_HANDSHAKE_TIMEOUT=str(TIMEOUT))
    peer.call("alloc", name="r", nbytes=8192)
    return peer


@tcp_only
def test_a_flood_of_bad_connections_leaves_the_fds_and_a_peer_is_served(target):
    pid, where = target.proc.pid, addr(target.endpoint)
    assert listening_ports(pid)[where[1]] == "0100007F"  # a loopback device's listener: 127.0.0.1 alone
    round_trip(target.endpoint)  # the first peer's link costs the device what it costs
    start, start_rss = num_fds(pid), rss_mib(pid)
    rng = random.Random(61)
    # Slow senders that never finish: more than the 64 the listener lets wait at once.
    slow = []
    for _ in range(80):
        s = socket.create_connection(where, timeout=5)
        s.sendall(hello(rng.randbytes(16))[:5])
        slow.append(s)
    flooding = threading.Event()

    def flood():
        for i in range(1000):
            bad_connection(where, rng, i)
            if i == 100:
                flooding.set()
        flooding.set()

    t = threading.Thread(target=flood)
    t0 = time.monotonic()
    t.start()
    assert flooding.wait(60)
    round_trip(target.endpoint)  # during the flood
    t.join(120)
    assert not t.is_alive()
    flood_s = time.monotonic() - t0
    round_trip(target.endpoint)  # after it
    time.sleep(TIMEOUT)
    n = settle_fds(pid, start, 1)  # a second's grace for a loaded machine
    assert close_wait(pid) == 0, f"{close_wait(pid)} sockets left in CLOSE-WAIT by the flood"
    assert n <= start + 5, f"{n} fds after the flood, {start} before"
    # Every slow sender was closed by the device: its timeout, or the cap on half-open ones.
    for s in slow:
        assert read_all(s, TIMEOUT + 5) == b""
        s.close()
    assert rss_mib(pid) < start_rss + 32, f"{rss_mib(pid):.0f} MiB resident after the flood, {start_rss:.0f} before"
    target.call("exit", timeout=10)
    target.proc.wait(10)
    err = target.proc.stderr.read()
    lines = [ln for ln in err.splitlines() if "handshake connection" in ln]
    assert lines and "closed" in lines[0], err[-2000:]
    assert len(lines) <= flood_s / 10 + 3, lines  # rate-limited: one line per 10 s at most


@tcp_only
def test_wrong_secret_tries_pin_no_fds(target):
    pid = target.proc.pid
    round_trip(target.endpoint)
    start = num_fds(pid)
    with local_device(secret=secrets.token_hex(16)) as stranger:
        for _ in range(300):
            with pytest.raises(rdmaflow.AuthError, match="secret mismatch"):
                stranger.channel(target.endpoint)
        n = settle_fds(pid, start, TIMEOUT + 5)  # while the stranger's device still lives
    assert n <= start + 5, f"{n} fds after 300 wrong-secret tries, {start} before"
    round_trip(target.endpoint)


def test_nothing_the_acceptor_sends_before_the_proof_depends_on_the_secret(job_secret):
    """Two devices with different secrets, the same HELLO: what each sends until the connector's
    AUTH is checked is a fresh nonce and its uuid, then the same REJECT; no MAC."""
    nonce, seen = b"N" * 16, []
    for secret in (secrets.token_hex(16), secrets.token_hex(16)):
        with local_device(secret=secret) as dev:
            per_connection = []
            for _ in range(2):
                with socket.create_connection(addr(dev.endpoint), timeout=5) as s:
                    s.sendall(hello(nonce))
                    kind, body = read_frame(s)
                    assert kind == CHALLENGE and len(body) == 16 + 8, (kind, body)
                    s.settimeout(0.3)  # and nothing more until we speak
                    with pytest.raises(socket.timeout):
                        s.recv(1)
                    s.sendall(frame(AUTH, struct.pack("<QI", 1, 3) + b"abc" + os.urandom(32)))
                    per_connection.append((body[:16], body[16:], read_all(s, 5)))
        (n1, uuid1, rest1), (n2, uuid2, rest2) = per_connection
        assert n1 != n2 and uuid1 == uuid2 and rest1 == rest2  # a fresh nonce, the device's uuid
        seen.append(rest1)
    assert seen[0] == seen[1] == frame(REJECT, b"job secret mismatch")


class Recorder:
    """A tcp relay in front of a device that keeps what the connector sent through it."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.sent = target, b""
        self.server = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.server.getsockname()[1]}"
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self):
        a, _ = self.server.accept()
        b = socket.create_connection(self.target)

        def pump(src, dst, keep):
            with contextlib.suppress(OSError):
                while chunk := src.recv(65536):
                    if keep:
                        self.sent += chunk
                    dst.sendall(chunk)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(b, a, False), daemon=True)
        back.start()
        pump(a, b, True)
        back.join(10)


@tcp_only
def test_a_replayed_handshake_is_refused(target):
    rec = Recorder(addr(target.endpoint))
    with local_device() as dev:  # a legitimate handshake through the relay
        dev.lookup_region(rec.endpoint, "r", timeout=20)
    assert rec.sent[:8] == struct.pack("<II", MAGIC, HELLO)
    with socket.create_connection(addr(target.endpoint), timeout=5) as s:
        s.sendall(rec.sent)  # HELLO and AUTH as captured: the device's nonce is a new one
        reply = read_all(s, 5)
    assert reply[12 + 24:] == frame(REJECT, b"job secret mismatch"), reply
    assert struct.pack("<I", WELCOME) not in reply[4:8]


@tcp_only
def test_the_listener_closes_what_it_cannot_use_at_once(target):
    """An oversized or malformed frame is answered by a close, not by the timeout."""
    where = addr(target.endpoint)
    for bad in (struct.pack("<III", MAGIC, HELLO, 1 << 30), b"GET / HTTP/1.1\r\n\r\n",
                frame(WELCOME, b""), frame(HELLO, struct.pack("<I16sQI", VERSION, b"n" * 16, 1, 5000) + b"x" * 9)):
        with socket.create_connection(where, timeout=5) as s:
            t0 = time.monotonic()
            s.sendall(bad)
            assert read_all(s, 5) == b""
            assert time.monotonic() - t0 < TIMEOUT / 2, bad
    with socket.create_connection(where, timeout=5) as s:  # silence: closed at the timeout
        t0 = time.monotonic()
        assert read_all(s, TIMEOUT + 5) == b""
        assert TIMEOUT * 0.8 < time.monotonic() - t0 < TIMEOUT + 4
