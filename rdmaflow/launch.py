"""``rdmaflow launch``: starts a job's processes on this host with torchrun (torch.distributed.run).

It starts ``--nproc-per-node`` workers plus ``--shards-per-node`` parameter-server shards on
each host (default one of each, as in Xue et al. §5.2), and says so as it starts; a pipeline
(rdmaflow.graph) runs one stage per process and no shard: ``--shards-per-node 0
--nproc-per-node STAGES``. torchrun sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and
MASTER_PORT, and rdmaflow.ps.init() derives each process's role from them.

On more than one host, run the same command on each, with ``--nnodes``, this host's
``--node-rank`` and node 0's ``--master-addr``/``--master-port`` (README, "Several hosts").
Each node waits at most ``--join-timeout`` seconds for the others (node 0 for every other node,
the others for node 0's store), then exits naming the address it waited at.

A failed job ends with one line naming the failed rank, its role and the cause (instead of
torchrun's ChildFailedError dump); Ctrl-C ends it with one line and exit status 130. The job secret
that devices prove to each other is generated here for a one-node job; a multi-node job needs
the same RDMAFLOW_JOB_SECRET exported on every node.

torchrun stops every process of a node when one fails. ``--min-workers N`` lets a job survive
worker failures (iRDMA §IV-D): rdmaflow launch then starts this node's processes itself, with
the same variables torchrun sets (static rendezvous: rank = node rank x processes per node +
local rank), keeps the others running when a worker dies, and stops them all when a shard
fails. The shards go on while at least N workers live (RDMAFLOW_MIN_WORKERS).

``--shard-replicas R`` (R > 1) keeps R replicas of each shard's units (RDMAFLOW_SHARD_REPLICAS;
the parameter server places and updates them) and needs the same self-supervision: a shard
process that dies (a signal, or an exit without an exception of its own) is restarted with its
rank and RDMAFLOW_SHARD_INCARNATION=1, 2, ... up to ``--max-shard-restarts`` times, one line
each; past that the job ends. Node 0's rdmaflow launch then serves the job's store itself, at
--master-addr:--master-port, until the job ends, so that the store outlives every shard; the
processes connect to it (TORCHELASTIC_USE_AGENT_STORE=True).

Either way a SIGTERM, SIGINT or SIGHUP sent to this process alone stops every process of the
node (docs/parameter-server.md, "Stopping a job").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

JOIN_TIMEOUT = 60.0  # seconds a node other than 0 waits for node 0's store (the ranks' own: theirs)
MAX_SHARD_RESTARTS = 3  # per shard process, with --shard-replicas > 1


def build_parser(p: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="rdmaflow launch")
    p.description = __doc__.replace("``", "`")  # what it starts; every flag below says its default
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--nnodes", type=int, default=1, help="number of hosts, each running this command (default 1)")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, dest="nproc_per_node",
                   help="workers per host, not counting shards; with --shards-per-node 0, the processes per host "
                        "(a pipeline's stages) (default 1)")
    p.add_argument("--shards-per-node", type=int, default=1,
                   help="parameter-server shards per host, started beside the workers; 0 for a job without a "
                        "parameter server, such as a pipeline (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, dest="node_rank",
                   help="this host's index in [0, --nnodes); node 0 serves the job's store (default 0)")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1", dest="master_addr",
                   help="node 0's address (or host name), the same on every host (default 127.0.0.1)")
    p.add_argument("--master-port", "--master_port", type=int, default=29500, dest="master_port",
                   help="the TCP port of the job's store on node 0, the same on every host (default 29500)")
    p.add_argument("--join-timeout", type=float, default=JOIN_TIMEOUT,
                   help=f"seconds a node waits for the others to join: node 0 for every other node, the others "
                        f"for node 0's store (default {JOIN_TIMEOUT:.0f})")
    p.add_argument("--min-workers", type=int, default=None,
                   help="survive worker failures while at least this many workers live (the job's total; "
                        "rdmaflow launch then supervises the processes itself instead of torchrun) (default: off, "
                        "the job stops when any process fails)")
    p.add_argument("--shard-replicas", type=int, default=1, metavar="R",
                   help="shard processes that hold each unit of the parameter server (a primary and R-1 backups, "
                        "on other hosts where there are several); R > 1 makes rdmaflow launch supervise the "
                        "processes itself, restart a dead shard and serve the job's store on node 0, so that the "
                        "store outlives every shard (default 1: no replicas, torchrun)")
    p.add_argument("--max-shard-restarts", type=int, default=None, metavar="N",
                   help=f"with --shard-replicas R > 1: how many times each shard process that dies is restarted "
                        f"(same rank, RDMAFLOW_SHARD_INCARNATION=1, 2, ...) before the job ends "
                        f"(default {MAX_SHARD_RESTARTS})")
    p.add_argument("--resume", action="store_true",
                   help="restart from the latest checkpoint (sets RDMAFLOW_RESUME=1 for the job) (default off)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the commands that would run the job (the variables it sets, then torchrun or, with "
                        "--min-workers, each process) and exit (default off)")
    p.add_argument("-m", "--module", default=None, metavar="MODULE",
                   help="run a module instead of a script, as `python -m` does; what follows are its arguments "
                        "(e.g. -m rdmaflow.fileview /mnt/model-{worker} --model model.json) (default: none, a script)")
    # Optional to argparse so that a missing script gets its own message (argparse named "script, args").
    p.add_argument("script", nargs="?", help="the training script")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the training script")
    return p


def command(ns: argparse.Namespace) -> tuple[list[str], dict]:
    if ns.nproc_per_node < 1 or ns.nnodes < 1:
        raise SystemExit("rdmaflow launch: --nnodes and --nproc-per-node must be >= 1")
    if ns.shards_per_node < 0:
        raise SystemExit("rdmaflow launch: --shards-per-node must be >= 0 (0: no parameter server, e.g. a pipeline)")
    if not 0 <= ns.node_rank < ns.nnodes:  # torchrun waits for the missing nodes without end
        raise SystemExit(f"rdmaflow launch: --node-rank {ns.node_rank} is not in [0, --nnodes {ns.nnodes})")
    if not 1 <= ns.master_port <= 65535 or not ns.master_addr.strip():
        raise SystemExit(f"rdmaflow launch: --master-addr {ns.master_addr!r} --master-port {ns.master_port}: "
                         "an address and a port in [1, 65535]")
    if not ns.join_timeout > 0:
        raise SystemExit(f"rdmaflow launch: --join-timeout {ns.join_timeout} must be > 0 seconds")
    check_replicas(ns)
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
    env["RDMAFLOW_LAUNCHED"] = "1"  # this launcher reports an interruption once for the job (rdmaflow.ps)
    if ns.resume:
        env["RDMAFLOW_RESUME"] = "1"
    if ns.min_workers is not None:
        if ns.shards_per_node == 0:
            raise SystemExit("rdmaflow launch: --min-workers keeps a parameter-server job going; it needs "
                             "--shards-per-node >= 1")
        if not 1 <= ns.min_workers <= ns.nnodes * ns.nproc_per_node:
            raise SystemExit(f"rdmaflow launch: --min-workers must be between 1 and the job's "
                             f"{ns.nnodes * ns.nproc_per_node} workers")
        env["RDMAFLOW_MIN_WORKERS"] = str(ns.min_workers)
    # The launcher's value is the job's, also over one exported in this shell.
    env["RDMAFLOW_SHARD_REPLICAS"] = str(ns.shard_replicas)
    env.pop("RDMAFLOW_SHARD_INCARNATION", None)  # set on a restart only
    env.pop("RDMAFLOW_MAX_SHARD_RESTARTS", None)
    if replicated(ns):
        env["RDMAFLOW_MAX_SHARD_RESTARTS"] = str(ns.max_shard_restarts)
        # The processes connect to the store node 0's launcher serves (torchrun's convention
        # for its agent's store; torch's env:// rendezvous then reads the restart count).
        env.update(TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0")
    argv = [sys.executable, "-m", "rdmaflow._agent",
            "--nnodes", str(ns.nnodes), "--nproc-per-node", str(ns.nproc_per_node + ns.shards_per_node),
            "--node-rank", str(ns.node_rank), "--master-addr", ns.master_addr, "--master-port", str(ns.master_port),
            # how long the agents wait for each other at the rendezvous (torchrun's default: 600 s)
            "--rdzv-conf", f"timeout={max(1, round(ns.join_timeout))}",
            "-m", "rdmaflow._rank", *target(ns)]
    return argv, env


def replicated(ns: argparse.Namespace) -> bool:
    """Whether the job keeps several replicas of each shard's units (--shard-replicas > 1)."""
    return getattr(ns, "shard_replicas", 1) > 1


