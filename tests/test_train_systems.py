"""The processes of ``rdmaflow bench train``: ``python -m rdmaflow.bench._train_proc``.

Real jobs (mlp-tiny, 2 workers, 1 or 2 shards, a few iterations) of every system, started as
the harness starts them (torchrun's variables + ``RDMAFLOW_TRAIN_CFG``):

- every process exits 0, each worker prints exactly one valid ``RDMAFLOW_TRAIN_RESULT`` line
  and nothing else on stdout, shards print nothing;
- the synchronous systems (tensorpipe, grpc, rdmaflow, ddp) end with the parameters of
  single-process training on the concatenated batches with the same SGD (worker 0's
  ``"dump"``), and every worker's loss of every iteration is the reference's loss of that
  worker's batch (so every worker computed on the right weights at every step); ``local``
  equals single-process training on worker 0's batches;
- a bad configuration exits nonzero at once with a clear message; a worker whose peers never
  come exits nonzero within its timeout.

Every wait is bounded; every process group is killed at the end of its test.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import torch
from typing_extensions import Self

from rdmaflow._ucx import ucx_env
from rdmaflow.bench import models
from rdmaflow.bench import train_job as job
from rdmaflow.bench.processes import free_port
from rdmaflow.testing.stacks import stacks_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB_TIMEOUT = 90.0          # one job, start to end (2 loaded cores: startup dominates)
CFG_TIMEOUT = 30.0          # the processes' own bound on every wait
RTOL, ATOL = 1e-5, 1e-6     # float32, a few steps, sums in another order
RESULT_KEYS = {"system", "model", "worker", "times", "losses", "batch"}

BASE_CFG = {"model": "mlp-tiny", "batch": 4, "workers": 2, "warmup": 1, "iters": 3, "zero_copy": True,
            "overlap": True, "mode": "sync", "lr": 0.05, "seed": 5, "timeout": CFG_TIMEOUT, "threads": 1}
# (system, shards): both 1 and 2 shards are covered.
JOBS = [("local", 0), ("ddp", 0), ("tensorpipe", 2), ("grpc", 1), ("rdmaflow", 2)]


@pytest.fixture
def workdir():
    """A private directory (not pytest's tmp_path: concurrent pytest sessions of the same user
    prune each other's basetemp directories)."""
    import pathlib

    d = tempfile.mkdtemp(prefix="rdmaflow-train-test-")
    yield pathlib.Path(d)
    shutil.rmtree(d, ignore_errors=True)


def world_of(system: str, workers: int, shards: int) -> int:
    return 1 if system == "local" else workers if system == "ddp" else workers + shards


class Job:
    """The processes of one cell; ``with Job(...)`` kills what is left of them on exit."""

    def __init__(self, workdir, cfg: dict, world: int | None = None):
        self.dir = workdir / cfg["system"]
        self.dir.mkdir(exist_ok=True)
        self.cfg = cfg
        self.world = world_of(cfg["system"], cfg["workers"], cfg.get("shards", 0)) if world is None else world
        self.procs: list[tuple[subprocess.Popen, str]] = []

    def start(self, ranks=None, env_extra: dict | None = None) -> Job:
        port, secret = free_port(), secrets.token_hex(16)
        base = ucx_env("tcp")
        for k in list(base):
            if k.startswith(("RDMAFLOW_ROLE", "RDMAFLOW_NUM_", "TORCHELASTIC_")) or k in (
                    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "RDMAFLOW_HOST"):
                del base[k]
        for rank in range(self.world) if ranks is None else ranks:
            env = dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                       WORLD_SIZE=str(self.world), LOCAL_RANK=str(rank), RDMAFLOW_JOB_SECRET=secret,
                       RDMAFLOW_TRAIN_CFG=json.dumps(self.cfg), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                       **(env_extra or {}))
            with open(self.dir / f"out.{rank}", "w") as out, open(self.dir / f"err.{rank}", "w") as err:
                p = subprocess.Popen([sys.executable, "-m", "rdmaflow.bench._train_proc"], env=env, cwd=ROOT,
                                     stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
            self.procs.append((p, str(rank)))
        return self

    def wait(self, timeout: float = JOB_TIMEOUT) -> list[int]:
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p, _ in self.procs):
            if time.monotonic() > deadline:
                stacks = stacks_of([(f"rank {r}", p.pid) for p, r in self.procs if p.poll() is None])
                pytest.fail(f"{self.cfg['system']}: still running after {timeout:.0f} s\n" + self.logs() + stacks)
            time.sleep(0.05)
        return [p.returncode for p, _ in self.procs]

    def stdout(self, rank: int) -> str:
        return (self.dir / f"out.{rank}").read_text()

    def stderr(self, rank: int) -> str:
        return (self.dir / f"err.{rank}").read_text(errors="replace")

    def logs(self) -> str:
        return "\n".join(f"--- rank {r} (exit {p.poll()}):\n{self.stderr(int(r))[-3000:]}" for p, r in self.procs)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        for p, _ in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        for p, _ in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass


