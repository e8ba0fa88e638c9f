"""``rdmaflow bench transfer``: one-way tensor transfer, side by side with the peers (Xue et al.
§5.1, Figure 8).

A sender process streams float32 tensors of one size to a receiver process, which consumes
each with a reduce_max (``tensor.max()``), as in the paper's micro-benchmark. Systems:

==================  =========================================================================
rdmaflow-zerocopy   ``StaticSender(mode="zerocopy")`` from a tensor made by ``device.empty``
                    (it lives in the registered arena) into a ``StaticReceiver``; the receiver
                    ``recv()``s, reduces, and the next ``recv()`` releases the slot (RDMA.zerocp)
rdmaflow-copy       ``StaticSender(mode="copy")`` from an ordinary torch tensor: copied into a
                    registered staging buffer first (the paper's RDMA.cp)
rdmaflow-dynamic    ``DynamicSender``/``DynamicReceiver`` from an arena tensor: metadata by
                    WRITE, data fetched by the receiver with a READ into a fresh arena tensor
grpc-protobuf       gRPC (Python grpcio) unary calls carrying the tensor's bytes in a protobuf
                    ``BytesValue``; the receiver makes a tensor of them (``torch.frombuffer``)
                    and reduces: the way TensorFlow's gRPC transport moves tensors
tensorpipe          ``torch.distributed.rpc`` (TensorPipe backend): ``rpc_async(receiver,
                    consume, args=(tensor,))``, pipelined: at most ``window`` calls in flight
gloo                ``torch.distributed`` gloo ``isend``/``irecv``; the receiver keeps
                    ``window`` receives posted
nixl                NIXL WRITE + notification per tensor into ``window`` registered slots,
                    a notification back per consumed slot (:mod:`.baselines.nixl_transfer`);
                    in the default list when NIXL is installed
ucx-perftest-put    ``ucx_perftest ucp_put_bw`` (:func:`rdmaflow.bench.perftest.run_perftest`):
                    the UCX transport's own ceiling (bandwidth only; no per-transfer time)
memcpy              single-thread ``dst.copy_(src)`` of the same size in one process: the
                    machine's ceiling
==================  =========================================================================

Transports (``--transport``): ``tcp`` restricts every system to TCP over loopback (rdmaflow via
``rdmaflow._ucx.ucx_env("tcp")``; TensorPipe's ``uv`` transport and ``basic`` channel; gRPC on 127.0.0.1);
``sm`` gives each its best same-host path (rdmaflow via ``ucx_env("sm")``: cma; TensorPipe
``shm`` transport and ``cma`` channel; gRPC over a unix domain socket; gloo has TCP only).

Method:

* Every system sends the same ``warmup + count`` tensors per measurement (``count`` from
  ``--target-bytes``, between ``--min-iters`` and ``--max-iters``; ``warmup`` is a tenth of it,
  at least 1). At most ``window`` transfers are in flight in every system (rdmaflow: the
  receiver's slot depth; TensorPipe/gRPC: outstanding calls; gloo: posted receives), fewer
  where ``window * size`` would exceed ``--max-inflight-bytes``.
* The receiver records, on CLOCK_MONOTONIC, the instant each reduce_max finished: ``t_0`` (the
  last warm-up transfer) ... ``t_count``. ``gb_per_s = count * size / (t_count - t_0)``
  (10^9 B = 1 GB), bytes moved per second as seen at the receiver, after the reduce_max of the
  last one. ``p50_us`` = median of ``t_i - t_(i-1)``: the time per transfer in a stream of
  back-to-back transfers (receiver-observed inter-arrival time). memcpy: best of 3 loops of
  ``count`` copies; the per-copy times of that loop. ucx_perftest reports bandwidth only.
* The systems are interleaved: for each repeat, for each size, every system once (the order
  rotates each repeat), so noise on this shared machine hits them alike. Each cell is the
  median of ``--repeats`` repeats, with min, max and IQR; a cell that has spent
  ``--cell-budget`` seconds (60) stops after 3 repeats (in practice: gRPC at the largest
  sizes).
* Around every measurement the harness times how long a cache line takes to move between the
  first two cpus (:func:`rdmaflow.bench.processes.handoff_ns`, 20 ms before and after; the
  slower counts). Under a hypervisor that figure moves several-fold with where the host runs
  the vCPUs, and every system's copies with it. Before a measurement the harness waits up to
  ``--settle`` seconds (5), idle, for the figure to come within twice the fastest seen on the
  transport. A cell with a repeat measured at twice the run's fastest handoff or more is
  marked ``~`` in the tables; the CSV has each repeat's figure (``values_handoff_ns``).
* Each system (:mod:`rdmaflow.bench.transfer_systems`) is a sender and a receiver process
  (memcpy: one), started once per transport in
  their own process groups, with the transport's environment; every wait is bounded, and
  every process is killed when the run ends, fails or is interrupted. A system that fails is
  reported as such in its cells and restarted for the next measurement.

CUDA tensors (``--device cuda``): the same stream, method and output, with CUDA
tensors on one GPU between two processes, 1K to 1G by default, as one "transport" named
``cuda`` (rdmaflow's processes run with ``rdmaflow._ucx.ucx_env("cuda")``: CUDA copies and
IPC, shared memory, tcp). Systems:

==================  =========================================================================
rdmaflow-zerocopy   the source tensor born in the sender's registered CUDA arena
                    (``dev.empty(..., device="cuda")``), static placement into the receiver's
                    CUDA slots (``StaticReceiver(..., cuda="cuda")``; flags in host memory);
                    on one host the sender maps the slots (CUDA IPC) and a copy kernel on its
                    stream writes them
rdmaflow-zerocopy-  the same through UCX alone (``RDMAFLOW_GPU_IPC=0``): its cuda_ipc transport
  ucx               copies with the copy engine
rdmaflow-dynamic    ``DynamicSender``/``DynamicReceiver`` with CUDA tensors (the paper's
                    default for GPU tensors): the metadata record in host memory, the receiver
                    copies the data into its CUDA arena (from the sender's mapped arena on one
                    host, else by a UCX READ)
rdmaflow-staging    through the host: the sender copies the CUDA tensor into a host arena
                    tensor and sends it over a host static pair (zero copy); the receiver copies
                    the received host tensor to a CUDA tensor
tensorpipe          ``rpc_async`` with CUDA tensors over TensorPipe's CUDA channels (device map
                    0 -> 0; ``cuda_ipc`` on one host), the callee returns None
gloo                host staging (gloo has no CUDA point-to-point): ``copy_`` into a host
                    tensor, ``isend``; the receiver ``irecv``s and copies to the GPU
d2d-copy            ``dst.copy_(src)`` on the GPU in one process, a stream of copies timed with
                    CUDA events: the ceiling
==================  =========================================================================

The receiver's consume step (``--consume``) is a ``torch.cuda.current_stream().synchronize()``
by default on CUDA ("sync": the time is the transfer's, comparable with the copy's; the last
tensor of each measurement has its max checked); ``--consume max`` makes it the reduce_max of
the host benchmark. The bars (:data:`ACCEPTANCE`) apply at 256 MiB and above: zero copy at
least 0.7x d2d-copy, 2x gloo and 1x TensorPipe. Defaults are sized for a short run on a GPU
machine: 3 repeats, 2 GiB per measurement (at least 2 transfers), a base timeout of 30 s,
each measurement bounded at ``timeout + bytes / 500 MB/s``. Without a usable GPU the command
exits at once with one line saying why.

``--json PATH`` (default ``OUT/transfer.json``, ``OUT/transfer-cuda.json`` on CUDA) gets the
rows of the CSV, the acceptance ratios, every ratio of zero copy to the others, the command
and the machine; it is rewritten after each transport and at an interruption.
"""
from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from rdmaflow.bench import flags
from rdmaflow.bench._transfer_worker import CONSUME_MODES
from rdmaflow.bench.harness import (
    add_settle_argument,
    cell_recorders,
    for_each_transport,
    format_size,
    parse_size,
    parse_sizes,
    run_interleaved,
    write_csv,
    write_json,
)
from rdmaflow.bench.processes import DEFAULT_SETTLE, BenchError, HostPhases, check_settle, new_secret
from rdmaflow.bench.transfer_report import (
    CSV_COLUMNS,
    CUDA_TRANSPORT,
    MIN_REPEATS,
    acceptance,
    csv_rows,
    format_acceptance,
    format_tables,
    json_doc,
    plot,
)
from rdmaflow.bench.transfer_systems import (
    System,
    arena_bytes,
    cuda_arena_bytes,
    make_system,
    window_of,
)