def check_replicas(ns: argparse.Namespace) -> None:
    """Refuses --shard-replicas and --max-shard-restarts that cannot describe the job, before
    anything starts; sets --max-shard-restarts' default."""
    shards = ns.nnodes * ns.shards_per_node
    if ns.shard_replicas < 1:
        raise SystemExit(f"rdmaflow launch: --shard-replicas {ns.shard_replicas} must be >= 1 (1: no replicas)")
    if replicated(ns) and ns.shard_replicas > shards:
        raise SystemExit(f"rdmaflow launch: --shard-replicas {ns.shard_replicas} needs at least {ns.shard_replicas} "
                         f"shard processes, one per replica; the job has {shards} (--nnodes {ns.nnodes} x "
                         f"--shards-per-node {ns.shards_per_node})")
    if ns.max_shard_restarts is None:
        ns.max_shard_restarts = MAX_SHARD_RESTARTS
    elif ns.max_shard_restarts < 0:
        raise SystemExit(f"rdmaflow launch: --max-shard-restarts {ns.max_shard_restarts} must be >= 0 "
                         "(0: a shard that dies is not restarted)")
    elif not replicated(ns):
        raise SystemExit("rdmaflow launch: --max-shard-restarts restarts the shards of a replicated job; it needs "
                         "--shard-replicas 2 or more (a restarted shard copies its state from another replica)")


