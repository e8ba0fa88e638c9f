"""``rdmaflow info``: what this machine's rdmaflow and UCX can do, for bringing up a cluster.

Prints the rdmaflow and UCX versions, which libucp was loaded (the libucx wheel's or a system
UCX), which libucx wheel is installed and PyTorch's CUDA version, the transports and devices UCX
finds (``ucx_info -d``), whether RDMA verbs and CUDA transports are among them and whether
GPUDirect RDMA is possible, the UCX_*/RDMAFLOW_* settings in force (secrets masked), and what
a temporary rdmaflow Device actually enabled and where it listens (its handshake listener and
UCX's tcp data ports, on the interface of its address only: docs/security.md). A
``$RDMAFLOW_JOB_SECRET`` that devices refuse as too weak is reported (exit status 1) and the
temporary device made with a secret of its own. ``--json`` gives the same as one JSON object.
"""
from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import re
import secrets
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

VERBS_TRANSPORTS = ("rc_verbs", "ud_verbs", "rc_mlx5", "dc_mlx5", "ud_mlx5")
CUDA_TRANSPORTS = ("cuda_copy", "cuda_ipc", "gdr_copy")
#: Kernel modules that let an RDMA NIC reach GPU memory (GPUDirect RDMA): the driver's
#: nvidia_peermem, or Mellanox's older nv_peer_mem.
PEER_MEMORY_MODULES = ("nvidia_peermem", "nv_peer_mem")
SECRET_ENV = "RDMAFLOW_JOB_SECRET"
_SECRET_WORDS = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "KEY")
_TOOL_TIMEOUT = 15.0

NO_VERBS_HINT = (
    "this UCX has no verbs transports (the libucx wheel is built without verbs); install a "
    "UCX built with verbs (e.g. the cluster's HPC-X/OFED UCX) and rebuild rdmaflow with "
    "RDMAFLOW_UCX_ROOT=<prefix>, see README")
NO_VERBS_DEVICE_HINT = (
    "this UCX is built with verbs but found no usable RDMA device; check `ibv_devinfo` / "
    "`rdma link`, the NIC driver (mlx5_ib), /dev/infiniband permissions and the locked-memory "
    "limit (`ulimit -l`)")
NO_CUDA_HINT = "this UCX has no CUDA transports (it is built without CUDA)"
NO_CUDA_DEVICE_HINT = ("this UCX is built with CUDA but found no GPU (no NVIDIA driver or "
                       "device visible to this process)")


# ------------------------------------------------------------------------------------------
# Decisions (pure functions of what was gathered)


def gpudirect_rdma(verbs: Sequence[str], cuda: Sequence[str], peer_memory: Sequence[str]) -> dict[str, Any]:
    """Whether GPUDirect RDMA (the NIC reading and writing GPU memory) is possible, from the verbs
    and CUDA transports this UCX found and the peer-memory kernel modules loaded. It takes all
    three: a verbs transport, a CUDA transport (UCX's CUDA memory domain), and the kernel's
    peer-memory support (:data:`PEER_MEMORY_MODULES`) or UCX's ``gdr_copy`` transport.

    Returns {"possible", "missing": [what is missing], "reason": one line, "verbs", "cuda",
    "peer_memory"}."""
    verbs = [t for t in verbs if t in VERBS_TRANSPORTS]
    cuda = [t for t in cuda if t in CUDA_TRANSPORTS]
    peer_memory = [m for m in peer_memory if m in PEER_MEMORY_MODULES]
    missing = []
    if not verbs:
        missing.append("an RDMA verbs transport in this UCX")
    if not cuda:
        missing.append("a CUDA transport in this UCX")
    if not peer_memory and "gdr_copy" not in cuda:
        missing.append("GPU peer memory: the nvidia_peermem (or nv_peer_mem) kernel module loaded, "
                       "or UCX's gdr_copy transport")
    if missing:
        reason = "missing " + "; ".join(missing)
    else:
        reason = ", ".join(verbs) + " + " + ", ".join(cuda) + " with " + (
            ", ".join(peer_memory) if peer_memory else "gdr_copy")
    return {"possible": not missing, "missing": missing, "reason": reason, "verbs": verbs,
            "cuda": cuda, "peer_memory": peer_memory}