__all__ = ["BenchError", "System", "add_arguments", "arena_bytes", "cuda_arena_bytes", "main", "make_system",
           "run", "window_of"]

SYSTEMS = ("rdmaflow-zerocopy", "rdmaflow-copy", "rdmaflow-dynamic", "grpc-protobuf",
           "tensorpipe", "gloo", "nixl", "ucx-perftest-put", "memcpy")
#: The systems of ``--device cuda``, in their default order.
CUDA_SYSTEMS = ("rdmaflow-zerocopy", "rdmaflow-zerocopy-ucx", "rdmaflow-dynamic", "rdmaflow-staging", "tensorpipe",
                "gloo", "d2d-copy")
TRANSPORTS = ("tcp", "sm")
DEVICES = ("cpu", "cuda")
#: The one "transport" of a CUDA run (its UCX environment: ``transport_env("cuda")``).
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M,16M,64M,256M,1G"
CUDA_DEFAULT_SIZES = "1K,64K,1M,16M,256M,1G"
QUICK_SIZES = "64K,1M"
DEFAULT_REPEATS = 5
QUICK_REPEATS = 2
DEFAULT_TARGET_BYTES = 256 << 20
QUICK_TARGET_BYTES = 8 << 20
DEFAULT_MIN_ITERS = 1
DEFAULT_MAX_ITERS = 1000
QUICK_MAX_ITERS = 100
DEFAULT_WINDOW = 2
DEFAULT_MAX_INFLIGHT = 1 << 30
#: --device cuda: 3 repeats; 2 GiB per measurement, at least 2 transfers (1G: 2, 256M: 8).
CUDA_REPEATS = 3
CUDA_TARGET_BYTES = 2 << 30
CUDA_MIN_ITERS = 2
DEFAULT_TIMEOUT = 60.0
CUDA_TIMEOUT = 30.0
#: The slowest rate a measurement is allowed before it counts as hung (its bound is
#: ``timeout + bytes / rate``): gRPC on the host; host staging over TCP on CUDA runs.
MIN_RATE = {"cpu": 20e6, "cuda": 500e6}
#: The receiver's consume step per device (:func:`rdmaflow.bench._transfer_worker.consume`).
DEFAULT_CONSUME = {"cpu": "max", "cuda": "sync"}
DEFAULT_OUT = "bench-results"
#: The output files per device: OUT/NAME.csv, .png, .json.
OUT_NAME = {"cpu": "transfer", "cuda": "transfer-cuda"}
CSV_NAME = "transfer.csv"
PNG_NAME = "transfer.png"
#: A cell (system, transport, size) that has used --cell-budget seconds stops at this many repeats.
DEFAULT_CELL_BUDGET = 60.0