def role(ns: argparse.Namespace, rank: int) -> str:
    """What global rank ``rank`` is in this job, as rdmaflow.ps.init() derives it: "shard 0",
    "worker 1", or, in a job without shards, "stage 2"."""
    spn, local = ns.shards_per_node, ns.nproc_per_node + ns.shards_per_node
    if spn == 0:
        return f"stage {rank}"
    node, lr = divmod(rank, local)
    return f"shard {node * spn + lr}" if lr < spn else f"worker {node * ns.nproc_per_node + lr - spn}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}{'es' if word.endswith('s') else 's'}"


def summary(ns: argparse.Namespace) -> str:
    """What this command starts, in one line."""
    local = ns.nproc_per_node + ns.shards_per_node
    first = ns.node_rank * local
    ranks = f"rank {first}" if local == 1 else f"ranks {first}-{first + local - 1}"
    where = (f"node {ns.node_rank} of {ns.nnodes}, job store at {ns.master_addr}:{ns.master_port}"
             if ns.nnodes > 1 else f"job store at {ns.master_addr}:{ns.master_port}")
    if ns.shards_per_node == 0:
        what = (f"{plural(local, 'process')} and no shard (a pipeline: one stage per process, "
                f"{ns.nnodes * local} stages in all)")
    else:
        what = f"{plural(ns.nproc_per_node, 'worker')} + {plural(ns.shards_per_node, 'shard')} per node"
        if ns.nnodes > 1:
            what += f" ({ns.nnodes * ns.nproc_per_node} workers + {ns.nnodes * ns.shards_per_node} shards in all)"
    if replicated(ns):
        where += (f" (served by node 0's rdmaflow launch); {ns.shard_replicas} replicas of each unit, a dead shard "
                  f"restarted up to {plural(ns.max_shard_restarts, 'time')}")
    return f"rdmaflow launch: starting {what}: {ranks}; {where}"


