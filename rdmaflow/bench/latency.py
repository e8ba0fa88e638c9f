"""``rdmaflow bench latency``: one-way latency of small transfers (ping-pong, round trip / 2),
rdmaflow next to the transport's own latency and the libraries a user would otherwise use.

Two processes per system; the "sender" starts each round trip and times it on
CLOCK_MONOTONIC, the "receiver" answers each message with one of the same size (protocol in
:mod:`rdmaflow.bench._latency_worker`). Systems:

============  ==============================================================================
rdmaflow      a ``StaticSender`` (zero copy, from an arena tensor) / ``StaticReceiver``
              (depth 1) pair each way, through the Python API: ``send(src, release=r);
              recv()`` against ``recv(); send(src, release=r)``: each send hands the slot of
              the message it answers back, in its own message where it can (docs/transfer.md).
ucx_perftest  ``ucx_perftest -t ucp_put_lat`` (:func:`rdmaflow.bench.perftest.run_perftest_latency`):
              puts ping-ponging, each side polling on its buffer's last byte; UCX's own floor
nixl          NIXL WRITE with a notification, host memory, progress thread off, UCX backend
              with ``ucx_error_handling_mode: none`` (:mod:`rdmaflow.bench.baselines.nixl_latency`)
gloo          ``torch.distributed`` gloo ``send``/``recv`` into preallocated tensors (TCP on
              every transport)
tensorpipe    ``torch.distributed.rpc.rpc_sync(receiver, echo, args=(tensor,))``: the tensor
              there and back (TensorPipe ``uv``/``basic`` on tcp, ``shm``/``cma`` on sm)
============  ==============================================================================

``--transport tcp`` restricts rdmaflow, NIXL and ucx_perftest to ``UCX_TLS=tcp`` on loopback;
``sm`` gives them ``rdmaflow._ucx.ucx_env("sm")`` (cma, posix, self).

Method: a measurement is ``warmup + iters`` round trips of one size (``iters`` from
``--iters``, fewer where ``iters * size`` would exceed ``--max-bytes``; ``warmup`` a tenth,
at least 10); its result is the median, 10th and 90th percentile of the timed round trips'
halves (ucx_perftest: its own typical latency, no percentiles). Systems are interleaved: for
each repeat, for each size, every system once, the order rotating each repeat; idle systems
are SIGSTOPped. A cell is the median over ``--repeats`` repeats of the measurement medians
(p10/p90: medians of the measurements' p10/p90). Every byte of the last message each way is
checked in every measurement. Around every measurement the host's phase is probed and waited
out as in ``bench transfer`` (:class:`rdmaflow.bench.processes.HostPhases`, ``--settle``, 5 s);
a cell with a repeat in a slow phase is marked ``~``.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rdmaflow.bench import flags
from rdmaflow.bench.harness import (
    add_settle_argument,
    cell_recorders,
    cell_status,
    for_each_transport,
    format_size,
    parse_size,
    parse_sizes,
    percentile,
    run_interleaved,
    summarize,
    text_table,
    write_csv,
)
from rdmaflow.bench.perftest import run_perftest_latency
from rdmaflow.bench.plots import pyplot, save_figure, size_axis, style
from rdmaflow.bench.processes import (
    BenchError,
    HostPhases,
    check_settle,
    fastest_handoff,
    handoff_values,
    new_secret,
    process_env,
    slow_handoff,
    slow_phase_note,
)
from rdmaflow.bench.transfer_systems import WorkerPair

SYSTEMS = ("rdmaflow", "ucx_perftest", "nixl", "gloo", "tensorpipe")
UCX_SYSTEMS = ("rdmaflow", "rdmaflow-profile", "nixl")  # processes that get the transport's UCX environment
TRANSPORTS = ("tcp", "sm")
REFERENCE = "rdmaflow"
RATIO_PEERS = ("ucx_perftest", "gloo", "nixl")
DEFAULT_SIZES = "8,64,1K,4K,16K,64K,256K,1M"
DEFAULT_ITERS = 1000
DEFAULT_REPEATS = 5
DEFAULT_MAX_BYTES = 64 << 20
MIN_ITERS = 10
DEFAULT_OUT = "bench-results"
CSV_NAME = "latency.csv"
PNG_NAME = "latency.png"

#: The latency targets: (transport, size, peer, most rdmaflow's one-way time may be, in peer's).
BARS: tuple[tuple[str, int, str, float], ...] = (
    ("tcp", 1 << 10, "ucx_perftest", 4.0), ("tcp", 1 << 10, "gloo", 0.25),
    ("tcp", 64 << 10, "ucx_perftest", 2.0), ("tcp", 64 << 10, "gloo", 0.5),
    ("sm", 1 << 10, "ucx_perftest", 20.0), ("sm", 1 << 10, "gloo", 0.1),
    ("sm", 64 << 10, "ucx_perftest", 3.0), ("sm", 64 << 10, "gloo", 0.2),
    ("tcp", 1 << 10, "nixl", 1.0), ("tcp", 64 << 10, "nixl", 1.0),
    ("sm", 1 << 10, "nixl", 1.0), ("sm", 64 << 10, "nixl", 1.0),
)

CSV_COLUMNS = [
    "system", "transport", "size_bytes", "size", "one_way_us", "p10_us", "p90_us", "min_us", "max_us",
    "iqr_us", "ratio_to_ucx_perftest", "ratio_to_gloo", "repeats", "failures", "iters", "warmup", "status",
    "values_us", "values_handoff_ns",
]

Key = tuple[str, str, int]  # (system, transport, size)


def iterations(size: int, iters: int, max_bytes: int) -> tuple[int, int]:
    """(timed round trips, warm-up round trips) of one measurement at ``size``."""
    n = max(MIN_ITERS, min(iters, max_bytes // max(1, size)))
    return n, max(MIN_ITERS, n // 10)


def one_way_summary(one_way_us: Sequence[float]) -> dict[str, float]:
    """Median, 10th and 90th percentile of one measurement's one-way times (us)."""
    vals = sorted(one_way_us)
    if not vals:
        raise BenchError("no round trips were timed")
    return {"median_us": statistics.median(vals), "p10_us": percentile(vals, 0.1),
            "p90_us": percentile(vals, 0.9)}


