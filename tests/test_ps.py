"""The parameter server end to end: real jobs of shard and worker processes.

- Synchronous mode gives the parameters of single-process training on the concatenated
  batches (both placement policies, SGD and Adam, W = 1, 2, 3 workers x S = 1, 2 shards).
- Asynchronous and bounded-staleness modes train to a stated loss; the staleness bound is
  never exceeded (counted by the shards and by the workers themselves, never timed).
- A job over two hosts (two network namespaces).
- Every error: a worker whose model differs, a shard or a worker that dies, a store that
  cannot be reached: every process exits with a clear error within a bounded time.

Jobs are started directly with torchrun's variables (faster than torchrun itself on a 2-core
machine); one goes through ``python -m rdmaflow.launch``. The job script is
tests/ps_jobs/train.py; the single-process reference uses its model, batches and optimizer.
Every wait is bounded and every process (torchrun's too) is killed at the end of its test.

The root-cause tests check that a process names the failure that started it all (the job's
abort reason), not a peer that merely stopped because of it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from conftest import HERE
from typing_extensions import Self

from rdmaflow.bench.perftest import ucx_env
from rdmaflow.bench.processes import free_port
from rdmaflow.ps.layout import Unit, covered_once, make_plan, runs_of, spec_of
from rdmaflow.testing.netns import TwoHosts, netns_unavailable_reason
from rdmaflow.testing.stacks import stacks_of

JOBS = os.path.join(HERE, "ps_jobs")
TRAIN = os.path.join(JOBS, "train.py")
_spec = importlib.util.spec_from_file_location("ps_train_job", TRAIN)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

JOB_TIMEOUT = 120.0     # a whole job, start to finish (a loaded 2-core machine is slow to start)
DETECT_TIMEOUT = 25.0   # from a failure to every process's exit
# Timeouts of the job's own waits: the step timeout is far longer than DETECT_TIMEOUT, so a test
# that passes saw the failure detected, not a step timing out.
PS_TIMEOUT = "20"
PS_STEP_TIMEOUT = "90"
RTOL, ATOL = 1e-5, 1e-6  # float32, a few steps, sums in another order


def base_env(extra: dict | None = None, transport_env: dict | None = None) -> dict:
    env = dict(transport_env if transport_env is not None else ucx_env("tcp"))
    for k in list(env):
        if k.startswith(("TORCHELASTIC_", "RDMAFLOW_ROLE", "RDMAFLOW_NUM_")) or k in (
                "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RDMAFLOW_HOST"):
            del env[k]
    env.update(RDMAFLOW_PS_TIMEOUT=PS_TIMEOUT, RDMAFLOW_PS_STEP_TIMEOUT=PS_STEP_TIMEOUT,
               PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.update(extra or {})
    return env


class Proc:
    def __init__(self, name: str, popen: subprocess.Popen, log: str):
        self.name, self.popen, self.log = name, popen, log
        self.t_exit: float | None = None

    def output(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILLs its process group and every descendant: torchrun starts its workers in
        sessions of their own, which a kill of the launcher's group would miss."""
        if self.popen.poll() is not None:
            return  # reaped: its pid may belong to someone else now
        pids = descendants(self.popen.pid)
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def descendants(root: int) -> list[int]:
    """The pids below ``root`` (from /proc; best effort)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Job:
    """The processes of one job; ``with Job(...)`` kills what is left of them on exit."""

    def __init__(self, tmp_path, cfg: dict, name: str = "job"):
        self.dir = tmp_path / name
        self.dir.mkdir()
        self.cfg = dict(cfg, out=str(self.dir))
        self.procs: list[Proc] = []
        self.secret = secrets.token_hex(16)
        self.store = None

    def env(self, extra: dict | None = None, transport_env: dict | None = None) -> dict:
        return base_env(dict(PS_TEST_CONFIG=json.dumps(self.cfg), RDMAFLOW_JOB_SECRET=self.secret, **(extra or {})),
                        transport_env)

    def spawn(self, name: str, argv: list[str], env: dict) -> Proc:
        log = str(self.dir / f"{name}.log")
        with open(log, "w") as f:
            p = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT,
                                 start_new_session=True, cwd=os.path.dirname(HERE))
        proc = Proc(name, p, log)
        self.procs.append(proc)
        return proc

    def start_local(self, workers: int, shards: int, port: int | None = None, ranks=None,
                    extra: dict | None = None, agent_store: bool = False, script: str | list[str] = TRAIN,
                    transport_env: dict | None = None) -> Job:
        """One node: ranks 0..S-1 are shards, the others workers. Rank 0 serves the job's store,
        or with ``agent_store`` this test process does, as torchrun's agent would (so the store
        outlives the job's processes). Every process runs ``script`` (a path, or a path and its
        arguments), over the transports of ``transport_env`` (default: tcp)."""
        extra = dict(extra or {})
        if agent_store:
            from datetime import timedelta

            import torch.distributed as dist

            self.store = dist.TCPStore("127.0.0.1", 0, workers + shards + 1, True,
                                       timeout=timedelta(seconds=30), wait_for_workers=False)
            port = self.store.port
            extra["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        port = port or free_port()
        local = workers + shards
        for rank in (range(local) if ranks is None else ranks):
            name = f"shard{rank}" if rank < shards else f"worker{rank - shards}"
            env = self.env(dict(RANK=str(rank), WORLD_SIZE=str(local), LOCAL_RANK=str(rank),
                                LOCAL_WORLD_SIZE=str(local), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), RDMAFLOW_SHARDS_PER_NODE=str(shards), **extra),
                           transport_env)
            self.spawn(name, [sys.executable, *([script] if isinstance(script, str) else script)], env)
        return self

    def proc(self, name: str) -> Proc:
        return next(p for p in self.procs if p.name == name)

    def kill_mid_training(self, victim: str, worker: int) -> list[Proc]:
        """Once ``worker`` has printed its step 5, SIGKILLs the process named ``victim``; every
        other process must then exit non-zero within DETECT_TIMEOUT of the kill. Returns them."""
        self.wait_output(f"worker{worker}", rf"worker {worker} step 5\b")
        gone = self.proc(victim)
        gone.kill()
        t_kill = time.monotonic()
        rest = [p for p in self.procs if p is not gone]
        rcs = self.wait(DETECT_TIMEOUT, rest)
        assert all(rc != 0 for rc in rcs.values()), f"exit codes {rcs}\n" + self.logs()
        assert max(p.t_exit for p in rest) - t_kill < DETECT_TIMEOUT
        return rest

    def wait(self, timeout: float = JOB_TIMEOUT, procs: list[Proc] | None = None) -> dict[str, int]:
        """Waits for every process (bounded); fails with their logs if one is still running."""
        procs = self.procs if procs is None else procs
        deadline = time.monotonic() + timeout
        while True:
            for p in procs:
                if p.t_exit is None and p.popen.poll() is not None:
                    p.t_exit = time.monotonic()
            running = [p for p in procs if p.t_exit is None]
            if not running:
                return {p.name: p.popen.returncode for p in procs}
            if time.monotonic() > deadline:
                stacks = stacks_of([(p.name, p.popen.pid) for p in running])
                pytest.fail(f"still running after {timeout:.0f} s: {[p.name for p in running]}\n" + self.logs()
                            + stacks)
            time.sleep(0.05)

    def wait_output(self, name: str, pattern: str, timeout: float = JOB_TIMEOUT) -> None:
        p = self.proc(name)
        deadline = time.monotonic() + timeout
        while not re.search(pattern, p.output()):
            if p.popen.poll() is not None:
                pytest.fail(f"{name} exited ({p.popen.returncode}) before printing {pattern!r}\n" + self.logs())
            if time.monotonic() > deadline:
                pytest.fail(f"{name} did not print {pattern!r} within {timeout:.0f} s\n" + self.logs())
            time.sleep(0.05)

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {p.name} (exit {p.popen.poll()}):\n{p.output()[-tail:]}" for p in self.procs)

    def check_ok(self, rcs: dict[str, int]) -> None:
        assert all(rc == 0 for rc in rcs.values()), f"exit codes {rcs}\n" + self.logs()

    def worker_result(self, w: int) -> dict:
        return torch.load(self.dir / f"worker{w}.pt")

    def shard_stats(self, s: int) -> dict:
        return json.loads((self.dir / f"shard{s}.json").read_text())

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            try:
                p.popen.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.store = None  # an agent_store stops serving


# -- the single-process reference -------------------------------------------------------------

def reference(cfg: dict, workers: int) -> dict[str, torch.Tensor]:
    """The same model and torch optimizer in this process, on the concatenation of every
    worker's batch of each step."""
    seed = cfg["seed"]
    model = job.make_model(seed, cfg.get("model"))
    opt = job.make_optimizer(job.optimized_parameters(model, cfg), cfg["optim"], cfg["lr"])
    scheduler = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if cfg.get("schedule") else None
    schedulers = job.make_schedulers(opt) if cfg.get("wrapper_schedule") else []
    for t in range(cfg["steps"]):
        batches = [job.make_batch(seed, w, t, cfg["batch"]) for w in range(workers)]
        x = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        if cfg.get("discard"):
            job.discarded_backward(model, x, y)
        opt.zero_grad(set_to_none=not (cfg.get("keep_grads") or cfg.get("inplace_zero")))
        if cfg.get("clip"):
            # Each worker clips its own gradient; the shards average the clipped gradients.
            clipped = []
            for b in batches:
                model.zero_grad()
                job.loss_fn(model, *b).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
                clipped.append([p.grad.clone() for p in model.parameters()])
            for p, *gs in zip(model.parameters(), *clipped, strict=True):
                p.grad = sum(gs) / len(gs)
        else:
            job.loss_fn(model, x, y).backward()
        opt.step()
        if scheduler is not None:
            job.reschedule(opt, scheduler, t)
        for sch in schedulers:
            sch.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_matches_reference(j: Job, workers: int, shards: int) -> None:
    ref = reference(j.cfg, workers)
    init = dict(job.make_model(j.cfg["seed"], j.cfg.get("model")).named_parameters())
    for w in range(workers):
        res = j.worker_result(w)
        assert res["steps"] == j.cfg["steps"]
        got = res["params"]
        assert list(got) == list(ref)
        for name in ref:
            assert got[name].dtype == ref[name].dtype and got[name].shape == ref[name].shape
            if torch.equal(ref[name], init[name]):  # torch left it alone: not in the optimizer, or no gradient
                assert torch.equal(got[name], init[name]), f"{name} moved; single-process training leaves it"
                continue
            # The job trained: the parameters moved well beyond the tolerance.
            assert not torch.allclose(got[name], init[name], rtol=RTOL, atol=1e-3), f"{name} did not move"
            err = (got[name] - ref[name]).abs().max().item()
            assert torch.allclose(got[name], ref[name], rtol=RTOL, atol=ATOL), (
                f"worker {w} of {workers} ({shards} shards, {j.cfg['policy']}, {j.cfg['optim']}): "
                f"{name} differs from single-process training by {err:.3g}")
    for s in range(shards):
        st = j.shard_stats(s)
        assert st["steps"] == j.cfg["steps"], st
        assert st["applied"] == [j.cfg["steps"]] * workers, st