def reference(cfg: dict, workers: int):
    """Single-process training on the concatenation of the workers' batches, the same SGD;
    also each worker's loss at each step (the loss of its batch on the weights of that step)."""
    name = cfg["model"]
    model = models.build(name, seed=cfg["seed"])
    opt = torch.optim.SGD(model.parameters(), lr=cfg["lr"], momentum=0.9)
    loss_fn = models.loss_fn(name)
    losses = [[] for _ in range(workers)]
    for t in range(cfg["warmup"] + cfg["iters"]):
        batches = [job.make_batch(name, cfg["batch"], cfg["seed"], w, t) for w in range(workers)]
        with torch.no_grad():
            for w, (x, y) in enumerate(batches):
                losses[w].append(loss_fn(model(x), y).item())
        opt.zero_grad()
        loss_fn(model(torch.cat([b[0] for b in batches])), torch.cat([b[1] for b in batches])).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def check_results(j: Job, workers: int, shards: int) -> list[dict]:
    """Exit codes, stdout lines, the result lines' contents; returns the results by worker."""
    cfg, system = j.cfg, j.cfg["system"]
    rcs = j.wait()
    assert rcs == [0] * len(rcs), f"{system}: exit codes {rcs}\n" + j.logs()
    results = {}
    for rank in range(j.world):
        lines = j.stdout(rank).splitlines()
        is_shard = system in job.PS_SYSTEMS and rank < shards
        if is_shard:
            assert lines == [], f"{system} shard (rank {rank}) printed on stdout: {lines}"
            continue
        assert len(lines) == 1 and lines[0].startswith(job.RESULT_PREFIX), (
            f"{system} rank {rank}: stdout must be exactly one result line, got {lines}\n" + j.logs())
        r = json.loads(lines[0][len(job.RESULT_PREFIX):])
        assert set(r) == RESULT_KEYS, r
        w = rank - shards if system in job.PS_SYSTEMS else rank
        assert (r["system"], r["model"], r["worker"], r["batch"]) == (system, cfg["model"], w, cfg["batch"])
        assert len(r["times"]) == cfg["iters"] and all(isinstance(t, float) and 0 < t < 30 for t in r["times"]), r
        assert len(r["losses"]) == cfg["warmup"] + cfg["iters"] and all(math.isfinite(x) for x in r["losses"]), r
        results[w] = r
    assert sorted(results) == list(range(workers))
    return [results[w] for w in range(workers)]


def check_matches_reference(j: Job, results: list[dict], workers: int) -> None:
    system = j.cfg["system"]
    ref, ref_losses = reference(j.cfg, workers)
    init = models.build(j.cfg["model"], seed=j.cfg["seed"]).state_dict()
    got = torch.load(j.cfg["dump"])
    assert list(got) == list(ref)
    for name in ref:
        assert got[name].shape == ref[name].shape and got[name].dtype == ref[name].dtype
        assert not torch.allclose(got[name], init[name], rtol=RTOL, atol=1e-3), f"{system}: {name} did not move"
        err = (got[name] - ref[name]).abs().max().item()
        assert torch.allclose(got[name], ref[name], rtol=RTOL, atol=ATOL), (
            f"{system}: {name} differs from single-process training by {err:.3g}")
    for w, r in enumerate(results):
        assert r["losses"] == pytest.approx(ref_losses[w], rel=1e-5, abs=1e-6), (system, w, r["losses"], ref_losses[w])


