"""Run UCX's own ``ucx_perftest`` as the bandwidth ceiling of a transport.

Standard library only, so it works without the C++ extension. Both ucx_perftest processes
run with :func:`rdmaflow._ucx.ucx_env` of the transport, the environment rdmaflow's own
benchmark processes get too, so that "ceiling" and "measured" run over exactly the same UCX
configuration (docs/benchmarks.md has the measurements behind these choices):

* tcp: ``UCX_TLS=tcp`` + ``UCX_NET_DEVICES=lo``. Never set ``UCX_PROTO_ENABLE=n``: it hangs
  TCP RMA.
* sm: ``UCX_TLS=cma,posix,self,tcp`` (see :data:`rdmaflow._ucx.TRANSPORT_ENV`). ``cma``
  (process_vm_writev/readv) is the only zero-copy RMA path for memory that UCX did not
  allocate itself.
* Memory (perftest only, not in ``ucx_env``): ``ucx_perftest`` allocates its buffers with
  ``ucp_mem_map(ALLOCATE)``, which by default (``UCX_ALLOC_PRIO=md:sysv,...``) hands out SysV
  shared memory. That is not what rdmaflow does (it registers mmap'ed or user memory), and it
  changes the result both ways: cma on those 4K-page segments is slower, while posix/sysv can
  then map the peer's buffer directly (rkey_ptr) and show in-cache memcpy speeds that
  registered user memory can never get. So by default we set
  ``UCX_ALLOC_PRIO=thp,mmap,heap`` (``memory="thp"``): plain anonymous memory with
  transparent huge pages, the best case for cma (THP is "madvise" on this kernel, so rdmaflow
  regions get it only if they ``madvise(MADV_HUGEPAGE)``). ``memory="mmap"`` (4K pages, like
  a plain mmap) and ``memory="ucx"`` (UCX's own default) are available for comparison.
* ``-D zcopy`` is a UCT-layer flag; the UCP tests accept it but ignore it (the header still
  says "Data layout: (automatic)"); UCP chooses zero-copy protocols by itself, so it is not
  passed.
* ``ucp_put_bw`` keeps 32 puts in flight by default; ``ucp_get`` is a latency test with a
  window of 1, so we pass ``-O 32`` to make it a bandwidth test like put.
* ``ucx_perftest`` prints bandwidth in MiB/s (it divides by 1024^2); :func:`run_perftest`
  converts to bytes per second (report 1 GB = 1e9 B).
* Each ucx_perftest process calibrates its clock at start-up (a sched_yield loop), a fixed
  cost on top of the transfer.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rdmaflow._ucx import find_bin, ucx_env
from rdmaflow.bench import flags
from rdmaflow.bench.harness import format_size, parse_size, parse_sizes, summarize
from rdmaflow.bench.processes import BenchError, ChildProcess, free_port

__all__ = ["LATENCY_ITERS", "MEMORY_ALLOC", "OPS", "TRANSPORTS", "auto_iters", "perftest_series", "run_perftest",
           "run_perftest_latency", "ucx_env"]

TRANSPORTS = ("tcp", "sm")

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

# Auto iteration count: move ~1 GiB, but never fewer than 16 messages for large sizes and
# never so many that per-message overhead dominates at tiny sizes.
_TARGET_BYTES = 1 << 30
_MIN_ITERS = 16
_MAX_ITERS = 200_000

_STDERR_TAIL = 2000

#: Round trips of one ucp_put_lat run when the caller names none.
LATENCY_ITERS = 10_000


def auto_iters(size_bytes: int) -> int:
    """Iteration count for ``size_bytes`` messages (see _TARGET_BYTES)."""
    if size_bytes <= 0:
        raise ValueError("size_bytes must be positive")
    return max(_MIN_ITERS, min(_MAX_ITERS, math.ceil(_TARGET_BYTES / size_bytes)))


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


def _tail(text: str, n: int = _STDERR_TAIL) -> str:
    text = text.strip()
    return text if len(text) <= n else "..." + text[-n:]


def _last_row(stdout: str, column: str, what: str) -> dict[str, str]:
    """The last result row of ``ucx_perftest -v -f`` output (CSV) whose header has ``column``."""
    header: list[str] | None = None
    row: dict[str, str] | None = None
    for line in stdout.splitlines():
        cols = [c.strip() for c in line.strip().split(",")]
        if column in cols:
            header = cols
            continue
        if header and len(cols) == len(header):
            try:
                float(cols[header.index(column)])
            except ValueError:
                continue
            row = dict(zip(header, cols))
    if row is None:
        raise RuntimeError(f"could not find a {what} result in ucx_perftest output:\n{_tail(stdout)}")
    return row


def _parse_bandwidth(stdout: str) -> float:
    """Bytes/s from ``ucx_perftest -v -f`` output (CSV; bandwidth in MiB/s)."""
    return float(_last_row(stdout, "overall_bw", "bandwidth")["overall_bw"]) * 1024.0 * 1024.0


def _parse_latency(stdout: str) -> dict[str, float]:
    """One-way latency in seconds from ``ucx_perftest -v -f`` output of a latency test: its
    typical latency (the column ``50.0_percentile_lat``, microseconds) and ``avg_lat``."""
    row = _last_row(stdout, "avg_lat", "latency")
    typical = next((k for k in row if k.endswith("_percentile_lat")), "avg_lat")
    return {"median_s": float(row[typical]) * 1e-6, "avg_s": float(row["avg_lat"]) * 1e-6}


def run_perftest(transport: str, op: str, size_bytes: int, iters: int | None = None,
                 timeout: float = 60.0, port: int | None = None, **kwargs: Any) -> float:
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
    test, op_args = OPS[op]
    return _parse_bandwidth(_client_output(transport, test, op_args, size_bytes, iters, timeout, port, **kwargs))


def run_perftest_latency(transport: str, size_bytes: int, iters: int | None = None,
                         timeout: float = 60.0, port: int | None = None, **kwargs: Any) -> dict[str, float]:
    """One ``ucx_perftest -t ucp_put_lat`` pair (ping-pong of puts, each side polling on the
    last byte of its buffer): ``{"median_s", "avg_s"}``, the one-way latency in seconds
    (ucx_perftest halves the round trip of its ping-pong tests itself). Arguments as
    :func:`run_perftest`; ``iters`` defaults to :data:`LATENCY_ITERS`."""
    out = _client_output(transport, "ucp_put_lat", (), size_bytes, iters or LATENCY_ITERS, timeout, port, **kwargs)
    return _parse_latency(out)


def _client_output(transport: str, test: str, op_args: Sequence[str], size_bytes: int, iters: int | None,
                   timeout: float, port: int | None, *,
                   warmup: int | None = None,
                   memory: str = "thp",
                   server_addr: str = "127.0.0.1",
                   net_device: str | None = None,
                   server_env: Mapping[str, str] | None = None,
                   client_env: Mapping[str, str] | None = None,
                   extra_args: Sequence[str] = (),
                   server_args: Sequence[str] = (),
                   server_popen: Callable[..., Any] | None = None,
                   client_popen: Callable[..., Any] | None = None) -> str:
    """The client's stdout of one ucx_perftest pair running ``test``."""
    if memory not in MEMORY_ALLOC:
        raise ValueError(f"unknown memory {memory!r}; expected one of {sorted(MEMORY_ALLOC)}")
    size_bytes = int(size_bytes)
    if size_bytes <= 0:
        raise ValueError("size_bytes must be positive")
    iters = auto_iters(size_bytes) if iters is None else int(iters)
    warmup = max(1, iters // 10) if warmup is None else int(warmup)
    deadline = time.monotonic() + timeout
    exe = find_bin("ucx_perftest")
    base = ucx_env(transport, net_device=net_device)
    if MEMORY_ALLOC[memory] is not None:
        base["UCX_ALLOC_PRIO"] = MEMORY_ALLOC[memory]
    senv = {**base, **(server_env or {})}
    cenv = {**base, **(client_env or {})}
    fixed_port = port is not None

    def left() -> float:
        return deadline - time.monotonic()

    last_err = "no attempt made"
    for _ in range(5):  # new port per attempt: covers the free-port race
        p = port if fixed_port else free_port()
        server = client = None
        try:
            server = ChildProcess([exe, "-p", str(p), *server_args], senv, "ucx_perftest server",
                                  stdin=False, popen=server_popen)
            while not _listening(server.pid, p):
                if server.poll() is not None:
                    break
                if left() <= 0:
                    raise BenchError(f"ucx_perftest server did not listen on port {p} "
                                     f"within {timeout:.1f}s; stderr:\n{server.stderr_tail(_STDERR_TAIL)}")
                time.sleep(0.01)
            if server.poll() is not None:
                last_err = (f"server exited early with code {server.poll()}; stderr:\n"
                            f"{_tail(server.stderr_tail() + ''.join(server.drain(1.0)))}")
                if fixed_port:
                    break
                continue

            argv = [exe, server_addr, "-p", str(p), "-t", test, "-s", str(size_bytes),
                    "-n", str(iters), "-w", str(warmup), "-v", "-f", *op_args, *extra_args]
            while True:
                client = ChildProcess(argv, cenv, "ucx_perftest client", stdin=False, popen=client_popen)
                code = client.wait(left())
                if code is None:
                    raise BenchError(
                        f"ucx_perftest client timed out after {timeout:.1f}s "
                        f"({transport} {test} {size_bytes} B x {iters}); client stderr:\n"
                        f"{client.stderr_tail(_STDERR_TAIL)}\nserver stderr:\n{server.stderr_tail(_STDERR_TAIL)}")
                err = client.stderr_tail(1 << 20)
                # Listen socket seen but accept not reachable yet (e.g. netns address still
                # settling): retry the client only.
                if code != 0 and "connect() failed" in err and server.poll() is None and left() > 0.2:
                    client.kill()
                    time.sleep(0.1)
                    continue
                break
            out = "".join(client.drain(max(0.5, min(left(), 5.0))))
            if code != 0:
                raise BenchError(
                    f"ucx_perftest client failed with code {code} "
                    f"({transport} {test} {size_bytes} B); client stderr:\n{_tail(err + out)}\n"
                    f"server stderr:\n{server.stderr_tail(_STDERR_TAIL)}")
            server.wait(min(left(), 10.0))  # the result is in hand; a server still there is killed
            return out
        finally:
            for proc in (client, server):
                if proc is not None:
                    proc.kill()
    raise BenchError(f"could not start ucx_perftest server: {last_err}")


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
    flags.add_transport(ap, ("tcp",), note="one per run")
    ap.add_argument("--op", choices=sorted(OPS), default="put")
    flags.add_sizes(ap, "1M,16M,64M", "message sizes (default 1M,16M,64M)")
    flags.add_repeats(ap, 5, "runs of ucx_perftest (default 5)")
    ap.add_argument("--iters", type=int, default=None, help="default: auto (~1 GiB per run)")
    ap.add_argument("--timeout", type=float, default=60.0, help="per run, seconds")
    ap.add_argument("--memory", choices=sorted(MEMORY_ALLOC), default="thp",
                    help="how ucx_perftest allocates its buffers (default: thp)")
    args = ap.parse_args(argv)
    try:
        transport = flags.transports(args.transport, one=True)[0]
        sizes = parse_sizes(args.sizes)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        series = perftest_series(transport, args.op, sizes, repeats=args.repeats,
                                 iters=args.iters, timeout=args.timeout,
                                 memory=args.memory)
    except (RuntimeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(_format_table(transport, args.op, series, args.memory))
    return 0


if __name__ == "__main__":
    sys.exit(main())