def shared_hosts(ns: argparse.Namespace) -> str | None:
    """What to say when replicas of a unit must share a host (more replicas than hosts), or None."""
    if not replicated(ns) or ns.shard_replicas <= ns.nnodes:
        return None
    if ns.nnodes == 1:
        return (f"rdmaflow launch: the {ns.shard_replicas} replicas of each unit share this one host: they survive a "
                "shard process's death, not the host's")
    return (f"rdmaflow launch: --shard-replicas {ns.shard_replicas} on {ns.nnodes} hosts: some replicas of a unit "
            "share a host, and that host's failure loses them both")


def target(ns: argparse.Namespace) -> list[str]:
    """What rdmaflow._rank runs in each process: the script and its arguments, or with ``-m``
    the module and its arguments (argparse took the first of them for the script)."""
    if getattr(ns, "module", None):
        return ["-m", ns.module, *([] if ns.script is None else [ns.script]), *ns.args]
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
    return [sys.executable, "-u", "-m", "rdmaflow._rank", *target(ns)]


def dry_run(ns: argparse.Namespace, argv: list[str], env: dict) -> str:
    """The shell commands that run the job as ``run`` would: the variables the launcher sets
    (a secret it would make is made by the shell), then torchrun, or with --min-workers each
    process it supervises."""
    set_here = {k: v for k, v in env.items()
                if k.startswith(("RDMAFLOW_", "TORCHELASTIC_")) and os.environ.get(k) != v}
    assigns = [shlex.join([f"{k}={v}"]) for k, v in sorted(set_here.items()) if k != "RDMAFLOW_JOB_SECRET"]
    if "RDMAFLOW_JOB_SECRET" in set_here:
        assigns.insert(0, "RDMAFLOW_JOB_SECRET=$(python3 -c 'import secrets; print(secrets.token_hex(16))')")
    lines = [f"export {' '.join(assigns)}"] if assigns else []
    if ns.min_workers is None and not replicated(ns):
        return "\n".join(lines + [shlex.join(argv)])
    flag = "--shard-replicas" if replicated(ns) else "--min-workers"
    lines.append(f"# {flag}: rdmaflow launch runs and supervises these processes itself (no torchrun)")
    if replicated(ns):
        lines.append(f"# they connect to the job's store at {ns.master_addr}:{ns.master_port}, which node 0's rdmaflow "
                     "launch serves (TORCHELASTIC_USE_AGENT_STORE=True); a shard that died restarts with its own "
                     "line and RDMAFLOW_SHARD_INCARNATION=1, 2, ...")
    for lr in range(ns.nproc_per_node + ns.shards_per_node):
        per = " ".join(f"{k}={shlex.quote(v)}" for k, v in supervised_env(ns, lr).items())
        lines.append(f"{per} {shlex.join(supervised_argv(ns))} &")
    return "\n".join(lines + ["wait"])


def _cause(message: str | None, exitcode: int) -> str:
    if message:
        return " ".join(message.split())  # one line
    if exitcode < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-exitcode).name}"
        return f"killed by signal {-exitcode}"
    return f"exited with {exitcode} (no Python exception: see its output above)"


STOPPING = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # what torchrun and this launcher stop processes with


def culprit(ns: argparse.Namespace, failures: list[dict]) -> dict:
    """The failure that caused the others (torchrun's "Root Cause" took the first rank, often a
    shard stopped because a worker failed). In this order: an exception of the process's own
    (not the abort another process recorded, nor a PeerError about another process); a process
    a signal killed that nobody sends to stop a job (SIGKILL, SIGSEGV); any other exception;
    the rest. The earliest first, then the lowest rank."""
    def tier(f) -> int:
        msg, rc = f.get("message") or "", f.get("exitcode", 0)
        own_abort = f"the job was aborted: {role(ns, f['rank'])}:" in msg
        consequence = msg.startswith("PeerError") or ("the job was aborted" in msg and not own_abort)
        if msg and not consequence:
            return 0
        if rc < 0 and -rc not in STOPPING:
            return 1
        return 2 if msg else 3
    return min(failures, key=lambda f: (tier(f), f.get("timestamp", 0), f["rank"]))


