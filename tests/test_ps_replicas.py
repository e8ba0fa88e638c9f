"""Replicated shards of a DistributedOptimizer in mode="sync" (rdmaflow/ps/dense_replica.py), in
real jobs of 2 workers x 2 shards over tcp whose c10d store this process serves (as the
launcher does with --shard-replicas, so that no shard serves it).

R = 2 and R = 1 train the same small MLP from the same data with Adam and a StepLR schedule
(the hyperparameters travel in the step records): the workers' final parameters must be equal
bit for bit, every primary must have replicated every step before replying, and each shard's
mirror of the other's units (weights and Adam's moments, applied by the backup's CPU from the
mean gradient the primary WRITEs into it) must hash as its primary's own state. A job asking
for replicas in a mode not built (async) must refuse with InvalidArgumentError.
"""
from __future__ import annotations

import json
import time

import pytest
from test_ps_kv import COMMON, Job

JOB_DEADLINE = 150.0
STEPS = 12

TRAIN = COMMON + """
R = @REPLICAS@
ctx = ps.init(shard_replicas=R, timeout=150)  # the machine may be loaded: the jobs start together
w = ctx.role.index
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
opt = torch.optim.Adam(model.parameters(), lr=0.01)

def body():
    dopt = ps.DistributedOptimizer(model, opt, mode=@MODE@, block_bytes=256)
    sched = torch.optim.lr_scheduler.StepLR(dopt, step_size=4, gamma=0.5)
    g = torch.Generator().manual_seed(100 + w)
    for _ in range(@STEPS@):
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)
        dopt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        dopt.step()
        sched.step()
    dopt.synchronize()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    dopt.close()
    report(error=None, params=params.double().tolist())

try:
    body()
except _core.RdmaflowError as e:
    report(error=f"{type(e).__name__}: {e}")
    sys.exit(3)
"""


def script(replicas: int, mode: str = "sync") -> str:
    return (TRAIN.replace("@REPLICAS@", str(replicas)).replace("@MODE@", repr(mode))
            .replace("@STEPS@", str(STEPS)))


def shard_stats(job: Job, s: int) -> dict:
    return json.loads(job.store.get(f"rdmaflow/ps/stats/shard/{s}"))


def test_dense_replicas_bit_identical(tmp_path):
    jobs = {r: Job(f"dense_r{r}", script(r), 2, 2, "tcp", tmp_path) for r in (1, 2)}
    refused = Job("dense_async", script(2, "async"), 1, 2, "tcp", tmp_path)
    try:
        deadline = time.monotonic() + JOB_DEADLINE
        for job in jobs.values():
            job.wait(deadline)
            bad = [r for r, p in enumerate(job.procs) if p.returncode != 0]
            assert not bad, f"ranks {bad} of job {job.name} failed:\n{job.output()}"
        one, two = (jobs[r].results() for r in (1, 2))
        for res in (*one, *two):
            assert res["error"] is None, res
        assert one[0]["params"] == one[1]["params"]
        assert [r["params"] for r in two] == [r["params"] for r in one]  # bit for bit (float32 as float64)
        stats = [shard_stats(jobs[2], s) for s in range(2)]
        for s, st in enumerate(stats):
            assert st["replication"]["steps"] == STEPS and not st["replication"]["dropped"], st
            other = stats[1 - s]
            assert other["mirrors"][str(s)] == st["digest"], (s, stats)  # the backup's mirror = its primary
        assert "digest" not in shard_stats(jobs[1], 0)  # R = 1: nothing of the replicas runs
        refused.wait(deadline)
        (res,) = refused.results()
        assert res["error"].startswith("InvalidArgumentError") and "mode='async' is not supported yet" in res["error"]
    finally:
        for job in (*jobs.values(), refused):
            job.kill()


if __name__ == "__main__":
    pytest.main([__file__, "-q"])