def sync_cfg(policy: str, optim: str, steps: int = 5) -> dict:
    return {"mode": "sync", "policy": policy, "block_bytes": 256, "optim": optim,
            "lr": 0.05 if optim == "sgd" else 0.02, "steps": steps, "batch": 4, "seed": 3, "fast_exit": True}


@pytest.mark.skipif(shutil.which("gdb") is None, reason="gdb is not installed")
def test_a_job_process_past_its_deadline_gets_its_stacks_reported():
    """What Job.wait adds to a "still running" failure: every thread's frames, named."""
    p = subprocess.Popen(["sleep", "30"])
    try:
        time.sleep(0.5)  # past the loader, into its sleep
        out = stacks_of([("sleeper", p.pid)])
    finally:
        p.kill()
        p.wait()
    assert out.startswith("\n--- sleeper: stacks\n"), out
    assert re.search(r"^#0 .*(nanosleep|sleep)", out, re.MULTILINE), out


def test_job_helpers_are_deterministic():
    """The test's own premises: batches depend on (seed, worker, step) only; with 256-byte
    blocks the block policy cuts variables, and both policies use both shards."""
    a = job.make_batch(3, 1, 4, 4)
    b = job.make_batch(3, 1, 4, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(job.make_batch(3, 2, 4, 4)[0], a[0])
    assert not torch.equal(job.make_batch(3, 1, 5, 4)[0], a[0])
    spec = spec_of(job.make_model(3).named_parameters())
    plan = make_plan(spec, 2, "block", 256)
    starts = {p.offset for p in plan.params} | {plan.total}
    assert any(u.offset + u.numel not in starts for u in plan.units), "no block cuts a variable"
    for policy in ("block", "variable"):
        plan = make_plan(spec, 2, policy, 256)
        assert plan.shard_numel(0) > 0 and plan.shard_numel(1) > 0


def test_variable_policy_places_contiguous_balanced_runs():
    """policy="variable" never cuts a variable, gives each shard one contiguous run of them (so
    runs_of merges a shard's units into one WRITE), and balances the shards' bytes to within one
    variable; "block" with several shards leaves a shard's blocks apart."""
    spec = spec_of(job.make_model(3, "many").named_parameters())
    sizes = [p.numel() for p in job.make_model(3, "many").parameters()]
    for shards in (1, 2, 3):
        plan = make_plan(spec, shards, "variable")
        assert [(u.offset, u.numel) for u in plan.units] == [(p.offset, p.numel) for p in plan.params]
        fills = [plan.shard_numel(s) for s in range(shards)]
        assert sum(fills) == plan.total and max(fills) - min(fills) <= 2 * max(sizes), fills
        for s in range(shards):
            assert len(runs_of(plan.units_of(s))) == 1, (shards, s)
    block = make_plan(spec, 2, "block", 256)
    assert len(runs_of(block.units_of(0))) == len(block.units_of(0)) > 1


def test_covered_once_tells_units_a_step_need_not_send_again():
    """The units that ranges written ahead of a step (DistributedOptimizer.push_range, the file
    view) cover whole and exactly once; the others they touch are sent again by the step."""
    units = [Unit(i, i % 2, 10 * i, 10, 10 * (i // 2), f"block {i}") for i in range(5)]  # [0, 50)
    assert covered_once(units, []) == (set(), set())
    assert covered_once(units, [(0, 50)]) == ({0, 1, 2, 3, 4}, {0, 1, 2, 3, 4})
    # Adjacent ranges, in any order, cover exactly once; a unit partly covered is only touched.
    assert covered_once(units, [(10, 20), (0, 10), (20, 25)]) == ({0, 1}, {0, 1, 2})
    # Overlapping ranges: every unit the overlap touches is sent again, the rest are not.
    assert covered_once(units, [(0, 30), (29, 31), (31, 50)]) == ({0, 1, 3, 4}, {0, 1, 2, 3, 4})
    assert covered_once(units, [(0, 50), (12, 13)]) == ({0, 2, 3, 4}, {0, 1, 2, 3, 4})
    # An element split between two writes: both ranges hold it (the file view's outward rounding).
    assert covered_once(units, [(0, 5), (4, 10), (10, 20)]) == ({1}, {0, 1})
    # Empty ranges count for nothing.
    assert covered_once(units, [(5, 5), (0, 10)]) == ({0}, {0})


def test_small_units_move_in_one_write_per_run(tmp_path):
    """A model of 124 small tensors under policy="variable", 2 workers and 2 shards: a worker
    pushes one gradient WRITE per shard per step and a shard replies with one WRITE per worker
    per step (round-robin placement took one WRITE per tensor: 62 per shard), and the result
    equals single-process training."""
    cfg = dict(sync_cfg("variable", "sgd", steps=6), model="many")
    assert len(list(job.make_model(3, "many").parameters())) == 124
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 2)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 2)
        for w in range(2):
            assert j.worker_result(w)["push_writes"] == cfg["steps"] * 2
        for s in range(2):
            # The initial weights, then each step's, to each of the 2 workers.
            assert j.shard_stats(s)["reply_writes"] == (cfg["steps"] + 1) * 2


# Every (W, S) pair, and every pair of values of any two of W, S, policy, optimizer.
SYNC_MATRIX = [
    (1, 1, "block", "sgd"),
    (1, 2, "variable", "adam"),
    (2, 2, "block", "adam"),
    (3, 1, "block", "adam"),
    (3, 2, "variable", "sgd"),
]
LAUNCH_ROW = (2, 1, "variable", "sgd")  # test_sync_through_rdmaflow_launch


@pytest.mark.parametrize("workers,shards,policy,optim", SYNC_MATRIX,
                         ids=[f"W{w}-S{s}-{p}-{o}" for w, s, p, o in SYNC_MATRIX])
def test_sync_equals_single_process(tmp_path, workers, shards, policy, optim):
    with Job(tmp_path, sync_cfg(policy, optim)) as j:
        j.start_local(workers, shards)
        j.check_ok(j.wait())
        assert_matches_reference(j, workers, shards)


def test_parameters_the_optimizer_does_not_hold_stay_as_they_are(tmp_path):
    """The first layer requires gradients but is not in the optimizer: torch leaves it as it is
    (the shards had trained it)."""
    with Job(tmp_path, dict(sync_cfg("block", "sgd"), head_only=True)) as j:
        j.start_local(2, 1)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 1)


@pytest.mark.parametrize("optim", ["sgd", "adam"])
def test_hyperparameters_changed_during_training_reach_the_shards(tmp_path, optim):
    """An LR scheduler halves lr every two steps and the weight decay changes by hand: the shards
    run the optimizer with the values each step had (they had kept the first ones)."""
    with Job(tmp_path, dict(sync_cfg("variable", optim, steps=6), schedule=True)) as j:
        j.start_local(2, 2)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 2)


