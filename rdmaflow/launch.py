"""``rdmaflow launch``: starts a parameter-server job with torchrun (torch.distributed.run).

Each node runs ``--nproc-per-node`` workers plus ``--shards-per-node`` shards (default one of
each, as in Xue et al. §5.2); torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT, and rdmaflow.ps.init() derives each process's role from them. The job secret
that devices prove to each other is generated here for a one-node job; a multi-node job needs
the same RDMAFLOW_JOB_SECRET exported on every node.

torchrun stops every process of a node when one fails. ``--min-workers N`` lets a job survive
worker failures (iRDMA §IV-D): rdmaflow launch then starts this node's processes itself, with
the same variables torchrun sets (static rendezvous: rank = node rank x processes per node +
local rank), keeps the others running when a worker dies, and stops them all when a shard
fails. The shards go on while at least N workers live (RDMAFLOW_MIN_WORKERS).

Either way a SIGTERM, SIGINT or SIGHUP sent to this process alone stops every process of the
node (docs/parameter-server.md, "Stopping a job").
"""
from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import shlex
import signal
import socket
import subprocess
import sys
import time


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
    p.add_argument("--min-workers", type=int, default=None,
                   help="survive worker failures while at least this many workers live (the job's total; "
                        "rdmaflow launch then supervises the processes itself instead of torchrun)")
    p.add_argument("--resume", action="store_true",
                   help="restart from the latest checkpoint (sets RDMAFLOW_RESUME=1 for the job)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands that would run the job (the variables it sets, then torchrun or, with "
                        "--min-workers, each process) and exit")
    p.add_argument("-m", "--module", default=None, metavar="MODULE",
                   help="run a module instead of a script, as `python -m` does; what follows are its arguments "
                        "(e.g. -m rdmaflow.fileview /mnt/model-{worker} --model model.json)")
    # Optional to argparse so that a missing script gets its own message (argparse named "script, args").
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the training script")
    return p


def command(ns: argparse.Namespace) -> tuple[list[str], dict]:
    if ns.nproc_per_node < 1 or ns.shards_per_node < 1 or ns.nnodes < 1:
        raise SystemExit("rdmaflow launch: --nnodes, --nproc-per-node and --shards-per-node must be >= 1")
    if not 0 <= ns.node_rank < ns.nnodes:  # torchrun waits for the missing nodes without end
        raise SystemExit(f"rdmaflow launch: --node-rank {ns.node_rank} is not in [0, --nnodes {ns.nnodes})")
    if not 1 <= ns.master_port <= 65535 or not ns.master_addr.strip():
        raise SystemExit(f"rdmaflow launch: --master-addr {ns.master_addr!r} --master-port {ns.master_port}: "
                         "an address and a port in [1, 65535]")
    if getattr(ns, "module", None):
        check_module(ns.module)
    elif ns.script is None:
        raise SystemExit("rdmaflow launch: no training script given: rdmaflow launch [options] train.py [its arguments]")
    elif not os.path.isfile(ns.script):
        what = "is a directory, not a script" if os.path.isdir(ns.script) else "does not exist"
        raise SystemExit(f"rdmaflow launch: the script {ns.script} {what}")
    env = dict(os.environ)
    if not env.get("RDMAFLOW_JOB_SECRET"):
        if ns.nnodes > 1:
            raise SystemExit("rdmaflow launch: a multi-node job needs the same RDMAFLOW_JOB_SECRET on every node; "
                             "export one (e.g. `export RDMAFLOW_JOB_SECRET=$(openssl rand -hex 16)`)")
        env["RDMAFLOW_JOB_SECRET"] = secrets.token_hex(16)
    env["RDMAFLOW_SHARDS_PER_NODE"] = str(ns.shards_per_node)
    if ns.resume:
        env["RDMAFLOW_RESUME"] = "1"
    if ns.min_workers is not None:
        if not 1 <= ns.min_workers <= ns.nnodes * ns.nproc_per_node:
            raise SystemExit(f"rdmaflow launch: --min-workers must be between 1 and the job's "
                             f"{ns.nnodes * ns.nproc_per_node} workers")
        env["RDMAFLOW_MIN_WORKERS"] = str(ns.min_workers)
    argv = [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", str(ns.nnodes), "--nproc-per-node", str(ns.nproc_per_node + ns.shards_per_node),
            "--node-rank", str(ns.node_rank), "--master-addr", ns.master_addr, "--master-port", str(ns.master_port),
            *(["--module"] if getattr(ns, "module", None) else []), *target(ns)]
    return argv, env


def target(ns: argparse.Namespace) -> list[str]:
    """What each process runs after the interpreter: the script and its arguments, or with
    ``-m`` the module and its arguments (argparse took the first of them for the script)."""
    if getattr(ns, "module", None):
        return [ns.module, *([] if ns.script is None else [ns.script]), *ns.args]
    return [ns.script, *ns.args]


def check_module(name: str) -> None:
    """Refuses at once a module ``python -m`` could not run in the job's processes."""
    import importlib.util

    sys.path.insert(0, os.getcwd())  # where `python -m` looks first
    try:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{name}.__main__")  # a package runs its __main__
    except (ImportError, ValueError) as e:
        raise SystemExit(f"rdmaflow launch: -m {name}: {e}") from None
    finally:
        sys.path.remove(os.getcwd())
    if spec is None:
        raise SystemExit(f"rdmaflow launch: -m {name}: no such module (or a package without __main__) here")


