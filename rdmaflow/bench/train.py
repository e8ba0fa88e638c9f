"""``rdmaflow bench train``: training throughput of parameter-server and all-reduce systems
(Xue et al. §5.2, Figures 9, 11 and 12).

Each *cell* is one short training job: ``(system, model, batch, workers, shards)``
(:mod:`rdmaflow.bench.train_cells` runs one). The job's processes are
``python -m rdmaflow.bench._train_proc``, each in its own process group, with torchrun's
variables (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``), a fresh ``RDMAFLOW_JOB_SECRET`` and the cell's configuration
as JSON in ``RDMAFLOW_TRAIN_CFG``:
``{"system", "model", "batch", "workers", "shards", "warmup", "iters", "zero_copy",
"overlap": true, "mode": "sync", "lr", "seed", "timeout"}`` (+ ``"threads"``).

==============  ==========================================================================
rdmaflow        rdmaflow.ps: ``shards`` shard processes (ranks ``0..S-1``) and ``workers``
                worker processes (ranks ``S..S+W-1``, worker ``RANK - S``); gradients pushed
                and parameters pulled by one-sided WRITEs (zero copy)
rdmaflow-copy   the same with ``zero_copy`` false (``--no-zero-copy``, Figure 12)
tensorpipe      the same parameter-server layout over ``torch.distributed.rpc`` (TensorPipe)
grpc            the same layout over gRPC
ddp             ``DistributedDataParallel`` with gloo all-reduce, ``workers`` processes
local           one process, no communication: the "Local" line of Figure 11
==============  ==========================================================================

``ddp`` does not depend on ``shards`` and ``local`` on neither: they are measured once per
(model, batch, workers) and (model, batch) and recorded with ``shards`` 0 (``local``:
``workers`` 1); the tables and ratios set them next to every shard count.

A worker prints ``RDMAFLOW_TRAIN_RESULT {json}`` (keys ``system, model, worker, times,
losses, batch``: ``times`` are the seconds of each iteration after ``warmup``) and every
process exits 0; anything else fails the cell, which is recorded with the last lines of the
failing process's stderr, its processes killed, and the run goes on. Every wait is bounded
by ``--timeout`` per cell.

Metrics per cell: a worker's rate is ``1 / median(times)``; ``batches_per_s`` is the median
of the workers' rates (mini-batches per second per worker, Figure 9's y axis);
``batches_per_s_p25/p75/min/max`` are percentiles of the per-iteration rates ``1 / t`` of
all workers' iterations; ``median_iter_s`` is the median of all those iteration times
(Figure 12's mini-batch time); ``samples_per_s = batches_per_s * batch * workers`` (the
job's throughput, Figure 11's y axis).

Measurement order: cells run one at a time; the systems of one configuration (model, batch,
workers, shards) run back to back, so they see the same machine state, in an order that
rotates from one configuration to the next.

``--hosts netns``: worker ``i`` and shard ``i`` run in their own network namespace, "host"
``i`` (:class:`rdmaflow.testing.netns.Hosts`: namespaces on one bridge, 10.252.0.x), as in
the paper's one worker and one parameter server per machine; so ``shards = workers``. The
rendezvous and the shard 0 are on host 0. rdmaflow's UCX and gloo/TensorPipe use the hosts'
veths.

Output in ``--out DIR`` (default ``bench-train-<timestamp>``): ``results.csv`` (a row per
cell, rewritten after every cell), ``results.json`` (the same with every worker's iteration
times and losses, the ratios and the acceptance verdicts), and unless ``--no-plot``:
``throughput.png`` always (bars: batches/s per worker per configuration and system),
``fig9_batch.png`` when 2+ batch sizes ran (Figure 9: batches/s per worker against the
mini-batch size), ``fig11_workers.png`` when 2+ worker counts ran (Figure 11: the job's
samples/s against workers, with local and its ideal linear scaling), ``fig12_zero_copy.png``
when rdmaflow-copy ran (Figure 12: mini-batch time with and without the copy). Printed: the
tables, rdmaflow's ratio over each system, the targets met or missed (batch 8, 2 workers,
2 shards, fcn5 and alexnet: rdmaflow >= 2x grpc, >= 1.3x tensorpipe, >= 1.0x ddp) and how
busy the machine was. Exit status: 0 every cell ok, 1 a cell failed, 2 bad arguments (or no
network namespaces for ``--hosts netns``), 130 interrupted (what was measured is written).

``--transport tcp`` (default) puts rdmaflow's UCX (``UCX_TLS=tcp``) and TensorPipe (uv
transport, basic channel) on TCP, like gRPC and gloo; ``sm`` gives those two shared memory
(one host only).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rdmaflow.bench import flags
from rdmaflow.bench.harness import percentile, verdict, write_csv, write_json
from rdmaflow.bench.processes import BackgroundMeter, format_background
from rdmaflow.bench.train_cells import (
    PROC_MODULE,
    RDMAFLOW_SYSTEMS,
    Config,
    Key,
    cell_key,
    lookup,
    run_cell,
    train_cfg,
)
from rdmaflow.bench.train_plots import make_plots

SYSTEMS = ("rdmaflow", "tensorpipe", "grpc", "ddp", "local")
#: Every system name, in the order of the tables and plots.
ALL_SYSTEMS = ("rdmaflow", "rdmaflow-copy", "tensorpipe", "grpc", "ddp", "local")
DEFAULT_MODELS = ("fcn5", "alexnet")
DEFAULT_BATCH = (8,)
DEFAULT_WORKERS = (2,)
DEFAULT_SHARDS = 2
DEFAULT_WARMUP = 3
DEFAULT_ITERS = 20
DEFAULT_TIMEOUT = 600.0
DEFAULT_LR = 0.01
HOSTS = ("local", "netns")

CSV_NAME = "results.csv"
JSON_NAME = "results.json"

#: The targets (rdmaflow's batches/s per worker over the system's), checked at
#: ACCEPT_CONFIG for ACCEPT_MODELS when the run measured them.
ACCEPT_CONFIG = {"batch": 8, "workers": 2, "shards": 2}
ACCEPT_MODELS = ("fcn5", "alexnet")
ACCEPTANCE = (("grpc", 2.0), ("tensorpipe", 1.3), ("ddp", 1.0))

CSV_COLUMNS = [
    "system", "model", "batch", "workers", "shards", "batches_per_s",
    "batches_per_s_p25", "batches_per_s_p75", "batches_per_s_min", "batches_per_s_max",
    "samples_per_s", "median_iter_s", "iters", "warmup", "hosts", "zero_copy",
    "loss_first", "loss_last", "worker_batches_per_s", "wall_s", "background_cpus",
    "status", "error",
]


# ------------------------------------------------------------------------------------------
# Metrics


def cell_metrics(results: Sequence[Mapping[str, Any]], batch: int) -> dict[str, Any]:
    """The numbers of a cell from its workers' results (see the module doc)."""
    if not results:
        raise ValueError("no worker results")
    per_worker = [1.0 / statistics.median(r["times"]) for r in results]
    times = [float(t) for r in results for t in r["times"]]
    rates = sorted(1.0 / t for t in times)
    bps = statistics.median(per_worker)

    def loss(i: int) -> float | None:
        vals = [float(r["losses"][i]) for r in results if r.get("losses")]
        return statistics.median(vals) if vals else None

    return {
        "batches_per_s": bps,
        "batches_per_s_p25": percentile(rates, 0.25),
        "batches_per_s_p75": percentile(rates, 0.75),
        "batches_per_s_min": rates[0],
        "batches_per_s_max": rates[-1],
        "samples_per_s": bps * batch * len(results),
        "median_iter_s": statistics.median(times),
        "iters": min(len(r["times"]) for r in results),
        "worker_batches_per_s": per_worker,
        "loss_first": loss(0),
        "loss_last": loss(-1),
    }


