"""UCX outside the extension: its libraries, its tools, and the transport environments.

* :func:`load` preloads the libucx wheel's libraries before the extension is imported, so that
  the extension's ``libucp.so.0`` dependency resolves. A build against a system UCX
  (``RDMAFLOW_UCX_ROOT``) finds it through its rpath and loads nothing from the wheel.
* :data:`WHEELS` / :func:`wheel_for_cuda`: which libucx wheel (``libucx-cu12``, ``libucx-cu13``:
  one importable ``libucx`` each, never both) goes with a PyTorch's CUDA version;
  :func:`installed_wheels` says which are installed. ``scripts/setup.sh`` and ``rdmaflow info``
  use them.
* :func:`bin_path` / :func:`find_bin` locate UCX's tools (``ucx_info``, ``ucx_perftest``);
  :func:`tool_env` is an environment in which they find their libraries.
* :func:`net_devices_for` is the ``UCX_NET_DEVICES`` a device gets by default: the interface
  of its own address (and the host's RDMA ports), so that UCX's tcp data ports listen only
  where the job is (docs/security.md).
* :func:`ucx_env` is the one definition of the transports that tests and benchmarks run
  over (:data:`TRANSPORT_ENV`): "tcp", "sm", "sm-cma", "cuda" (sm with UCX's CUDA
  transports) and "cuda-tcp".

Standard library only, and nothing here loads a library at import: the benchmark tools and
``rdmaflow.testing`` use it without the C++ extension.
"""
from __future__ import annotations

import fcntl
import importlib.util
import ipaddress
import os
import shutil
import socket
import struct
from collections.abc import Mapping

#: transport name -> the variables that restrict a process to it. :func:`ucx_env` adds
#: ``UCX_NET_DEVICES`` (``lo`` unless another device is given) and :data:`COMMON_ENV`.
TRANSPORT_ENV: dict[str, dict[str, str]] = {
    "tcp": {"UCX_TLS": "tcp"},
    # tcp is there for the connection manager only (rdmaflow devices connect through UCX's
    # sockaddr CM, which needs it); intra-node puts and gets take cma. posix is needed because
    # UCP wire-up needs an active-message transport ("cma,self" alone fails), self covers
    # loopback endpoints. Without cma (posix,self) puts are emulated over the shm FIFO.
    "sm": {"UCX_TLS": "cma,posix,self,tcp"},
    # sm with rdmaflow's same-host mapping turned off: every memcpy goes through UCX (cma).
    "sm-cma": {"UCX_TLS": "cma,posix,self,tcp", "RDMAFLOW_SAME_HOST": "0"},
    # sm plus UCX's CUDA transports: GPU memory between processes of one host (cuda_ipc), and
    # between GPU and host memory (cuda_copy).
    "cuda": {"UCX_TLS": "cma,posix,self,tcp,cuda_copy,cuda_ipc"},
    # GPU memory over sockets alone, staged through host memory by cuda_copy: what two hosts
    # without RDMA do.
    "cuda-tcp": {"UCX_TLS": "tcp,cuda_copy"},
}
TRANSPORTS = tuple(TRANSPORT_ENV)
DEFAULT_NET_DEVICE = "lo"

#: Settings for every transport. Processes may carry UCX_* variables meant for other
#: components; the "unused variable" warnings would pollute the stderr the tools parse.
COMMON_ENV: dict[str, str] = {"UCX_WARN_UNUSED_ENV_VARS": "n"}

#: CUDA major version -> the libucx wheel built for it (pyproject.toml's extras ``cu12``, ``cu13``
#: and its ``tool.scikit-build`` build requirements). Both install the same package ``libucx``
#: (the same UCX release, the same ``libucp.so.0``), so exactly one of them may be installed.
WHEELS: dict[str, str] = {"12": "libucx-cu12", "13": "libucx-cu13"}
#: The wheel for a CPU-only PyTorch, no PyTorch, and CUDA majors without a wheel of their own.
DEFAULT_WHEEL = "libucx-cu12"

NO_UCX_HINT = (
    "rdmaflow needs UCX and finds none: install the libucx wheel that matches your PyTorch's "
    "CUDA major version, libucx-cu12 (CUDA 12 or a CPU-only PyTorch: pip install 'rdmaflow[cu12]') "
    "or libucx-cu13 (CUDA 13: pip install 'rdmaflow[cu13]'), never both; or rebuild rdmaflow "
    "against a system UCX with RDMAFLOW_UCX_ROOT=<prefix> (see README)")