@pytest.mark.parametrize("optim,overlap,keep", [("sgd", True, False), ("adam", False, False), ("sgd", True, True)])
def test_a_parameter_without_a_gradient_is_not_stepped(tmp_path, optim, overlap, keep):
    """A layer the forward never uses has no gradient: torch's optimizer skips it (its grad is
    None), the shards stepped it with zeros, which weight decay, momentum and Adam move. Also
    when gradients are zeroed with set_to_none=False (keep): that layer's grad still never
    exists in torch, though the worker's, its send buffer, is never None."""
    with Job(tmp_path, dict(sync_cfg("variable", optim), model="unused", overlap=overlap, keep_grads=keep)) as j:
        j.start_local(2, 2)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 2)


@pytest.mark.parametrize("zeroing", ["optimizer, to none", "optimizer, in place", "model, in place"])
def test_a_discarded_backward_leaves_nothing_on_the_shards(tmp_path, zeroing):
    """With overlap, each step first runs a backward that also reaches a large unused layer (its
    weight is pushed on its own while backward runs), zeroes, and runs the step's backward, which
    does not reach it. Torch steps that layer with zeros (set_to_none=False) or not at all:
    the shards must not apply the discarded gradient that reached them. The model's own
    zero_grad is invisible to the worker: only the buffer it zeroes in place says so."""
    keep = zeroing != "optimizer, to none"
    cfg = dict(sync_cfg("variable", "sgd", steps=4), model="unused_large", overlap=True, keep_grads=keep,
               model_zero=zeroing.startswith("model"), discard=True)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 2)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 2)