def ucx_hint(cause: str, env: dict) -> str:
    """What the UCX settings have to do with ``cause`` and how to fix them (rdmaflow info's
    knowledge), or ""."""
    from rdmaflow.info import explain_device_error

    hint = explain_device_error(cause, env)
    return f" ({hint})" if hint else ""


def failure_line(ns: argparse.Namespace, failures: list[dict], env: dict) -> str:
    """The one line a failed job ends with: the culprit's rank, role and cause."""
    f = culprit(ns, failures)
    cause = _cause(f.get("message"), f.get("exitcode", 1)) + f.get("note", "")
    others = len(failures) - 1
    tail = f"; {plural(others, 'other process')} failed after it" if others else ""
    return (f"rdmaflow launch: the job failed: rank {f['rank']} ({role(ns, f['rank'])}): {cause}"
            f"{ucx_hint(cause, env)}{tail}")


def _read_error_file(path: str) -> str | None:
    try:
        with open(path) as fh:
            m = json.load(fh)["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(m.get("message", m)) if isinstance(m, dict) else str(m)


def restartable(f: dict) -> bool:
    """Whether a shard's end is a death that a restart answers: killed by a signal (SIGKILL, a
    crash), or a non-zero exit without an exception of its own (os._exit). An exception (the
    program's failure, or the job's abort: a rerun would raise it again) or an interruption
    (Ctrl-C: status 130) ends the job as without replicas."""
    return not f.get("message") and f["exitcode"] not in (130, -signal.SIGINT)


def _job_store(ns: argparse.Namespace, serve: bool):
    """Node 0's store (``serve``: served here, for the whole job), or a client of it."""
    from rdmaflow.job import StoreHost

    return StoreHost(ns.master_addr, ns.master_port, ns.join_timeout, serve=serve)


def supervise(ns: argparse.Namespace, env: dict) -> int:
    """Runs this node's processes (--min-workers, --shard-replicas > 1): with --min-workers a dead
    worker is reported and the rest go on; with --shard-replicas a dead shard is restarted with
    its rank (up to --max-shard-restarts), and node 0 serves the job's store until the job ends."""
    spn, local = ns.shards_per_node, ns.nproc_per_node + ns.shards_per_node
    errors = tempfile.mkdtemp(prefix="rdmaflow-launch-")
    replicas = replicated(ns)

    def on_term(signum, frame):
        raise KeyboardInterrupt  # stop the job's processes as on Ctrl-C

    # SIGHUP too: UCX's debug handler (UCX_DEBUG_SIGNO) took it, and the job ran on.
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_term)
    procs: list[subprocess.Popen] = []
    restarts, seen = [0] * local, [False] * local
    store = None  # node 0's, served here (--shard-replicas > 1)

    def start(lr: int, incarnation: int = 0) -> subprocess.Popen:
        per = dict(env, **supervised_env(ns, lr), TORCHELASTIC_ERROR_FILE=os.path.join(errors, f"{lr}.json"))
        if incarnation:
            per["RDMAFLOW_SHARD_INCARNATION"] = str(incarnation)
        return subprocess.Popen(supervised_argv(ns), env=per, start_new_session=True)

    def stop_all(sig=signal.SIGTERM):
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass

    def failure(lr: int, rc: int) -> dict:
        path = os.path.join(errors, f"{lr}.json")
        return {"rank": ns.node_rank * local + lr, "exitcode": rc, "message": _read_error_file(path),
                "timestamp": os.stat(path).st_mtime if os.path.exists(path) else time.time()}

    def who(lr: int) -> str:
        rank = ns.node_rank * local + lr
        return f"{role(ns, rank)} (rank {rank})"

    status, stopping, failures = 0, False, []
    try:  # from the first start on: a signal while starting stops the ones already started
        if replicas:  # node 0 serves the store; another node's launcher holds a client, to say it is done
            from rdmaflow.errors import PeerError

            try:
                store = _job_store(ns, serve=ns.node_rank == 0)
            except PeerError as e:
                raise SystemExit(f"rdmaflow launch: {e}") from None
        for lr in range(local):
            procs.append(start(lr))
        while not all(seen):
            for lr, p in enumerate(procs):
                rc = p.poll()
                if rc is None or seen[lr]:
                    continue
                seen[lr] = True
                if rc == 0 or stopping:
                    continue  # done; or stopped with the job: the failure that stopped it is the one reported
                f = failure(lr, rc)
                cause = _cause(f["message"], rc)
                if lr < spn and replicas and restartable(f) and restarts[lr] < ns.max_shard_restarts:
                    restarts[lr] += 1
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(errors, f"{lr}.json"))
                    procs[lr], seen[lr] = start(lr, restarts[lr]), False
                    print(f"rdmaflow launch: {who(lr)} died ({cause}); restarted it as incarnation {restarts[lr]} "
                          f"(restart {restarts[lr]} of at most {ns.max_shard_restarts}), pid {procs[lr].pid}",
                          file=sys.stderr, flush=True)
                    continue
                failures.append(f)
                if lr < spn and replicas and restartable(f):
                    f["note"] = (f", after {plural(restarts[lr], 'restart')}: past --max-shard-restarts "
                                 f"{ns.max_shard_restarts}")
                    print(f"rdmaflow launch: {who(lr)} died ({cause}) with no restart left (--max-shard-restarts "
                          f"{ns.max_shard_restarts}); stopping the job", file=sys.stderr, flush=True)
                    # the parameter server's abort reason: every process, on every node, ends with it
                    from rdmaflow.ps.context import PREFIX

                    store.abort(PREFIX, f"{role(ns, f['rank'])}: died ({cause}) {restarts[lr] + 1} times, past "
                                        f"--max-shard-restarts {ns.max_shard_restarts}")
                elif lr >= spn and ns.min_workers is not None:
                    print(f"rdmaflow launch: {who(lr)} exited with {rc}; the others go on", file=sys.stderr,
                          flush=True)
                    continue
                else:
                    print(f"rdmaflow launch: {who(lr)} exited with {rc}; stopping the job", file=sys.stderr,
                          flush=True)
                status, stopping = (rc if rc > 0 else 1), True
                stop_all()
            time.sleep(0.1)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.1)
        stop_all(signal.SIGKILL)
        print(f"rdmaflow launch: interrupted; stopped the job's {plural(local, 'process')} on this node",
              file=sys.stderr, flush=True)
        if ns.node_rank == 0:
            store = None  # interrupted: node 0 closes the store at once
        return 130
    finally:
        shutil.rmtree(errors, ignore_errors=True)
        if replicas:
            leave(ns, store)
    if status == 0 and any(p.returncode != 0 for p in procs[:spn]):
        status = 1
    if status != 0:
        print(failure_line(ns, failures, env), file=sys.stderr, flush=True)
    return status