def wheel_for_cuda(cuda: str | None) -> str:
    """The libucx wheel for a PyTorch built with CUDA ``cuda`` (``torch.version.cuda``: "13.0",
    "12.8"; None for a CPU build): :data:`WHEELS` by major version, else :data:`DEFAULT_WHEEL`."""
    major = (cuda or "").strip().split(".")[0]
    return WHEELS.get(major, DEFAULT_WHEEL)


def wheel_name(choice: str) -> str:
    """``"cu13"``, ``"13"`` or ``"libucx-cu13"`` -> ``"libucx-cu13"``; ValueError for a wheel not
    in :data:`WHEELS`."""
    c = choice.strip().lower().replace("_", "-")
    name = c if c.startswith("libucx-") else "libucx-" + (c if c.startswith("cu") else "cu" + c)
    if name not in WHEELS.values():
        raise ValueError(f"unknown libucx wheel {choice!r}; expected one of {sorted(WHEELS.values())}")
    return name


def installed_wheels() -> list[tuple[str, str]]:
    """[(distribution name, version)] of the libucx wheels installed (``libucx-cu12`` ...),
    sorted; more than one means a broken ``libucx`` package."""
    import importlib.metadata

    found = set()
    for d in importlib.metadata.distributions():
        name = (d.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith("libucx-"):
            found.add((name, d.version))
    return sorted(found)


def wheel_dir() -> str | None:
    """The libucx wheel's package directory, or None. Found without importing it (importing
    it loads nothing today, but a spec lookup never will)."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return os.path.dirname(spec.origin)


def build_source() -> str:
    """'wheel' or 'system': which UCX the extension was built against."""
    try:
        from rdmaflow._build_info import UCX_SOURCE
    except ImportError:
        return "wheel"
    return UCX_SOURCE


def load() -> None:
    # A build against a system UCX finds it through its rpath; preloading the wheel's copy
    # would put two UCX builds in one process.
    if build_source() == "system":
        return
    try:
        import libucx
    except ImportError:
        # No wheel: a UCX on the loader's path may still serve; if there is none, say which
        # wheel to install rather than leave it to "libucp.so.0: cannot open shared object file".
        import ctypes

        try:
            ctypes.CDLL("libucp.so.0", ctypes.RTLD_LOCAL)
        except OSError:
            raise ImportError(NO_UCX_HINT) from None
        return
    libucx.load_library()


def _roots() -> list[str]:
    """Where UCX may be installed: the wheel, then $UCX_HOME."""
    return [r for r in (wheel_dir(), os.environ.get("UCX_HOME")) if r]


def lib_dir() -> str | None:
    """The directory holding libucp.so: the wheel's lib/, else $UCX_HOME/lib; None if neither."""
    for root in _roots():
        d = os.path.join(root, "lib")
        if os.path.isfile(os.path.join(d, "libucp.so.0")) or os.path.isfile(os.path.join(d, "libucp.so")):
            return d
    return None


def bin_path(name: str) -> str | None:
    """Path of a UCX tool (``ucx_info``, ``ucx_perftest``): the wheel's, $UCX_HOME's or PATH's."""
    for root in _roots():
        p = os.path.join(root, "bin", name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return shutil.which(name)


def find_bin(name: str) -> str:
    """:func:`bin_path`, raising FileNotFoundError (saying where it looked) when there is none."""
    p = bin_path(name)
    if p is None:
        where = [os.path.join(r, "bin") for r in _roots()] or "no wheel/UCX_HOME dirs"
        raise FileNotFoundError(f"{name} not found (looked in {where} and PATH); "
                                "install the libucx-cu12 or libucx-cu13 wheel or set UCX_HOME")
    return p


def tool_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of ``base`` (default ``os.environ``) in which UCX's binaries find their
    libraries: :func:`lib_dir` first on ``LD_LIBRARY_PATH``."""
    env = dict(os.environ if base is None else base)
    lib = lib_dir()
    if lib:
        parts = [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p and p != lib]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([lib, *parts])
    return env


def transport_vars(transport: str, *, net_device: str | None = None) -> dict[str, str]:
    """The variables that put a process on ``transport`` (one of :data:`TRANSPORTS`): its
    :data:`TRANSPORT_ENV` entry, :data:`COMMON_ENV` and ``UCX_NET_DEVICES``."""
    if transport not in TRANSPORT_ENV:
        raise ValueError(f"unknown transport {transport!r}; expected one of {sorted(TRANSPORT_ENV)}")
    # Also for sm: UCX_NET_DEVICES filters network devices only (shared memory is under
    # UCX_SHM_DEVICES), and keeps the connection manager's tcp lane on loopback, not eth0.
    return {**COMMON_ENV, **TRANSPORT_ENV[transport], "UCX_NET_DEVICES": net_device or DEFAULT_NET_DEVICE}


def ucx_env(transport: str, base_env: Mapping[str, str] | None = None, *,
            net_device: str | None = None) -> dict[str, str]:
    """The environment of a process restricted to ``transport``: ``base_env`` (default
    ``os.environ``; copied, not modified) with :func:`transport_vars` and :func:`tool_env`'s
    ``LD_LIBRARY_PATH``. ``net_device`` replaces ``lo`` in ``UCX_NET_DEVICES`` (e.g. a veth
    inside a network namespace)."""
    env = tool_env(base_env)
    env.update(transport_vars(transport, net_device=net_device))
    return env


def with_tcp(env: dict[str, str]) -> dict[str, str]:
    """Makes sure ``UCX_TLS`` in ``env`` (modified in place, and returned) allows ``tcp``:
    rdmaflow devices connect through UCX's sockaddr connection manager, which needs it even
    when the data goes over shared memory."""
    tls = env.get("UCX_TLS", "").strip()
    if not tls:
        return env  # UCX's default: every transport
    if tls.startswith("^"):
        names = [t for t in tls[1:].split(",") if t and t != "tcp"]
        env["UCX_TLS"] = "^" + ",".join(names) if names else "all"
        return env
    names = [t.strip() for t in tls.split(",") if t.strip()]
    if not {"tcp", "all"} & set(names):
        env["UCX_TLS"] = ",".join(names + ["tcp"])
    return env


SIOCGIFADDR = 0x8915  # ioctl: an interface's IPv4 address
ALL_DEVICES = "all"


def _ipv4_of(name: str) -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            got = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(got[20:24])


def _ipv6_interfaces(sys_root: str = "/proc/net/if_inet6") -> dict[str, str]:
    """IPv6 address (compressed) -> the interface holding it."""
    found = {}
    try:
        with open(sys_root) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 6:
                    found[str(ipaddress.IPv6Address(bytes.fromhex(parts[0])))] = parts[5]
    except (OSError, ValueError):
        pass
    return found


def interface_of(address: str) -> str | None:
    """The network interface that holds IP ``address`` on this host (``lo`` for any loopback
    address), or None: a wildcard address (every interface), or one this host does not hold."""
    try:
        ip = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    if ip.is_unspecified:
        return None
    names = [n for _, n in socket.if_nameindex()]
    if ip.is_loopback:
        loop = [n for n in names if n == "lo"] or [n for n in names if n.startswith("lo")]
        return loop[0] if loop else None
    if ip.version == 6:
        return _ipv6_interfaces().get(str(ip))
    return next((n for n in names if _ipv4_of(n) == str(ip)), None)


def rdma_ports(sys_root: str = "/sys/class/infiniband") -> list[str]:
    """The host's RDMA ports as UCX names them (``mlx5_0:1``): they stay usable when a device's
    UCX_NET_DEVICES is narrowed to its interface, so that verbs is not lost."""
    ports = []
    try:
        for dev in sorted(os.listdir(sys_root)):
            for port in sorted(os.listdir(os.path.join(sys_root, dev, "ports"))):
                ports.append(f"{dev}:{port}")
    except OSError:
        pass
    return ports


def net_devices_for(endpoint: str) -> str:
    """The ``UCX_NET_DEVICES`` a device listening on ``endpoint`` (``host:port``) gets by
    default: the interface holding that address, plus the host's RDMA ports; :data:`ALL_DEVICES`
    ("all", UCX's default) where the address is a wildcard or is no interface's."""
    host = endpoint.rsplit(":", 1)[0].strip("[]") if ":" in endpoint else endpoint
    try:
        addr = socket.getaddrinfo(host or None, None, type=socket.SOCK_STREAM)[0][4][0]
    except (OSError, UnicodeError):
        return ALL_DEVICES
    name = interface_of(addr)
    return ",".join([name, *rdma_ports()]) if name else ALL_DEVICES