def test_gradients_zeroed_in_place_right_after_step_are_safe(tmp_path):
    """With overlap and zero copy, p.grad is the send buffer. A loop that zeroes it in place with
    the model's zero_grad(set_to_none=False) right after step() must not change what that step
    pushed: step() returns once the gradient has left its buffer. The first layer (1 MiB) is the
    last unit backward pushes, so its WRITE is the one in flight when step() is called."""
    cfg = dict(sync_cfg("variable", "sgd", steps=8), model="wide", overlap=True, inplace_zero=True, lr=0.003)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 1)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 1)
        for w in range(2):  # nothing changed between backward and step(): nothing is written twice
            assert j.worker_result(w)["push_writes"] == 2 * cfg["steps"], j.worker_result(w)["push_writes"]


@pytest.mark.parametrize("zero_copy", [True, False])
def test_gradients_clipped_between_backward_and_step_are_what_the_shards_apply(tmp_path, zero_copy):
    """With overlap, backward pushes the 1 MiB first layer's gradient as soon as it has it; the
    loop then clips every gradient in place (clip_grad_norm_, well below the norm). step() finds
    the gradients changed since backward and writes those units again, behind a fence: the
    shards apply the clipped gradients (each worker's own, averaged), not backward's."""
    cfg = dict(sync_cfg("variable", "sgd", steps=5), model="wide", overlap=True, zero_copy=zero_copy, lr=0.05, clip=5.0)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 1)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 1)
        for w in range(2):  # backward's 2 WRITEs a step, then the changed units again
            assert j.worker_result(w)["push_writes"] > 2 * cfg["steps"], j.worker_result(w)["push_writes"]


def test_sync_through_rdmaflow_launch(tmp_path):
    """W=2, S=1, variable placement, SGD, started by `python -m rdmaflow.launch` (torchrun); the
    shards take the library's own exit path (ps.init() exits them) and the ordinary interpreter
    exit, and publish their statistics in the store."""
    workers, shards, policy, optim = LAUNCH_ROW
    cfg = dict(sync_cfg(policy, optim), fast_exit=False, init_exit_shards=True, stats_from_store=True)
    with Job(tmp_path, cfg) as j:
        j.spawn("launch", [sys.executable, "-m", "rdmaflow.launch", "--nproc-per-node", str(workers),
                           "--shards-per-node", str(shards), "--master-port", str(free_port()), TRAIN], j.env())
        j.check_ok(j.wait())
        assert_matches_reference(j, workers, shards)


# -- asynchronous and bounded staleness -------------------------------------------------------

# Eval MSE on a fixed batch; the untrained model is at about 0.63. The slow worker finishes
# last, so it holds the weights after every update of the job: FINAL_LOSS applies to it. The
# fast worker stopped early, with the weights of about two thirds of the updates: EARLY_LOSS.
# (A single-process simulation of either mode, over fast/slow speed ratios 1..100, ends at
# 0.005-0.01 and 0.01-0.04.)
FINAL_LOSS = 0.05
EARLY_LOSS = 0.15
STALENESS = 1


def async_cfg(mode: str) -> dict:
    return {"mode": mode, "staleness": STALENESS if mode == "bounded" else 0, "policy": "block",
            "block_bytes": 256, "optim": "adam", "lr": 0.02, "steps": 60, "batch": 8, "seed": 5,
            "slow": {"worker": 1, "delay": 0.02}, "track_gap": True, "fast_exit": True}


def eval_loss(cfg: dict, params: dict) -> float:
    model = job.make_model(cfg["seed"])
    model.load_state_dict(params)
    with torch.no_grad():
        return job.loss_fn(model, *job.eval_batch(cfg["seed"])).item()


@pytest.mark.parametrize("mode", ["bounded", "async"])
def test_async_modes_train_and_staleness_is_bounded(tmp_path, mode):
    """Two workers, worker 1 slow (20 ms more per step), two shards. Both modes train below
    the thresholds. In bounded mode no worker ever ran more than STALENESS steps ahead of
    another still running, as the shards count it and as the fast worker counts it through the
    store, and that bound was reached; in async mode the same job runs further ahead, so the
    bound is what holds the fast worker back."""
    cfg = dict(async_cfg(mode), checkpoint_dir=str(tmp_path / "ckpt"))  # takes none here: the job says so
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 2)
        j.check_ok(j.wait())
        assert f"checkpoints are taken in mode='sync' only: this {mode} job writes none" in j.proc("shard0").output()
        assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir())
        initial = eval_loss(cfg, dict(job.make_model(cfg["seed"]).named_parameters()))
        assert initial > 4 * EARLY_LOSS
        fast, slow = j.worker_result(0), j.worker_result(1)
        assert fast["steps"] == slow["steps"] == cfg["steps"]
        final, early = eval_loss(cfg, slow["params"]), eval_loss(cfg, fast["params"])
        assert final < FINAL_LOSS, f"{mode}: the final model is at eval loss {final:.4f} (from {initial:.4f})"
        assert early < EARLY_LOSS, f"{mode}: the fast worker ends at eval loss {early:.4f} (from {initial:.4f})"
        stats = [j.shard_stats(s) for s in range(2)]
        for st in stats:
            assert st["steps"] == 2 * cfg["steps"], st  # every gradient of both workers applied
            assert st["applied"] == [cfg["steps"]] * 2, st
        gaps = [st["max_gap"] for st in stats]
        if mode == "bounded":
            assert all(g <= STALENESS for g in gaps), f"shards saw gaps {gaps} > staleness {STALENESS}"
            assert fast["observed_gap"] <= STALENESS, (
                f"worker 0 ran {fast['observed_gap']} steps ahead of worker 1 (staleness {STALENESS})")
            assert max(gaps) == STALENESS, f"no gap occurred (shards: {gaps}): the test proves nothing"
        else:
            assert min(gaps) > STALENESS + 2, f"async: shards saw gaps {gaps}"
            assert fast["observed_gap"] > STALENESS + 2, f"async: worker 0 got only {fast['observed_gap']} steps ahead"


def test_adaptive_pulling_waits_the_bubble_and_measures_each_pull_on_its_own_thread():
    """The delay before a pull request is 0.9 of the average compute less the average pull
    latency (never negative); a pull that gave up leaves the averages as they were."""
    import threading

    from rdmaflow.ps.adaptive_pull import EMA, AdaptivePull

    events, give_up = [], threading.Event()

    def send(r):
        events.append(("send", r, threading.current_thread() is threading.main_thread()))

    def landed(r):
        time.sleep(0.02)
        return not give_up.is_set()

    pull = AdaptivePull(send, landed)
    assert pull.next_delay() == 0.0, "no averages yet: at once"
    t0 = time.monotonic()
    pull.request(1, 0.05)
    assert events == [], "request returns before the delay passed"
    pull.join(5.0)
    assert time.monotonic() - t0 >= 0.05 and events == [("send", 1, False)], events
    assert pull.last == 1
    pull.computed(1.0)
    first = pull.next_delay()
    assert pull.avg_pull is not None and 0.02 <= pull.avg_pull < 0.5, pull.avg_pull
    assert first == pytest.approx(0.9 * 1.0 - pull.avg_pull)
    pull.computed(0.0)  # a step that computed nothing: the average moves by EMA, the bubble stays >= 0
    assert pull.avg_compute == pytest.approx(1 - EMA)
    give_up.set()
    before = pull.avg_pull
    pull.request(2, 0.0)
    pull.join(5.0)
    assert pull.next_delay() == pytest.approx(max(0.0, 0.9 * (1 - EMA) - before))
    assert pull.avg_pull == before, "a pull that gave up is no latency sample"
    assert pull.bubbles == [0.0, first, pull.bubbles[-1]] and pull.last == 2