def ucx_wheel_warning(installed: Sequence[str], torch_cuda: str | None, built_against: str) -> str | None:
    """A warning when the libucx wheels installed (distribution names) do not suit a PyTorch
    with CUDA ``torch_cuda``: more than one (they overwrite each other's files), none for an
    extension built against a wheel, or, for a PyTorch with CUDA, another than
    :func:`rdmaflow._ucx.wheel_for_cuda` names. None when they suit."""
    from rdmaflow import _ucx

    expected = _ucx.wheel_for_cuda(torch_cuda)
    fix = f"run scripts/setup.sh, or pip uninstall them all and pip install {expected}"
    if len(installed) > 1:
        return (f"more than one libucx wheel is installed ({', '.join(installed)}); they share the "
                f"package libucx and break each other: {fix}")
    if built_against != "wheel":
        return None
    if not installed:
        return f"rdmaflow was built against a libucx wheel but none is installed: pip install {expected}"
    if torch_cuda and installed[0] != expected:  # without CUDA in PyTorch, either wheel serves
        return f"{installed[0]} is installed but this PyTorch (CUDA {torch_cuda}) goes with {expected}: {fix}"
    return None


# ------------------------------------------------------------------------------------------
# Gathering


def loaded_kernel_modules(names: Sequence[str], sys_module: str = "/sys/module",
                          proc_modules: str = "/proc/modules") -> list[str]:
    """Those of ``names`` that the kernel has loaded: /sys/module/<name>, else /proc/modules."""
    listed: set[str] = set()
    try:
        with open(proc_modules) as f:
            listed = {line.split(None, 1)[0] for line in f if line.strip()}
    except OSError:
        pass
    return [n for n in names if os.path.isdir(os.path.join(sys_module, n)) or n in listed]


def _torch_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError as e:
        return {"version": None, "cuda": None, "cuda_available": False, "gpus": 0, "error": str(e)}
    available = bool(torch.cuda.is_available())
    return {"version": torch.__version__, "cuda": torch.version.cuda, "cuda_available": available,
            "gpus": torch.cuda.device_count() if available else 0}



def _loaded_ucx_libs() -> dict[str, str]:
    """{"libucp": path, ...} of the UCX libraries mapped into this process."""
    libs: dict[str, str] = {}
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) < 6:
                    continue
                path = parts[5].strip()
                m = re.search(r"/(libuc[pstm])\.so[.\d]*$", path)
                if m:
                    libs.setdefault(m.group(1), path)
    except OSError:
        pass
    return libs


def _ucx_source(libucp: str | None) -> str:
    from rdmaflow import _ucx

    if not libucp:
        return "unknown"
    wd = _ucx.wheel_dir()
    if wd and os.path.realpath(libucp).startswith(os.path.realpath(wd) + os.sep):
        return "libucx wheel"
    return "system"