def new_cell(key: Key, *, hosts: str, warmup: int, iters: int) -> dict[str, Any]:
    system, model, batch, workers, shards = key
    return {"system": system, "model": model, "batch": batch, "workers": workers,
            "shards": shards, "hosts": hosts, "warmup": warmup, "iters": iters,
            "zero_copy": (system == "rdmaflow") if system in RDMAFLOW_SYSTEMS else None,
            "status": "not run", "error": "", "wall_s": None, "background_cpus": None,
            "metrics": None, "workers_results": []}


def ratio(cells: Mapping[Key, dict[str, Any]], cfg: Config, num: str, den: str,
          metric: str = "batches_per_s") -> float | None:
    a, b = lookup(cells, num, cfg), lookup(cells, den, cfg)
    if a is None or b is None or not b[metric]:
        return None
    return a[metric] / b[metric]


def ratio_rows(cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config],
               systems: Sequence[str]) -> list[dict[str, Any]]:
    """rdmaflow over every other system, per configuration (batches/s per worker); over local
    also as a speedup of the job's samples/s."""
    rows = []
    for cfg in configs:
        if lookup(cells, "rdmaflow", cfg) is None:
            continue
        row: dict[str, Any] = dict(zip(("model", "batch", "workers", "shards"), cfg))
        for s in systems:
            if s != "rdmaflow":
                row[s] = ratio(cells, cfg, "rdmaflow", s)
        if "local" in systems:
            row["speedup_vs_local"] = ratio(cells, cfg, "rdmaflow", "local", "samples_per_s")
        rows.append(row)
    return rows


