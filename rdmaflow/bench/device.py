"""``rdmaflow bench device``: bandwidth of ``Channel.memcpy`` next to ``ucx_perftest``.

Two processes on this host: a receiver (``python -m rdmaflow.bench.device --serve``) that
publishes two large regions (a WRITE destination and a READ source), and the sender, this
process, that streams WRITEs into one and READs out of the other with a window of memcpys in
flight. In the same run, on the same transport (the
same environment from :func:`rdmaflow._ucx.ucx_env`), ``ucx_perftest`` measures UCX's
own ``put`` and ``get`` between two processes: the ceiling rdmaflow is held against.

Method, per transport:

* rdmaflow and ucx_perftest move the same number of messages per measurement: a calibration
  pass streams each size once with rdmaflow and picks ``iters`` so that a measurement moves
  at least ``--target-bytes`` and lasts about ``--target-seconds`` (write's count is used for
  write and put, read's for read and get), after ``iters // 10`` (at least one) untimed
  warm-up messages. ucx_perftest gets the same ``-n``/``-w``.
* rdmaflow: each message is ``ch.memcpy(local, 0, remote, 0, size, WRITE|READ)`` (always the
  same offsets, as ucx_perftest reuses its buffers), at most ``--window`` outstanding; when
  the window is full the sender waits until ``--refill`` (half the window) have completed and
  posts as many, one wake-up per batch rather than per memcpy. A WRITE future completes only
  when the data is visible at the receiver (flush), so the last one ends the timed interval
  with everything delivered. Bandwidth = bytes / elapsed, 1 GB = 10^9 B.
* The systems are interleaved: for repeat 1, every size, each of rdmaflow write, rdmaflow
  read, perftest put, perftest get; then repeat 2, and so on, so that noise on this shared
  machine hits all of them alike. Each cell reports the median and min/max over repeats.
* rdmaflow devices connect through UCX's sockaddr connection manager, which needs ``tcp`` in
  ``UCX_TLS``, so the rdmaflow processes get ``,tcp`` appended where ``ucx_env`` lacks it
  (:func:`rdmaflow_env`); UCX still picks cma for intra-node puts on ``sm``.
* Memory (``--memory``, see the notes at "Memory" below): by default rdmaflow moves real,
  written data from ``Device.alloc_region`` buffers. ucx_perftest never writes its buffers, so
  its put/get source is the kernel's zero page, always in cache: for messages that do not fit
  the last-level cache that flatters perftest.
  ``--memory zero`` gives rdmaflow the same untouched sources, for a like-for-like ratio.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import mmap
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from typing_extensions import Self

from rdmaflow._ucx import ucx_env, with_tcp
from rdmaflow.bench import flags
from rdmaflow.bench.harness import (
    format_size,
    median_ratio,
    paired_ratio,
    parse_size,
    parse_sizes,
    summarize,
    write_csv,
)
from rdmaflow.bench.perftest import run_perftest
from rdmaflow.bench.processes import ChildProcess, environ, new_secret

DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M,256M"
QUICK_SIZES = "1M,16M"
DEFAULT_REPEATS = 5
QUICK_REPEATS = 3
TRANSPORTS = ("tcp", "sm")
DEFAULT_OUT = "bench-results"
CSV_NAME = "device.csv"
#: Outstanding memcpys per stream: ucp_put_bw's default outstanding count (docs/benchmarks.md
#: has the window sweep behind it).
DEFAULT_WINDOW = 32
DEFAULT_TARGET_BYTES = 256 << 20
QUICK_TARGET_BYTES = 64 << 20
DEFAULT_TARGET_SECONDS = 0.3
QUICK_TARGET_SECONDS = 0.05
DEFAULT_MIN_ITERS = 4
MAX_ITERS = 200_000
REGION_NAME = "rdmaflow-bench-device"
#: The acceptance bar: rdmaflow WRITE / perftest put, for sizes from ACCEPT_MIN_SIZE up.
ACCEPT_RATIO = 0.90
ACCEPT_MIN_SIZE = 1 << 20

CSV_COLUMNS = [
    "system", "transport", "op", "size_bytes", "size", "gb_per_s_median", "gb_per_s_min",
    "gb_per_s_max", "gb_per_s_iqr", "repeats", "iters", "window", "memory", "ratio_vs_perftest",
    "paired_ratio_vs_perftest", "values_gb_per_s",
]

# (system, op) in the order they run inside one repeat; rdmaflow op -> perftest op it is held
# against.
SYSTEMS = (("rdmaflow", "write"), ("rdmaflow", "read"), ("ucx_perftest", "put"),
           ("ucx_perftest", "get"))
PAIRS = {"write": "put", "read": "get"}


# ------------------------------------------------------------------------------------------
# Environment


def rdmaflow_env(transport: str, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """:func:`ucx_env` for ``transport``, with tcp added for rdmaflow's connection manager."""
    return with_tcp(ucx_env(transport, base_env))


