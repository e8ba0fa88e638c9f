"""``rdmaflow bench converge``: training to convergence on a real data set, rdmaflow's parameter
server next to DistributedDataParallel over gloo, loss against wall-clock time (Xue et al. §5.2,
Figure 10).

The task: scikit-learn's handwritten digits (``sklearn.datasets.load_digits``: 1797 8x8 images,
10 classes; it ships with the package, nothing is downloaded), a fixed stratified split (80 %
train = 1437 images, 20 % test = 360; ``random_state=0`` whatever ``--seed``), features
standardized with the training set's mean and deviation. The model is an MLP 64 -> 128 (ReLU)
-> 10 (9,738 float32 parameters, 39 KB): the smallest network that is not linear (a linear model
stops short of this one's test accuracy; docs/benchmarks.md has the figures) and trains quickly
on a CPU, so a step is short enough that the communication runtime, not the arithmetic, sets
its time: what the comparison is about. Loss: cross-entropy.

Both systems run the same synchronous data-parallel SGD:

* every process builds the model with ``torch.manual_seed(seed)`` (DDP then broadcasts rank 0's
  weights; the shards read worker 0's);
* epoch e shuffles the training set with a generator seeded from (seed, e); worker w takes the
  w-th of ``workers`` equal contiguous pieces of that permutation and, at step i of the epoch,
  the i-th slice of ``batch / workers`` of them (the remainder is dropped). Every step therefore
  has the same global batch of ``batch`` samples in both systems, and every epoch the same
  ``(1437 // workers) // (batch / workers)`` steps;
* each worker averages its loss over its own samples; the gradients are averaged over the
  workers (DDP's allreduce divides by the world size; a shard takes the mean of the workers'
  gradient slots), which is the gradient of the mean loss over the global batch;
* ``torch.optim.SGD(lr, momentum, weight_decay)``, the same hyperparameters, run by every DDP
  process on its replica and by the shards (on their blocks) for rdmaflow.

Given the same seed the two systems compute the same numbers up to the order of float32 sums, so
their loss curves agree step by step and only the time axis differs (tests/test_bench_converge.py
checks both against single-process SGD on the concatenated batches).

Systems (``--systems``):

========  ===================================================================================
rdmaflow  a parameter-server job: ``--shards`` shard processes and ``--workers`` worker
          processes; ``rdmaflow.ps.init()`` and ``ps.DistributedOptimizer(model,
          torch.optim.SGD(...), mode="sync")``; roles through ``RDMAFLOW_ROLE``,
          ``RDMAFLOW_ROLE_INDEX``, ``RDMAFLOW_NUM_SHARDS``, ``RDMAFLOW_NUM_WORKERS`` (shards take
          ranks 0..S-1). UCX is restricted to ``--transport`` (``tcp``: TCP over loopback, the
          path gloo takes; ``sm``: cma shared memory) with ``rdmaflow._ucx.ucx_env``;
          ``--transport tcp sm`` runs it once per transport, labelled rdmaflow-tcp and
          rdmaflow-sm. Block placement, the parameters cut into ``--shards`` equal blocks.
ddp       ``torch.nn.parallel.DistributedDataParallel`` over gloo (TCP, loopback) with
          ``--workers`` processes.
========  ===================================================================================

Measurement: worker 0 (rank 0 for DDP) starts its clock after setup (model, optimizer or DDP
wrapper built, a barrier of all workers) and records after every ``--log-every``-th step the
seconds since then and the loss of its step's batch; after every epoch it evaluates the model on
the test set (loss and accuracy; also once before the first step). The clock stops while it
evaluates (the other workers are then waiting for it in the next step), so ``seconds`` is
training time. The systems run one after the other, never at the same time. With ``--repeats R``
every system runs R times, the order rotating each round (on a shared machine a single run of each
says little); the curves, the plot and the summary show each system's round with the median
training time, and the summary also the fastest and slowest round.

Processes: the driver writes the prepared data set into ``--out``/data.pt and starts every process
of a system as ``python -m rdmaflow.bench.converge --proc`` with its configuration as JSON in
``$RDMAFLOW_CONVERGE_CONFIG`` and its role in the usual variables (``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``, ``MASTER_PORT``, ``RDMAFLOW_JOB_SECRET``, ...), each in its own process group
with its output in ``--out``/logs/; worker 0 prints one ``CONVERGE_RESULT {json}`` line. Every
wait is bounded by ``--timeout`` per system, and every process is killed when a system fails,
times out or the driver is interrupted (or dies: PR_SET_PDEATHSIG).

Output in ``--out`` (default ``bench-results/converge``):

* ``curves.csv``: ``system,step,epoch,seconds,train_loss,test_loss,test_acc``. One row per
  recorded step (``train_loss``: worker 0's batch loss); the test columns are filled on the row of
  an epoch's last step, and on a row with step 0 (the untrained model);
* ``summary.csv``: per system the final test loss and accuracy, the seconds to reach
  ``--target-acc`` test accuracy and ``--target-loss`` test loss (at the end of the first epoch
  that reached them; empty if none did), training seconds, steps per second, setup seconds
  (worker 0, from importing torch to its first step), the rounds and the min and max training
  seconds over them;
* ``converge.png`` (or ``--plot``): training loss (worker 0's batch loss, thin, and its
  moving average over an epoch, bold) against seconds, and test accuracy against seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from rdmaflow._ucx import ucx_env
from rdmaflow.bench import flags
from rdmaflow.bench.harness import write_csv
from rdmaflow.bench.plots import pyplot, save_figure, style
from rdmaflow.bench.processes import BenchError, ChildProcess, free_port, new_secret

SYSTEMS = ("rdmaflow", "ddp")
TRANSPORTS = ("tcp", "sm")
DEFAULT_OUT = os.path.join("bench-results", "converge")
CONFIG_ENV = "RDMAFLOW_CONVERGE_CONFIG"
RESULT_TAG = "CONVERGE_RESULT "
CURVE_FIELDS = ("system", "step", "epoch", "seconds", "train_loss", "test_loss", "test_acc")
SUMMARY_FIELDS = ("system", "workers", "shards", "epochs", "steps", "final_train_loss", "final_test_loss",
                  "final_test_acc", "best_test_acc", "target_acc", "seconds_to_target_acc", "target_loss",
                  "seconds_to_target_loss", "train_seconds", "steps_per_s", "setup_seconds", "rounds", "round",
                  "train_seconds_min", "train_seconds_max")
SPLIT_SEED = 0       # the train/test split is fixed whatever --seed
TEST_FRACTION = 0.2
IN_FEATURES, CLASSES = 64, 10

# Environment variables of launchers that must not leak into the processes we place ourselves.
_ROLE_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RDMAFLOW_HOST",
              "RDMAFLOW_SHARDS_PER_NODE", "RDMAFLOW_ROLE", "RDMAFLOW_ROLE_INDEX", "RDMAFLOW_NUM_SHARDS",
              "RDMAFLOW_NUM_WORKERS", "MASTER_ADDR", "MASTER_PORT", "RDMAFLOW_JOB_SECRET")


# ------------------------------------------------------------------------------------------
# The task: data, model, batches, optimizer (shared by the processes and the tests' reference)


def load_data() -> dict:
    """The digits data set, split and standardized: float32 features, int64 labels."""
    import torch
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_digits(return_X_y=True)
    xtr, xte, ytr, yte = train_test_split(x, y, test_size=TEST_FRACTION, stratify=y, random_state=SPLIT_SEED)
    scaler = StandardScaler().fit(xtr)  # pixels that are 0 in every training image keep scale 1
    return {"x_train": torch.tensor(scaler.transform(xtr), dtype=torch.float32),
            "y_train": torch.tensor(ytr, dtype=torch.int64),
            "x_test": torch.tensor(scaler.transform(xte), dtype=torch.float32),
            "y_test": torch.tensor(yte, dtype=torch.int64)}


def make_model(seed: int, hidden: int = 128):
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN_FEATURES, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, CLASSES))


def make_optimizer(params, cfg: Mapping[str, Any]):
    import torch

    return torch.optim.SGD(params, lr=float(cfg["lr"]), momentum=float(cfg["momentum"]),
                           weight_decay=float(cfg["weight_decay"]))


def steps_per_epoch(n_train: int, workers: int, batch: int) -> int:
    return (n_train // workers) // (batch // workers)


def worker_batches(seed: int, epoch: int, n_train: int, workers: int, batch: int, worker: int) -> list:
    """Worker ``worker``'s index batches of epoch ``epoch`` (1-based): its contiguous piece of the
    epoch's permutation, cut into slices of ``batch // workers``."""
    import torch

    local = batch // workers
    per = n_train // workers
    perm = torch.randperm(n_train, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    mine = perm[worker * per : (worker + 1) * per]
    return [mine[i * local : (i + 1) * local] for i in range(per // local)]


def check_config(cfg: Mapping[str, Any], n_train: int) -> None:
    w, b = int(cfg["workers"]), int(cfg["batch"])
    if w < 1 or int(cfg["shards"]) < 1:
        raise ValueError("--workers and --shards must be >= 1")
    if b < w or b % w:
        raise ValueError(f"--batch {b} must be a multiple of --workers {w} (every worker takes batch/workers)")
    if steps_per_epoch(n_train, w, b) < 1:
        raise ValueError(f"--batch {b} is larger than the training set's piece per worker")
    if int(cfg["epochs"]) < 1 or int(cfg["log_every"]) < 1 or int(cfg.get("repeats", 1)) < 1:
        raise ValueError("--epochs, --log-every and --repeats must be >= 1")


# ------------------------------------------------------------------------------------------
# One process of a job (python -m rdmaflow.bench.converge --proc)


def _proc_main() -> int:
    cfg = json.loads(os.environ[CONFIG_ENV])
    t_start = time.perf_counter()
    import torch

    torch.set_num_threads(1)
    system = cfg["system"]
    if system == "rdmaflow":
        from rdmaflow import ps

        ctx = ps.init()  # a shard serves here and exits the process when the job ends
        rank, nw = ctx.role.index, ctx.role.num_workers
    elif system == "ddp":
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group("gloo", timeout=timedelta(seconds=float(cfg["timeout"])))
        rank, nw = dist.get_rank(), dist.get_world_size()
    else:
        raise ValueError(f"unknown system {system!r}")
    data = torch.load(cfg["data"])
    xtr, ytr, xte, yte = data["x_train"], data["y_train"], data["x_test"], data["y_test"]
    seed, batch = int(cfg["seed"]), int(cfg["batch"])
    model = make_model(seed, int(cfg["hidden"]))
    opt = make_optimizer(model.parameters(), cfg)
    if system == "rdmaflow":
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
        per_shard = math.ceil(nbytes / ctx.role.num_shards / 4) * 4  # S equal blocks, one per shard
        dopt = ps.DistributedOptimizer(model, opt, mode="sync", policy="block", block_bytes=per_shard)
        forward, zero_grad, step = model, dopt.zero_grad, dopt.step
        ctx.store.set(f"converge/ready/{rank}", "1")
        ctx.store.wait([f"converge/ready/{w}" for w in range(nw)])
    else:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model)
        zero_grad, step = opt.zero_grad, opt.step
        dist.barrier()
    loss_fn = torch.nn.functional.cross_entropy

    def evaluate() -> tuple[float, float]:
        with torch.no_grad():
            out = model(xte)  # the module itself, not the DDP wrapper: no collective
            return loss_fn(out, yte).item(), (out.argmax(1) == yte).float().mean().item()

    records: list[list] = []
    if rank == 0:
        records.append([0, 0, 0.0, None, *evaluate()])
    setup_s = time.perf_counter() - t_start
    t0 = time.perf_counter()
    paused = 0.0  # seconds spent evaluating
    t = 0
    log_every = int(cfg["log_every"])
    for epoch in range(1, int(cfg["epochs"]) + 1):
        batches = worker_batches(seed, epoch, len(xtr), nw, batch, rank)
        for i, idx in enumerate(batches):
            zero_grad()
            loss = loss_fn(forward(xtr[idx]), ytr[idx])
            loss.backward()
            step()
            t += 1
            if rank == 0:
                last = i == len(batches) - 1
                if last or t % log_every == 0:
                    now = time.perf_counter() - t0 - paused
                    records.append([t, epoch, now, loss.item(), None, None])
                if last:
                    te0 = time.perf_counter()
                    records[-1][4:6] = evaluate()
                    paused += time.perf_counter() - te0
    train_s = time.perf_counter() - t0 - paused
    if system == "rdmaflow":
        dopt.close()
    else:
        dist.barrier()  # nobody tears gloo down while a peer still talks to it
        dist.destroy_process_group()
    if rank == 0:
        print(RESULT_TAG + json.dumps({"system": system, "steps": t, "setup_s": setup_s, "train_s": train_s,
                                       "records": records}), flush=True)
    if system == "rdmaflow":
        ctx.close()
    return 0


# ------------------------------------------------------------------------------------------
# The driver


def _start(name: str, env: Mapping[str, str], log: str) -> ChildProcess:
    """One process of a job, its output in ``log``."""
    return ChildProcess([sys.executable, "-m", "rdmaflow.bench.converge", "--proc"], env, name, stdin=False, log=log)


def _base_env(system: str, transport: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _ROLE_VARS and not k.startswith("TORCHELASTIC_")}
    if system == "rdmaflow":
        env = ucx_env(transport, env)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
    return env


def run_system(system: str, cfg: Mapping[str, Any], out: str, timeout: float, transport: str = "tcp",
               verbose: bool = False, label: str | None = None) -> dict:
    """Runs one system's job to the end; returns worker 0's result. Raises BenchError (with the
    processes' output) if a process fails or the job outlives ``timeout``; kills what is left."""
    logs = os.path.join(out, "logs")
    os.makedirs(logs, exist_ok=True)
    label = label or system
    workers, shards = int(cfg["workers"]), int(cfg["shards"])
    env = _base_env(system, transport)
    env.update(MASTER_PORT=str(free_port()))
    if system == "rdmaflow":
        world = workers + shards
        roles = [("shard", s, s) for s in range(shards)] + [("worker", w, shards + w) for w in range(workers)]
        env.update(RDMAFLOW_JOB_SECRET=new_secret(), RDMAFLOW_NUM_SHARDS=str(shards),
                   RDMAFLOW_NUM_WORKERS=str(workers),
                   RDMAFLOW_PS_TIMEOUT=str(min(timeout, 60.0)), RDMAFLOW_PS_STEP_TIMEOUT=str(min(timeout, 120.0)))
    else:
        world = workers
        roles = [("worker", w, w) for w in range(workers)]
    procs: list[ChildProcess] = []
    t_begin = time.monotonic()
    try:
        for kind, index, rank in roles:
            penv = dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
            penv[CONFIG_ENV] = json.dumps(dict(cfg, system=system, timeout=timeout))
            if system == "rdmaflow":
                penv.update(RDMAFLOW_ROLE=kind, RDMAFLOW_ROLE_INDEX=str(index))
            procs.append(_start(f"{label}-{kind}{index}", penv, os.path.join(logs, f"{label}-{kind}{index}.log")))
        deadline = t_begin + timeout
        while True:
            codes = [p.poll() for p in procs]
            failed = [p for p, c in zip(procs, codes) if c not in (None, 0)]
            if failed:
                time.sleep(1.0)  # let the others print their view of it
                raise BenchError(f"{label}: {', '.join(f'{p.label} exited with {p.poll()}' for p in failed)}\n"
                                 + _tails(procs))
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                running = [p.label for p, c in zip(procs, codes) if c is None]
                raise BenchError(f"{label}: still running after {timeout:.0f} s: {running}\n" + _tails(procs))
            time.sleep(0.05)
        worker0 = next(p for p in procs if p.label.endswith("worker0"))
        lines = [ln for ln in worker0.output().splitlines() if ln.startswith(RESULT_TAG)]
        if not lines:
            raise BenchError(f"{label}: worker 0 printed no result\n" + _tails(procs))
        res = json.loads(lines[-1][len(RESULT_TAG):])
        res["wall_s"] = time.monotonic() - t_begin
        if verbose:
            print(f"{label}: {res['steps']} steps, {res['train_s']:.2f} s training, "
                  f"{res['wall_s']:.1f} s with start-up", flush=True)
        return res
    finally:
        for p in procs:
            p.kill()


def _tails(procs: Sequence[ChildProcess], n: int = 2000) -> str:
    return "\n".join(f"--- {p.label} (exit {p.poll()}):\n{p.output()[-n:]}" for p in procs)


def curve_rows(system: str, res: Mapping[str, Any]) -> list[dict]:
    return [dict(zip(CURVE_FIELDS, [system, *rec])) for rec in res["records"]]


def summarize_system(system: str, cfg: Mapping[str, Any], res: Mapping[str, Any], target_acc: float,
                     target_loss: float) -> dict:
    recs = res["records"]
    evals = [r for r in recs if r[4] is not None]
    epochs = int(cfg["epochs"])
    last_epoch = [r[3] for r in recs if r[1] == epochs and r[3] is not None]
    t_acc = next((r[2] for r in evals if r[5] >= target_acc), None)
    t_loss = next((r[2] for r in evals if r[4] <= target_loss), None)
    shards = cfg["shards"] if system.startswith("rdmaflow") else ""
    return {"system": system, "workers": cfg["workers"], "shards": shards, "epochs": epochs, "steps": res["steps"],
            "final_train_loss": sum(last_epoch) / len(last_epoch) if last_epoch else None,
            "final_test_loss": evals[-1][4], "final_test_acc": evals[-1][5],
            "best_test_acc": max(r[5] for r in evals), "target_acc": target_acc, "seconds_to_target_acc": t_acc,
            "target_loss": target_loss, "seconds_to_target_loss": t_loss, "train_seconds": res["train_s"],
            "steps_per_s": res["steps"] / res["train_s"] if res["train_s"] > 0 else None,
            "setup_seconds": res["setup_s"]}


def _fmt(v: Any, digits: int = 4) -> str:
    if v is None or v == "":
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def print_table(summaries: Sequence[Mapping[str, Any]]) -> None:
    cols = [("system", "system"), ("final_test_acc", "test acc"), ("final_test_loss", "test loss"),
            ("seconds_to_target_acc", "s to acc"), ("seconds_to_target_loss", "s to loss"),
            ("train_seconds", "train s"), ("steps_per_s", "steps/s"), ("setup_seconds", "setup s")]
    rows = [[_fmt(s[k]) for k, _ in cols] for s in summaries]
    if any(s.get("rounds", 1) > 1 for s in summaries):
        cols.append(("rounds", "train s min-max (rounds)"))
        for r, s in zip(rows, summaries):
            r.append(f"{_fmt(s['train_seconds_min'])}-{_fmt(s['train_seconds_max'])} ({s['rounds']})")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (_, h) in enumerate(cols)]
    print("  ".join(h.rjust(w) for (_, h), w in zip(cols, widths)))
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))


