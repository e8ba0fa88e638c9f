"""Two (or N) "hosts" on one machine: network namespaces joined by veths.

Gives multi-host tests a real network path (own IPs, own routing, optional
rate limit) without touching any real network: the addresses live only
inside namespaces created here. Standard library only; needs root and the
``ip`` binary (``tc`` too when ``rate`` is given). ``ucx_env`` below is
:func:`rdmaflow._ucx.ucx_env`; scripts/netns_perftest.py is a self-check.

    with TwoHosts() as (a, b):
        srv = a.popen(["ucx_perftest", "-p", "13337"], env=ucx_env("tcp", net_device=a.ifname))
        cli = b.popen(["ucx_perftest", a.addr, "-p", "13337", ...], env=...)

:class:`Hosts` is the same for N hosts: each namespace has one veth into a
bridge that lives in a namespace of its own (a "switch"), so every host reaches
every other and nothing appears in the root namespace:

    with Hosts(3) as hosts:
        p = hosts.popen(2, ["python", "-m", "..."], env={...})   # runs in host 2
        hosts[0].addr, hosts[0].ifname                            # 10.252.0.1, its veth

Cleanup (``__exit__``, ``close()``, and an atexit hook for anything left
open) kills the processes still running inside the namespaces and deletes
both namespaces, which also destroys the veth pair. A SIGKILLed Python
cannot clean up; :func:`cleanup_stale` removes namespaces left by dead pids.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import ipaddress
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

__all__ = ["Host", "Hosts", "TwoHosts", "cleanup_stale", "netns_unavailable_reason"]

_DEFAULT_TIMEOUT = 10.0
_IFNAMSIZ = 15  # Linux interface names are at most 15 characters
_seq = itertools.count()
_live: dict[int, Any] = {}  # TwoHosts and Hosts still open
_live_lock = threading.Lock()


class NetnsError(RuntimeError):
    """An ``ip``/``tc`` command needed for the namespaces failed."""


def _run(argv: Sequence[str], timeout: float = _DEFAULT_TIMEOUT,
         check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        cp = subprocess.run(list(argv), stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise NetnsError(f"`{' '.join(argv)}` timed out after {timeout:.0f}s") from None
    except OSError as e:
        raise NetnsError(f"cannot run `{' '.join(argv)}`: {e}") from None
    if check and cp.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed with code {cp.returncode}: "
                         f"{(cp.stderr or cp.stdout).strip()}")
    return cp


def list_netns(timeout: float = _DEFAULT_TIMEOUT) -> list[str]:
    """Names from ``ip netns list`` (first column; it may append "(id: N)")."""
    cp = _run(["ip", "netns", "list"], timeout=timeout)
    return [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]


@functools.lru_cache(maxsize=1)
def netns_unavailable_reason() -> str | None:
    """Why TwoHosts cannot work here, or None if it can (probes once, cached)."""
    if os.geteuid() != 0:
        return f"network namespaces need root (running as uid {os.geteuid()})"
    if shutil.which("ip") is None:
        return "the `ip` binary (iproute2) is not on PATH"
    probe = f"rflprobe-{os.getpid()}-{next(_seq)}"
    try:
        _run(["ip", "netns", "add", probe], timeout=5)
    except NetnsError as e:
        return f"`ip netns add` does not work here: {e}"
    try:
        # veth support is a separate kernel feature; check it too.
        _run(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"], timeout=5)
    except NetnsError as e:
        return f"cannot create a veth pair: {e}"
    finally:
        _run(["ip", "netns", "del", probe], timeout=5, check=False)
    return None


class Host:
    """One end of a :class:`TwoHosts` pair."""

    def __init__(self, ns: str, ifname: str, addr: str, prefixlen: int, peer_addr: str) -> None:
        self.ns = ns                # network namespace name
        self.ifname = ifname        # veth device inside ns (use for UCX_NET_DEVICES)
        self.addr = addr            # this host's IPv4 address
        self.prefixlen = prefixlen
        self.peer_addr = peer_addr  # the other host's address
        self._procs: list[subprocess.Popen] = []

    def __repr__(self) -> str:
        return f"Host(ns={self.ns!r}, ifname={self.ifname!r}, addr={self.addr!r})"

    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` prefixed to run inside this namespace."""
        # `ip netns exec` execs the command (no extra fork), so pid and
        # process group of the Popen are the command's own.
        return ["ip", "netns", "exec", self.ns, *argv]

    def popen(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw: Any) -> subprocess.Popen:
        """Start ``argv`` inside this namespace; ``kw`` goes to subprocess.Popen."""
        p = subprocess.Popen(self.argv(argv), env=None if env is None else dict(env), **kw)
        self._procs.append(p)
        return p

    def run(self, argv: Sequence[str], timeout: float = _DEFAULT_TIMEOUT,
            **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run inside this namespace (bounded by ``timeout``)."""
        kw.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.argv(argv), timeout=timeout, check=kw.pop("check", False), **kw)

    def _kill_all(self, timeout: float) -> None:
        for p in self._procs:
            if p.poll() is None:
                try:
                    p.kill()
                except ProcessLookupError:
                    pass
        for p in self._procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        self._procs.clear()
        # Anything else still in the namespace (children of our commands)
        # would keep it alive after `ip netns del`; all of it is ours.
        cp = _run(["ip", "netns", "pids", self.ns], timeout=timeout, check=False)
        if cp.returncode == 0:
            for tok in cp.stdout.split():
                if tok.isdigit() and int(tok) != os.getpid():
                    try:
                        os.kill(int(tok), signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass


class _Namespaces:
    """What TwoHosts and Hosts share: open (checks, ``_build``, carriers up; undone if a step
    fails), rate shaping, and close (kill what runs, delete every namespace made)."""

    def __enter__(self):
        self.open()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self):
        reason = netns_unavailable_reason()
        if reason is not None:
            raise NetnsError(f"cannot create network namespaces: {reason}")
        if self.rate is not None and shutil.which("tc") is None:
            raise NetnsError("rate shaping needs the `tc` binary (iproute2)")
        with _live_lock:
            _live[id(self)] = self
        try:
            self._build()
            for h in self.hosts:
                self._wait_carrier(h)
        except BaseException:
            self.close()
            raise
        return self

    def _build(self) -> None:
        raise NotImplementedError

    def _add_namespace(self, ns: str) -> None:
        _run(["ip", "netns", "add", ns], timeout=self.timeout)
        self._created.append(ns)

    def _shape(self, h: Host) -> None:
        rate_bps = _parse_rate(self.rate or "")
        # tbf needs a bucket of at least one MTU-sized packet per timer tick;
        # ~1 ms worth of data (>= 64 KiB) keeps it accurate at multi-Gbit rates.
        burst = max(64 * 1024, rate_bps // 8 // 1000)
        _run(["ip", "netns", "exec", h.ns, "tc", "qdisc", "add", "dev", h.ifname, "root",
              "tbf", "rate", str(self.rate), "burst", str(burst), "latency", "50ms"],
             timeout=self.timeout)

    def _wait_carrier(self, h: Host) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            cp = _run(["ip", "-n", h.ns, "-o", "link", "show", "dev", h.ifname], timeout=self.timeout)
            if "LOWER_UP" in cp.stdout:
                return
            if time.monotonic() > deadline:
                raise NetnsError(f"{h.ifname} in {h.ns} did not come up: {cp.stdout.strip()}")
            time.sleep(0.02)

    def close(self) -> None:
        """Kill what runs in the hosts and delete every namespace made. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors = []
        for h in self.hosts:
            if h.ns in self._created:
                h._kill_all(self.timeout)
        for ns in reversed(self._created):
            cp = _run(["ip", "netns", "del", ns], timeout=self.timeout, check=False)
            if cp.returncode != 0 and ns in list_netns():
                errors.append(f"{ns}: {cp.stderr.strip()}")
        self._created.clear()
        with _live_lock:
            _live.pop(id(self), None)
        if errors:
            raise NetnsError("could not delete namespaces: " + "; ".join(errors))


class TwoHosts(_Namespaces):
    """Context manager: two namespaces ``a`` and ``b`` joined by a veth pair.

    ``prefix``: start of the namespace names (``{prefix}-{pid}-{n}-a``/``-b``).
    ``subnet``: a private /30 (or larger) network; host a gets the first
    usable address, b the second. The addresses exist only in these namespaces.
    ``rate``: optional tc rate, e.g. "10gbit", applied as a tbf qdisc on
    both veth ends (so each direction is limited).
    ``mtu``: optional MTU for the veth pair (kernel default is 1500).
    ``timeout``: bound for each ``ip``/``tc`` command.
    """

    def __init__(self, prefix: str = "rfl", *, subnet: str = "10.251.0.0/30",
                 rate: str | None = None, mtu: int | None = None,
                 timeout: float = _DEFAULT_TIMEOUT) -> None:
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"invalid prefix {prefix!r}: use letters, digits, '_', '.', '-'")
        net = ipaddress.ip_network(subnet)
        if net.version != 4 or net.num_addresses < 4 or not net.is_private:
            raise ValueError(f"subnet must be a private IPv4 network of /30 or larger, got {subnet}")
        hosts = list(itertools.islice(net.hosts(), 2))
        n = next(_seq)
        pid = os.getpid()
        names = (f"{prefix}-{pid}-{n}-a", f"{prefix}-{pid}-{n}-b")
        # Interfaces live inside the namespaces only, so short fixed names
        # cannot collide; keep them under IFNAMSIZ anyway.
        ifs = (f"{prefix}-a"[:_IFNAMSIZ], f"{prefix}-b"[:_IFNAMSIZ])
        if ifs[0] == ifs[1]:
            ifs = ("veth-a", "veth-b")
        self.rate = rate
        self.mtu = mtu
        self.timeout = timeout
        self.a = Host(names[0], ifs[0], str(hosts[0]), net.prefixlen, str(hosts[1]))
        self.b = Host(names[1], ifs[1], str(hosts[1]), net.prefixlen, str(hosts[0]))
        self._created: list[str] = []
        self._closed = False

    # -- sequence-like access: `with TwoHosts() as (a, b)` -----------------
    @property
    def hosts(self) -> tuple[Host, Host]:
        return (self.a, self.b)

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return 2

    @property
    def namespaces(self) -> tuple[str, str]:
        return (self.a.ns, self.b.ns)

    # -- lifecycle (open, close, with: _Namespaces) ------------------------
    def _build(self) -> None:
        t = self.timeout
        for h in self.hosts:
            self._add_namespace(h.ns)
        a, b = self.a, self.b
        # Create each end directly in its namespace: nothing ever appears
        # in the root namespace, even if a later step fails.
        _run(["ip", "link", "add", a.ifname, "netns", a.ns, "type", "veth",
              "peer", "name", b.ifname, "netns", b.ns], timeout=t)
        for h in self.hosts:
            _run(["ip", "-n", h.ns, "addr", "add", f"{h.addr}/{h.prefixlen}", "dev", h.ifname], timeout=t)
            if self.mtu is not None:
                _run(["ip", "-n", h.ns, "link", "set", h.ifname, "mtu", str(self.mtu)], timeout=t)
            _run(["ip", "-n", h.ns, "link", "set", "lo", "up"], timeout=t)
            _run(["ip", "-n", h.ns, "link", "set", h.ifname, "up"], timeout=t)
            if self.rate is not None:
                self._shape(h)