# ------------------------------------------------------------------------------------------
# Memory
#
# Each side has a source buffer (what a WRITE or READ copies from) and a destination buffer,
# as ucx_perftest has a send and a receive buffer. How they are made is --memory:
#
#   region  Device.alloc_region, every byte written first (what rdmaflow users get)
#   thp     mmap + madvise(MADV_HUGEPAGE), written first, registered with Device.register
#   zero    as thp, but the source is never written, so the kernel backs it with its (huge)
#           zero page: exactly ucx_perftest's buffers (UCX_ALLOC_PRIO=thp allocates and
#           nobody writes them). A zero-page source is always cache-hot, which makes copies
#           of messages larger than the last-level cache look faster than copies of real
#           data; this mode shows rdmaflow under the same conditions as perftest.

MEMORY_KINDS = ("region", "thp", "zero")
_FILL = 0x5A


class _MappedBuffer:
    """Anonymous MADV_HUGEPAGE memory registered through Device.register."""

    def __init__(self, dev: Any, nbytes: int, write: bool):
        import torch

        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(AttributeError, OSError):
            self.map.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(self.map, dtype=torch.uint8)
        if write:
            t.fill_(_FILL)
        self.region = dev.register(t)


def _alloc(dev: Any, nbytes: int, memory: str, source: bool) -> tuple[Any, Any]:
    """(region, keepalive): a source or destination buffer of ``nbytes`` of kind ``memory``."""
    if memory in ("thp", "zero"):
        buf = _MappedBuffer(dev, nbytes, write=not (memory == "zero" and source))
        return buf.region, buf
    if memory != "region":
        raise ValueError(f"unknown memory kind {memory!r}; expected one of {MEMORY_KINDS}")
    import torch

    r = dev.alloc_region(nbytes)
    r.tensor(torch.uint8, nbytes).fill_(_FILL)  # real data, pages faulted in before timing
    return r, None


# ------------------------------------------------------------------------------------------
# Receiver process


def serve(region_bytes: int, memory: str, busy_poll: bool, out=None, inp=None) -> int:
    """The receiver: publishes a destination (WRITE target) and a source (READ origin) region,
    prints ``{"ok": true, "endpoint": ...}`` and serves until stdin says ``{"cmd": "exit"}``
    or closes."""
    import rdmaflow

    out = out or sys.stdout
    inp = inp or sys.stdin
    dev = rdmaflow.Device("127.0.0.1:0", busy_poll=busy_poll)
    try:
        dst, keep_dst = _alloc(dev, region_bytes, memory, source=False)
        src, keep_src = _alloc(dev, region_bytes, memory, source=True)
        dev.publish_region(REGION_NAME + "-dst", dst)
        dev.publish_region(REGION_NAME + "-src", src)
        out.write(json.dumps({"ok": True, "endpoint": dev.endpoint, "dst": REGION_NAME + "-dst",
                              "src": REGION_NAME + "-src", "nbytes": region_bytes,
                              "pid": os.getpid()}) + "\n")
        out.flush()
        for line in inp:
            with contextlib.suppress(ValueError, AttributeError):
                if json.loads(line).get("cmd") == "exit":
                    break
        del keep_dst, keep_src
    finally:
        dev.close()
    return 0


def start_receiver(env: Mapping[str, str], region_bytes: int, memory: str, busy_poll: bool = False,
                   timeout: float = 60.0) -> tuple[ChildProcess, dict]:
    """Starts the ``--serve`` process; returns it and its hello (endpoint, region names)."""
    argv = [sys.executable, "-m", "rdmaflow.bench.device", "--serve",
            "--region-bytes", str(region_bytes), "--memory", memory]
    if busy_poll:
        argv.append("--busy-poll")
    proc = ChildProcess(argv, env, "benchmark receiver")
    try:
        return proc, proc.read(timeout)
    except BaseException:
        proc.close()
        raise