def supervised_env(ns: argparse.Namespace, lr: int) -> dict:
    """What torchrun would set for local rank ``lr`` of this node."""
    local = ns.nproc_per_node + ns.shards_per_node
    return {"RANK": str(ns.node_rank * local + lr), "LOCAL_RANK": str(lr), "WORLD_SIZE": str(ns.nnodes * local),
            "LOCAL_WORLD_SIZE": str(local), "GROUP_RANK": str(ns.node_rank), "MASTER_ADDR": ns.master_addr,
            "MASTER_PORT": str(ns.master_port)}


def supervised_argv(ns: argparse.Namespace) -> list[str]:
    return [sys.executable, "-u", *(["-m"] if getattr(ns, "module", None) else []), *target(ns)]


def dry_run(ns: argparse.Namespace, argv: list[str], env: dict) -> str:
    """The shell commands that run the job as ``run`` would: the variables the launcher sets
    (a secret it would make is made by the shell), then torchrun, or with --min-workers each
    process it supervises."""
    set_here = {k: v for k, v in env.items() if k.startswith("RDMAFLOW_") and os.environ.get(k) != v}
    assigns = [shlex.join([f"{k}={v}"]) for k, v in sorted(set_here.items()) if k != "RDMAFLOW_JOB_SECRET"]
    if "RDMAFLOW_JOB_SECRET" in set_here:
        assigns.insert(0, "RDMAFLOW_JOB_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(16))')")
    lines = [f"export {' '.join(assigns)}"] if assigns else []
    if ns.min_workers is None:
        return "\n".join(lines + [shlex.join(argv)])
    lines.append("# --min-workers: rdmaflow launch runs and supervises these processes itself (no torchrun)")
    for lr in range(ns.nproc_per_node + ns.shards_per_node):
        per = " ".join(f"{k}={shlex.quote(v)}" for k, v in supervised_env(ns, lr).items())
        lines.append(f"{per} {shlex.join(supervised_argv(ns))} &")
    return "\n".join(lines + ["wait"])


def supervise(ns: argparse.Namespace, env: dict) -> int:
    """Runs this node's processes; a dead worker is reported and the rest go on."""
    spn, local = ns.shards_per_node, ns.nproc_per_node + ns.shards_per_node

    def on_term(signum, frame):
        raise KeyboardInterrupt  # stop the job's processes as on Ctrl-C

    # SIGHUP too: UCX's debug handler (UCX_DEBUG_SIGNO) took it, and the job ran on.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_term)
    procs = []

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    status = 0
    try:  # from the first start on: a signal while starting stops the ones already started
        for lr in range(local):
            procs.append(subprocess.Popen(supervised_argv(ns), env=dict(env, **supervised_env(ns, lr)),
                                          start_new_session=True))
        while any(p.poll() is None for p in procs):
            for lr, p in enumerate(procs):
                rc = p.poll()
                if rc is None or getattr(p, "_seen", False):
                    continue
                p._seen = True
                if rc != 0 and lr < spn:
                    print(f"rdmaflow launch: shard (local rank {lr}) exited with {rc}; stopping the job",
                          file=sys.stderr, flush=True)
                    status = rc if rc > 0 else 1
                    stop_all()
                elif rc != 0:
                    print(f"rdmaflow launch: worker (local rank {lr}) exited with {rc}; the others go on",
                          file=sys.stderr, flush=True)
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        stop_all(signal.SIGKILL)
        return 130
    if status == 0 and any(p.returncode != 0 for p in procs[:spn]):
        status = 1
    return status


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE = 60.0  # seconds torchrun has, after the first signal passed on, to stop its processes (its own: 30)


def run_torchrun(argv: list[str], env: dict) -> int:
    """Runs torchrun in a session of its own and passes SIGTERM, SIGINT and SIGHUP sent to this
    process on to it, once each; torchrun stops every process of the node on any of them. A
    scheduler signals the launcher's pid, not its group: without this, the launcher died and
    torchrun and the ranks ran on. Ctrl-C reaches torchrun once, through here. If torchrun has
    not ended STOP_GRACE seconds after the first signal, its session is killed. Returns its exit
    status (128 + the signal when a signal ended it, as a shell reports)."""
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    signalled: list[float] = []

    def forward(signum, frame):
        if proc.poll() is None:
            signalled.append(time.monotonic())
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if signalled and time.monotonic() - signalled[0] > STOP_GRACE:
                    print(f"rdmaflow launch: torchrun did not stop within {STOP_GRACE:.0f} s of the signal; "
                          "killing its processes", file=sys.stderr, flush=True)
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    return 128 - rc if rc < 0 else rc


def unservable(port: int) -> str | None:
    """Why this host could not serve the job's store on ``port``, or None. Node 0 serves it on
    every address (torchrun's agent, or rank 0 under --min-workers); a port another process
    holds failed there only after torchrun had started, with c10d's long traceback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store's own socket
        try:
            s.bind(("", port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def unresolved(addr: str, port: int) -> str | None:
    """Why ``addr`` names no address this host can reach the store at, or None. torchrun's
    ranks retried such a name, printing c10d warnings, for more than 90 s."""
    try:
        socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        return getattr(e, "strerror", None) or str(e)
    return None


def run(ns: argparse.Namespace) -> int:
    argv, env = command(ns)
    if ns.dry_run:
        print(dry_run(ns, argv, env))
        return 0
    why = unresolved(ns.master_addr, ns.master_port)
    if why:
        raise SystemExit(f"rdmaflow launch: --master-addr {ns.master_addr!r} does not resolve on this host ({why}): "
                         "give node 0's address or host name")
    why = unservable(ns.master_port) if ns.node_rank == 0 else None
    if why:
        raise SystemExit(f"rdmaflow launch: node 0 serves the job's store on --master-port {ns.master_port}, and this "
                         f"host cannot ({why}): another job may hold it; pick a free port")
    if ns.min_workers is not None:
        return supervise(ns, env)
    return run_torchrun(argv, env)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