class Hosts(_Namespaces):
    """Context manager: ``n`` namespaces ("hosts") on one bridge, every host reaching every other.

    Host ``i`` (``hosts[i]``, a :class:`Host`) has the namespace
    ``{prefix}-{pid}-{k}-h{i}``, one veth ``ifname`` (the same short name in every host:
    names are per namespace) and the address ``subnet`` + i + 1 (10.252.0.1, 10.252.0.2, ...
    by default). The other ends of the veths are ports of a bridge in the namespace
    ``{prefix}-{pid}-{k}-sw``, so nothing is created in the root namespace and instances
    never collide (each has its own bridge: the same subnet in two instances is fine).
    ``Host.peer_addr`` is host 0's address (host 0's own: host 1's, or its own when n == 1).

    ``rate``: optional tc rate (e.g. "10gbit"), a tbf qdisc on every host's veth (egress of
    each host). ``mtu``: optional MTU of the veths. ``timeout``: bound on each ``ip``/``tc``
    command. ``run(i, argv)`` and ``popen(i, argv, env)`` run a command in host ``i``;
    ``close()`` (also ``__exit__`` and at exit) kills what runs in the hosts and deletes every
    namespace, which destroys the veths and the bridge.
    """

    def __init__(self, n: int, prefix: str = "rfl", *, subnet: str = "10.252.0.0/24",
                 rate: str | None = None, mtu: int | None = None, ifname: str = "eth0",
                 timeout: float = _DEFAULT_TIMEOUT) -> None:
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive number of hosts, got {n!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"invalid prefix {prefix!r}: use letters, digits, '_', '.', '-'")
        if not re.fullmatch(rf"[A-Za-z0-9_.-]{{1,{_IFNAMSIZ}}}", ifname):
            raise ValueError(f"invalid interface name {ifname!r}")
        net = ipaddress.ip_network(subnet)
        if net.version != 4 or not net.is_private or net.num_addresses < n + 2:
            raise ValueError(f"subnet must be a private IPv4 network with room for {n} hosts, got {subnet}")
        addrs = [str(a) for a in itertools.islice(net.hosts(), n)]
        k = next(_seq)
        base = f"{prefix}-{os.getpid()}-{k}"
        self.switch_ns = f"{base}-sw"
        self.bridge = "br0"
        self.rate = rate
        self.mtu = mtu
        self.timeout = timeout
        self.hosts: list[Host] = []
        for i, addr in enumerate(addrs):
            peer = addrs[0] if i else (addrs[1] if n > 1 else addrs[0])
            self.hosts.append(Host(f"{base}-h{i}", ifname, addr, net.prefixlen, peer))
        self._created: list[str] = []
        self._closed = False

    def __iter__(self) -> Iterator[Host]:
        return iter(self.hosts)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    @property
    def namespaces(self) -> tuple[str, ...]:
        """Every namespace of this instance: the hosts', then the switch's."""
        return tuple(h.ns for h in self.hosts) + (self.switch_ns,)

    @property
    def addrs(self) -> list[str]:
        return [h.addr for h in self.hosts]

    def run(self, i: int, argv: Sequence[str], timeout: float = _DEFAULT_TIMEOUT,
            **kw: Any) -> subprocess.CompletedProcess:
        """subprocess.run of ``argv`` in host ``i`` (bounded by ``timeout``)."""
        return self.hosts[i].run(argv, timeout=timeout, **kw)

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None,
              **kw: Any) -> subprocess.Popen:
        """Start ``argv`` in host ``i``; ``kw`` goes to subprocess.Popen."""
        return self.hosts[i].popen(argv, env=env, **kw)

    # -- lifecycle (open, close, with: _Namespaces) ------------------------
    def _build(self) -> None:
        t = self.timeout
        sw = self.switch_ns
        for ns in (sw, *(h.ns for h in self.hosts)):
            self._add_namespace(ns)
        _run(["ip", "-n", sw, "link", "add", self.bridge, "type", "bridge"], timeout=t)
        _run(["ip", "-n", sw, "link", "set", self.bridge, "up"], timeout=t)
        _run(["ip", "-n", sw, "link", "set", "lo", "up"], timeout=t)
        for i, h in enumerate(self.hosts):
            port = f"p{i}"
            # Both ends made directly in their namespaces (nothing in the root namespace).
            _run(["ip", "link", "add", h.ifname, "netns", h.ns, "type", "veth",
                  "peer", "name", port, "netns", sw], timeout=t)
            if self.mtu is not None:
                _run(["ip", "-n", sw, "link", "set", port, "mtu", str(self.mtu)], timeout=t)
                _run(["ip", "-n", h.ns, "link", "set", h.ifname, "mtu", str(self.mtu)], timeout=t)
            _run(["ip", "-n", sw, "link", "set", port, "master", self.bridge], timeout=t)
            _run(["ip", "-n", sw, "link", "set", port, "up"], timeout=t)
            _run(["ip", "-n", h.ns, "addr", "add", f"{h.addr}/{h.prefixlen}", "dev", h.ifname], timeout=t)
            _run(["ip", "-n", h.ns, "link", "set", "lo", "up"], timeout=t)
            _run(["ip", "-n", h.ns, "link", "set", h.ifname, "up"], timeout=t)
            if self.rate is not None:
                self._shape(h)


