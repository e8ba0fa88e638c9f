"""Tests for the benchmark tooling: size parsing and summaries (harness), the transport
environments (rdmaflow._ucx), the ucx_perftest runner, the netns helper."""

from __future__ import annotations

import importlib
import math
import os
import sys
import time
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _import_tools() -> tuple[types.ModuleType, ...]:
    names = ("rdmaflow.bench.harness", "rdmaflow.bench.perftest", "rdmaflow.testing.netns", "rdmaflow._ucx")
    try:
        return tuple(importlib.import_module(n) for n in names)  # type: ignore[return-value]
    except ImportError:
        pass
    # rdmaflow/__init__ imports the C++ extension, which these stdlib-only
    # tools do not need: import them under a bare stand-in package, then
    # drop the stand-in so other tests still see the real import error.
    for k in [k for k in sys.modules if k == "rdmaflow" or k.startswith("rdmaflow.")]:
        del sys.modules[k]
    stub = types.ModuleType("rdmaflow")
    stub.__path__ = [str(ROOT / "rdmaflow")]  # type: ignore[attr-defined]
    sys.modules["rdmaflow"] = stub
    try:
        return tuple(importlib.import_module(n) for n in names)  # type: ignore[return-value]
    finally:
        if sys.modules.get("rdmaflow") is stub:
            del sys.modules["rdmaflow"]


harness, perftest, netns, ucx = _import_tools()


def _our_ucx_children() -> list[int]:
    """Pids of ucx_perftest processes whose parent is this test process."""
    me = os.getpid()
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        if ppid == me and comm.startswith("ucx_perftest"):
            found.append(int(d))
    return found


def _ucx_available() -> str | None:
    try:
        ucx.find_bin("ucx_perftest")
    except FileNotFoundError as e:
        return str(e)
    return None


needs_ucx = pytest.mark.skipif(_ucx_available() is not None, reason=str(_ucx_available()))


# --- harness: sizes, summaries ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("123", 123),
    ("0", 0),
    ("64K", 64 * 1024),
    ("64k", 64 * 1024),
    ("1M", 1 << 20),
    ("16M", 16 << 20),
    ("1G", 1 << 30),
    ("2MiB", 2 << 20),
    (" 4K ", 4096),
    (4096, 4096),
])
def test_parse_size(text, expected):
    assert harness.parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "M", "1.5M", "-1", "10X", "1 M B", "abc", -5])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        harness.parse_size(bad)


def test_format_size_roundtrip():
    for s in ("1K", "64K", "1M", "16M", "1G", "123"):
        assert harness.format_size(harness.parse_size(s)) == s


def test_summarize():
    s = harness.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert s == {"median": 3.0, "min": 1.0, "max": 5.0, "iqr": 2.0}
    s = harness.summarize([1, 2, 3, 4])
    assert s["median"] == 2.5 and s["iqr"] == pytest.approx(1.5)
    assert harness.summarize([7]) == {"median": 7.0, "min": 7.0, "max": 7.0, "iqr": 0.0}
    with pytest.raises(ValueError):
        harness.summarize([])


# --- ucx_env / perftest -------------------------------------------------------------------------

def test_ucx_env_mapping():
    base = {"PATH": "/usr/bin", "UCX_NET_DEVICES": "eth0", "LD_LIBRARY_PATH": "/x"}
    tcp = ucx.ucx_env("tcp", base)
    assert tcp["UCX_TLS"] == "tcp" and tcp["UCX_NET_DEVICES"] == "lo"
    assert tcp["PATH"] == "/usr/bin"
    assert tcp["LD_LIBRARY_PATH"].endswith("/x")
    assert base["UCX_NET_DEVICES"] == "eth0"  # not modified in place
    assert ucx.ucx_env("tcp", base, net_device="veth0")["UCX_NET_DEVICES"] == "veth0"
    sm = ucx.ucx_env("sm", base)
    assert "cma" in sm["UCX_TLS"] and sm["UCX_NET_DEVICES"] == "lo"
    lib = ucx.lib_dir()
    if lib:
        assert sm["LD_LIBRARY_PATH"].split(os.pathsep)[0] == lib
    with pytest.raises(ValueError):
        ucx.ucx_env("ib")
    # sm-cma: the same UCX transports as sm, rdmaflow's same-host mapping off.
    cma = ucx.ucx_env("sm-cma", base)
    assert cma["UCX_TLS"] == sm["UCX_TLS"] and cma["RDMAFLOW_SAME_HOST"] == "0"
    assert "RDMAFLOW_SAME_HOST" not in sm
    assert perftest.ucx_env is ucx.ucx_env  # one definition