def test_threads_sharing_a_reply_word_poll_it_one_at_a_time_and_each_returns_at_its_target():
    """wait_range from several threads (the file view's readers): one polls the shard's reply
    word, for the smallest target asked, the others sleep; each returns once the word reaches
    its own target, or raises TimeoutError naming the shard when its deadline passes."""
    import threading

    import rdmaflow
    from rdmaflow.deadline import Deadline
    from rdmaflow.ps.shared_wait import SharedWait

    word, lock = [0], threading.Lock()
    polling, most, polled = [0], [0], []

    def poll(target, what, seconds):
        with lock:
            polling[0] += 1
            most[0] = max(most[0], polling[0])
            polled.append(target)
        try:
            end = time.monotonic() + seconds
            while word[0] < target:
                if time.monotonic() > end:
                    raise rdmaflow.TimeoutError("slice")
                time.sleep(0.0002)
        finally:
            with lock:
                polling[0] -= 1

    shared = SharedWait("shard 1", lambda: word[0], poll)
    returned, errors = {}, []

    def waiter(target):
        try:
            shared.wait(target, f"target {target}", Deadline(10.0))
            returned[target] = word[0]
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=waiter, args=(t,)) for t in (3, 1, 5, 2, 4, 5)]
    for th in threads:
        th.start()
    for v in range(1, 6):
        time.sleep(0.02)
        word[0] = v
    for th in threads:
        th.join(10)
    assert errors == [] and not any(th.is_alive() for th in threads), errors
    assert all(got >= target for target, got in returned.items()) and sorted(returned) == [1, 2, 3, 4, 5]
    assert most[0] == 1, "two threads polled the word at once"
    assert min(polled) == 1, "a poller waits for the smallest target asked (target 3's poll came first)"
    with pytest.raises(rdmaflow.TimeoutError, match=r"shard 1 did not deliver target 9 within 0.05 s"):
        shared.wait(9, "target 9", Deadline(0.05))
    shared.wait(5, "reached", Deadline(0.0))  # already there: no poll, no deadline


# -- two hosts ---------------------------------------------------------------------------------

NETNS = netns_unavailable_reason()


@pytest.mark.skipif(NETNS is not None, reason=f"network namespaces unavailable: {NETNS}")
def test_two_host_job(tmp_path):
    """Node 0 (shard 0 + worker 0) in namespace A, node 1 (shard 1 + worker 1) in B, the store
    on A, UCX over tcp on the veth: the parameters of single-process training."""
    cfg = dict(sync_cfg("block", "adam"), fast_exit=False)
    with TwoHosts() as hosts, Job(tmp_path, cfg) as j:
        a = hosts.a
        for node, host in enumerate(hosts):
            for local in range(2):
                rank = 2 * node + local
                name = f"shard{node}" if local == 0 else f"worker{node}"
                env = j.env({"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(local),
                             "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": str(node), "MASTER_ADDR": a.addr,
                             "MASTER_PORT": "29800", "RDMAFLOW_SHARDS_PER_NODE": "1"},
                            transport_env=ucx_env("tcp", net_device=host.ifname))
                j.spawn(name, host.argv([sys.executable, TRAIN]), env)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 2)


# -- errors ------------------------------------------------------------------------------------

# What an error of the library looks like at the end of a process's output.
LIB_ERROR = r"(rdmaflow\.\w*Error|ShardFailure|WorkerFailure): "
MISMATCH = {  # worker -> (its model, what it must say)
    1: ("extra", r"6 parameters here, 4 in the job's model; extra here: \['3\.bias', '3\.weight'\]"),
    2: ("shape", r"parameter 0\.weight float32\[17, 8\] here vs 0\.weight float32\[16, 8\] in the job's model"),
    3: ("dtype", r"parameter 0\.weight float64\[16, 8\] here vs 0\.weight float32\[16, 8\] in the job's model"),
    4: ("names", r"parameter inp\.weight float32\[16, 8\] here vs 0\.weight float32\[16, 8\] in the job's model"),
}


def test_worker_models_differ(tmp_path):
    """Workers 1-4 build models that differ from worker 0's (an extra layer, a shape, a dtype,
    other names): every process exits non-zero within DETECT_TIMEOUT of the first failure; each
    differing worker names its difference, the shard names one of them, worker 0 has a library
    error (which may be the shard's exit: see test_root_cause_*). The store is served by this
    process, as under torchrun: with rank 0 serving it, a slow worker may find it gone before
    it compares its model (test_late_worker_learns_why_the_job_failed)."""
    cfg = dict(sync_cfg("block", "sgd"), variant={str(w): v for w, (v, _) in MISMATCH.items()})
    with Job(tmp_path, cfg) as j:
        j.start_local(1 + len(MISMATCH), 1, agent_store=True)
        rcs = j.wait(JOB_TIMEOUT)
        assert all(rc != 0 for rc in rcs.values()), f"exit codes {rcs}\n" + j.logs()
        times = sorted(p.t_exit for p in j.procs)
        assert times[-1] - times[0] < DETECT_TIMEOUT, j.logs()
        for w, (_, said) in MISMATCH.items():
            out = j.proc(f"worker{w}").output()
            assert re.search(f"worker {w}'s model differs from the job's: {said}", out), f"worker{w}\n" + j.logs()
        shard = j.proc("shard0").output()
        assert re.search(r"shard 0 failed: the job was aborted: worker \d: worker \d's model differs", shard), j.logs()
        assert re.search(LIB_ERROR, j.proc("worker0").output()), j.logs()