def _ucx_info_tool(libucp: str | None, source: str) -> tuple[str | None, dict[str, str]]:
    """The ucx_info that belongs to the loaded libucp, and the environment to run it in."""
    from rdmaflow import _ucx

    if libucp and source == "system":
        # <prefix>/lib/libucp.so -> <prefix>/bin/ucx_info, run against that lib dir.
        libdir = os.path.dirname(os.path.realpath(libucp))
        for cand in (os.path.join(os.path.dirname(libdir), "bin", "ucx_info"),):
            if os.access(cand, os.X_OK):
                env = dict(os.environ)
                env["LD_LIBRARY_PATH"] = libdir + (
                    ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
                return cand, env
    return _ucx.bin_path("ucx_info"), _ucx.tool_env()


def _run_tool(argv: list[str], env: dict[str, str]) -> tuple[str | None, str | None]:
    """(stdout, error)."""
    try:
        p = subprocess.run(argv, env=env, stdin=subprocess.DEVNULL, capture_output=True,
                           text=True, timeout=_TOOL_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{' '.join(argv)}: {e}"
    if p.returncode != 0:
        return None, f"{' '.join(argv)} exited with {p.returncode}: {p.stderr.strip()[-500:]}"
    return p.stdout, None


def parse_ucx_info_d(text: str) -> list[dict[str, str]]:
    """[{"transport", "device", "md"}] from ``ucx_info -d`` output."""
    found: list[dict[str, str]] = []
    md = ""
    transport: str | None = None
    for line in text.splitlines():
        s = line.strip().lstrip("#").strip()
        if s.startswith("Memory domain:"):
            md = s.split(":", 1)[1].strip()
            transport = None
        elif s.startswith("Transport:"):
            transport = s.split(":", 1)[1].strip()
        elif s.startswith("Device:") and transport:
            found.append({"transport": transport, "device": s.split(":", 1)[1].strip(), "md": md})
            transport = None
    return found


_RESOURCE_RE = re.compile(r"resource\s+\d+\s*:.*?--\s+(\S+?)/(\S+)\s*$")


def parse_context_resources(text: str) -> list[dict[str, str]]:
    """[{"transport", "device"}] from ``ucp_context_print_info`` (``Device.ucx_info()``)."""
    out = []
    for line in text.splitlines():
        m = _RESOURCE_RE.search(line.strip().lstrip("#").strip())
        if m:
            out.append({"transport": m.group(1), "device": m.group(2)})
    return out


def _configure_flags(version_text: str | None) -> list[str]:
    if not version_text:
        return []
    for line in version_text.splitlines():
        s = line.strip().lstrip("#").strip()
        if s.startswith("Configured with:"):
            return s.split(":", 1)[1].split()
    return []


def _masked(name: str, value: str) -> str:
    if name == SECRET_ENV or any(w in name.upper() for w in _SECRET_WORDS):
        return f"<set, {len(value)} characters, masked>" if value else "<empty>"
    return value


def settings(environ: dict[str, str] | None = None) -> dict[str, str]:
    env = os.environ if environ is None else environ
    return {k: _masked(k, v) for k, v in sorted(env.items())
            if k.startswith(("UCX_", "RDMAFLOW_"))}


CONNECT_TLS = ("tcp", "rdmacm", "all")  # UCX_TLS entries that keep the sockaddr connection manager
TCP_FIX = "add tcp to UCX_TLS (e.g. UCX_TLS=cma,posix,self,tcp) or unset it"


def _tls_connects(tls: str) -> bool:
    """Whether UCX_TLS=``tls`` keeps a transport devices connect through (``^x`` excludes x)."""
    entries = [t.strip() for t in tls.split(",") if t.strip()]
    if entries and entries[0].startswith("^"):
        return not {e.lstrip("^") for e in entries} >= {"tcp", "rdmacm"}
    return any(e in CONNECT_TLS for e in entries)


def explain_device_error(error: str, environ: dict[str, str] | None = None) -> str | None:
    """The UCX setting behind a device error (``ucp_init failed: No such device``, an unreachable
    peer) and its fix, or None when the settings do not explain it."""
    env = os.environ if environ is None else environ
    tls, nets = env.get("UCX_TLS", ""), env.get("UCX_NET_DEVICES", "")
    if "ucp_init failed" in error or "No such device" in error:
        if tls:
            return (f"UCX_TLS={tls} names no transport UCX can use on this host: unset it, or name transports "
                    "`rdmaflow info` lists, with tcp (e.g. UCX_TLS=cma,posix,self,tcp)")
        if nets:
            return (f"UCX_NET_DEVICES={nets} names no device of this host ({', '.join(_net_devices()) or 'none found'})"
                    ": name one, or unset it")
    if "unreachable" in error and tls and not _tls_connects(tls):
        return (f"UCX_TLS={tls} has no tcp: rdmaflow devices connect through UCX's sockaddr connection manager "
                f"over tcp (or rdmacm), even when data moves over shared memory; {TCP_FIX}")
    return None


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int]]:
    """(address, port) of every TCP socket process ``pid`` holds that listens, from
    /proc/PID/net/tcp{,6} and the socket inodes among its fds; sorted."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
                if link.startswith("socket:["):
                    inodes.add(link[8:-1])
    except OSError:
        return []
    found = set()
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) < 10 or cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = cols[1].split(":")
            raw = bytes.fromhex(hexaddr)
            # the kernel prints each 32-bit word in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            found.add((str(ipaddress.ip_address(raw)), int(hexport, 16)))
    return sorted(found)


def _temporary_device() -> dict[str, Any]:
    import rdmaflow

    secret = os.environ.get(SECRET_ENV) or secrets.token_hex(16)
    secret_error = None
    before = set(listening_sockets())
    try:
        try:
            dev = rdmaflow.Device("127.0.0.1:0", secret=secret, connect_timeout=5.0, rpc_timeout=5.0)
        except rdmaflow.InvalidArgumentError as e:
            if "job secret is too weak" not in str(e):
                raise
            # Reported on its own; the probe of this host goes on with a secret of its own.
            secret_error = str(e)
            dev = rdmaflow.Device("127.0.0.1:0", secret=secrets.token_hex(16), connect_timeout=5.0, rpc_timeout=5.0)
    except Exception as e:  # noqa: BLE001 - reported, not raised
        return {"ok": False, "error": f"{type(e).__name__}: {e}", "transports": [], "text": "",
                "secret_error": secret_error}
    try:
        text = dev.ucx_info()
        listening = [f"[{a}]:{p}" if ":" in a else f"{a}:{p}" for a, p in sorted(set(listening_sockets()) - before)]
        return {"ok": True, "error": None, "secret_error": secret_error, "endpoint": dev.endpoint,
                "transports": parse_context_resources(text), "text": text,
                "same_host_mapping": bool(dev.same_host_mapping),
                "net_devices": dev.net_devices, "listening": listening}
    finally:
        dev.close()


def _presence(names: Sequence[str], found: list[dict[str, str]]) -> list[str]:
    seen: list[str] = []
    for r in found:
        if r["transport"] in names and r["transport"] not in seen:
            seen.append(r["transport"])
    return seen


def gather() -> dict[str, Any]:
    """Everything ``rdmaflow info`` reports, as a JSON-able dict."""
    import rdmaflow
    from rdmaflow import _ucx

    info: dict[str, Any] = {
        "rdmaflow_version": rdmaflow.__version__,
        "rdmaflow_path": os.path.dirname(os.path.abspath(rdmaflow.__file__)),
        "python": sys.version.split()[0],
        "ucx_version": rdmaflow.ucx_version(),
        "warnings": [],
    }
    libs = _loaded_ucx_libs()
    libucp = libs.get("libucp")
    source = _ucx_source(libucp)
    info["libucp_path"] = libucp
    info["ucx_source"] = source
    info["libucx_wheel_dir"] = _ucx.wheel_dir()
    build = getattr(_ucx, "build_source", lambda: "unknown")()
    info["ucx_built_against"] = build  # "wheel" or "system" (rdmaflow/_build_info.py)
    if libucp and (build, source) in (("wheel", "system"), ("system", "libucx wheel")):
        info["warnings"].append(
            f"rdmaflow was built against the {build} UCX but loaded the {source} one from "
            f"{libucp}; rebuild rdmaflow, or check LD_LIBRARY_PATH / "
            "RAPIDS_LIBUCX_PREFER_SYSTEM_LIBRARY")

    tool, tool_env = _ucx_info_tool(libucp, source)
    info["ucx_info_tool"] = tool
    transports: list[dict[str, str]] = []
    flags: list[str] = []
    if tool:
        out, err = _run_tool([tool, "-d"], tool_env)
        if out is not None:
            transports = parse_ucx_info_d(out)
        if err:
            info["warnings"].append(err)
        vout, _ = _run_tool([tool, "-v"], tool_env)
        flags = _configure_flags(vout)
    else:
        info["warnings"].append("ucx_info not found (libucx wheel bin/, $UCX_HOME/bin, PATH)")
    wanted = r"--(with|without|enable|disable)-(verbs|rdmacm|cuda|rocm|mlx5|gdrcopy|cma|knem|xpmem|mt)"
    info["ucx_configure"] = [f for f in flags if re.match(wanted, f)]

    dev = _temporary_device()
    info["device"] = {k: v for k, v in dev.items() if k != "text"}
    if not transports and dev["transports"]:
        transports = dev["transports"]
        info["transports_source"] = "Device.ucx_info() (limited by UCX_TLS/UCX_NET_DEVICES)"
    else:
        info["transports_source"] = "ucx_info -d" if transports else "none"
    info["transports"] = transports
    if not dev["ok"]:
        info["warnings"].append(f"a temporary rdmaflow Device could not be created: {dev['error']}")
    if dev["secret_error"]:
        info["warnings"].append(f"every device refuses ${SECRET_ENV}: {dev['secret_error']}")

    verbs = _presence(VERBS_TRANSPORTS, transports)
    built_without_verbs = "--without-verbs" in flags
    info["rdma_verbs"] = {
        "present": bool(verbs), "transports": verbs,
        "hint": None if verbs else (NO_VERBS_HINT if built_without_verbs or not flags
                                    else NO_VERBS_DEVICE_HINT)}
    cuda = _presence(CUDA_TRANSPORTS, transports)
    built_with_cuda = any(f.startswith("--with-cuda") for f in flags)
    info["cuda"] = {
        "present": bool(cuda), "transports": cuda,
        "hint": None if cuda else (NO_CUDA_DEVICE_HINT if built_with_cuda else NO_CUDA_HINT)}
    info["gpudirect_rdma"] = gpudirect_rdma(verbs, cuda, loaded_kernel_modules(PEER_MEMORY_MODULES))

    info["torch"] = _torch_info()
    wheels = _ucx.installed_wheels()
    info["libucx_wheels"] = [{"name": n, "version": v} for n, v in wheels]
    info["libucx_wheel_expected"] = _ucx.wheel_for_cuda(info["torch"]["cuda"])
    warning = ucx_wheel_warning([n for n, _ in wheels], info["torch"]["cuda"], build)
    if warning:
        info["warnings"].append(warning)
    info["settings"] = settings()
    return info


# ------------------------------------------------------------------------------------------
# Printing


def _group(resources: list[dict[str, str]]) -> list[tuple[str, list[str]]]:
    order: dict[str, list[str]] = {}
    for r in resources:
        devs = order.setdefault(r["transport"], [])
        if r["device"] not in devs:
            devs.append(r["device"])
    return list(order.items())


def format_text(info: dict[str, Any]) -> str:
    lines = [f"rdmaflow {info['rdmaflow_version']} ({info['rdmaflow_path']}), Python {info['python']}"]
    lines.append(f"UCX {info['ucx_version']}: {info['libucp_path'] or 'libucp not found in /proc/self/maps'}"
                 f" ({info['ucx_source']}; rdmaflow built against: {info['ucx_built_against']})")
    if info["ucx_configure"]:
        lines.append(f"  built with: {' '.join(info['ucx_configure'])}")
    lines.append(f"  ucx_info: {info['ucx_info_tool'] or 'not found'}")
    wheels = ", ".join(f"{w['name']} {w['version']}" for w in info["libucx_wheels"]) or "none"
    lines.append(f"  libucx wheel installed: {wheels} " + (
        "(not used: rdmaflow is built against a system UCX)" if info["ucx_built_against"] == "system"
        else f"(for this PyTorch: {info['libucx_wheel_expected']})"))
    t = info["torch"]
    if t["version"] is None:
        lines.append(f"PyTorch: not importable ({t.get('error')})")
    else:
        gpus = f", {t['gpus']} GPU(s) visible" if t["cuda_available"] else ", no GPU visible"
        lines.append(f"PyTorch {t['version']}: CUDA {t['cuda']}{gpus}" if t["cuda"]
                     else f"PyTorch {t['version']}: CPU-only build (no CUDA)")
    lines.append("")
    lines.append(f"Transports and devices UCX found ({info['transports_source']}):")
    if info["transports"]:
        width = max(len(t) for t, _ in _group(info["transports"]))
        for t, devs in _group(info["transports"]):
            lines.append(f"  {t:<{width}}  {', '.join(devs)}")
    else:
        lines.append("  none")
    v = info["rdma_verbs"]
    lines.append("")
    lines.append(f"RDMA verbs: yes ({', '.join(v['transports'])})" if v["present"]
                 else f"RDMA verbs: no — {v['hint']}")
    c = info["cuda"]
    lines.append(f"CUDA: yes ({', '.join(c['transports'])})" if c["present"]
                 else f"CUDA: no — {c['hint']}")
    g = info["gpudirect_rdma"]
    lines.append(f"GPUDirect RDMA: {'yes' if g['possible'] else 'no'} — {g['reason']}")
    lines.append("")
    lines.append("UCX settings in force (UCX_*, RDMAFLOW_* environment):")
    if info["settings"]:
        for k, val in info["settings"].items():
            lines.append(f"  {k}={val}")
    else:
        lines.append("  none (UCX defaults: every transport found may be used)")
    lines.append("")
    d = info["device"]
    if d["ok"]:
        res = ", ".join(f"{t}/{'/'.join(devs)}" if len(devs) == 1 else f"{t}/{{{','.join(devs)}}}"
                        for t, devs in _group(d["transports"]))
        lines.append(f"A temporary rdmaflow Device ({d['endpoint']}) enabled: {res or 'nothing'}")
        names = {r["transport"] for r in d["transports"]}
        if "tcp" not in names and not names & set(VERBS_TRANSPORTS):
            nets = os.environ.get("UCX_NET_DEVICES")
            fix = (f"UCX_NET_DEVICES={nets} names no network device tcp can use: name one of this host's "
                   f"({', '.join(_net_devices()) or 'none found'}), e.g. UCX_NET_DEVICES=lo, or unset it"
                   if nets and "tcp" in {r["transport"] for r in info["transports"]} else
                   TCP_FIX)
            lines.append("  warning: no tcp among them: rdmaflow devices connect through UCX's "
                         f"sockaddr connection manager and will not reach their peers; {fix}")
        lines.append(f"It listens on {', '.join(d['listening']) or 'nothing found'} (its handshake listener and "
                     f"UCX's tcp data ports); UCX network devices: {d['net_devices']} "
                     + ("(UCX_NET_DEVICES)" if os.environ.get("UCX_NET_DEVICES") else
                        "(the interface of its address: a job's devices listen where the job is, docs/security.md)"))
        lines.append("Same-host fast path (peers on this host map regions, one memcpy): " +
                     ("on" if d.get("same_host_mapping") else
                      "off (RDMAFLOW_SAME_HOST=0, or UCX_TLS rules out shared memory)"))
    else:
        known = explain_device_error(d["error"])
        hint = ("" if "RDMAFLOW_" in d["error"] else  # a bad rdmaflow setting names itself
                f" ({known})" if known else
                " (check the UCX_* settings above: UCX_TLS and UCX_NET_DEVICES must name transports and devices "
                "this host has)")
        lines.append(f"A temporary rdmaflow Device could not be created: {d['error']}{hint}")
    for w in info["warnings"]:
        if not w.startswith("a temporary rdmaflow Device"):
            lines.append(f"warning: {w}")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Prints the report; exits 1 when no rdmaflow Device can be made here (scripts check it),
    a weak ``$RDMAFLOW_JOB_SECRET`` included."""
    info = gather()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_text(info))
    return 0 if info["device"]["ok"] and not info["device"]["secret_error"] else 1


def _net_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/net"))
    except OSError:
        return []


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rdmaflow info", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
