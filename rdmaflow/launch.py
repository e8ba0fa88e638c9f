"""``rdmaflow launch``: starts a parameter-server job with torchrun (torch.distributed.run).

Each node runs ``--nproc-per-node`` workers plus ``--shards-per-node`` shards (default one of
each, as in seed 000 §5.2); torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT, and rdmaflow.ps.init() derives each process's role from them. The job secret
that devices prove to each other is generated here for a one-node job; a multi-node job needs
the same RDMAFLOW_JOB_SECRET exported on every node.
"""
from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import sys


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="rdmaflow launch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nnodes", type=int, default=1, help="number of hosts (default 1)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, dest="nproc_per_node",
                   help="workers per host (default 1)")
    p.add_argument("--shards-per-node", type=int, default=1, help="parameter-server shards per host (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, dest="node_rank")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1", dest="master_addr")
    p.add_argument("--master-port", "--master_port", type=int, default=29500, dest="master_port")
    p.add_argument("--resume", action="store_true",
                   help="restart from the latest checkpoint (sets RDMAFLOW_RESUME=1 for the job)")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun command and exit")
    p.add_argument("script", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the training script")
    return p


def command(ns: argparse.Namespace) -> tuple[list[str], dict]:
    if ns.nproc_per_node < 1 or ns.shards_per_node < 1 or ns.nnodes < 1:
        raise SystemExit("rdmaflow launch: --nnodes, --nproc-per-node and --shards-per-node must be >= 1")
    env = dict(os.environ)
    if not env.get("RDMAFLOW_JOB_SECRET"):
        if ns.nnodes > 1:
            raise SystemExit("rdmaflow launch: a multi-node job needs the same RDMAFLOW_JOB_SECRET on every node; "
                             "export one (e.g. `export RDMAFLOW_JOB_SECRET=$(openssl rand -hex 16)`)")
        env["RDMAFLOW_JOB_SECRET"] = secrets.token_hex(16)
    env["RDMAFLOW_SHARDS_PER_NODE"] = str(ns.shards_per_node)
    if ns.resume:
        env["RDMAFLOW_RESUME"] = "1"
    argv = [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(ns.nnodes), "--nproc-per-node", str(ns.nproc_per_node + ns.shards_per_node),
            "--node-rank", str(ns.node_rank), "--master-addr", ns.master_addr, "--master-port", str(ns.master_port),
            ns.script, *ns.args]
    return argv, env


def run(ns: argparse.Namespace) -> int:
    argv, env = command(ns)
    if ns.dry_run:
        print(" ".join(argv))
        return 0
    return subprocess.call(argv, env=env)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
