"""The congestion control of UCX's tcp data sockets (Device(tcp_congestion=...)).

Two real processes over UCX's tcp transport. Which of this process's TCP sockets carried the
data is read from the kernel (TCP_INFO's byte counters), and its congestion control from
TCP_CONGESTION: the choice must be on the sockets that moved the bytes, both ways.
"""
from __future__ import annotations

import os
import socket
import stat
import struct

import pytest
import torch
from conftest import PeerProcess, local_device

import rdmaflow
from rdmaflow._ucx import transport_vars
from rdmaflow.device import tcp_congestion_of

MiB = 1 << 20
SIZE = 8 * MiB
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, u64 at 120 and 128.
BYTES_ACKED, BYTES_RECEIVED = 120, 128


def _tcp_sockets() -> list[tuple[str, int, int]]:
    """(congestion control, bytes acked, bytes received) of every TCP socket of this process."""
    out = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if not stat.S_ISSOCK(os.fstat(fd).st_mode):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        with s:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            cc = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0").decode()
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
            acked, received = (struct.unpack_from("=Q", info, off)[0] for off in (BYTES_ACKED, BYTES_RECEIVED))
            out.append((cc, acked, received))
    return out


def _settable_other_than_default() -> str:
    """A congestion control this process may set that is not the system's default."""
    default = tcp_congestion_of("system")
    for cc in ("reno", "cubic", "bbr"):
        if cc == default:
            continue
        try:
            if tcp_congestion_of(cc) == cc:
                return cc
        except rdmaflow.InvalidArgumentError:
            continue
    pytest.skip(f"this process may set no congestion control besides the system's ({default})")


@pytest.fixture
def tcp_peer(monkeypatch, job_secret):
    """Starts a peer over UCX's tcp transport alone, with this process's environment."""
    for k, v in {"RDMAFLOW_SAME_HOST": "auto", **transport_vars("tcp")}.items():
        monkeypatch.setenv(k, v)
    peers: list[PeerProcess] = []

    def spawn() -> PeerProcess:
        peers.append(PeerProcess(dict(os.environ)))
        return peers[-1]

    yield spawn
    for p in peers:
        p.close()


@pytest.mark.parametrize("choice", ["named", "system"])
def test_the_sockets_that_carry_the_data_run_the_chosen_congestion_control(tcp_peer, choice, monkeypatch):
    wanted = _settable_other_than_default() if choice == "named" else "system"
    expect = tcp_congestion_of(wanted)
    monkeypatch.setenv("RDMAFLOW_TCP_CONGESTION", wanted)
    peer = tcp_peer()
    peer.call("alloc", name="buf", nbytes=SIZE, timeout=60)
    with local_device() as dev:
        assert dev.tcp_congestion == expect
        local = dev.alloc_region(SIZE)
        dev.publish_region("mine", local)
        local.tensor(torch.uint8, SIZE).fill_(3)
        ch = dev.channel(peer.endpoint)
        ch.memcpy(local, 0, dev.lookup_region(peer.endpoint, "buf"), 0, SIZE, rdmaflow.WRITE).result(60)
        peer.call("write_to", endpoint=dev.endpoint, name="mine", nbytes=SIZE, value=5, timeout=60)
        assert int(local.tensor(torch.uint8, SIZE).min()) == 5
        sockets = _tcp_sockets()
        sent = [cc for cc, acked, _ in sockets if acked >= SIZE // 2]
        received = [cc for cc, _, got in sockets if got >= SIZE // 2]
        assert sent and received, f"no TCP socket of this process carried the data: {sockets}"
        assert set(sent) == {expect} and set(received) == {expect}, (
            f"wanted {expect}: the sockets that sent ran {sent}, those that received {received}")


def test_a_congestion_control_this_process_may_not_set_is_refused_by_name(job_secret):
    with pytest.raises(rdmaflow.InvalidArgumentError, match="'no-such-cc'.*this host has"):
        rdmaflow.Device("127.0.0.1:0", tcp_congestion="no-such-cc")
    with pytest.raises(rdmaflow.InvalidArgumentError, match="tcp_congestion must be"):
        rdmaflow.Device("127.0.0.1:0", tcp_congestion=3)


def test_auto_leaves_a_congestion_control_that_does_not_pace():
    system = tcp_congestion_of("system")
    auto = tcp_congestion_of("auto")
    if system.startswith("bbr"):
        assert auto in ("cubic", "reno", system)  # the system's only where neither may be set
    else:
        assert auto == system