def test_auto_iters_bounds():
    for size in (1, 4096, 1 << 20, 16 << 20, 64 << 20, 1 << 30):
        n = perftest.auto_iters(size)
        assert perftest._MIN_ITERS <= n <= perftest._MAX_ITERS
    assert perftest.auto_iters(1 << 20) * (1 << 20) >= 256 << 20  # "a few hundred MB"


def test_parse_bandwidth_csv():
    out = ("iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n"
           " 100,0.150,4550.731,4550.731,3515.92,3600.00,220,220\n")
    assert perftest._parse_bandwidth(out) == pytest.approx(3600.0 * 2**20)
    with pytest.raises(RuntimeError):
        perftest._parse_bandwidth("garbage\n")


@needs_ucx
@pytest.mark.parametrize("transport", ["tcp", "sm"])
def test_run_perftest_put_1m(transport):
    t0 = time.monotonic()
    bw = perftest.run_perftest(transport, "put", 1 << 20, timeout=30)
    assert math.isfinite(bw) and bw > 1e7, bw  # > 10 MB/s rules out unit mix-ups
    assert time.monotonic() - t0 < 10
    assert _our_ucx_children() == []


@needs_ucx
def test_run_perftest_get_small():
    bw = perftest.run_perftest("sm", "get", 1 << 20, iters=64, timeout=30)
    assert math.isfinite(bw) and bw > 0


@needs_ucx
def test_run_perftest_failure_raises_and_cleans_up():
    # An impossible transport list makes the client fail during UCX init.
    with pytest.raises(RuntimeError, match="client failed"):
        perftest.run_perftest("tcp", "put", 1 << 20, iters=8, timeout=20,
                              client_env={"UCX_TLS": "no_such_transport"})
    assert _our_ucx_children() == []


@needs_ucx
def test_run_perftest_timeout_kills_both():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="timed out|did not listen"):
        perftest.run_perftest("tcp", "put", 16 << 20, iters=10_000_000, timeout=2.0)
    assert time.monotonic() - t0 < 8
    assert _our_ucx_children() == []


# --- netns --------------------------------------------------------------------------------------

_netns_reason = netns.netns_unavailable_reason()
needs_netns = pytest.mark.skipif(_netns_reason is not None, reason=str(_netns_reason))


@needs_netns
@needs_ucx
def test_two_hosts_perftest_roundtrip():
    with netns.TwoHosts() as th:
        a, b = th
        assert a.addr != b.addr and a.peer_addr == b.addr
        bw = perftest.run_perftest(
            "tcp", "put", 1 << 20, iters=64, timeout=20, server_addr=a.addr,
            server_env={"UCX_NET_DEVICES": a.ifname}, client_env={"UCX_NET_DEVICES": b.ifname},
            server_popen=a.popen, client_popen=b.popen)
        assert math.isfinite(bw) and bw > 0
        names = th.namespaces
    assert not set(names) & set(netns.list_netns())
    assert _our_ucx_children() == []


@needs_netns
def test_two_hosts_cleanup_after_exit_and_exception():
    with netns.TwoHosts() as th:
        names = th.namespaces
        assert set(names) <= set(netns.list_netns())
        # A lingering process inside the namespace must not keep it alive.
        th.a.popen(["sleep", "30"])
    assert not set(names) & set(netns.list_netns())

    with pytest.raises(ZeroDivisionError), netns.TwoHosts(rate="1gbit") as th:
        names = th.namespaces
        raise ZeroDivisionError
    assert not set(names) & set(netns.list_netns())