def _parse_rate(rate: str) -> int:
    """tc rate string -> bits per second (tc units: bit, kbit, mbit, gbit, bps = bytes/s, ...)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?\s*", rate, re.IGNORECASE)
    if not m:
        raise ValueError(f"invalid rate {rate!r}; use a tc rate such as 10gbit or 500mbit")
    value = float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2).lower()]
    if (m.group(3) or "bit").lower() == "bps":
        value *= 8
    return int(value)


def cleanup_stale(prefix: str = "rfl", timeout: float = _DEFAULT_TIMEOUT) -> list[str]:
    """Delete ``{prefix}-{pid}-...`` namespaces whose creating pid is gone. Returns their names."""
    pat = re.compile(rf"^{re.escape(prefix)}-(\d+)-\d+-(?:[ab]|h\d+|sw)$")
    removed = []
    for ns in list_netns(timeout):
        m = pat.match(ns)
        if (m and not os.path.exists(f"/proc/{m.group(1)}")
                and _run(["ip", "netns", "del", ns], timeout=timeout, check=False).returncode == 0):
            removed.append(ns)
    return removed


@atexit.register
def _cleanup_at_exit() -> None:
    with _live_lock:
        pending = list(_live.values())
    for th in pending:
        with contextlib.suppress(NetnsError):  # at exit: delete what can be deleted
            th.close()