def acceptance(cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config]) -> list[dict[str, Any]]:
    rows = []
    for model in ACCEPT_MODELS:
        cfg = (model, ACCEPT_CONFIG["batch"], ACCEPT_CONFIG["workers"], ACCEPT_CONFIG["shards"])
        if cfg not in configs:
            continue
        for den, bar in ACCEPTANCE:
            if cell_key(den, *cfg) not in cells:
                continue
            x = ratio(cells, cfg, "rdmaflow", den)
            rows.append({"model": model, **ACCEPT_CONFIG, "num": "rdmaflow", "den": den,
                         "bar": bar, "ratio": x,
                         "verdict": verdict(x, bar)})
    return rows


# ------------------------------------------------------------------------------------------
# Reporting


def _fmt(x: float | None, spec: str = ".3g") -> str:
    return "-" if x is None else format(x, spec)


def _num(x: float) -> str:
    """Compact, without exponents: 3840, 216, 16.6, 0.123."""
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.3g}"


def csv_row(cell: Mapping[str, Any]) -> dict[str, Any]:
    m = cell["metrics"]
    row = {k: cell[k] for k in ("system", "model", "batch", "workers", "shards", "hosts",
                                "warmup", "status", "error")}
    row["iters"] = m["iters"] if m else cell["iters"]
    row["zero_copy"] = "" if cell["zero_copy"] is None else int(cell["zero_copy"])
    row["wall_s"] = "" if cell["wall_s"] is None else f"{cell['wall_s']:.1f}"
    row["background_cpus"] = "" if cell["background_cpus"] is None else f"{cell['background_cpus']:.2f}"
    for k in ("batches_per_s", "batches_per_s_p25", "batches_per_s_p75", "batches_per_s_min",
              "batches_per_s_max", "samples_per_s", "median_iter_s", "loss_first", "loss_last"):
        row[k] = "" if not m or m[k] is None else f"{m[k]:.6g}"
    row["worker_batches_per_s"] = " ".join(f"{v:.6g}" for v in m["worker_batches_per_s"]) if m else ""
    return row


def save_csv(path: str, cells: Iterable[Mapping[str, Any]]) -> None:
    write_csv(path, CSV_COLUMNS, [csv_row(c) for c in cells])


def save_json(path: str, meta: Mapping[str, Any], cells: Iterable[Mapping[str, Any]],
              ratios: Any = None, accept: Any = None) -> None:
    write_json(path, {"meta": dict(meta), "cells": list(cells), "ratios": ratios or [],
                      "acceptance": accept or []})