# ------------------------------------------------------------------------------------------
# Sender


class RdmaflowStream:
    """The sender side: a local Device connected to a receiver, timing windows of memcpys."""

    def __init__(self, transport: str, region_bytes: int, *, memory: str = "region",
                 busy_poll: bool = False, timeout: float = 60.0):
        import rdmaflow

        self.rdmaflow = rdmaflow
        self.timeout = timeout
        env = rdmaflow_env(transport)
        env["RDMAFLOW_JOB_SECRET"] = new_secret()
        self.env = env
        self.receiver: ChildProcess | None = None
        self.dev = None
        try:
            self.receiver, hello = start_receiver(env, region_bytes, memory, busy_poll, timeout)
            # UCX_WARN_UNUSED_ENV_VARS is a global option, read when libucs loaded; set now,
            # the new context would only warn that it is unused.
            denv = {k: v for k, v in env.items() if k != "UCX_WARN_UNUSED_ENV_VARS"}
            with environ(denv):
                self.dev = rdmaflow.Device("127.0.0.1:0", busy_poll=busy_poll,
                                           secret=env["RDMAFLOW_JOB_SECRET"])
            self.local_src, keep_src = _alloc(self.dev, region_bytes, memory, source=True)
            self.local_dst, keep_dst = _alloc(self.dev, region_bytes, memory, source=False)
            self._keep = (keep_src, keep_dst)
            ep = hello["endpoint"]
            self.remote_dst = self.dev.lookup_region(ep, hello["dst"], timeout)
            self.remote_src = self.dev.lookup_region(ep, hello["src"], timeout)
            self.ch = self.dev.channel(ep)
            # Fault in and warm every page both ways once, before anything is timed (this
            # writes only destinations, so a "zero" source stays the zero page).
            self.run("write", region_bytes, 1, 1, 0)
            self.run("read", region_bytes, 1, 1, 0)
        except BaseException:
            self.close()
            raise

    def run(self, op: str, size: int, iters: int, window: int, warmup: int,
            refill: int | None = None) -> float:
        """Streams ``iters`` memcpys of ``size`` bytes, at most ``window`` outstanding; bytes/s.

        When the window is full the sender sleeps until ``refill`` (default: half the window)
        memcpys have completed, then posts that many: one wake-up per batch rather than per
        memcpy, which costs sm READs of small messages much of their bandwidth.
        """
        if op == "write":
            direction, local, remote = self.rdmaflow.WRITE, self.local_src, self.remote_dst
        elif op == "read":
            direction, local, remote = self.rdmaflow.READ, self.local_dst, self.remote_src
        else:
            raise ValueError(f"unknown op {op!r}")
        memcpy = self.ch.memcpy
        timeout = self.timeout

        batch = max(1, min(window, refill if refill else window // 2))

        def stream(n: int) -> None:
            futs: collections.deque = collections.deque()
            for _ in range(n):
                if len(futs) >= window:
                    # Completions come in order on one channel; wait for the batch's last.
                    futs[batch - 1].result(timeout)
                    for _ in range(batch):
                        futs.popleft().result(timeout)
                futs.append(memcpy(local, 0, remote, 0, size, direction))
            while futs:
                futs.popleft().result(timeout)

        if warmup > 0:
            stream(warmup)
        t0 = time.perf_counter()
        stream(iters)
        elapsed = time.perf_counter() - t0
        return size * iters / elapsed

    def close(self) -> None:
        if self.dev is not None:
            with contextlib.suppress(Exception):
                self.dev.close()
            self.dev = None
        if self.receiver is not None:
            self.receiver.close(grace=10.0)
            self.receiver = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------------------
# The benchmark


def iterations(size: int, target_bytes: int, min_iters: int, target_seconds: float = 0.0,
               bytes_per_s: float = 0.0) -> int:
    """Messages per measurement: at least ``min_iters``, ``target_bytes`` and, at the given
    rate, ``target_seconds``; at most MAX_ITERS (unless min_iters asks for more)."""
    n = max(math.ceil(target_bytes / size), math.ceil(target_seconds * bytes_per_s / size))
    return max(min_iters, min(MAX_ITERS, n))


Key = tuple[str, str, str, int]  # (system, transport, op, size)


def bench_transport(transport: str, sizes: Sequence[int], *, repeats: int, window: int,
                    target_bytes: int, target_seconds: float, min_iters: int,
                    refill: int | None = None,
                    memory: str = "region", busy_poll: bool = False, timeout: float = 120.0,
                    log: Callable[[str], None] | None = None) -> dict[Key, dict[str, Any]]:
    """Measures every (system, op, size) ``repeats`` times, interleaved; see the module doc.

    A calibration pass first streams each op and size once with rdmaflow to size the
    measurements (``target_seconds`` at that rate); put and get get the same message counts
    as write and read.
    """
    log = log or (lambda s: None)
    results: dict[Key, dict[str, Any]] = {}
    with RdmaflowStream(transport, max(sizes), memory=memory, busy_poll=busy_poll,
                        timeout=timeout) as stream:
        iters: dict[tuple[str, int], int] = {}
        for size in sizes:
            for op in PAIRS:
                n = iterations(size, target_bytes, min_iters)
                bw = stream.run(op, size, n, window, max(1, n // 10), refill)
                iters[(op, size)] = iterations(size, target_bytes, min_iters, target_seconds, bw)
                log(f"[{transport} calibration] rdmaflow {op} {format_size(size)}: "
                    f"{bw / 1e9:.3f} GB/s -> {iters[(op, size)]} messages per measurement")
        for system, op in SYSTEMS:
            wr = op if op in PAIRS else {v: k for k, v in PAIRS.items()}[op]
            for size in sizes:
                results[(system, transport, op, size)] = {"values": [],
                                                          "iters": iters[(wr, size)]}
        for rep in range(repeats):
            for size in sizes:
                for system, op in SYSTEMS:
                    r = results[(system, transport, op, size)]
                    n = r["iters"]
                    warmup = max(1, n // 10)
                    if system == "rdmaflow":
                        bw = stream.run(op, size, n, window, warmup, refill)
                    else:
                        bw = run_perftest(transport, op, size, n, timeout=timeout, warmup=warmup)
                    r["values"].append(bw)
                    log(f"[{transport} {rep + 1}/{repeats}] {system} {op} {format_size(size)}: "
                        f"{bw / 1e9:.3f} GB/s")
    return results


def _values(results: Mapping[Key, dict[str, Any]], system: str, transport: str, op: str, size: int) -> list:
    r = results.get((system, transport, op, size))
    return r["values"] if r else []


def _ratio(results: Mapping[Key, dict[str, Any]], transport: str, op: str, size: int) -> float | None:
    return median_ratio(_values(results, "rdmaflow", transport, op, size),
                        _values(results, "ucx_perftest", transport, PAIRS[op], size))


def _paired_ratio(results: Mapping[Key, dict[str, Any]], transport: str, op: str,
                  size: int) -> float | None:
    """Median over repeats of rdmaflow / perftest measured in the same repeat (seconds apart)."""
    return paired_ratio(_values(results, "rdmaflow", transport, op, size),
                        _values(results, "ucx_perftest", transport, PAIRS[op], size))


def format_table(results: Mapping[Key, dict[str, Any]], transport: str, sizes: Sequence[int], *,
                 repeats: int, window: int, memory: str, refill: int | None = None) -> str:
    env = ucx_env(transport)
    renv = rdmaflow_env(transport)
    desc = f"UCX_TLS={env['UCX_TLS']}"
    if env.get("UCX_NET_DEVICES"):
        desc += f" UCX_NET_DEVICES={env['UCX_NET_DEVICES']}"
    if renv["UCX_TLS"] != env["UCX_TLS"]:
        desc += f" (rdmaflow: UCX_TLS={renv['UCX_TLS']})"
    lines = [
        f"# transport {transport}: {desc}",
        (f"# GB/s (1 GB = 1e9 B), median [min-max] of {repeats} interleaved repeats; "
         f"rdmaflow window {window} (refill {max(1, min(window, refill or window // 2))}), "
         f"memory {memory}; WRITE/put, READ/get: ratio of the medians"),
    ]
    if memory != "zero":
        lines.append("# note: ucx_perftest never writes its buffers, so it copies from the kernel's "
                     "zero page (always cached); rdmaflow copies written data. "
                     "--memory zero compares like for like")

    def cell(system: str, op: str, size: int) -> str:
        r = results.get((system, transport, op, size))
        if not r or not r["values"]:
            return "-"
        s = summarize(r["values"])
        return f"{s['median'] / 1e9:6.2f} [{s['min'] / 1e9:.2f}-{s['max'] / 1e9:.2f}]"

    def ratio(op: str, size: int) -> str:
        x = _ratio(results, transport, op, size)
        return "-" if x is None else f"{x * 100:5.0f}%"

    head = (f"{'size':>6}  {'rdmaflow WRITE':>19}  {'perftest put':>19}  {'WRITE/put':>9}  "
            f"{'rdmaflow READ':>19}  {'perftest get':>19}  {'READ/get':>8}")
    lines += [head, "-" * len(head)]
    for size in sizes:
        lines.append(
            f"{format_size(size):>6}  {cell('rdmaflow', 'write', size):>19}  "
            f"{cell('ucx_perftest', 'put', size):>19}  {ratio('write', size):>9}  "
            f"{cell('rdmaflow', 'read', size):>19}  {cell('ucx_perftest', 'get', size):>19}  "
            f"{ratio('read', size):>8}")
    checked = [s for s in sizes if s >= ACCEPT_MIN_SIZE]
    if checked:
        ratios = {s: _ratio(results, transport, "write", s) for s in checked}
        bad = [s for s, x in ratios.items() if x is None or x < ACCEPT_RATIO]
        worst = min((x for x in ratios.values() if x is not None), default=float("nan"))
        result = "met" if not bad else "missed at " + ",".join(format_size(s) for s in bad)
        paired = [_paired_ratio(results, transport, "write", s) for s in checked]
        pworst = min((x for x in paired if x is not None), default=float("nan"))
        lines.append(f"target: rdmaflow WRITE >= {ACCEPT_RATIO:.0%} of ucx_perftest put for sizes >= "
                     f"{format_size(ACCEPT_MIN_SIZE)}: {result} (lowest {worst * 100:.0f}%; "
                     f"lowest median of per-repeat ratios {pworst * 100:.0f}%)")
    return "\n".join(lines)


def csv_rows(results: Mapping[Key, dict[str, Any]], *, window: int, memory: str) -> list[dict[str, Any]]:
    rows = []
    for (system, transport, op, size), r in results.items():
        if not r["values"]:
            continue
        s = summarize(r["values"])
        ratio = _ratio(results, transport, op, size) if system == "rdmaflow" else None
        paired = _paired_ratio(results, transport, op, size) if system == "rdmaflow" else None
        rows.append({
            "system": system, "transport": transport, "op": op, "size_bytes": size,
            "size": format_size(size),
            "gb_per_s_median": f"{s['median'] / 1e9:.4f}",
            "gb_per_s_min": f"{s['min'] / 1e9:.4f}",
            "gb_per_s_max": f"{s['max'] / 1e9:.4f}",
            "gb_per_s_iqr": f"{s['iqr'] / 1e9:.4f}",
            "repeats": len(r["values"]), "iters": r["iters"],
            "window": window if system == "rdmaflow" else "",
            "memory": memory if system == "rdmaflow" else "zero",  # perftest never writes its buffers
            "ratio_vs_perftest": "" if ratio is None else f"{ratio:.4f}",
            "paired_ratio_vs_perftest": "" if paired is None else f"{paired:.4f}",
            "values_gb_per_s": " ".join(f"{v / 1e9:.4f}" for v in r["values"]),
        })
    return rows


# ------------------------------------------------------------------------------------------
# Command line


def add_arguments(ap: argparse.ArgumentParser) -> None:
    flags.add_transport(ap)
    flags.add_sizes(ap, None, f"message sizes (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})")
    flags.add_repeats(ap, None, f"interleaved rounds (default {DEFAULT_REPEATS}; --quick: {QUICK_REPEATS})")
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                    help=f"rdmaflow memcpys kept in flight (default {DEFAULT_WINDOW})")
    ap.add_argument("--refill", type=int, default=None,
                    help="when the window is full, wait for this many memcpys to complete and "
                         "post as many (default: half the window; 1 = one at a time)")
    ap.add_argument("--target-bytes", default=None,
                    help="each measurement moves at least this much (default 256M; --quick: 64M)")
    ap.add_argument("--target-seconds", type=float, default=None,
                    help="and lasts about this long at the calibrated rdmaflow rate "
                         f"(default {DEFAULT_TARGET_SECONDS}; --quick: {QUICK_TARGET_SECONDS})")
    ap.add_argument("--min-iters", type=int, default=DEFAULT_MIN_ITERS,
                    help=f"fewest messages per measurement (default {DEFAULT_MIN_ITERS})")
    ap.add_argument("--memory", choices=MEMORY_KINDS, default="region",
                    help="rdmaflow buffers: region = Device.alloc_region, written (default); "
                         "thp = registered MADV_HUGEPAGE memory, written; zero = as thp but "
                         "sources never written (kernel zero page), like ucx_perftest's buffers")
    ap.add_argument("--busy-poll", action="store_true",
                    help="rdmaflow devices busy-poll instead of sleeping on the wakeup fd")
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="bound on any single measurement, seconds (default 120)")
    flags.add_out(ap, DEFAULT_OUT, f"{CSV_NAME} (default {DEFAULT_OUT}/)")
    ap.add_argument("--csv", default=None, help=argparse.SUPPRESS)  # older spelling: the CSV file itself
    flags.add_quick(ap, f"sizes {QUICK_SIZES}, {QUICK_REPEATS} repeats")
    flags.add_verbose(ap)


def run(args: argparse.Namespace) -> int:
    sizes_text = args.sizes if args.sizes is not None else (QUICK_SIZES if args.quick else DEFAULT_SIZES)
    try:
        sizes = parse_sizes(sizes_text)
    except ValueError as e:
        print(f"error: --sizes: {e}", file=sys.stderr)
        return 2
    if not sizes or any(s <= 0 for s in sizes):
        print("error: --sizes needs positive sizes", file=sys.stderr)
        return 2
    repeats = args.repeats if args.repeats is not None else (QUICK_REPEATS if args.quick else DEFAULT_REPEATS)
    if repeats < 1 or args.window < 1 or args.min_iters < 1 or (args.refill is not None
                                                                and args.refill < 1):
        print("error: --repeats, --window, --refill and --min-iters must be >= 1",
              file=sys.stderr)
        return 2
    target = parse_size(args.target_bytes) if args.target_bytes else (
        QUICK_TARGET_BYTES if args.quick else DEFAULT_TARGET_BYTES)
    seconds = args.target_seconds if args.target_seconds is not None else (
        QUICK_TARGET_SECONDS if args.quick else DEFAULT_TARGET_SECONDS)
    try:
        transports = flags.transports(args.transport)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    csv_path = args.csv or os.path.join(args.out, CSV_NAME)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else None

    import rdmaflow

    print(f"rdmaflow {rdmaflow.__version__} bench device: UCX {rdmaflow.ucx_version()}, "
          f"{os.cpu_count()} CPUs, sizes {','.join(format_size(s) for s in sizes)}, "
          f"{repeats} repeats, window {args.window}, memory {args.memory}", flush=True)
    results: dict[Key, dict[str, Any]] = {}
    status = 0
    for t in transports:
        try:
            r = bench_transport(t, sizes, repeats=repeats, window=args.window,
                                target_bytes=target, target_seconds=seconds,
                                min_iters=args.min_iters, refill=args.refill,
                                memory=args.memory, busy_poll=args.busy_poll,
                                timeout=args.timeout, log=log)
        except (RuntimeError, OSError, rdmaflow.RdmaflowError) as e:
            print(f"error: transport {t}: {e}", file=sys.stderr)
            status = 1
            continue
        results.update(r)
        print()
        print(format_table(r, t, sizes, repeats=repeats, window=args.window, memory=args.memory,
                           refill=args.refill), flush=True)
        write_csv(csv_path, CSV_COLUMNS, csv_rows(results, window=args.window, memory=args.memory))
    if results:
        print(f"\nCSV: {csv_path}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="rdmaflow bench device",
        description="WRITE/READ bandwidth of Channel.memcpy next to ucx_perftest put/get.")
    add_arguments(ap)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--region-bytes", default="256M", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.serve:
        return serve(parse_size(args.region_bytes), args.memory, args.busy_poll)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