def test_late_worker_learns_why_the_job_failed(tmp_path):
    """Rank 0 (shard 0) serves the store, as without torchrun. Worker 2's model differs and
    aborts the job at once; worker 1, whose model differs too, gets to its setup 8 s later,
    when every other process has failed and shard 0 only lingers to serve the store (up to
    15 s, see JobStore.leave). It should still say that its model differs (or why the job was
    aborted), not merely that a peer is gone. (Joining after the store is gone too can only
    say that the store is gone; waiting up to 15 s here raced with the 15 s linger.)"""
    cfg = dict(sync_cfg("block", "sgd"), variant={"1": "extra", "2": "shape"},
               setup_after_store_gone={"1": 8})
    with Job(tmp_path, cfg) as j:
        j.start_local(3, 1)
        rcs = j.wait(JOB_TIMEOUT)
        assert all(rc != 0 for rc in rcs.values()), f"exit codes {rcs}\n" + j.logs()
        out = j.proc("worker1").output()
        assert re.search(r"model differs|the job was aborted: worker 2", out), out[-2000:]


@pytest.mark.parametrize("victim", [1, 0], ids=["shard1", "shard0-serving-the-store"])
def test_shard_killed_mid_training(tmp_path, victim):
    """SIGKILL a shard (of 2) while two workers train: every other process exits non-zero within
    DETECT_TIMEOUT; the workers name the shard. Shard 0 (rank 0) also serves the job's store,
    so killing it takes the store down too."""
    cfg = dict(sync_cfg("block", "sgd", steps=100000), step_delay=0.01)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 2)
        for p in j.kill_mid_training(f"shard{victim}", 0):
            out = p.output()
            assert re.search(LIB_ERROR, out), f"{p.name}: no library error\n" + j.logs()
            if p.name.startswith("worker"):
                assert re.search(rf"shard {victim} at \S+ died while worker \d (waited|pushed)", out), (
                    f"{p.name} does not name shard {victim}\n" + j.logs())


def test_a_shard_interrupted_mid_training_aborts_the_job_without_a_traceback(tmp_path):
    """SIGINT (Ctrl-C, which rdmaflow launch passes to every process) to shard 1 while two
    workers train: it prints one line, no traceback, and exits 130; the workers exit non-zero
    with its reason (it printed a KeyboardInterrupt traceback, and the workers found it dead).
    ``ps.init()`` exits the shard, as it does by default."""
    cfg = dict(sync_cfg("block", "sgd", steps=100000), step_delay=0.01, init_exit_shards=True)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 2)
        j.wait_output("worker0", r"worker 0 step 5\b")
        os.kill(j.proc("shard1").popen.pid, signal.SIGINT)
        rcs = j.wait(DETECT_TIMEOUT)
        out = j.proc("shard1").output()
        assert rcs["shard1"] == 130 and "Traceback" not in out, j.logs()
        assert "rdmaflow ps: shard 1 interrupted; the job is aborted" in out, j.logs()
        for w in ("worker0", "worker1"):
            assert rcs[w] != 0 and "shard 1: interrupted (SIGINT)" in j.proc(w).output(), j.logs()


def test_a_worker_declares_a_dead_shard_in_the_store(tmp_path):
    """SIGKILL shard 1 with the store served by this process (as torchrun's agent does): the
    worker that finds the shard dead records it in the store, so that a process serving the
    store would not wait at exit for a shard that will never leave."""
    from rdmaflow.ps.context import PREFIX

    cfg = dict(sync_cfg("block", "sgd", steps=100000), step_delay=0.01)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 2, agent_store=True)
        j.kill_mid_training("shard1", 0)
        assert j.store.check([PREFIX + "dead/shard/1"]), j.logs()
        assert not j.store.check([PREFIX + "dead/shard/0"]), j.logs()


def test_worker_killed_mid_training(tmp_path):
    """SIGKILL worker 1 (of 2) while training: the shard and worker 0 exit non-zero within
    DETECT_TIMEOUT with an error naming worker 1 (surviving it is a later issue). Worker 0
    learns the reason from the store after the shard's ABORT; the store is served by this
    process, as under torchrun, so that the shard's own exit cannot race it (see
    test_late_worker_learns_why_the_job_failed)."""
    cfg = dict(sync_cfg("variable", "sgd", steps=100000), step_delay=0.01)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 1, agent_store=True)
        for p in j.kill_mid_training("worker1", 1):
            assert re.search(r"worker 1 at \S+ died", p.output()), f"{p.name} does not name worker 1\n" + j.logs()


def test_store_unreachable(tmp_path):
    """Nothing listens on MASTER_PORT (rank 0, which serves the store, never started): a shard
    and a worker each exit non-zero with an error naming the store's address, within the store
    timeout (3 s) plus a margin."""
    with socket.socket() as s:  # bound, never listening: nothing can connect to it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        with Job(tmp_path, sync_cfg("block", "sgd")) as j:
            t0 = time.monotonic()
            j.start_local(1, 2, port=port, ranks=[1, 2], extra={"RDMAFLOW_PS_TIMEOUT": "3"})
            rcs = j.wait(DETECT_TIMEOUT)
            assert all(rc != 0 for rc in rcs.values()), f"exit codes {rcs}\n" + j.logs()
            for p in j.procs:
                assert f"cannot reach the job's c10d store at 127.0.0.1:{port} within 3 s" in p.output(), (
                    f"{p.name}\n" + j.logs())
            assert max(p.t_exit for p in j.procs) - t0 < DETECT_TIMEOUT


# -- root causes -------------------------------------------------------------------------------
# When one process fails, the others see two things: the abort reason it left in the store,
# and, once it has exited, its connection failing. They report whichever they notice first,
# and they look at the connection every 50 ms but at the store only once a second, so a shard
# whose worker exited *because shard 1 died* usually says "worker 0 died". These tests put a
# process in exactly that state (a reason in the store and a dead connection), without the race.

class _Store:
    def __init__(self, reason: str):
        self.reason = reason
        self.aborts: list[str] = []

    def aborted(self):
        return self.reason

    def abort_reason(self):
        return self.reason

    def abort(self, reason: str) -> None:
        self.aborts.append(reason)

    def fail_with(self, msg: str, dead=None):
        if self.reason:
            return self.reason
        self.abort(msg)
        return None


def _word():
    from rdmaflow.transfer import Word

    return Word(torch.zeros(8, dtype=torch.int64)[:1])


ROOT = "shard 1 at 127.0.0.1:4 died while worker 0 waited for the weights of step 6"


def test_root_cause_shard_reports_abort_reason():
    from types import SimpleNamespace

    from rdmaflow.ps.shard import Shard, ShardFailure

    ctx = SimpleNamespace(role=SimpleNamespace(index=0), store=_Store(ROOT), device=None, timeout=5.0,
                          step_timeout=5.0)
    shard = Shard(ctx)
    shard.push = [_word()]
    shard.workers = [{"ep": "127.0.0.1:3", "channel": SimpleNamespace(failed=True)}]
    with pytest.raises(ShardFailure) as e:
        shard._wait_push(0, 1)
    assert ROOT in str(e.value)