# ------------------------------------------------------------------------------------------
# Parameters of a measurement


def iterations(size: int, target_bytes: int, min_iters: int, max_iters: int) -> int:
    return max(min_iters, min(max_iters, math.ceil(target_bytes / size)))


def warmup_of(count: int) -> int:
    return max(1, count // 10)


# ------------------------------------------------------------------------------------------
# The benchmark

Key = tuple[str, str, int]  # (system, transport, size)


def measurement_timeout(size: int, count: int, base: float, rate: float = MIN_RATE["cpu"]) -> float:
    # Generous: the slowest system (gRPC on the host) must finish, not be cut off: the bound
    # allows `rate` bytes/s.
    return base + (count + warmup_of(count)) * size / rate


def bench_transport(transport: str, systems: Sequence[str], sizes: Sequence[int], *, repeats: int,
                    target_bytes: int, min_iters: int, max_iters: int, window: int,
                    max_inflight: int, busy_poll: bool, timeout: float, torch_threads: int,
                    results: dict[Key, dict[str, Any]],
                    log: Callable[[str], None], consume: str = "max", device: str = "cpu",
                    cell_budget: float = float("inf"), settle: float = 0.0) -> None:
    """Fills ``results`` for one transport; see the module doc for the method. ``settle``: how
    long to wait before a measurement for the host to leave a slow phase (``--settle``)."""
    secret = new_secret()
    sock_dir = tempfile.mkdtemp(prefix="rdmaflow-bench-")
    try:
        objs = {name: make_system(name, transport, secret=secret, sizes=sizes, window=window,
                                  max_inflight=max_inflight, busy_poll=busy_poll, sock_dir=sock_dir,
                                  timeout=timeout, torch_threads=torch_threads, consume=consume,
                                  device=device)
                for name in systems}
        for size in sizes:
            count = iterations(size, target_bytes, min_iters, max_iters)
            for name in systems:
                results.setdefault((name, transport, size), {
                    "gb_per_s": [], "p50_us": [], "handoff_ns": [], "errors": [], "iters": count,
                    "warmup": warmup_of(count), "window": window_of(size, window, max_inflight),
                    "seconds": 0.0})

        def measure(name: str, size: int, tag: int) -> str | None:
            cell = results[(name, transport, size)]
            if len(cell["gb_per_s"]) >= MIN_REPEATS and cell["seconds"] >= cell_budget:
                return None  # a slow cell (gRPC at 1G): MIN_REPEATS repeats are enough
            count = iterations(size, target_bytes, min_iters, max_iters)
            t0 = time.monotonic()
            m = objs[name].measure(size, count, warmup_of(count), window_of(size, window, max_inflight),
                                   measurement_timeout(size, count, timeout, MIN_RATE[device]), tag)
            cell["seconds"] += time.monotonic() - t0
            cell["gb_per_s"].append(m["gb_per_s"])
            if m["p50_us"] is not None:
                cell["p50_us"].append(m["p50_us"])
            return f"{m['gb_per_s']:.3f} GB/s" + ("" if m["p50_us"] is None else f", p50 {m['p50_us']:.1f} us")

        fail, record_phase = cell_recorders(results, transport)
        run_interleaved(objs, sizes, repeats, measure, fail, log, transport, format_size,
                        phases=HostPhases(settle), record_phase=record_phase)
    finally:
        shutil.rmtree(sock_dir, ignore_errors=True)


# ------------------------------------------------------------------------------------------
# Command line


def default_systems(device: str = "cpu") -> list[str]:
    """Every system of ``device``; on the host less NIXL where it is not installed
    (scripts/setup.sh installs it)."""
    if device == "cuda":
        return list(CUDA_SYSTEMS)
    return [s for s in SYSTEMS if s != "nixl" or importlib.util.find_spec("nixl") is not None]


def cuda_device_info() -> dict[str, Any]:
    """The GPU a ``--device cuda`` run uses (name, memory, torch and CUDA versions); RuntimeError
    saying why there is none."""
    import torch

    if torch.version.cuda is None:
        raise RuntimeError(f"this PyTorch ({torch.__version__}) is built without CUDA")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError("no CUDA device is visible (torch.cuda.is_available() is False"
                           + ("" if visible is None else f"; CUDA_VISIBLE_DEVICES={visible!r}") + ")")
    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "gpu_memory_gib": round(props.total_memory / (1 << 30), 1),
            "gpus": torch.cuda.device_count(), "torch": torch.__version__, "cuda": torch.version.cuda}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--device", choices=DEVICES, default="cpu",
                    help="cpu: host tensors over tcp and sm (default); cuda: CUDA tensors between two "
                         f"processes on one GPU ({','.join(CUDA_SYSTEMS)})")
    flags.add_transport(ap, note=f"--device cuda: {CUDA_TRANSPORT}, its own",
                        allowed=(*TRANSPORTS, CUDA_TRANSPORT))
    flags.add_systems(ap, None, f"{', '.join(SYSTEMS)} (all: nixl when it is installed); --device cuda: "
                                f"{', '.join(CUDA_SYSTEMS)}")
    flags.add_sizes(ap, None, f"tensor sizes (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES}; "
                              f"--device cuda: {CUDA_DEFAULT_SIZES})")
    flags.add_repeats(ap, None, f"interleaved rounds (default {DEFAULT_REPEATS}; --quick: {QUICK_REPEATS}; "
                                f"--device cuda: {CUDA_REPEATS})")
    ap.add_argument("--target-bytes", default=None,
                    help="bytes per measurement: count = target / size, clamped to [min, max] "
                         "iterations (default 256M; --quick: 8M; --device cuda: 2G)")
    ap.add_argument("--min-iters", type=int, default=None,
                    help=f"fewest timed transfers per measurement (default {DEFAULT_MIN_ITERS}; "
                         f"--device cuda: {CUDA_MIN_ITERS})")
    ap.add_argument("--max-iters", type=int, default=None,
                    help=f"most timed transfers per measurement (default {DEFAULT_MAX_ITERS}; "
                         f"--quick: {QUICK_MAX_ITERS})")
    add_settle_argument(ap, None, f"{DEFAULT_SETTLE:g}; --quick: 0")
    ap.add_argument("--window", type=int, default=DEFAULT_WINDOW,
                    help=f"transfers in flight in every system (default {DEFAULT_WINDOW})")
    ap.add_argument("--max-inflight-bytes", default="1G",
                    help="the window shrinks so that window * size stays within this (default 1G)")
    flags.add_threads(ap, 1, "every system's, for the reduce_max; default 1")
    ap.add_argument("--torch-threads", type=int, dest="threads", default=argparse.SUPPRESS,
                    help=argparse.SUPPRESS)  # older spelling
    ap.add_argument("--consume", choices=CONSUME_MODES, default=None,
                    help="the receiver's consume step: max (reduce_max, the default on the host), sync "
                         "(torch.cuda.current_stream().synchronize(), the default on CUDA), none")
    ap.add_argument("--no-reduce", action="store_true",
                    help="diagnostic: --consume none (receivers skip the reduce_max: transfer cost alone)")
    ap.add_argument("--busy-poll", action="store_true",
                    help="rdmaflow devices busy-poll instead of sleeping on the wakeup fd")
    ap.add_argument("--cell-budget", type=float, default=DEFAULT_CELL_BUDGET,
                    help=f"seconds: a cell (system, size) that has spent this much stops after "
                         f"{MIN_REPEATS} repeats (default {DEFAULT_CELL_BUDGET:g}: gRPC at 1G); "
                         f"0 disables")
    ap.add_argument("--timeout", type=float, default=None,
                    help=f"base bound on one measurement, seconds; grows with its bytes (default "
                         f"{DEFAULT_TIMEOUT:g}; --device cuda: {CUDA_TIMEOUT:g})")
    flags.add_out(ap, DEFAULT_OUT, f"{CSV_NAME}, {PNG_NAME} and transfer.json (--device cuda: "
                                   f"transfer-cuda.*) (default {DEFAULT_OUT}/)")
    ap.add_argument("--json", default=None, metavar="PATH",
                    help="write the results, ratios and bars as JSON here (default OUT/transfer.json, "
                         "OUT/transfer-cuda.json on CUDA)")
    ap.add_argument("--plot", default=None, help=f"also write the plot here (e.g. docs/img/{PNG_NAME})")
    flags.add_quick(ap, f"sizes {QUICK_SIZES}, {QUICK_REPEATS} repeats, 8M per measurement")
    flags.add_verbose(ap)


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The run's parameters from the command line, each default taken per ``--device`` and
    ``--quick``: device, transports, systems, sizes, repeats, target_bytes, min_iters,
    max_iters, max_inflight, timeout, consume, settle. ValueError names what is wrong."""
    cuda = args.device == "cuda"
    if cuda:
        given = flags.transports(args.transport, (*TRANSPORTS, CUDA_TRANSPORT))
        if given not in (list(TRANSPORTS), [CUDA_TRANSPORT]):
            raise ValueError(f"--device cuda runs over its own transport ({CUDA_TRANSPORT}); "
                             f"--transport {','.join(given)} is for host tensors")
        transports = [CUDA_TRANSPORT]
    else:
        transports = flags.transports(args.transport)
    allowed = CUDA_SYSTEMS if cuda else SYSTEMS
    systems = flags.choose(args.systems, allowed, "--systems") if args.systems else default_systems(args.device)
    sizes = parse_sizes(_given(args.sizes, QUICK_SIZES if args.quick else CUDA_DEFAULT_SIZES if cuda else DEFAULT_SIZES))
    if not sizes or any(s <= 0 or s % 4 for s in sizes):
        raise ValueError("--sizes needs positive multiples of 4 bytes (float32 tensors)")
    target = parse_size(args.target_bytes) if args.target_bytes is not None else (
        QUICK_TARGET_BYTES if args.quick else CUDA_TARGET_BYTES if cuda else DEFAULT_TARGET_BYTES)
    consume = "none" if args.no_reduce else (args.consume or DEFAULT_CONSUME[args.device])
    if args.no_reduce and args.consume not in (None, "none"):
        raise ValueError(f"--no-reduce is --consume none, not --consume {args.consume}")
    if consume == "sync" and not cuda:
        raise ValueError("--consume sync waits for a CUDA stream: it needs --device cuda")
    out = {
        "device": args.device, "transports": transports, "systems": systems, "sizes": sizes,
        "repeats": _given(args.repeats, QUICK_REPEATS if args.quick else CUDA_REPEATS if cuda else DEFAULT_REPEATS),
        "target_bytes": target,
        "min_iters": _given(args.min_iters, CUDA_MIN_ITERS if cuda and not args.quick else DEFAULT_MIN_ITERS),
        "max_iters": _given(args.max_iters, QUICK_MAX_ITERS if args.quick else DEFAULT_MAX_ITERS),
        "max_inflight": parse_size(args.max_inflight_bytes),
        "timeout": _given(args.timeout, CUDA_TIMEOUT if cuda else DEFAULT_TIMEOUT),
        "window": args.window, "consume": consume,
        "settle": check_settle(args.settle if args.settle is not None else 0.0 if args.quick else DEFAULT_SETTLE),
    }
    if out["repeats"] < 1 or args.window < 1 or out["min_iters"] < 1 or out["max_iters"] < out["min_iters"]:
        raise ValueError("--repeats, --window, --min-iters must be >= 1 and --max-iters >= --min-iters")
    if not out["timeout"] > 0 or target <= 0 or out["max_inflight"] <= 0:
        raise ValueError("--timeout, --target-bytes and --max-inflight-bytes must be positive")
    return out


def _given(value, default):
    """An option's value where one was given (0 and "" included, for the checks to refuse), else
    its default: ``value or default`` would run the default for --repeats 0."""
    return default if value is None else value


def run(args: argparse.Namespace) -> int:
    try:
        cfg = settings(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    device, transports, systems, sizes = cfg["device"], cfg["transports"], cfg["systems"], cfg["sizes"]
    repeats = cfg["repeats"]
    machine: dict[str, Any] = {"cpus": os.cpu_count()}
    if device == "cuda":
        try:
            machine.update(cuda_device_info())
        except RuntimeError as e:
            print(f"error: --device cuda: {e}", file=sys.stderr)
            return 1

    import rdmaflow

    machine.update(rdmaflow=rdmaflow.__version__, ucx=rdmaflow.ucx_version())
    gpu = (f", GPU {machine.get('gpu')} ({machine.get('gpu_memory_gib')} GiB), torch {machine.get('torch')}, "
           f"CUDA {machine.get('cuda')}" if device == "cuda" else "")
    header = (f"rdmaflow {rdmaflow.__version__} bench transfer --device {device}: UCX {rdmaflow.ucx_version()}, "
              f"{os.cpu_count()} CPUs{gpu}, sizes {','.join(format_size(s) for s in sizes)}, "
              f"{repeats} repeats, window {args.window}, torch threads {args.threads}, "
              f"consume: {cfg['consume']}, settle {cfg['settle']:g} s")
    print(header, flush=True)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
    results: dict[Key, dict[str, Any]] = {}
    name = OUT_NAME[device]
    csv_path = os.path.join(args.out, f"{name}.csv")
    png_path = os.path.join(args.out, f"{name}.png")
    json_path = args.json or os.path.join(args.out, f"{name}.json")

    started = time.monotonic()

    def run_one(t: str) -> None:
        bench_transport(t, systems, sizes, repeats=repeats, target_bytes=cfg["target_bytes"],
                        min_iters=cfg["min_iters"], max_iters=cfg["max_iters"], window=args.window,
                        max_inflight=cfg["max_inflight"], busy_poll=args.busy_poll,
                        timeout=cfg["timeout"], torch_threads=args.threads,
                        results=results, log=log, consume=cfg["consume"], device=device,
                        cell_budget=args.cell_budget if args.cell_budget > 0 else float("inf"),
                        settle=cfg["settle"])

    def save(interrupted: bool = False) -> None:
        write_csv(csv_path, CSV_COLUMNS, csv_rows(results))
        done = [t for t in transports if any(k[1] == t for k in results)]
        shown = {k: (format_size(v) if k == "target_bytes" else v) for k, v in cfg.items()
                 if k not in ("transports", "systems", "sizes")}
        write_json(json_path, json_doc(results, done, systems, sizes, header=header, settings=shown,
                                       machine=machine, elapsed_s=time.monotonic() - started,
                                       interrupted=interrupted))

    def table(t: str) -> str:
        return format_tables(results, t, systems, sizes, repeats, cfg["consume"])

    interrupted = for_each_transport(transports, run_one, table, save)
    if not results:
        return 130 if interrupted else 1
    save(interrupted)
    done = [t for t in transports if any(k[1] == t for k in results)]
    rows = acceptance(results, done)
    if rows:
        print()
        print(format_acceptance(rows))
    try:
        plot(png_path, results, done, systems, sizes, title=header)
        if args.plot:
            plot(args.plot, results, done, systems, sizes, title=header)
    except Exception as e:  # noqa: BLE001  (a plot problem must not lose the numbers)
        print(f"warning: could not write the plot: {e}", file=sys.stderr)
    print(f"\nCSV: {csv_path}\nJSON: {json_path}\nplot: {png_path}" + (f", {args.plot}" if args.plot else "")
          + f"\nelapsed: {time.monotonic() - started:.0f} s")
    if interrupted:
        return 130
    failed = any(not c["gb_per_s"] for c in results.values())
    return 1 if failed else 0


def worker_main(argv: Sequence[str], prog: str, make: Callable | None = None) -> int:
    """A worker process of ``bench transfer`` (or, with its ``make``, of ``bench latency``):
    parses the options its driver passes and serves :mod:`rdmaflow.bench._transfer_worker`'s
    protocol."""
    ap = argparse.ArgumentParser(prog=prog)
    ap.add_argument("system")
    ap.add_argument("role")
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--sock-dir", default=tempfile.gettempdir())
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--arena-bytes", type=int, default=64 << 20)
    ap.add_argument("--max-size", type=int, default=1 << 20)
    ap.add_argument("--busy-poll", action="store_true")
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--device", choices=DEVICES, default="cpu")
    ap.add_argument("--cuda-arena-bytes", type=int, default=0)
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.torch_threads)
    from rdmaflow.bench import _transfer_worker

    return _transfer_worker.serve(args, make)


def main(argv: Sequence[str] | None = None) -> int:
    return main_with_workers(argv, "rdmaflow bench transfer",
                             "One-way tensor transfer with reduce_max at the receiver: rdmaflow next to "
                             "gRPC, TensorPipe, gloo, ucx_perftest and memcpy (Xue et al. Figure 8); "
                             "--device cuda: CUDA tensors on one GPU next to TensorPipe's CUDA channels, "
                             "gloo through the host and a device-to-device copy.",
                             add_arguments, run)


def main_with_workers(argv: Sequence[str] | None, prog: str, description: str,
                      add_arguments: Callable[[argparse.ArgumentParser], None], run: Callable[[Any], int],
                      make_worker: Callable[[], Callable] | None = None) -> int:
    """The entry point of a benchmark whose peers are transfer workers (``bench transfer``,
    ``bench latency``): ``--worker ...`` serves as one (``make_worker()`` gives its ``make``),
    anything else runs the benchmark."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker_main(argv[1:], f"{prog} --worker", make_worker() if make_worker else None)
    ap = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
