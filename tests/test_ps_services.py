"""One parameter-server job, several services: a DistributedOptimizer beside a KVStore, served by
the same shard processes (rdmaflow/ps/services.py), over UCX tcp.

Two jobs of 2 workers x 2 shards run together (tests/ps_job.py): one trains a small MLP
through DistributedOptimizer while it pushes and pulls a KVStore table in the same loop, the
other trains the same MLP alone. The MLP's parameters must be bit-identical, and the table's
values exactly the sums every worker pushed. A third job (1 x 1) has a KVStore handler that
raises: the KVStore and the DistributedOptimizer of its worker both get the reason.
"""
from __future__ import annotations

import json
import textwrap

import pytest
from ps_job import PSJob

SCRIPT = """
import json, sys, torch
import rdmaflow.ps as ps

mixed = sys.argv[1] == "mixed"
ctx = ps.init(services=("optimizer", "kv") if mixed else None)
w, nw = ctx.role.index, ctx.role.num_workers
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
opt = ps.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              policy="variable")
ROWS, DIM, STEPS = 40, 4, 25
if mixed:
    kv = ps.KVStore(range(ROWS), [(DIM,)] * ROWS, torch.float32)

def ids_of(v, step):  # every worker can tell which rows worker v pushes at a step
    g = torch.Generator().manual_seed(1000 * v + step)
    return torch.randint(0, ROWS, (6,), generator=g).unique()

g = torch.Generator().manual_seed(1 + w)
w_true = torch.randn(8, 1, generator=torch.Generator().manual_seed(7))
seen_own = True
for step in range(STEPS):
    x = torch.randn(32, 8, generator=g)
    y = x @ w_true
    if mixed:
        ids = ids_of(w, step)
        before = kv.wait(kv.pull(ids)).view(-1, DIM)
        kv.push(ids, torch.full((len(ids) * DIM,), float(w + 1)))
        after = kv.wait(kv.pull(ids)).view(-1, DIM)   # read-your-writes: at least our push more
        seen_own &= bool((after - before >= w + 1).all())
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
opt.synchronize()
res = {"worker": w, "params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
       "loss": loss.item()}
if mixed:
    kv.barrier()
    want = torch.zeros(ROWS, DIM)
    for v in range(nw):
        for step in range(STEPS):
            want[ids_of(v, step)] += v + 1
    got = kv.wait(kv.pull(torch.arange(ROWS))).view(ROWS, DIM)
    res.update(kv_exact=bool(torch.equal(got, want)), seen_own=seen_own, kv_total=float(got.sum()))
    kv.close()
opt.close()
print("RESULT " + json.dumps(res), flush=True)
"""


# 1 worker x 1 shard, both services; the KVStore's handler raises on the shard. The worker's
# KVStore and then its DistributedOptimizer must both learn why the job stopped.
FAILING = """
import json, sys, torch
import rdmaflow.ps as ps
from rdmaflow import _core

def handler(key, stored, pushed):
    raise ValueError("no such row")

ctx = ps.init(services=("optimizer", "kv"), kv_handler=handler)
model = torch.nn.Linear(4, 1)
opt = ps.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
kv = ps.KVStore([0], [(2,)])
errors = {}
try:
    kv.wait(kv.push([0], [torch.ones(2)]))
    kv.wait(kv.pull([0]))
except _core.RdmaflowError as e:
    errors["kv"] = f"{type(e).__name__}: {e}"
try:
    for _ in range(3):
        opt.zero_grad()
        model(torch.ones(2, 4)).sum().backward()
        opt.step()
    opt.synchronize()
except _core.RdmaflowError as e:
    errors["optimizer"] = f"{type(e).__name__}: {e}"
print("RESULT " + json.dumps(dict(errors, worker=0)), flush=True)
sys.exit(3)
"""


def results(job: PSJob, count: int) -> dict:
    found = [json.loads(ln.split("RESULT ", 1)[1]) for w in range(count)
             for ln in job.worker_output(w).splitlines() if ln.startswith("RESULT ")]
    assert len(found) == count, job.output()
    return {r["worker"]: r for r in found}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Every job of this file, started together (they spend most of their time importing torch)."""
    tmp = tmp_path_factory.mktemp("services")
    (tmp / "mixed.py").write_text(textwrap.dedent(SCRIPT))
    (tmp / "failing.py").write_text(textwrap.dedent(FAILING))
    started = {}
    try:
        started["mixed"] = PSJob("mixed", [str(tmp / "mixed.py"), "mixed"], 2, 2, "tcp", tmp)
        started["alone"] = PSJob("alone", [str(tmp / "mixed.py"), "alone"], 2, 2, "tcp", tmp)
        started["failing"] = PSJob("failing", [str(tmp / "failing.py")], 1, 1, "tcp", tmp)
        yield started
    finally:
        for job in started.values():
            job.kill()


def test_a_job_serves_a_distributed_optimizer_beside_a_kvstore(jobs):
    for name in ("mixed", "alone"):
        assert jobs[name].wait() == [0] * 4, jobs[name].output()
    mixed, alone = results(jobs["mixed"], 2), results(jobs["alone"], 2)
    for w in (0, 1):
        assert mixed[w]["params"] == alone[w]["params"], "the MLP trained beside a KVStore differs"
        assert mixed[w]["kv_exact"] and mixed[w]["seen_own"], mixed[w]
    assert mixed[0]["params"] == mixed[1]["params"]  # sync mode: one model
    assert mixed[0]["kv_total"] > 0


def test_a_failing_service_stops_the_others_with_its_reason(jobs):
    job = jobs["failing"]
    assert job.wait() == [1, 3], job.output()  # the shard fails, the worker reports and exits 3
    errors = results(job, 1)[0]
    why = "the kv handler raised on key 0 (push from worker 0): ValueError('no such row')"
    assert errors.get("kv", "").startswith("WorkerFailure: ") and why in errors["kv"], job.output()
    assert errors.get("optimizer", "").startswith("WorkerFailure: the job was aborted: ") and why in errors["optimizer"], \
        job.output()
    shard = job.logs[0].read_text()
    assert shard.count("shard 0 failed: ") == 1 and why in shard, job.output()  # the shard says it, once