# ------------------------------------------------------------------------------------------
# The systems


class LatencyPair(WorkerPair):
    """A sender (times round trips) and a receiver (answers them) process of one system."""

    def __init__(self, name: str, transport: str, env: Mapping[str, str], *, sizes: Sequence[int],
                 busy_poll: bool, timeout: float):
        super().__init__(name, transport, env, sizes=sizes, window=1, max_inflight=max(sizes), busy_poll=busy_poll,
                         sock_dir="", timeout=timeout, torch_threads=1)

    def _argv(self, role: str, port: int) -> list[str]:
        argv = [sys.executable, "-m", "rdmaflow.bench.latency", "--worker", self.name, role,
                "--transport", self.transport, "--port", str(port), "--timeout", str(self.timeout),
                "--max-size", str(max(self.sizes)), "--arena-bytes", str(arena_bytes(self.sizes))]
        return argv + (["--busy-poll"] if self.busy_poll else [])

    def exchange(self, size: int, count: int, tag: int, timeout: float, **extra: Any) -> tuple[dict, dict]:
        """``count`` round trips: the sender's and the receiver's replies (``extra`` goes into
        both commands); BenchError if wrong bytes arrived."""
        self.start()
        assert self.rx is not None and self.tx is not None
        cmd = {"size": size, "count": count, "tag": tag, "timeout": timeout, **extra}
        deadline = time.monotonic() + timeout
        self.rx.send({"cmd": "pong", "peer": self.sender_info, **cmd})
        self.rx.read(min(timeout, 60.0))  # ready
        self.tx.send({"cmd": "ping", "peer": self.peer, **cmd})
        res = self.tx.read(deadline - time.monotonic())
        end = self.rx.read(deadline - time.monotonic() + 5.0)
        if res.get("bad") or end.get("bad"):
            raise BenchError(f"wrong bytes arrived ({'at the receiver' if end.get('bad') else 'at the sender'})")
        return res, end

    def measure(self, size: int, count: int, warmup: int, timeout: float, tag: int) -> dict[str, float]:
        res, _ = self.exchange(size, warmup + count, tag, timeout)
        if len(res["one_way_us"]) != warmup + count:
            raise BenchError(f"expected {warmup + count} round trips, got {len(res['one_way_us'])}")
        return one_way_summary(res["one_way_us"][warmup:])


