"""Run UCX's own ``ucx_perftest`` as the bandwidth ceiling of a transport.

Standard library only, so it works before (or without) the C++ extension.

Transport settings live in one place, :data:`TRANSPORT_ENV`, and
:func:`ucx_env` turns them into a process environment; rdmaflow's own
benchmark processes must use ``ucx_env`` too so that "ceiling" and
"measured" run over exactly the same UCX configuration.

Chosen defaults and why (measured on the 2-core dev VM, UCX 1.22 from the
libucx-cu12 wheel, 16 MiB messages, several interleaved rounds; the VM is
noisy, run-to-run spread is often +-30%):

* tcp: ``UCX_TLS=tcp`` + ``UCX_NET_DEVICES=lo``. Larger
  ``UCX_TCP_{TX,RX}_SEG_SIZE``, 4 MiB socket buffers, pinning client and
  server to different cores (``-c``), ``-E sleep`` and other windows
  (``-O 1/4/32``) were all within noise. ``UCX_TCP_PUT_ENABLE=n`` is 3x
  slower. (Never set ``UCX_PROTO_ENABLE=n``: it hangs TCP RMA.)
* sm: ``UCX_TLS=cma,posix,self,tcp``. ``tcp`` is there for rdmaflow's
  connection manager only: intra-node RMA still takes cma. ``cma`` (process_vm_writev/readv) is the
  only zero-copy RMA path for memory that UCX did not allocate itself;
  ``posix`` is still needed because UCP wire-up needs an active-message
  transport (``cma,self`` alone fails: "no active messages transport");
  ``self`` covers loopback endpoints. ``sm,self`` picks the same lanes.
  Without cma (``posix,self``) puts are software-emulated over the shm FIFO.
  ``UCX_NET_DEVICES=lo`` is set here too: it does not touch shm devices but
  keeps a tcp lane that a runtime adds (e.g. for its connection manager) on
  loopback.
* Memory (perftest only, not in :func:`ucx_env`): ``ucx_perftest``
  allocates its buffers with ``ucp_mem_map(ALLOCATE)``, which by default
  (``UCX_ALLOC_PRIO=md:sysv,...``) hands out SysV shared memory. That is not
  what rdmaflow does (it registers mmap'ed or user memory), and it changes
  the result both ways: cma on those 4K-page segments is ~2x slower, while
  posix/sysv can then map the peer's buffer directly (rkey_ptr) and show
  in-cache memcpy speeds that registered user memory can never get. So by
  default we set ``UCX_ALLOC_PRIO=thp,mmap,heap`` (``memory="thp"``): plain
  anonymous memory with transparent huge pages, the best case for cma (THP is
  "madvise" on this kernel, so rdmaflow regions get it only if they
  ``madvise(MADV_HUGEPAGE)``). ``memory="mmap"`` (4K pages, like a plain
  mmap) and ``memory="ucx"`` (UCX's own default) are available for comparison.
* ``-D zcopy`` is a UCT-layer flag; the UCP tests accept it but ignore it
  (the header still says "Data layout: (automatic)"); UCP chooses zero-copy
  protocols by itself, so it is not passed.
* ``ucp_put_bw`` keeps 32 puts in flight by default; ``ucp_get`` is a
  latency test with a window of 1, so we pass ``-O 32`` to make it a
  bandwidth test like put (on this VM the window made no measurable difference).
* ``ucx_perftest`` prints bandwidth in MiB/s (it divides by 1024^2);
  :func:`run_perftest` converts to bytes per second (report 1 GB = 1e9 B).
* Each ucx_perftest process spends ~0.4 s at start-up (UCX calibrates its
  clock with a sched_yield loop), so a run costs ~0.8 s on top of the transfer.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import IO, Any

if __package__ in (None, ""):
    # Allow `python rdmaflow/bench/perftest.py` as well as `-m`.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
try:
    from rdmaflow.bench.util import format_size, parse_size, summarize
except ImportError:
    # rdmaflow/__init__ imports the C++ extension, which this tool does not
    # need; load the sibling util.py directly so it still runs unbuilt.
    _spec = importlib.util.spec_from_file_location(
        "_rdmaflow_bench_util", os.path.join(os.path.dirname(os.path.abspath(__file__)), "util.py"))
    assert _spec is not None and _spec.loader is not None
    _util = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_util)
    format_size, parse_size, summarize = _util.format_size, _util.parse_size, _util.summarize

__all__ = [
    "TRANSPORT_ENV",
    "OPS",
    "MEMORY_ALLOC",
    "find_ucx_bin",
    "ucx_lib_dir",
    "ucx_env",
    "run_perftest",
    "perftest_series",
    "auto_iters",
]

#: The single source of truth for "transport name -> UCX settings".
#: :func:`ucx_env` adds ``UCX_NET_DEVICES`` (``lo`` unless a device is given).
TRANSPORT_ENV: dict[str, dict[str, str]] = {
    "tcp": {"UCX_TLS": "tcp"},
    # tcp: rdmaflow devices connect through UCX's sockaddr connection manager, which needs
    # it; intra-node puts and gets still take cma (UCX_PROTO_INFO=y shows the lanes).
    "sm": {"UCX_TLS": "cma,posix,self,tcp"},
}
_DEFAULT_NET_DEVICE = "lo"

# Settings that apply to every transport.
_COMMON_ENV: dict[str, str] = {
    # rdmaflow processes may carry UCX_* vars meant for other components;
    # the "unused variable" warnings would pollute parsed stderr.
    "UCX_WARN_UNUSED_ENV_VARS": "n",
}

#: perftest buffer allocation -> UCX_ALLOC_PRIO (see module docstring).
MEMORY_ALLOC: dict[str, str | None] = {
    "thp": "thp,mmap,heap",
    "mmap": "mmap,heap",
    "ucx": None,  # UCX's default: SysV/POSIX shared-memory segments first
}

#: op -> (ucx_perftest test name, extra client flags).
OPS: dict[str, tuple[str, tuple[str, ...]]] = {
    "put": ("ucp_put_bw", ()),
    # ucp_get defaults to a window of 1 (latency mode); -O keeps gets in flight.
    "get": ("ucp_get", ("-O", "32")),
}

# Auto iteration count: move ~1 GiB, which is 0.1-0.9 s at the 1-12 GB/s
# this machine does, but never fewer than 16 messages for large sizes and
# never so many that per-message overhead dominates at tiny sizes.
_TARGET_BYTES = 1 << 30
_MIN_ITERS = 16
_MAX_ITERS = 200_000

_STDERR_TAIL = 2000


def _wheel_dir() -> str | None:
    # find_spec does not execute libucx/__init__, so nothing gets dlopen()ed here.
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or spec.origin is None:
        return None
    return os.path.dirname(spec.origin)


def ucx_lib_dir() -> str | None:
    """Directory holding libucp.so etc.: the libucx wheel's lib/, else $UCX_HOME/lib."""
    candidates = []
    wd = _wheel_dir()
    if wd:
        candidates.append(os.path.join(wd, "lib"))
    if os.environ.get("UCX_HOME"):
        candidates.append(os.path.join(os.environ["UCX_HOME"], "lib"))
    for c in candidates:
        if os.path.isfile(os.path.join(c, "libucp.so.0")) or os.path.isfile(os.path.join(c, "libucp.so")):
            return c
    return None