def test_root_cause_worker_reports_abort_reason():
    from types import SimpleNamespace

    from rdmaflow.ps.worker import Worker

    reason = "worker 1: worker 1's model differs from the job's: parameter 0.weight float64[16, 8] here vs ..."
    w = Worker.__new__(Worker)
    w.id, w.store, w.ctx = 0, _Store(reason), SimpleNamespace(step_timeout=5.0, timeout=5.0)
    w.reply = [_word()]
    w.shards = [{"ep": "127.0.0.1:3", "channel": SimpleNamespace(failed=True)}]
    with pytest.raises(Exception) as e:
        w._wait_word(0, 1, "the initial weights")
    assert reason in str(e.value)


def test_worker_arguments_are_checked_before_joining():
    """A DistributedOptimizer's counts must be integers: InvalidArgumentError naming the
    argument, before the worker touches the job."""
    from types import SimpleNamespace

    import rdmaflow
    from rdmaflow.ps.worker import Worker

    ctx = SimpleNamespace(role=SimpleNamespace(num_workers=2))
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for kw, name in [({"mode": "bounded", "staleness": "2"}, "staleness"), ({"mode": "bounded", "staleness": None},
                     "staleness"), ({"min_workers": "1"}, "min_workers"), ({"min_workers": 1.5}, "min_workers"),
                     ({"checkpoint_every": None}, "checkpoint_every"), ({"block_bytes": 2.0}, "block_bytes"),
                     ({"log_every": True}, "log_every")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=f"{name} must be an integer"):
            Worker(ctx, model, opt, **kw)
    for value in ("two", "0", "3"):  # rdmaflow launch --min-workers sets it; a ValueError before
        os.environ["RDMAFLOW_MIN_WORKERS"] = value
        try:
            with pytest.raises(rdmaflow.InvalidArgumentError, match=r"\$RDMAFLOW_MIN_WORKERS"):
                Worker(ctx, model, opt)
        finally:
            del os.environ["RDMAFLOW_MIN_WORKERS"]
    with pytest.raises(rdmaflow.InvalidArgumentError, match="the optimizer holds 1 tensor"):
        Worker(ctx, model, torch.optim.SGD([*model.parameters(), torch.nn.Parameter(torch.zeros(2))], lr=0.1))
    for mode in ("sync", "async"):  # a bound these modes would ignore
        with pytest.raises(rdmaflow.InvalidArgumentError, match=f"applies to mode 'bounded' only; mode '{mode}'"):
            Worker(ctx, model, opt, mode=mode, staleness=3)
    ranged = Worker.__new__(Worker)
    ranged._closed, ranged.plan = False, SimpleNamespace(total=10)
    for lo, hi in [(-1, 3), (5, 3), (0, 11)]:  # they were cut to the units they overlap, silently
        for call, op in [(ranged.push_range, "push_range"), (ranged.wait_range, "wait_range")]:
            with pytest.raises(rdmaflow.InvalidArgumentError,
                               match=rf"{op}: \[{lo}, {hi}\) is not a range of the model's 10 flat elements"):
                call(lo, hi)
    # One DistributedOptimizer per job (after close() too: the shards finished with it), and one API.
    from rdmaflow import ps
    from rdmaflow.ps.kv_client import KVStore
    for state, words in [("open", "already has a DistributedOptimizer"), ("closed", "was closed, and its shards")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=words):
            ps.DistributedOptimizer(model, opt, ctx=SimpleNamespace(is_worker=True, kv_state=None, optimizer_state=state))
        with pytest.raises(rdmaflow.InvalidArgumentError, match="this job's KVStore was closed"
                           if state == "closed" else "already has a KVStore"):
            KVStore([0], [(1,)], ctx=SimpleNamespace(is_worker=True, kv_state=state, optimizer_state=None))
    # Both in one job: declared by ps.init(services=...) (rdmaflow/ps/services.py), else refused.
    from rdmaflow.ps import services
    one = SimpleNamespace(services=("optimizer",), services_agreed=True, role=SimpleNamespace(index=1))
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"runs DistributedOptimizer only.*"
                       r"ps.init\(services=\['kv', 'optimizer'\]\)"):
        services.declare(one, "kv")
    assert services.checked(["kv", "optimizer"]) == services.checked(("optimizer", "kv")) == ("kv", "optimizer")
    for bad, words in [(["kv", "kv"], "twice"), ([], "at least one"), (["dense"], "at least one"), (3, "a list")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=words):
            services.checked(bad)
    closed = Worker.__new__(Worker)
    closed._closed = True
    for call, op in [(lambda: closed.push_range(0, 4), "push_range"), (lambda: closed.wait_range(0, 4), "wait_range"),
                     (closed.zero_grad, "zero_grad"), (closed.step, "step")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=f"{op}: this parameter-server worker is closed"):
            call()