def leave(ns: argparse.Namespace, store) -> None:
    """The end of a replicated job on this node (rdmaflow.job, "Leaving"): node 0's launcher keeps
    the store it serves until every other node's launcher said its processes have ended, at most
    rdmaflow.job.LINGER seconds; another node's launcher says so."""

    if ns.nnodes == 1 or store is None:
        return
    if ns.node_rank > 0:
        store.node_done()
        return
    from rdmaflow.job import LINGER

    done = store.wait_nodes(ns.nnodes - 1)
    if done < ns.nnodes - 1:
        print(f"rdmaflow launch: {plural(ns.nnodes - 1 - done, 'other node')} did not say its processes ended "
              f"within {LINGER:.0f} s; closing the job's store", file=sys.stderr, flush=True)


FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOP_GRACE = 60.0  # seconds torchrun has, after the first signal passed on, to stop its processes (its own: 30)


def run_torchrun(argv: list[str], env: dict) -> int:
    """Runs torchrun in a session of its own and passes SIGTERM, SIGINT and SIGHUP sent to this
    process on to it, once each; torchrun stops every process of the node on any of them. A
    scheduler signals the launcher's pid, not its group: without this, the launcher died and
    torchrun and the ranks ran on. Ctrl-C reaches torchrun once, through here. If torchrun has
    not ended STOP_GRACE seconds after the first signal, its session is killed. Returns its exit
    status (128 + the signal when a signal ended it, as a shell reports) and what rdmaflow._agent
    reported (the failed ranks, or the signal that stopped it), if anything."""
    fd, report = tempfile.mkstemp(prefix="rdmaflow-launch-", suffix=".json")
    os.close(fd)
    proc = subprocess.Popen(argv, env=dict(env, RDMAFLOW_LAUNCH_REPORT=report), start_new_session=True)
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
        try:
            with open(report) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {}
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        with contextlib.suppress(OSError):
            os.unlink(report)
    return (128 - rc if rc < 0 else rc), doc


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


