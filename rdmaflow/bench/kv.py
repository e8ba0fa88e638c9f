"""``rdmaflow bench kv``: what a key-value request of many small keys costs next to one tensor of
the same bytes.

For each transport, one job of one shard and one worker (two processes, the c10d store served
here as torchrun's agent would). The worker declares scalar float32 keys 0..max(N)-1 and, for
each N, one key holding an N-float tensor (the keys after them). Per N it times, with the default (sum) handler:

    keys push    push(N scalar keys, batched form) + wait
    keys pull    pull(N scalar keys) + wait
    tensor push  push(the N-float tensor key) + wait
    tensor pull  pull(the N-float tensor key) + wait

Each repeat is the median of ``--iters`` timed calls; the table shows the median over repeats
[min-max] and the ratio keys/tensor, the target being at most 3x for N from 100 to 10,000.

``--sparse`` runs :mod:`rdmaflow.bench.kv_sparse` instead: Zipf-distributed ids from an embedding
table, ``SparseTable`` next to the declared store and dictionary servers over RPC.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Sequence

from rdmaflow.bench import flags, plots, processes
from rdmaflow.bench import harness as h

TRANSPORTS = ("tcp", "sm")
DEFAULT_KEYS = "1,10,100,1000,10000"
OPS = ("push", "pull")
BAR = 3.0
BAR_FROM, BAR_TO = 100, 10_000
CSV_COLUMNS = ("transport", "system", "point", "unit", "median", "min", "max", "iqr", "repeats", "values")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from rdmaflow.bench import kv_sparse

    flags.add_transport(ap)
    ap.add_argument("--keys", default=None,
                    help=f"numbers of keys per request (default {DEFAULT_KEYS}; --sparse: one number, default "
                         f"{kv_sparse.DEFAULT_KEYS})")
    flags.add_repeats(ap, None, "each the median of --iters calls (default 7); --sparse: interleaved rounds of "
                                "--iters pulls and pushes per system (default 5)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per repeat (default 30; --sparse: 20)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed calls before each cell (default 5; --sparse: before each repeat, default 2)")
    ap.add_argument("--timeout", type=float, default=300.0,
                    help="seconds the whole job may take per transport (--sparse: per call, plus setup)")
    flags.add_out(ap, "bench-results/kv", "kv.csv and kv.png; --sparse: kv-sparse.csv and kv-sparse.json "
                                          "(default bench-results/kv)")
    flags.add_quick(ap, "2 repeats of 3 calls (--sparse: 1 repeat of 3, 10,000 rows x 16)")
    ap.add_argument("--sparse", action="store_true",
                    help="pulls and pushes of Zipf keys from an embedding table: SparseTable (both read paths) next "
                         "to the declared KVStore and dictionary servers over TensorPipe RPC and gRPC (kv_sparse.py)")
    flags.add_systems(ap, None, kv_sparse.SYSTEMS)
    ap.add_argument("--rows", default=None,
                    help=f"--sparse: table rows, one or several, comma-separated (1e6 = 1000000; default "
                         f"{kv_sparse.DEFAULT_ROWS}; 10,000,000 runs the systems that fit --max-memory)")
    ap.add_argument("--dims", default=None, help=f"--sparse: float32 per row (default {kv_sparse.DEFAULT_DIMS})")
    ap.add_argument("--zipf", type=float, default=1.1, help="--sparse: the keys' Zipf exponent (default 1.1)")
    flags.add_seed(ap, "the --sparse keys")
    ap.add_argument("--max-memory", default=None, metavar="SIZE",
                    help="--sparse: a system whose estimated memory exceeds this (K/M/G) is reported n/a at that "
                         "size (default 60%% of MemAvailable)")
    ap.add_argument("--no-perftest", action="store_true", help="--sparse: leave out ucx_perftest ucp_get over tcp")
    flags.add_verbose(ap)


# -- the job's processes ---------------------------------------------------------------------------
def _timed(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def job_process(counts: list[int], repeats: int, iters: int, warmup: int) -> int:
    """A process of the job: a shard serves (inside ps.init) and exits; the worker measures and
    prints one JSON line per repeat and cell."""
    import torch

    from rdmaflow import ps

    ps.init()  # a shard never returns from here
    top = max(counts)
    tensor_key = {n: top + i for i, n in enumerate(counts)}  # right after the scalars: dense keys
    keys = list(range(top)) + list(tensor_key.values())
    kv = ps.KVStore(keys, [()] * top + [(n,) for n in counts], torch.float32)
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for r in range(repeats):
        for n in counts:
            scalar_keys, values, tensor, key = torch.arange(n), torch.ones(n), torch.ones(n), tensor_key[n]
            cells = {
                "keys push": lambda k=scalar_keys, v=values: kv.wait(kv.push(k, v)),
                "keys pull": lambda k=scalar_keys: kv.wait(kv.pull(k)),
                "tensor push": lambda k=key, t=tensor: kv.wait(kv.push(k, t)),
                "tensor pull": lambda k=key: kv.wait(kv.pull(k)),
            }
            for system, fn in cells.items():
                ms = _timed(fn, iters, warmup)
                print(json.dumps({"ok": True, "repeat": r, "n": n, "system": system, "ms": ms}), flush=True)
    kv.close()
    print(json.dumps({"ok": True, "done": True}), flush=True)
    return 0


def bench_transport(transport: str, counts: list[int], args: argparse.Namespace, m: h.Measurements) -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
    secret = processes.new_secret()
    argv = [sys.executable, "-m", "rdmaflow.bench.kv", "--job-process", "--keys", ",".join(map(str, counts)),
            "--repeats", str(args.repeats), "--iters", str(args.iters), "--warmup", str(args.warmup)]
    procs = []
    try:
        for rank, label in enumerate(("kv shard", "kv worker")):
            env = processes.process_env(transport, secret=secret, threads=1)
            env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port), RDMAFLOW_SHARDS_PER_NODE="1",
                       TORCHELASTIC_USE_AGENT_STORE="True")
            procs.append(processes.ChildProcess(argv, env, label, stdin=False))
        worker = procs[1]
        deadline = time.monotonic() + args.timeout
        worker.read(max(1.0, deadline - time.monotonic()))  # ready
        while True:
            msg = worker.read(max(1.0, deadline - time.monotonic()))
            if msg.get("done"):
                break
            m.add(f"{transport} {msg['system']}", int(msg["n"]), msg["ms"])
    finally:
        for p in procs:
            p.close(grace=5.0)


def report(m: h.Measurements, transports: list[str], counts: list[int]) -> list[dict]:
    """Prints a table per transport and operation and returns the bars' rows."""
    bars = []
    for t in transports:
        for op in OPS:
            keys, tensor = f"{t} keys {op}", f"{t} tensor {op}"
            sub = h.Measurements("ms")
            for n in counts:
                for system in (keys, tensor):
                    for v in m.values(system, n):
                        sub.add(system, n, v)
            print()
            print(h.ratio_table(sub, keys, point_label=lambda n: f"N={n}",
                                title=f"{t}, {op} + wait, ms: median [min-max] over repeats; keys/tensor"))
            # tensor/keys >= 1/BAR is keys/tensor <= BAR (check_bars passes ratios at or above the bar)
            bars += h.check_bars(m, [(tensor, keys, 1 / BAR)], [n for n in counts if BAR_FROM <= n <= BAR_TO])
    return bars