def test_a_shard_runs_each_push_with_the_step_record_sent_with_it():
    """Asynchronous overlap: a worker's pushes t and t + 1 may both wait at the shard, so each
    has its own step record (slot t % 2); a push without one runs with the hyperparameters in use
    and every parameter stepped. A unit is skipped only if no parameter it holds part of has a
    gradient in any of the step's pushes."""
    from rdmaflow.ps.layout import make_plan, spec_of, units_holding
    from rdmaflow.ps.optim import build_optimizer, describe_optimizer, hyper_fields, hyper_values
    from rdmaflow.ps.protocol import ShardLayout, write_record
    from rdmaflow.ps.shard import Shard

    # Three parameters of 4, 1 and 3 floats in blocks of 16 bytes: units [0, 4) [4, 8).
    named = [("a", torch.zeros(4)), ("b", torch.zeros(1)), ("c", torch.zeros(3))]
    plan = make_plan(spec_of(named), 1, "block", 16)
    units = plan.units_of(0)
    assert [(u.offset, u.numel) for u in units] == [(0, 4), (4, 4)]
    starts = [info.offset for info in plan.params]
    assert [units_holding(starts, u.offset, u.offset + u.numel) for u in units] == [range(1), range(1, 3)]
    params = [torch.zeros(4), torch.zeros(4)]
    desc = describe_optimizer(torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.99)))
    shard = Shard.__new__(Shard)
    shard.hyper_fields = hyper_fields(desc)
    assert shard.hyper_fields == [("betas", 0), ("betas", 1), ("eps", None), ("lr", None), ("weight_decay", None)]
    shard.layout = L = ShardLayout(8, 4, 2, slots=2, hyper=len(shard.hyper_fields), params=3)
    raw = torch.zeros(L.total, dtype=torch.uint8)
    shard.records = [[raw[L.record_at(w, k) : L.record_at(w, k) + L.record_stride] for k in range(2)]
                     for w in range(2)]
    shard.optimizers = [(params, build_optimizer(desc, params))]
    shard.hyper_start = shard.hyper_in_use = hyper_values(desc["hyper"], shard.hyper_fields)
    shard.unit_params = [(torch.tensor([0, 1]), torch.tensor([1, 3]))]  # unit 0: a; unit 1: b, c
    shard._skipped_for = None

    def write(w, t, values, has):
        write_record(raw[L.record_at(w, t) : L.record_at(w, t) + L.record_stride], t, values, has, L.hyper_count)

    group = shard.optimizers[0][1].param_groups[0]
    assert shard.record(1, 3) is None
    shard.use_hyper(None)  # no record: the values in use
    assert group["lr"] == 0.01 and group["betas"] == (0.9, 0.99)
    write(1, 3, [0.8, 0.95, 1e-8, 0.005, 0.0], [1, 1, 0])
    write(1, 4, [0.8, 0.95, 1e-8, 0.0025, 0.0], [0, 0, 1])
    shard.use_hyper(shard.record(1, 3))
    assert group["lr"] == 0.005 and group["betas"] == (0.8, 0.95)
    shard.use_hyper(shard.record(1, 4))
    assert group["lr"] == 0.0025
    # Worker 0 sent none: its push runs with the job's (not with what worker 1's left in use).
    shard.use_hyper(shard.record(0, 4))
    assert group["lr"] == 0.01 and group["betas"] == (0.9, 0.99)
    write(0, 4, None, [1, 1, 1])  # a record for its gradients only: the job's hyperparameters
    shard.use_hyper(shard.record(1, 4))
    shard.use_hyper(shard.record(0, 4))
    assert group["lr"] == 0.01
    # Unit 1 holds b (gradient) and c: stepped; unit 0 holds a alone.
    assert shard.skipped([shard.record(1, 3)]) is None
    assert shard.skipped([shard.record(1, 4)]) == [{0}]
    assert shard.skipped([shard.record(1, 4), None]) is None  # the other push has every gradient
    write(0, 4, [0.8, 0.95, 1e-8, 0.0025, 0.0], [1, 0, 0])
    assert shard.skipped([shard.record(0, 4), shard.record(1, 4)]) is None
    write(0, 4, [0.8, 0.95, 1e-8, 0.0025, 0.0], [0, 0, 0])
    assert shard.skipped([shard.record(0, 4), shard.record(1, 4)]) == [{0}]


def test_init_refuses_timeouts_that_are_not_seconds(monkeypatch):
    """ps.init's timeouts bound every wait of the job: NaN, zero, a negative, infinity or a word
    is refused before the job is joined, naming the argument or the variable."""
    import rdmaflow
    from rdmaflow import ps

    for kw, name in [({"timeout": float("nan")}, "timeout"), ({"timeout": -1}, "timeout"),
                     ({"step_timeout": 0}, "step_timeout"), ({"step_timeout": float("inf")}, "step_timeout"),
                     ({"timeout": "60"}, "timeout")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=f"^{name} must be a positive, finite number"):
            ps.init(**kw)
    monkeypatch.setenv("RDMAFLOW_PS_TIMEOUT", "abc")
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"\$RDMAFLOW_PS_TIMEOUT must be a number"):
        ps.init()
    monkeypatch.setenv("RDMAFLOW_PS_TIMEOUT", "nan")
    with pytest.raises(rdmaflow.InvalidArgumentError, match=r"\$RDMAFLOW_PS_TIMEOUT must be a positive"):
        ps.init()


def test_roles_from_an_impossible_launcher_environment_are_refused(monkeypatch):
    """Ranks and sizes that cannot describe a job used to give impossible roles (worker 6 of 1,
    shard -2); each is refused naming its variables. Good environments give the usual roles."""
    import rdmaflow
    from rdmaflow.ps.context import Role, resolve_role

    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RDMAFLOW_SHARDS_PER_NODE",
             "RDMAFLOW_ROLE", "RDMAFLOW_ROLE_INDEX", "RDMAFLOW_NUM_SHARDS", "RDMAFLOW_NUM_WORKERS")

    def role(**env):
        for k in names:
            monkeypatch.delenv(k, raising=False)
        for k, v in env.items():
            monkeypatch.setenv(k, str(v))
        return resolve_role()

    for env, said in [({"RANK": 5, "WORLD_SIZE": 2}, r"\$RANK=5 is not in \[0, \$WORLD_SIZE=2\)"),
                      ({"RANK": -1, "WORLD_SIZE": 2}, r"\$RANK=-1"),
                      ({"RANK": 1, "WORLD_SIZE": 2, "LOCAL_RANK": 7, "LOCAL_WORLD_SIZE": 2}, r"\$LOCAL_RANK=7"),
                      ({"RANK": 1, "WORLD_SIZE": 2, "GROUP_RANK": 5}, r"\$GROUP_RANK=5 is not in \[0, 1\)"),
                      ({"RANK": 3, "WORLD_SIZE": 4, "LOCAL_WORLD_SIZE": 3}, r"\$LOCAL_WORLD_SIZE=3 does not divide"),
                      ({"RANK": 1, "WORLD_SIZE": 2, "RDMAFLOW_ROLE": "worker", "RDMAFLOW_ROLE_INDEX": 9,
                        "RDMAFLOW_NUM_SHARDS": 1, "RDMAFLOW_NUM_WORKERS": 1}, r"\$RDMAFLOW_ROLE_INDEX=9"),
                      ({"RDMAFLOW_ROLE": "shard", "RDMAFLOW_ROLE_INDEX": 0, "RDMAFLOW_NUM_SHARDS": 0,
                        "RDMAFLOW_NUM_WORKERS": -1}, "must both be at least 1"),
                      ({"RANK": 1, "WORLD_SIZE": 2, "RDMAFLOW_ROLE": "worker", "RDMAFLOW_ROLE_INDEX": 0,  # waited
                        "RDMAFLOW_NUM_SHARDS": 1, "RDMAFLOW_NUM_WORKERS": 2}, r"make 3 processes; \$WORLD_SIZE=2"),
                      ({"RANK": 1, "WORLD_SIZE": 2, "RDMAFLOW_SHARDS_PER_NODE": 0},
                       r"started without a parameter-server shard \(rdmaflow launch --shards-per-node 0"),
                      ({}, r"no launcher started it: run it with `rdmaflow launch --nproc-per-node 1 SCRIPT")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=said):
            role(**env)
    assert role(RANK=0, WORLD_SIZE=3) == Role("shard", 0, 1, 2, 0, 3)
    assert role(RANK=5, WORLD_SIZE=6, LOCAL_RANK=2, LOCAL_WORLD_SIZE=3, GROUP_RANK=1) == Role("worker", 3, 2, 4, 5, 6)
