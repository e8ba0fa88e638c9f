"""``rdmaflow bench c10d``: torch.distributed over the "rdmaflow" backend next to gloo, in one run.

Per transport and rank count, one job of N processes (``_c10d_worker.py``) runs each op on an
rdmaflow group and on a gloo group of the same ranks, the systems' order rotating per repeat:

- ``pingpong``: one-way P2P latency, ``dist.send`` then ``dist.recv`` round trips / 2 (2 ranks);
- ``stream``: P2P stream, rank 0 ``isend``s a window of tensors that rank 1 ``recv``s (2 ranks);
- ``all_reduce``: SUM of float32 tensors (every rank count).

Prints medians with the spread (min-max over the repeats) and the ratio gloo / rdmaflow (above
1: rdmaflow is faster); ``--out DIR`` writes ``c10d.csv`` with every repeat.

    rdmaflow bench c10d --transport tcp,sm --sizes 8,1K,64K,1M,16M --ranks 2,4 --repeats 5
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict

from rdmaflow._ucx import ucx_env
from rdmaflow.bench import flags
from rdmaflow.bench.harness import format_size, parse_sizes
from rdmaflow.bench.processes import free_port, new_secret

SYSTEMS = ("rdmaflow", "gloo")
OPS = ("pingpong", "stream", "all_reduce")
JOB_TIMEOUT = 600.0


def add_arguments(ap: argparse.ArgumentParser) -> None:
    flags.add_transport(ap)
    flags.add_sizes(ap, "8,1K,64K,1M,16M", "tensor sizes (default 8,1K,64K,1M,16M)")
    flags.add_systems(ap, SYSTEMS, SYSTEMS)
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma list of {OPS} (default all)")
    ap.add_argument("--ranks", default="2,4", help="comma list of rank counts; P2P runs at 2 only (default 2,4)")
    flags.add_repeats(ap, 5, "timed runs per cell and system (default 5)")
    ap.add_argument("--iterations", type=int, default=2000,
                    help="most calls in one timed run (fewer for large sizes: 64 MiB per run; default 2000)")
    flags.add_out(ap, None, "c10d.csv (default: none)")


def _run_job(transport: str, ranks: int, cfg: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.jsonl")
        port, secret = free_port(), new_secret()
        procs = []
        for rank in range(ranks):
            env = ucx_env(transport)
            for k in ("TORCHELASTIC_USE_AGENT_STORE", "RDMAFLOW_HOST"):
                env.pop(k, None)
            env.update(RANK=str(rank), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       RDMAFLOW_JOB_SECRET=secret, OMP_NUM_THREADS="1", C10D_BENCH=json.dumps(dict(cfg, out=out)))
            procs.append(subprocess.Popen([sys.executable, "-m", "rdmaflow.bench._c10d_worker"], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        failed = []
        for rank, p in enumerate(procs):
            try:
                text, _ = p.communicate(timeout=JOB_TIMEOUT)
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                text = "(timed out)"
            if p.returncode != 0:
                failed.append(f"rank {rank} (rc {p.returncode}):\n{text[-3000:]}")
        if failed:
            raise RuntimeError(f"bench c10d over {transport} at {ranks} ranks failed:\n" + "\n".join(failed))
        with open(out) as f:
            return [dict(json.loads(line), transport=transport) for line in f]


def run(args: argparse.Namespace) -> int:
    sizes = parse_sizes(args.sizes)
    ops = [o for o in args.ops.split(",") if o]
    try:
        transports = flags.transports(args.transport)
        systems = flags.choose(args.systems, SYSTEMS, "--systems")
    except ValueError as e:
        print(f"bench c10d: {e}", file=sys.stderr)
        return 2
    bad = [o for o in ops if o not in OPS]
    if bad or args.repeats < 1 or args.iterations < 2:
        print(f"bench c10d: unknown op {bad} (ops {OPS}), or --repeats < 1, or --iterations < 2", file=sys.stderr)
        return 2
    rows = []
    for transport in transports:
        for ranks in [int(r) for r in args.ranks.split(",") if r]:
            cell_ops = ops if ranks == 2 else [o for o in ops if o == "all_reduce"]
            if cell_ops:
                rows += _run_job(transport, ranks, {"sizes": sizes, "systems": systems, "repeats": args.repeats,
                                                    "ops": cell_ops, "iterations": args.iterations})
    cells: dict[tuple, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[(r["transport"], r["ranks"], r["op"], r["bytes"])][r["system"]].append(r["seconds"])
    print(f"{'transport':9} {'ranks':>5} {'op':10} {'size':>6}  " +
          "  ".join(f"{s + ' median us [min-max]':>34}" for s in systems) + "  gloo/rdmaflow")
    for key in sorted(cells):
        got = cells[key]
        line = f"{key[0]:9} {key[1]:>5} {key[2]:10} {format_size(key[3]):>6}  "
        line += "  ".join(f"{statistics.median(got[s]) * 1e6:>14.1f} [{min(got[s]) * 1e6:.1f}-{max(got[s]) * 1e6:.1f}]"
                          .rjust(34) if got.get(s) else f"{'-':>34}" for s in systems)
        if got.get("gloo") and got.get("rdmaflow"):
            line += f"  {statistics.median(got['gloo']) / statistics.median(got['rdmaflow']):.2f}x"
        print(line)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "c10d.csv")
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["transport", "ranks", "op", "bytes", "system", "repeat", "seconds",
                                              "iterations"])
            w.writeheader()
            for r in rows:
                w.writerow({k: r[k] for k in w.fieldnames})
        print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rdmaflow bench c10d", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