def ordered_cells(cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config],
                  systems: Sequence[str]) -> list[dict[str, Any]]:
    out, seen = [], set()
    for cfg in configs:
        for s in systems:
            k = cell_key(s, *cfg)
            if k in cells and k not in seen:
                seen.add(k)
                out.append(cells[k])
    out += [c for k, c in cells.items() if k not in seen]
    return out


def format_tables(cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config],
                  systems: Sequence[str]) -> str:
    width = 22
    head = f"{'model':<12} {'batch':>5} {'W':>2} {'S':>2} " + " ".join(f"{s:>{width}}" for s in systems)
    lines = [("mini-batches/s per worker: median over workers of 1/median(iteration time) "
              "[p25-p75 of all iterations' rates]"), head, "-" * len(head)]
    notes: dict[Key, str] = {}
    for cfg in configs:
        row = [f"{cfg[0]:<12} {cfg[1]:>5} {cfg[2]:>2} {cfg[3]:>2}"]
        for s in systems:
            k = cell_key(s, *cfg)
            cell = cells.get(k)
            if cell is None:
                txt = "-"
            elif cell["metrics"] is None:
                txt = "failed" if cell["error"] else cell["status"]
                if cell["error"]:
                    notes.setdefault(k, cell["error"])
            else:
                m = cell["metrics"]
                txt = (f"{_num(m['batches_per_s'])} [{_num(m['batches_per_s_p25'])}-"
                       f"{_num(m['batches_per_s_p75'])}]")
            row.append(f"{txt:>{width}}")
        lines.append(" ".join(row))
    head2 = f"{'model':<12} {'batch':>5} {'W':>2} {'S':>2} " + " ".join(f"{s:>{width}}" for s in systems)
    lines += ["", "samples/s of the whole job (batches_per_s * batch * workers; local: 1 process)",
              head2, "-" * len(head2)]
    for cfg in configs:
        row = [f"{cfg[0]:<12} {cfg[1]:>5} {cfg[2]:>2} {cfg[3]:>2}"]
        for s in systems:
            m = lookup(cells, s, cfg)
            row.append(f"{_num(m['samples_per_s']) if m else '-':>{width}}")
        lines.append(" ".join(row))
    if any(s in systems for s in ("ddp", "local")):
        lines.append("(ddp is measured once per model/batch/workers, local once per model/batch; "
                     "shown next to every shard count)")
    for k, msg in notes.items():
        lines.append(f"* {k[0]} {k[1]} batch {k[2]} W{k[3]} S{k[4]}: failed: {msg}")
    return "\n".join(lines)


def format_ratios(rows: Sequence[Mapping[str, Any]], systems: Sequence[str]) -> str:
    others = [s for s in systems if s != "rdmaflow"]
    if not rows or not others:
        return ""
    cols = [f"/{s}" for s in others] + (["speedup/local"] if "local" in systems else [])
    head = f"{'model':<12} {'batch':>5} {'W':>2} {'S':>2} " + " ".join(f"{c:>14}" for c in cols)
    lines = [("rdmaflow over each system: batches/s per worker (speedup/local: samples/s of the "
              "job over one local process)"), head, "-" * len(head)]
    for r in rows:
        vals = [r.get(s) for s in others] + ([r.get("speedup_vs_local")] if "local" in systems else [])
        lines.append(f"{r['model']:<12} {r['batch']:>5} {r['workers']:>2} {r['shards']:>2} "
                     + " ".join(f"{_fmt(v, '.2f'):>14}" for v in vals))
    return "\n".join(lines)


