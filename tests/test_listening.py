"""Where a loopback job listens (docs/security.md): its devices' UCX tcp data ports, their
handshake listeners, and the job's c10d store that rdmaflow serves, on loopback only, with
UCX_NET_DEVICES unset (UCX's default was every interface: two ports per device on the host's
external address too). Read from /proc/self/net/tcp{,6} for this process's socket inodes."""
from __future__ import annotations

import ipaddress
import secrets
import socket

import pytest
import torch

import rdmaflow
from rdmaflow import _ucx
from rdmaflow.bench.processes import free_port
from rdmaflow.info import listening_sockets
from rdmaflow.job import JobStore


def _non_loopback(sockets) -> list:
    return [(a, p) for a, p in sockets if not ipaddress.ip_address(a).is_loopback]


@pytest.fixture
def default_ucx(monkeypatch):
    """UCX as a user's job has it: no UCX_NET_DEVICES (the tests' transports set lo)."""
    monkeypatch.delenv("UCX_NET_DEVICES", raising=False)
    monkeypatch.setenv("UCX_TLS", "tcp")


def test_a_loopback_job_listens_on_loopback_only(default_ucx, monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    before = set(listening_sockets())
    store = JobStore(0, 1, 10.0, "listening/")
    secret = secrets.token_hex(16)
    with rdmaflow.Device("127.0.0.1:0", secret=secret) as a, rdmaflow.Device("127.0.0.1:0", secret=secret) as b:
        assert a.net_devices == "lo" and b.net_devices == "lo"
        # A round trip, so that every lane the job uses is up.
        region = b.alloc_region(4096)
        b.publish_region("r", region)
        local = a.alloc_region(4096)
        local.tensor(torch.uint8, 4096).fill_(7)
        a.channel(b.endpoint).memcpy(local, 0, a.lookup_region(b.endpoint, "r"), 0, 4096, rdmaflow.WRITE).result(30)
        assert region.tensor(torch.uint8, 4096).unique().tolist() == [7]
        new = set(listening_sockets()) - before
        ports = {p for _, p in new}
        handshakes = {int(d.endpoint.rsplit(":", 1)[1]) for d in (a, b)}
        store_port = int(store.address.rsplit(":", 1)[1])
        assert handshakes <= ports and store_port in ports, new
        # Each device's workers (num_cqs, 2) have a UCX tcp interface listening of their own.
        assert len(ports - handshakes - {store_port}) >= 2 * a.num_cqs, new
        assert not _non_loopback(new), f"a loopback job listens beyond loopback: {sorted(new)}"


def test_the_default_narrows_only_what_the_user_left_open(default_ucx, monkeypatch):
    """UCX_NET_DEVICES, or net_devices=, wins over the device's address; "all" is UCX's default,
    which on a host with another interface listens there too (what the default now avoids)."""
    secret = secrets.token_hex(16)
    assert _ucx.net_devices_for("0.0.0.0:0") == "all"
    assert _ucx.net_devices_for("localhost:5") == "lo"
    with pytest.raises(rdmaflow.InvalidArgumentError, match="net_devices must be"):
        rdmaflow.Device("127.0.0.1:0", secret=secret, net_devices=" ")
    before = set(listening_sockets())
    with rdmaflow.Device("127.0.0.1:0", secret=secret, net_devices="all") as d:
        assert d.net_devices == "all"
        wide = set(listening_sockets()) - before
    if not any(n != "lo" for _, n in socket.if_nameindex()):
        pytest.skip("this host has no interface but loopback: 'all' cannot listen elsewhere")
    assert _non_loopback(wide), f"UCX's default listened on loopback only: {sorted(wide)}"
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    with rdmaflow.Device("127.0.0.1:0", secret=secret) as d:
        assert d.net_devices == "lo"