class PerftestLatency:
    """``ucx_perftest -t ucp_put_lat``: a fresh server/client pair per measurement."""

    def __init__(self, transport: str):
        self.name = "ucx_perftest"
        self.transport = transport

    def spawn(self) -> None:
        pass

    def start(self) -> None:
        pass

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def close(self) -> None:
        pass

    def measure(self, size: int, count: int, warmup: int, timeout: float, tag: int) -> dict[str, float | None]:
        r = run_perftest_latency(self.transport, size, iters=count, warmup=warmup, timeout=timeout)
        return {"median_us": r["median_s"] * 1e6, "p10_us": None, "p90_us": None}


def arena_bytes(sizes: Sequence[int]) -> int:
    """An rdmaflow worker's arena: per size a receive slot and a source tensor, plus the pairs'
    control blocks, flags and acks."""
    return sum(2 * ((s + 255) // 256 * 256) for s in sizes) + (16 << 20) + len(sizes) * (64 << 10)


def nixl_missing() -> str | None:
    """Why NIXL cannot run here, or None."""
    if importlib.util.find_spec("nixl") is None:
        return "NIXL is not installed (scripts/setup.sh installs it: pip install --no-deps nixl nixl-cu12)"
    return None


def make_system(name: str, transport: str, *, secret: str, sizes: Sequence[int], busy_poll: bool, timeout: float):
    if name == "ucx_perftest":
        return PerftestLatency(transport)
    ucx = name in UCX_SYSTEMS
    env = process_env(transport if ucx else None, secret=secret if ucx else None, threads=1)
    env.update(GLOO_SOCKET_IFNAME="lo", TP_SOCKET_IFNAME="lo")
    return LatencyPair(name, transport, env, sizes=sizes, busy_poll=busy_poll, timeout=timeout)


# ------------------------------------------------------------------------------------------
# The benchmark


def new_cell(iters: int, warmup: int) -> dict[str, Any]:
    return {"median_us": [], "p10_us": [], "p90_us": [], "handoff_ns": [], "errors": [], "iters": iters,
            "warmup": warmup}


def bench_transport(transport: str, systems: Sequence[str], sizes: Sequence[int], *, repeats: int, iters: int,
                    max_bytes: int, busy_poll: bool, timeout: float, results: dict[Key, dict[str, Any]],
                    log: Callable[[str], None], unavailable: dict[str, str], settle: float = 0.0) -> None:
    """Fills ``results`` for one transport; see the module doc for the method. A system that
    cannot run on this machine gets no cells, and the reason in ``unavailable``. ``settle``:
    how long to wait before a measurement for the host to leave a slow phase (``--settle``)."""
    secret = new_secret()
    if "nixl" in systems and nixl_missing():
        unavailable["nixl"] = nixl_missing()
    systems = [s for s in systems if s not in unavailable]
    for name in systems:
        for size in sizes:
            results.setdefault((name, transport, size), new_cell(*iterations(size, iters, max_bytes)))
    objs = {name: make_system(name, transport, secret=secret, sizes=sizes, busy_poll=busy_poll, timeout=timeout)
            for name in systems}

    def measure(name: str, size: int, tag: int) -> str:
        m = objs[name].measure(size, *iterations(size, iters, max_bytes), timeout, tag)
        cell = results[(name, transport, size)]
        for k in ("median_us", "p10_us", "p90_us"):
            if m[k] is not None:
                cell[k].append(m[k])
        return f"{m['median_us']:.2f} us one way"

    fail, record_phase = cell_recorders(results, transport)
    run_interleaved(objs, sizes, repeats, measure, fail, log, transport, format_size,
                    phases=HostPhases(settle), record_phase=record_phase)


# ------------------------------------------------------------------------------------------
# Reporting


def fmt_us(x: float) -> str:
    """Microseconds to three or more significant digits, never in exponent form."""
    return f"{x:.2f}" if x < 10 else f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def median_of(results: Mapping[Key, dict[str, Any]], key: Key, field: str = "median_us") -> float | None:
    cell = results.get(key)
    return statistics.median(cell[field]) if cell and cell[field] else None


def ratio(results: Mapping[Key, dict[str, Any]], transport: str, size: int, num: str, den: str) -> float | None:
    """Median one-way time of ``num`` over that of ``den``: below 1, ``num`` is faster."""
    a, b = median_of(results, (num, transport, size)), median_of(results, (den, transport, size))
    return a / b if a is not None and b else None


def format_table(results: Mapping[Key, dict[str, Any]], transport: str, systems: Sequence[str],
                 sizes: Sequence[int], repeats: int, unavailable: Mapping[str, str]) -> str:
    peers = [p for p in RATIO_PEERS if p in systems and p != REFERENCE]
    head = ["size", *systems, *(f"{REFERENCE}/{p}" for p in peers if REFERENCE in systems)]
    rows, notes = [], {}
    fastest, slow = fastest_handoff(results.values()), False
    for size in sizes:
        row = [format_size(size)]
        for s in systems:
            cell = results.get((s, transport, size))
            med = median_of(results, (s, transport, size))
            if cell and cell["errors"]:
                notes.setdefault(s, cell["errors"][0])
            if med is None:
                row.append("failed" if cell and cell["errors"] else "-")
                continue
            lo, hi = median_of(results, (s, transport, size), "p10_us"), median_of(results, (s, transport, size),
                                                                                   "p90_us")
            marked = slow_handoff(cell, fastest)
            slow |= marked
            row.append(fmt_us(med) + (f" ({fmt_us(lo)}-{fmt_us(hi)})" if lo is not None else "")
                       + ("*" if cell["errors"] else "") + ("~" if marked else ""))
        if REFERENCE in systems:
            row += ["-" if (x := ratio(results, transport, size, REFERENCE, p)) is None else f"{x:.2f}" for p in peers]
        rows.append(row)
    title = (f"## transport {transport}: one-way latency, us: median (p10-p90) over round trips, median of "
             f"{repeats} interleaved repeats; ratios of the medians (below 1: rdmaflow is faster)")
    lines = [title, *text_table(head, rows)]
    lines += [slow_phase_note(fastest)] if slow else []
    lines += [f"* {s}: failed: {msg}" for s, msg in notes.items()]
    lines += [f"{s}: not measured: {why}" for s, why in unavailable.items() if s in systems]
    return "\n".join(lines)


def check_bars(results: Mapping[Key, dict[str, Any]], transports: Sequence[str]) -> list[dict[str, Any]]:
    """The targets this run measured both sides of: rdmaflow's one-way time over the peer's,
    "met" when at most the target."""
    rows = []
    for t, size, peer, bar in BARS:
        if t in transports and (REFERENCE, t, size) in results and (peer, t, size) in results:
            x = ratio(results, t, size, REFERENCE, peer)
            rows.append({"transport": t, "size": size, "peer": peer, "bar": bar, "ratio": x,
                         "verdict": "n/a" if x is None else ("met" if x <= bar else "missed")})
    return rows


def format_bars(rows: Sequence[dict[str, Any]]) -> str:
    cells = [[r["transport"], format_size(r["size"]), f"rdmaflow / {r['peer']}",
              "-" if r["ratio"] is None else f"{r['ratio']:.2f}x", f"<= {r['bar']:g}x", r["verdict"]] for r in rows]
    head = ["transport", "size", "one-way time", "ratio", "target", "met?"]
    return "\n".join(["targets: rdmaflow's one-way time over the peer's (median over median):",
                      *text_table(head, cells)])


def csv_rows(results: Mapping[Key, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for (system, transport, size), cell in results.items():
        s = summarize(cell["median_us"]) if cell["median_us"] else None
        p10, p90 = median_of(results, (system, transport, size), "p10_us"), median_of(results, (system, transport,
                                                                                               size), "p90_us")
        rows.append({
            "system": system, "transport": transport, "size_bytes": size, "size": format_size(size),
            "one_way_us": s and s["median"], "p10_us": p10, "p90_us": p90, "min_us": s and s["min"],
            "max_us": s and s["max"], "iqr_us": s and s["iqr"],
            "ratio_to_ucx_perftest": ratio(results, transport, size, system, "ucx_perftest"),
            "ratio_to_gloo": ratio(results, transport, size, system, "gloo"),
            "repeats": len(cell["median_us"]), "failures": len(cell["errors"]), "iters": cell["iters"],
            "warmup": cell["warmup"], "status": cell_status(cell, "median_us"),
            "values_us": " ".join(f"{v:.4g}" for v in cell["median_us"]),
            "values_handoff_ns": handoff_values(cell),
        })
    return rows


def plot(path: str, results: Mapping[Key, dict[str, Any]], transports: Sequence[str], systems: Sequence[str],
         sizes: Sequence[int], title: str = "") -> None:
    """Log-log one-way latency against size, a panel per transport, a line per system through
    its medians with a band from p10 to p90."""
    fig, axes = pyplot().subplots(1, len(transports), figsize=(6.5 * len(transports), 4.8), squeeze=False)
    for ax, t in zip(axes[0], transports):
        for s in systems:
            pts = [(z, median_of(results, (s, t, z)), median_of(results, (s, t, z), "p10_us"),
                    median_of(results, (s, t, z), "p90_us")) for z in sizes]
            pts = [p for p in pts if p[1] is not None]
            if not pts:
                continue
            color, mark, ls = style(s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=mark or None, linestyle=ls, color=color,
                    label=s, ms=4)
            band = [p for p in pts if p[2] is not None]
            if band:
                ax.fill_between([p[0] for p in band], [p[2] for p in band], [p[3] for p in band], color=color,
                                alpha=0.15, linewidth=0)
        size_axis(ax, sizes)
        ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlabel("message size")
        ax.set_ylabel("one-way latency (round trip / 2), us")
        ax.set_title(f"transport: {t}" + (" (gloo: TCP)" if t == "sm" else ""))
        ax.legend(fontsize=8, loc="best")
    save_figure(fig, path, title, fontsize=9, dpi=110)


# ------------------------------------------------------------------------------------------
# Command line


def add_arguments(ap: argparse.ArgumentParser) -> None:
    flags.add_transport(ap)
    flags.add_systems(ap, SYSTEMS, SYSTEMS)
    flags.add_sizes(ap, DEFAULT_SIZES, f"message sizes (default {DEFAULT_SIZES})")
    flags.add_repeats(ap, DEFAULT_REPEATS, f"interleaved rounds (default {DEFAULT_REPEATS})")
    ap.add_argument("--iters", type=int, default=DEFAULT_ITERS,
                    help=f"timed round trips per measurement (default {DEFAULT_ITERS}; at least {MIN_ITERS})")
    ap.add_argument("--max-bytes", default="64M",
                    help="fewer round trips where iters * size would exceed this (default 64M)")
    ap.add_argument("--busy-poll", action="store_true",
                    help="rdmaflow devices busy-poll instead of sleeping on the wakeup fd")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound on one measurement, seconds (default 60)")
    add_settle_argument(ap)
    flags.add_out(ap, DEFAULT_OUT, f"{CSV_NAME} and {PNG_NAME} (default {DEFAULT_OUT}/)")
    ap.add_argument("--profile", action="store_true",
                    help="instead: where the time of one rdmaflow transfer goes (rdmaflow.bench.latency_profile)")
    flags.add_verbose(ap)


def run(args: argparse.Namespace) -> int:
    try:
        transports = flags.transports(args.transport)
        systems = flags.choose(args.systems, SYSTEMS, "--systems")
        sizes = parse_sizes(args.sizes)
        if not sizes or any(s <= 0 for s in sizes):
            raise ValueError("--sizes needs positive sizes")
        max_bytes = parse_size(args.max_bytes)
        if args.repeats < 1 or args.iters < 1:
            raise ValueError("--repeats and --iters must be >= 1")
        check_settle(args.settle)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.profile:
        from rdmaflow.bench import latency_profile

        return latency_profile.run(args, transports, sizes)

    import rdmaflow

    header = (f"rdmaflow {rdmaflow.__version__} bench latency: UCX {rdmaflow.ucx_version()}, {os.cpu_count()} CPUs, "
              f"sizes {','.join(format_size(s) for s in sizes)}, {args.repeats} repeats, up to {args.iters} round "
              f"trips per measurement, settle {args.settle:g} s")
    print(header, flush=True)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
    results: dict[Key, dict[str, Any]] = {}
    unavailable: dict[str, str] = {}  # system -> why it cannot run here
    csv_path, png_path = os.path.join(args.out, CSV_NAME), os.path.join(args.out, PNG_NAME)

    started = time.monotonic()

    def run_one(t: str) -> None:
        bench_transport(t, systems, sizes, repeats=args.repeats, iters=args.iters, max_bytes=max_bytes,
                        busy_poll=args.busy_poll, timeout=args.timeout, results=results, log=log,
                        unavailable=unavailable, settle=args.settle)

    def table(t: str) -> str:
        return format_table(results, t, systems, sizes, args.repeats, unavailable)

    def save() -> None:
        write_csv(csv_path, CSV_COLUMNS, csv_rows(results))

    interrupted = for_each_transport(transports, run_one, table, save)
    if results:
        save()
        summarize_run(results, transports, systems, sizes, png_path, header)
        print(f"\nCSV: {csv_path}\nplot: {png_path}\nelapsed: {time.monotonic() - started:.0f} s")
    if interrupted:
        return 130
    return 1 if not results or any(not c["median_us"] for c in results.values()) else 0


def summarize_run(results: Mapping[Key, dict[str, Any]], transports: Sequence[str], systems: Sequence[str],
                  sizes: Sequence[int], png_path: str, title: str) -> None:
    """After the tables: the targets and the plot, over the transports that ran."""
    done = [t for t in transports if any(k[1] == t for k in results)]
    bars = check_bars(results, done)
    if bars:
        print("\n" + format_bars(bars))
    try:
        plot(png_path, results, done, systems, sizes, title=title)
    except Exception as e:  # noqa: BLE001  (a plot problem must not lose the numbers)
        print(f"warning: could not write the plot: {e}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from rdmaflow.bench.transfer import main_with_workers

    def make_worker():
        from rdmaflow.bench._latency_worker import make_worker

        return make_worker

    return main_with_workers(argv, "rdmaflow bench latency",
                             "One-way latency (ping-pong) of small transfers: rdmaflow next to "
                             "ucx_perftest, NIXL, gloo and TensorPipe.", add_arguments, run, make_worker)


if __name__ == "__main__":
    sys.exit(main())