def format_acceptance(rows: Sequence[Mapping[str, Any]]) -> str:
    if not rows:
        return ""
    c = ACCEPT_CONFIG
    lines = [(f"targets (batch {c['batch']}, {c['workers']} workers, {c['shards']} shards; "
              f"median batches/s per worker over median):")]
    for r in rows:
        lines.append(f"  {r['model']:<8} rdmaflow / {r['den']:<10} {_fmt(r['ratio'], '.2f'):>6}x"
                     f"  target: >= {r['bar']:g}x  {r['verdict']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------
# The benchmark


def plan(models: Sequence[str], batches: Sequence[int], workers: Sequence[int],
         shards: Sequence[int] | None, netns: bool) -> list[Config]:
    """The configurations, in measurement order (netns: shards = workers)."""
    out = []
    for model in models:
        for w in workers:
            for s in ([w] if netns else shards or [DEFAULT_SHARDS]):
                for b in batches:
                    out.append((model, b, w, s))
    return list(dict.fromkeys(out))


def schedule(configs: Sequence[Config], systems: Sequence[str]) -> list[Key]:
    """Cells in order: the systems of a configuration back to back, their order rotated by one
    from one configuration to the next; ddp/local cells only where first needed."""
    out: list[Key] = []
    seen: set[Key] = set()
    for g, cfg in enumerate(configs):
        r = g % len(systems)
        for s in list(systems[r:]) + list(systems[:r]):
            k = cell_key(s, *cfg)
            if k not in seen:
                seen.add(k)
                out.append(k)
    return out


def _positive_ints(values: Sequence[int], what: str) -> list[int]:
    vals = list(dict.fromkeys(values))
    if not vals or any(v < 1 for v in vals):
        raise ValueError(f"--{what} needs positive integers")
    return vals


def _describe_models(models: Sequence[str]) -> list[str]:
    try:
        from rdmaflow.bench import models as mdl  # written next to this module
    except Exception:  # noqa: BLE001 - only the header is affected
        return []
    out = []
    for m in models:
        try:
            d = mdl.describe(m)
            t2 = f" (Xue et al. Table 2: {d['table2_mb']:g} MB)" if d.get("table2_mb") else ""
            out.append(f"  {m}: {d['params']:,} parameters in {d['tensors']} tensors, "
                       f"{d['mb']:.3g} MiB{t2}")
        except Exception as e:  # noqa: BLE001 - the cell reports the real error
            out.append(f"  {m}: unknown here ({type(e).__name__}: {e})")
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    flags.add_models(ap, DEFAULT_MODELS, "rdmaflow.bench.models' names")
    ap.add_argument("--batch", nargs="+", type=int, default=list(DEFAULT_BATCH), metavar="B",
                    help="mini-batch sizes per worker (default 8; several: Figure 9)")
    ap.add_argument("--workers", nargs="+", type=int, default=list(DEFAULT_WORKERS), metavar="W",
                    help="worker counts (default 2; several: Figure 11)")
    ap.add_argument("--shards", nargs="+", type=int, default=None, metavar="S",
                    help=f"parameter-server shard counts (default {DEFAULT_SHARDS}; "
                         f"--hosts netns: = workers)")
    flags.add_systems(ap, SYSTEMS, f"{', '.join(ALL_SYSTEMS)}")
    ap.add_argument("--no-zero-copy", action="store_true",
                    help="also run rdmaflow with zero_copy=False, as system rdmaflow-copy (Figure 12)")
    ap.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                    help=f"untimed iterations per worker (default {DEFAULT_WARMUP})")
    ap.add_argument("--iters", type=int, default=DEFAULT_ITERS,
                    help=f"timed iterations per worker (default {DEFAULT_ITERS})")
    ap.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                    help=f"bound on one cell, start-up included, seconds (default {DEFAULT_TIMEOUT:g})")
    flags.add_hosts(ap, "worker i and shard i in network namespace i")
    flags.add_transport(ap, ("tcp",), note="rdmaflow's and TensorPipe's (gRPC and gloo use TCP); one per "
                                          "run; sm: --hosts local only")
    ap.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"learning rate (default {DEFAULT_LR:g})")
    flags.add_seed(ap, "the models and data")
    flags.add_threads(ap, None, "default: the training process decides")
    flags.add_out(ap, None, f"{CSV_NAME}, {JSON_NAME}, PNGs (default bench-train-<timestamp>)")
    ap.add_argument("--no-plot", dest="plot", action="store_false", default=True, help="write no PNG plots")
    ap.add_argument("--plot", dest="plot", action="store_true", help=argparse.SUPPRESS)  # older: the default
    flags.add_verbose(ap)
    ap.add_argument("--proc-module", default=PROC_MODULE, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    netns = args.hosts == "netns"
    try:
        models = flags.split(args.models)
        batches = _positive_ints(args.batch, "batch")
        workers = _positive_ints(args.workers, "workers")
        shards = _positive_ints(args.shards, "shards") if args.shards is not None else None
        systems = flags.choose(args.systems, ALL_SYSTEMS, "--systems")
        transport = flags.transports(args.transport, one=True)[0]
        if args.no_zero_copy and "rdmaflow-copy" not in systems:
            at = systems.index("rdmaflow") + 1 if "rdmaflow" in systems else 0
            systems.insert(at, "rdmaflow-copy")
        systems = [s for s in ALL_SYSTEMS if s in systems]  # canonical order
        if args.iters < 1 or args.warmup < 0 or args.timeout <= 0:
            raise ValueError("--iters must be >= 1, --warmup >= 0, --timeout > 0")
        if args.threads is not None and args.threads < 1:
            raise ValueError("--threads must be >= 1")
        if not models or any(not m for m in models):
            raise ValueError("--models needs names")
        if netns and shards is not None and sorted(shards) != sorted(workers):
            raise ValueError("--hosts netns runs one shard per host (shards = workers): drop --shards")
        if netns and transport != "tcp":
            raise ValueError("--hosts netns needs --transport tcp (the hosts share no memory)")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if importlib.util.find_spec(args.proc_module) is None:
        print(f"error: {args.proc_module} is missing: the training process of this benchmark",
              file=sys.stderr)
        return 1
    if netns:
        from rdmaflow.testing.netns import netns_unavailable_reason

        reason = netns_unavailable_reason()
        if reason:
            print(f"error: --hosts netns: network namespaces are unavailable here: {reason}",
                  file=sys.stderr)
            return 2
    configs = plan(models, batches, workers, shards, netns)
    order = schedule(configs, systems)
    out = args.out or time.strftime("bench-train-%Y%m%d-%H%M%S")
    os.makedirs(out, exist_ok=True)
    csv_path, json_path = os.path.join(out, CSV_NAME), os.path.join(out, JSON_NAME)

    import rdmaflow

    header = (f"rdmaflow {rdmaflow.__version__} bench train: UCX {rdmaflow.ucx_version()}, "
              f"{os.cpu_count()} CPUs, hosts {args.hosts}, rdmaflow (UCX) and TensorPipe over "
              f"{transport}, "
              f"models {' '.join(models)}, batch {' '.join(map(str, batches))}, workers "
              f"{' '.join(map(str, workers))}, shards "
              f"{'= workers' if netns else ' '.join(map(str, shards or [DEFAULT_SHARDS]))}, "
              f"warmup {args.warmup}, iters {args.iters}, sync, lr {args.lr:g}, seed {args.seed}"
              + (f", {args.threads} torch threads" if args.threads else ""))
    print(header, flush=True)
    for line in _describe_models(models):
        print(line, flush=True)
    print(f"{len(order)} cells, one at a time (timeout {args.timeout:g} s each); output in {out}/",
          flush=True)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if args.verbose else (lambda s: None)
    meta = {"header": header, "argv": sys.argv, "hosts": args.hosts, "transport": transport,
            "models": models, "batch": batches, "workers": workers,
            "shards": "workers" if netns else (shards or [DEFAULT_SHARDS]), "systems": systems,
            "warmup": args.warmup, "iters": args.iters, "lr": args.lr, "seed": args.seed,
            "threads": args.threads, "timeout": args.timeout, "cpus": os.cpu_count(),
            "rdmaflow": rdmaflow.__version__, "ucx": rdmaflow.ucx_version(),
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    cells: dict[Key, dict[str, Any]] = {}

    def save() -> None:
        ordered = ordered_cells(cells, configs, systems)
        save_csv(csv_path, ordered)
        save_json(json_path, meta, ordered, ratio_rows(cells, configs, systems),
                   acceptance(cells, configs))

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    run_meter = BackgroundMeter()
    interrupted = False
    hosts_cm: Any = None
    try:
        hosts = None
        if netns:
            from rdmaflow.testing.netns import Hosts

            hosts_cm = Hosts(max(workers))
            hosts = hosts_cm.open()
            log(f"hosts: {', '.join(f'{h.ns} {h.addr}' for h in hosts)}")
        for i, key in enumerate(order, 1):
            system, model, batch, w, s = key
            cell = new_cell(key, hosts=args.hosts, warmup=args.warmup, iters=args.iters)
            cfg = train_cfg(key, warmup=args.warmup, iters=args.iters, lr=args.lr,
                            seed=args.seed, timeout=args.timeout, threads=args.threads,
                            transport=transport)
            label = f"[{i}/{len(order)}] {system} {model} batch {batch} W{w} S{s}"
            meter = BackgroundMeter()
            t0 = time.monotonic()
            try:
                res = run_cell(key, cfg=cfg, timeout=args.timeout, transport=transport,
                               hosts=hosts, threads=args.threads, proc_module=args.proc_module,
                               log=log)
                cell["metrics"] = cell_metrics(res, batch)
                cell["workers_results"] = res
                cell["status"] = "ok"
                m = cell["metrics"]
                msg = (f"{_num(m['batches_per_s'])} batches/s per worker "
                       f"[{_num(m['batches_per_s_p25'])}-{_num(m['batches_per_s_p75'])}], "
                       f"{_num(m['samples_per_s'])} samples/s")
            except Exception as e:  # noqa: BLE001 - a failed cell must not end the run
                cell["status"] = "failed"
                cell["error"] = " ".join(str(e).split())[:1000] or type(e).__name__
                msg = f"FAILED: {cell['error'][:300]}"
            finally:
                cell["wall_s"] = time.monotonic() - t0
            bg = meter.report()
            cell["background_cpus"] = bg["other_cpus"]
            cells[key] = cell
            print(f"{label}: {msg} ({cell['wall_s']:.0f} s"
                  + (f", others used {bg['other_cpus']:.2f} cores" if bg["other_cpus"] > 0.1 else "")
                  + ")", flush=True)
            save()
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted; every benchmark process was stopped", file=sys.stderr, flush=True)
    finally:
        signal.signal(signal.SIGTERM, old)
        if hosts_cm is not None:
            with contextlib.suppress(Exception):
                hosts_cm.close()
    if not cells:
        print("nothing was measured", file=sys.stderr)
        return 130 if interrupted else 1
    save()
    print()
    print(format_tables(cells, configs, systems))
    rr = format_ratios(ratio_rows(cells, configs, systems), systems)
    if rr:
        print()
        print(rr)
    acc = format_acceptance(acceptance(cells, configs))
    if acc:
        print()
        print(acc)
    print()
    print(format_background(run_meter.report()))
    plots: list[str] = []
    if args.plot:
        try:
            plots = make_plots(out, cells, configs, systems, netns, header)
        except Exception as e:  # noqa: BLE001  (a plot problem must not lose the numbers)
            print(f"warning: could not write the plots: {e}", file=sys.stderr)
    print(f"\nCSV: {csv_path}\nJSON: {json_path}"
          + (f"\nplots: {', '.join(plots)}" if plots else "")
          + f"\nelapsed: {time.monotonic() - started:.0f} s", flush=True)
    if interrupted:
        return 130
    return 1 if any(c["status"] != "ok" for c in cells.values()) else 0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="rdmaflow bench train",
        description="Training throughput (mini-batches/s) of rdmaflow's parameter server next "
                    "to TensorPipe, gRPC, DDP-gloo and one local process (Xue et al. Figures 9, 11, 12).")
    add_arguments(ap)
    return run(ap.parse_args(list(sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    sys.exit(main())