def plot(path: str, results: Mapping[str, Mapping[str, Any]], cfg: Mapping[str, Any], target_acc: float,
         title: str = "", steps_in_epoch: int = 1) -> None:
    """Figure 10 style: training loss against wall-clock seconds, one line per system; test
    accuracy against seconds beside it."""
    fig, (a, b) = pyplot().subplots(1, 2, figsize=(12, 4.6))
    for system, res in results.items():
        color = style(system)[0]
        steps = [r for r in res["records"] if r[3] is not None]
        xs, ys = [r[2] for r in steps], [r[3] for r in steps]
        window = max(1, steps_in_epoch // int(cfg["log_every"]))
        smooth = [sum(ys[max(0, i - window + 1): i + 1]) / len(ys[max(0, i - window + 1): i + 1])
                  for i in range(len(ys))]
        a.plot(xs, ys, color=color, alpha=0.2, linewidth=0.7)
        a.plot(xs, smooth, color=color, linewidth=2, label=f"{system} (moving average, 1 epoch)")
        evals = [r for r in res["records"] if r[5] is not None]
        b.plot([r[2] for r in evals], [r[5] for r in evals], color=color, marker="o", ms=3, label=system)
    a.set_yscale("log")
    a.set_xlabel("wall-clock seconds (training)")
    a.set_ylabel("training loss (worker 0's batch, cross-entropy)")
    a.set_title("(a) training loss")
    b.axhline(target_acc, color="grey", linestyle="--", linewidth=1, label=f"target {target_acc:g}")
    b.set_ylim(max(0.0, min(0.8, target_acc - 0.15)), 1.0)
    b.set_xlabel("wall-clock seconds (training)")
    b.set_ylabel("test accuracy (360 held-out digits)")
    b.set_title("(b) test accuracy, after every epoch")
    for ax in (a, b):
        ax.grid(True, which="both", alpha=0.3)
        ax.set_xlim(left=0)
        ax.legend(fontsize=8)
    save_figure(fig, path, title, wrap=130, fontsize=9, dpi=110)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    flags.add_systems(ap, SYSTEMS, f"{', '.join(SYSTEMS)}, run in the order given")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (DDP: the world size; default 2)")
    ap.add_argument("--shards", type=int, default=1, help="rdmaflow parameter-server shards (default 1)")
    ap.add_argument("--epochs", type=int, default=40, help="passes over the training set (default 40)")
    ap.add_argument("--batch", type=int, default=64,
                    help="global batch per step, split evenly over the workers (default 64)")
    ap.add_argument("--lr", type=float, default=0.01, help="SGD learning rate (default 0.01)")
    ap.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    ap.add_argument("--weight-decay", type=float, default=0.0, help="SGD weight decay (default 0)")
    ap.add_argument("--hidden", type=int, default=128, help="hidden units of the MLP (default 128)")
    flags.add_seed(ap, "the model's initialization and the shuffling")
    ap.add_argument("--log-every", type=int, default=1,
                    help="worker 0 records every N-th step (and every epoch's last; default 1)")
    flags.add_transport(ap, ("tcp",), note="rdmaflow's (gloo's is TCP); several run rdmaflow once per "
                                          "transport, as rdmaflow-tcp, rdmaflow-sm")
    ap.add_argument("--target-acc", type=float, default=0.95,
                    help="summary: seconds until the test accuracy first reaches this (default 0.95)")
    ap.add_argument("--target-loss", type=float, default=0.15,
                    help="summary: seconds until the test loss first reaches this (default 0.15)")
    flags.add_repeats(ap, 1, "rounds of every system, the order rotating each round; the curves and the "
                             "summary are each system's round with the median training time, with the min "
                             "and max (default 1)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="bound on each system's job, start to end, seconds (default 600)")
    flags.add_out(ap, DEFAULT_OUT, f"curves.csv, summary.csv, converge.png, logs/ (default {DEFAULT_OUT})")
    ap.add_argument("--plot", default=None, help="write the plot here instead of OUT/converge.png")
    flags.add_verbose(ap)


def run(args: argparse.Namespace) -> int:
    try:
        systems = flags.choose(args.systems, SYSTEMS, "--systems")
        transports = flags.transports(args.transport)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    cfg = {"workers": args.workers, "shards": args.shards, "epochs": args.epochs, "batch": args.batch,
           "lr": args.lr, "momentum": args.momentum, "weight_decay": args.weight_decay, "hidden": args.hidden,
           "seed": args.seed, "log_every": args.log_every, "repeats": args.repeats}
    try:
        import sklearn  # noqa: F401 - say so before starting anything
    except ImportError:
        print("error: this benchmark needs scikit-learn (pip install 'rdmaflow[bench]' or scikit-learn)",
              file=sys.stderr)
        return 2
    import torch

    data = load_data()
    try:
        check_config(cfg, len(data["x_train"]))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    cfg["data"] = os.path.abspath(os.path.join(args.out, "data.pt"))
    torch.save(data, cfg["data"])
    runs = []  # (label, system, transport)
    for system in systems:
        if system == "rdmaflow":
            runs += [("rdmaflow" if len(transports) == 1 else f"rdmaflow-{t}", system, t) for t in transports]
        else:
            runs.append((system, system, "tcp"))
    rounds: dict[str, list[dict]] = {label: [] for label, _, _ in runs}
    try:
        for r in range(args.repeats):
            # Rotating the order each round spreads the machine's slow and quiet spells over the systems.
            for label, system, transport in runs[r % len(runs):] + runs[: r % len(runs)]:
                res = run_system(system, cfg, args.out, args.timeout, transport, args.verbose, label)
                res["round"] = r + 1
                rounds[label].append(res)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # run_system has killed its processes
        print("interrupted", file=sys.stderr)
        return 130
    labels = list(rounds)
    # Per system, the round with the median training time (the lower one of two middles).
    results = {s: sorted(rounds[s], key=lambda res: res["train_s"])[(len(rounds[s]) - 1) // 2] for s in labels}
    rows = [row for s in labels for row in curve_rows(s, results[s])]
    write_csv(os.path.join(args.out, "curves.csv"), CURVE_FIELDS, rows)
    summaries = [summarize_system(s, cfg, results[s], args.target_acc, args.target_loss) for s in labels]
    for sm in summaries:
        times = [res["train_s"] for res in rounds[sm["system"]]]
        sm.update(rounds=len(times), round=results[sm["system"]]["round"], train_seconds_min=min(times),
                  train_seconds_max=max(times))
    write_csv(os.path.join(args.out, "summary.csv"), SUMMARY_FIELDS, summaries)
    spe = steps_per_epoch(len(data["x_train"]), args.workers, args.batch)
    print(f"digits: {len(data['x_train'])} train / {len(data['x_test'])} test, MLP 64-{args.hidden}-10, "
          f"{args.workers} workers" + (f", {args.shards} shard(s), UCX {'/'.join(transports)}" if "rdmaflow" in systems
                                       else "")
          + f", batch {args.batch}, {spe} steps/epoch, {args.epochs} epochs, SGD lr {args.lr:g} "
          f"momentum {args.momentum:g} wd {args.weight_decay:g}, seed {args.seed}")
    print_table(summaries)
    curves = {s: {r[0]: r[3] for r in results[s]["records"] if r[3] is not None} for s in labels}
    for other in labels[1:]:
        common = sorted(set(curves[labels[0]]) & set(curves[other]))
        if common:
            diff = max(abs(curves[labels[0]][k] - curves[other][k]) for k in common)
            print(f"training loss, {labels[0]} vs {other} at the same step: largest difference {diff:.2g} "
                  f"over {len(common)} steps")
    png = args.plot or os.path.join(args.out, "converge.png")
    title = (f"sklearn digits, MLP 64-{args.hidden}-10, {args.workers} workers"
             + (f" ({args.shards} PS shard(s), UCX {'/'.join(transports)})" if "rdmaflow" in systems else "")
             + f", global batch {args.batch}, SGD lr {args.lr:g} momentum {args.momentum:g}, {args.epochs} epochs"
             + (f"; each system's median of {args.repeats} rounds" if args.repeats > 1 else ""))
    try:
        plot(png, results, cfg, args.target_acc, title, spe)
    except ImportError as e:
        print(f"no plot: {e} (pip install matplotlib)", file=sys.stderr)
        png = "(no plot)"
    print(f"wrote {os.path.join(args.out, 'curves.csv')}, {os.path.join(args.out, 'summary.csv')}, {png}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--proc"]:
        code = _proc_main()
        # Run the exit handlers (the store's host lingers in one), then skip the interpreter's
        # teardown: gloo's threads can abort it ("terminate called without an active exception").
        import atexit

        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
        os._exit(code)
    ap = argparse.ArgumentParser(prog="python -m rdmaflow.bench.converge",
                                 description="training to convergence on the digits data set, rdmaflow PS vs DDP-gloo")
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