def find_ucx_bin(name: str) -> str:
    """Locate a UCX tool (``ucx_perftest``, ``ucx_info``): wheel bin/, then $UCX_HOME/bin, then PATH."""
    dirs = []
    wd = _wheel_dir()
    if wd:
        dirs.append(os.path.join(wd, "bin"))
    if os.environ.get("UCX_HOME"):
        dirs.append(os.path.join(os.environ["UCX_HOME"], "bin"))
    for d in dirs:
        p = os.path.join(d, name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    p = shutil.which(name)
    if p:
        return p
    raise FileNotFoundError(
        f"{name} not found (looked in {dirs or 'no wheel/UCX_HOME dirs'} and PATH); "
        "install the libucx-cu12 wheel or set UCX_HOME")


def ucx_env(transport: str, base_env: Mapping[str, str] | None = None, *,
            net_device: str | None = None) -> dict[str, str]:
    """Environment for a UCX process restricted to ``transport`` ("tcp" or "sm").

    ``base_env`` defaults to ``os.environ``; it is copied, not modified.
    ``net_device`` replaces the default ``lo`` in ``UCX_NET_DEVICES`` (e.g. a
    veth inside a netns).
    ``LD_LIBRARY_PATH`` gets the wheel's lib dir prepended so the wheel's
    binaries find their libraries.
    """
    if transport not in TRANSPORT_ENV:
        raise ValueError(f"unknown transport {transport!r}; expected one of {sorted(TRANSPORT_ENV)}")
    env = dict(os.environ if base_env is None else base_env)
    env.update(_COMMON_ENV)
    env.update(TRANSPORT_ENV[transport])
    # Also for sm: UCX_NET_DEVICES only filters network devices (shared memory
    # is "memory", under UCX_SHM_DEVICES), and it keeps any tcp lane a runtime
    # adds for connection setup on loopback instead of eth0.
    env["UCX_NET_DEVICES"] = net_device or _DEFAULT_NET_DEVICE
    lib = ucx_lib_dir()
    if lib:
        old = env.get("LD_LIBRARY_PATH", "")
        parts = [p for p in old.split(os.pathsep) if p and p != lib]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([lib, *parts])
    return env


def auto_iters(size_bytes: int) -> int:
    """Iteration count for ``size_bytes`` messages (see _TARGET_BYTES)."""
    if size_bytes <= 0:
        raise ValueError("size_bytes must be positive")
    return max(_MIN_ITERS, min(_MAX_ITERS, math.ceil(_TARGET_BYTES / size_bytes)))


def _free_port() -> int:
    # Racy by nature (the port is released before the server binds); the
    # caller retries with a new port if the server fails to listen.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_libc: Any = None


def _die_with_parent() -> None:
    # Runs in the child before exec: if the Python parent is SIGKILLed, the
    # kernel kills the perftest too (survives exec, incl. `ip netns exec`).
    global _libc
    try:
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


PopenFn = Callable[..., subprocess.Popen]


def _spawn(popen: PopenFn, argv: Sequence[str], env: dict[str, str],
           out: IO[bytes], err: IO[bytes]) -> subprocess.Popen:
    # Own session => own process group, so a kill reaches everything it started.
    return popen(list(argv), env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                 start_new_session=True, preexec_fn=_die_with_parent)


def _kill(proc: subprocess.Popen | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        # Leader not yet reaped, so its pid is still our process group id.
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def _listening(pid: int, port: int) -> bool:
    """True if process ``pid``'s network namespace has a TCP socket listening on ``port``."""
    needle = f":{port:04X} "
    for fam in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{fam}") as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    # fields[1] = local addr:port, fields[3] = state, 0A = LISTEN
                    if len(fields) > 3 and (fields[1] + " ").endswith(needle) and fields[3] == "0A":
                        return True
        except OSError:
            pass
    return False


def _read(f: IO[bytes]) -> str:
    f.flush()
    f.seek(0)
    return f.read().decode(errors="replace")


def _tail(text: str, n: int = _STDERR_TAIL) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _parse_bandwidth(stdout: str) -> float:
    """Bytes/s from ``ucx_perftest -v -f`` output (CSV; bandwidth in MiB/s)."""
    header: list[str] | None = None
    value: float | None = None
    for line in stdout.splitlines():
        cols = [c.strip() for c in line.strip().split(",")]
        if "overall_bw" in cols:
            header = cols
            continue
        if header and len(cols) == len(header):
            try:
                value = float(cols[header.index("overall_bw")])
            except ValueError:
                continue
    if value is None:
        raise RuntimeError(f"could not find a bandwidth result in ucx_perftest output:\n{_tail(stdout)}")
    return value * 1024.0 * 1024.0


def run_perftest(transport: str, op: str, size_bytes: int, iters: int | None = None,
                 timeout: float = 60.0, port: int | None = None, *,
                 warmup: int | None = None,
                 memory: str = "thp",
                 server_addr: str = "127.0.0.1",
                 net_device: str | None = None,
                 server_env: Mapping[str, str] | None = None,
                 client_env: Mapping[str, str] | None = None,
                 extra_args: Sequence[str] = (),
                 server_args: Sequence[str] = (),
                 server_popen: PopenFn | None = None,
                 client_popen: PopenFn | None = None) -> float:
    """Run one ucx_perftest server/client pair and return bandwidth in bytes/s.

    ``op`` is "put" (``ucp_put_bw``) or "get" (``ucp_get -O 32``); the
    client does the RMA on the server's memory. ``iters``/``warmup`` default
    to :func:`auto_iters` and 10% of it. ``memory`` picks how perftest
    allocates its buffers (:data:`MEMORY_ALLOC`).

    ``server_popen``/``client_popen`` (default ``subprocess.Popen``) let the
    two sides run elsewhere, e.g. ``TwoHosts`` namespaces; they must accept
    ``Popen``'s keyword arguments. ``server_env``/``client_env`` are extra
    variables layered over :func:`ucx_env`.

    Every wait is bounded by ``timeout`` (whole call). On failure both
    processes are killed and RuntimeError carries the stderr tails.
    """
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; expected one of {sorted(OPS)}")
    if memory not in MEMORY_ALLOC:
        raise ValueError(f"unknown memory {memory!r}; expected one of {sorted(MEMORY_ALLOC)}")
    size_bytes = int(size_bytes)
    if size_bytes <= 0:
        raise ValueError("size_bytes must be positive")
    iters = auto_iters(size_bytes) if iters is None else int(iters)
    warmup = max(1, iters // 10) if warmup is None else int(warmup)
    deadline = time.monotonic() + timeout
    exe = find_ucx_bin("ucx_perftest")
    base = ucx_env(transport, net_device=net_device)
    if MEMORY_ALLOC[memory] is not None:
        base["UCX_ALLOC_PRIO"] = MEMORY_ALLOC[memory]
    senv = {**base, **(server_env or {})}
    cenv = {**base, **(client_env or {})}
    server_popen = server_popen or subprocess.Popen
    client_popen = client_popen or subprocess.Popen
    test, op_args = OPS[op]
    fixed_port = port is not None

    def left() -> float:
        return deadline - time.monotonic()

    last_err = "no attempt made"
    for _ in range(5):  # new port per attempt: covers the free-port race
        p = port if fixed_port else _free_port()
        server = client = None
        with tempfile.TemporaryFile() as s_out, tempfile.TemporaryFile() as s_err, \
                tempfile.TemporaryFile() as c_out, tempfile.TemporaryFile() as c_err:
            try:
                server = _spawn(server_popen, [exe, "-p", str(p), *server_args], senv, s_out, s_err)
                while not _listening(server.pid, p):
                    if server.poll() is not None:
                        break
                    if left() <= 0:
                        raise RuntimeError(f"ucx_perftest server did not listen on port {p} "
                                           f"within {timeout:.1f}s; stderr:\n{_tail(_read(s_err))}")
                    time.sleep(0.01)
                if server.poll() is not None:
                    last_err = (f"server exited early with code {server.returncode}; stderr:\n"
                                f"{_tail(_read(s_err) + _read(s_out))}")
                    if fixed_port:
                        break
                    continue

                argv = [exe, server_addr, "-p", str(p), "-t", test, "-s", str(size_bytes),
                        "-n", str(iters), "-w", str(warmup), "-v", "-f", *op_args, *extra_args]
                while True:
                    client = _spawn(client_popen, argv, cenv, c_out, c_err)
                    try:
                        client.wait(timeout=max(left(), 0.001))
                    except subprocess.TimeoutExpired:
                        raise RuntimeError(
                            f"ucx_perftest client timed out after {timeout:.1f}s "
                            f"({transport} {op} {size_bytes} B x {iters}); client stderr:\n"
                            f"{_tail(_read(c_err))}\nserver stderr:\n{_tail(_read(s_err))}") from None
                    err = _read(c_err)
                    # Listen socket seen but accept not reachable yet (e.g. netns
                    # address still settling): retry the client only.
                    if client.returncode != 0 and "connect() failed" in err \
                            and server.poll() is None and left() > 0.2:
                        for f in (c_out, c_err):
                            f.seek(0)
                            f.truncate()
                        time.sleep(0.1)
                        continue
                    break
                out = _read(c_out)
                if client.returncode != 0:
                    raise RuntimeError(
                        f"ucx_perftest client failed with code {client.returncode} "
                        f"({transport} {op} {size_bytes} B); client stderr:\n{_tail(err + out)}\n"
                        f"server stderr:\n{_tail(_read(s_err))}")
                try:
                    server.wait(timeout=max(min(left(), 10.0), 0.001))
                except subprocess.TimeoutExpired:
                    pass  # result is already in hand; _kill below cleans up
                return _parse_bandwidth(out)
            finally:
                _kill(client)
                _kill(server)
    raise RuntimeError(f"could not start ucx_perftest server: {last_err}")


def perftest_series(transport: str, op: str, sizes: Iterable[int | str], repeats: int = 5,
                    **kwargs: Any) -> dict[int, list[float]]:
    """``repeats`` runs of :func:`run_perftest` per size -> {size: [bytes/s, ...]}."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    result: dict[int, list[float]] = {}
    for s in sizes:
        n = parse_size(s)
        result[n] = [run_perftest(transport, op, n, **kwargs) for _ in range(repeats)]
    return result


def _format_table(transport: str, op: str, series: Mapping[int, list[float]],
                  memory: str = "thp") -> str:
    rows = [f"# ucx_perftest {transport} {op}, memory={memory} (GB/s, 1 GB = 1e9 B)",
            f"{'size':>8} {'median':>8} {'min':>8} {'max':>8} {'iqr':>8} {'runs':>5}"]
    for size, vals in series.items():
        s = summarize(vals)
        rows.append(f"{format_size(size):>8} {s['median'] / 1e9:8.3f} {s['min'] / 1e9:8.3f} "
                    f"{s['max'] / 1e9:8.3f} {s['iqr'] / 1e9:8.3f} {len(vals):5d}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Measure the UCX transport ceiling with ucx_perftest.")
    ap.add_argument("--transport", choices=sorted(TRANSPORT_ENV), default="tcp")
    ap.add_argument("--op", choices=sorted(OPS), default="put")
    ap.add_argument("--sizes", default="1M,16M,64M", help="comma list, e.g. 64K,1M,16M")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--iters", type=int, default=None, help="default: auto (~1 GiB per run)")
    ap.add_argument("--timeout", type=float, default=60.0, help="per run, seconds")
    ap.add_argument("--memory", choices=sorted(MEMORY_ALLOC), default="thp",
                    help="how ucx_perftest allocates its buffers (default: thp)")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    try:
        series = perftest_series(args.transport, args.op, sizes, repeats=args.repeats,
                                 iters=args.iters, timeout=args.timeout,
                                 memory=args.memory)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(_format_table(args.transport, args.op, series, args.memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