def plot(path: str, m: h.Measurements) -> None:
    """Median ms against N on log-log axes, a line per transport, operation and form."""
    plt = plots.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in m.systems:
        pts = [(n, h.summarize(m.values(system, n))["median"]) for n in m.points if m.values(system, n)]
        ax.plot([n for n, _ in pts], [v for _, v in pts], marker="o" if "keys" in system else "x",
                linestyle="-" if "push" in system else "--", label=system, ms=4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("N: scalar float32 keys per request (tensor: N floats)")
    ax.set_ylabel("ms per call + wait (median)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    plots.save_figure(fig, path, "rdmaflow bench kv: N keys in one request next to one tensor of the same bytes")


def run(args: argparse.Namespace) -> int:
    if args.sparse:
        from rdmaflow.bench import kv_sparse

        return kv_sparse.run(args)
    args.keys = args.keys or DEFAULT_KEYS
    args.repeats = 7 if args.repeats is None else args.repeats
    args.iters = 30 if args.iters is None else args.iters
    args.warmup = 5 if args.warmup is None else args.warmup
    try:
        counts = sorted({int(x) for x in args.keys.split(",") if x.strip()})
    except ValueError:
        print(f"error: --keys takes integers, got {args.keys!r}", file=sys.stderr)
        return 2
    if not counts or counts[0] < 1 or args.repeats < 1 or args.iters < 1 or args.warmup < 0:
        print("error: --keys, --repeats and --iters must be >= 1, --warmup >= 0", file=sys.stderr)
        return 2
    if args.quick:
        args.repeats, args.iters, args.warmup = 2, 3, 1
    try:
        transports = flags.transports(args.transport)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    m = h.Measurements("ms")
    status = 0
    for t in transports:
        try:
            bench_transport(t, counts, args, m)
        except processes.BenchError as e:
            print(f"error: transport {t}: {e}", file=sys.stderr)
            status = 1
    bars = report(m, transports, counts)
    for b in bars:
        ratio = "-" if not b["ratio"] else f"{1 / b['ratio']:.2f}"
        print(f"{b['den']} / {b['num']} at N={b['point']}: {ratio}x  target: <= {BAR:g}x  {b['verdict']}")
    os.makedirs(args.out, exist_ok=True)
    rows = [dict(r, transport=r["system"].split()[0], system=r["system"].split(" ", 1)[1]) for r in m.rows()]
    h.write_csv(os.path.join(args.out, "kv.csv"), CSV_COLUMNS, rows)
    if m.cells:
        plot(os.path.join(args.out, "kv.png"), m)
    print(f"\nCSV: {os.path.join(args.out, 'kv.csv')}, plot: {os.path.join(args.out, 'kv.png')}")
    return status


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rdmaflow bench kv", description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--job-process", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.job_process:
        return job_process([int(x) for x in args.keys.split(",")], args.repeats, args.iters, args.warmup)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