def wait_for_store(addr: str, port: int, timeout: float) -> str | None:
    """Waits until node 0's store at ``addr:port`` accepts a connection; None once it does, else
    why it did not within ``timeout`` seconds. torchrun's agent on a node other than 0 waited for
    a wrong port with no output for more than 400 s."""
    give_up, said, why = time.monotonic() + timeout, False, "no answer"
    while True:
        try:
            with socket.create_connection((addr, port), timeout=min(5.0, timeout)):
                return None
        except OSError as e:
            why = e.strerror or str(e) or type(e).__name__
        left = give_up - time.monotonic()
        if left <= 0:
            return why
        if not said and timeout - left > 2:
            print(f"rdmaflow launch: waiting up to {timeout:.0f} s for node 0's store at {addr}:{port} ({why})",
                  file=sys.stderr, flush=True)
            said = True
        time.sleep(min(0.5, left))


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
    print(summary(ns), file=sys.stderr, flush=True)
    if ns.node_rank > 0:
        why = wait_for_store(ns.master_addr, ns.master_port, ns.join_timeout)
        if why:
            raise SystemExit(f"rdmaflow launch: node 0's store at {ns.master_addr}:{ns.master_port} did not answer "
                             f"within {ns.join_timeout:.0f} s ({why}): start node 0 with the same --master-addr and "
                             "--master-port, and open that port in its firewall")
    if hosts := shared_hosts(ns):
        print(hosts, file=sys.stderr, flush=True)
    if ns.min_workers is not None or replicated(ns):
        return supervise(ns, env)
    rc, doc = run_torchrun(argv, env)
    if doc.get("failures"):
        print(failure_line(ns, doc["failures"], env), file=sys.stderr, flush=True)
    elif doc.get("signal") == signal.SIGINT or rc == 130:
        print("rdmaflow launch: interrupted; stopped the job's processes on this node", file=sys.stderr, flush=True)
        return 130
    elif doc.get("signal"):
        print(f"rdmaflow launch: stopped by {signal.Signals(doc['signal']).name}; stopped the job's processes on "
              "this node", file=sys.stderr, flush=True)
    elif doc.get("error") and ns.nnodes > 1:
        others = (f"nodes 1-{ns.nnodes - 1}" if ns.nnodes > 2 else "node 1") if ns.node_rank == 0 else "the other nodes"
        print(f"rdmaflow launch: the job's nodes did not all join at {ns.master_addr}:{ns.master_port} within "
              f"{ns.join_timeout:.0f} s (this is node {ns.node_rank}; waited for {others}): start the same command on "
              f"every host with its own --node-rank, or raise --join-timeout ({doc['error']})",
              file=sys.stderr, flush=True)
    elif doc.get("error"):
        print(f"rdmaflow launch: the job failed: torchrun: {doc['error']}", file=sys.stderr, flush=True)
    elif rc != 0:
        print(f"rdmaflow launch: the job failed: torchrun exited with {rc} (see its output above)",
              file=sys.stderr, flush=True)
    return rc


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