def test_batches_are_a_function_of_seed_worker_iteration():
    a = job.make_batch("mlp-tiny", 4, 5, 1, 3)
    b = job.make_batch("mlp-tiny", 4, 5, 1, 3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for other in ((6, 1, 3), (5, 0, 3), (5, 1, 4)):
        assert not torch.equal(job.make_batch("mlp-tiny", 4, *other)[0], a[0])
    assert len({job.batch_seed(s, w, t) for s in range(3) for w in range(8) for t in range(50)}) == 3 * 8 * 50


def test_interfaces_face_the_master(monkeypatch):
    """gloo and TensorPipe are pointed at the interface of this host's address facing the
    master (processes in other network namespaces reach it); a value already set is kept."""
    assert job.interface_of("127.0.0.1") == "lo"
    assert job.interface_of("192.0.2.77") is None
    monkeypatch.delenv("RDMAFLOW_HOST", raising=False)
    monkeypatch.delenv("TP_SOCKET_IFNAME", raising=False)
    job.point_at_interface("127.0.0.1", "TP_SOCKET_IFNAME")
    assert os.environ["TP_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    job.point_at_interface("127.0.0.1", "GLOO_SOCKET_IFNAME")
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


@pytest.mark.parametrize("system,shards", JOBS, ids=[f"{s}-S{n}" for s, n in JOBS])
def test_system_trains_like_single_process(workdir, system, shards):
    workers = 1 if system == "local" else BASE_CFG["workers"]
    cfg = dict(BASE_CFG, system=system, workers=workers, shards=shards, dump=str(workdir / "final.pt"))
    with Job(workdir, cfg) as j:
        j.start()
        results = check_results(j, workers, shards)
        check_matches_reference(j, results, workers)


def test_bad_configuration_fails_clearly(workdir):
    cases = {
        "system": (dict(BASE_CFG, system="nope", shards=1), 3, "unknown system 'nope'"),
        "model": (dict(BASE_CFG, system="grpc", model="resnet9000", shards=1), 3, "unknown model 'resnet9000'"),
        "world": (dict(BASE_CFG, system="tensorpipe", shards=2), 3, "WORLD_SIZE is 3"),
        "mode": (dict(BASE_CFG, system="grpc", shards=1, mode="async"), 3, "synchronous"),
    }
    jobs = {}
    try:
        for name, (cfg, world, _) in cases.items():
            (workdir / name).mkdir()
            jobs[name] = Job(workdir / name, cfg, world=world).start(ranks=[world - 1])
        for name, j in jobs.items():
            assert j.wait(60) == [2], j.logs()
            assert j.stdout(cases[name][1] - 1) == ""
            last = j.stderr(cases[name][1] - 1).strip().splitlines()[-1]
            assert last.startswith("rdmaflow bench train: bad configuration:") and cases[name][2] in last, last
    finally:
        for j in jobs.values():
            j.__exit__()


def test_missing_peers_end_in_bounded_time(workdir):
    """A grpc worker whose store and shards never come: nonzero exit, within its timeout."""
    cfg = dict(BASE_CFG, system="grpc", shards=1, timeout=3.0)
    with Job(workdir, cfg) as j:
        t0 = time.monotonic()
        j.start(ranks=[1])
        rcs = j.wait(60)
        assert rcs[0] not in (0, None), j.logs()
        assert "rdmaflow bench train: grpc worker0 (rank 1) failed" in j.stderr(1), j.logs()
        assert j.stdout(1) == ""
        assert time.monotonic() - t0 < 45
