"""One parameter-server job, several services: a DistributedOptimizer beside a KVStore, served by
the same shard processes (rdmaflow/ps/services.py), over UCX tcp.

Two jobs of 2 workers x 2 shards run together through ``rdmaflow launch``: one trains a small MLP
through DistributedOptimizer while it pushes and pulls a KVStore table in the same loop, the
other trains the same MLP alone. The MLP's parameters must be bit-identical, and the table's
values exactly the sums every worker pushed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from rdmaflow._ucx import ucx_env
from rdmaflow.bench.processes import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def launch(script: str, mode: str) -> subprocess.Popen:
    env = ucx_env("tcp", {k: v for k, v in os.environ.items() if not k.startswith(("RDMAFLOW_", "TORCHELASTIC_"))})
    env.update(OMP_NUM_THREADS="1", RDMAFLOW_PS_TIMEOUT="90", RDMAFLOW_PS_STEP_TIMEOUT="90")
    return subprocess.Popen([sys.executable, "-m", "rdmaflow", "launch", "--master-port", str(free_port()),
                             "--nproc-per-node", "2", "--shards-per-node", "2", script, mode], cwd=ROOT, env=env,
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def results(p: subprocess.Popen, timeout: float = 150) -> dict:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, _ = p.communicate()
        raise AssertionError(f"the job did not finish in {timeout} s:\n{out[-4000:]}") from None
    assert p.returncode == 0, out[-4000:]
    found = [json.loads(ln.split("RESULT ", 1)[1]) for ln in out.splitlines() if "RESULT " in ln]
    assert len(found) == 2, out[-4000:]
    return {r["worker"]: r for r in found}


def test_a_job_serves_a_distributed_optimizer_beside_a_kvstore(tmp_path):
    script = tmp_path / "mixed.py"
    script.write_text(textwrap.dedent(SCRIPT))
    jobs = {mode: launch(str(script), mode) for mode in ("mixed", "alone")}
    try:
        mixed, alone = results(jobs["mixed"]), results(jobs["alone"])
    finally:
        for p in jobs.values():
            if p.poll() is None:
                os.killpg(p.pid, 9)
    for w in (0, 1):
        assert mixed[w]["params"] == alone[w]["params"], "the MLP trained beside a KVStore differs"
        assert mixed[w]["kv_exact"] and mixed[w]["seen_own"], mixed[w]
    assert mixed[0]["params"] == mixed[1]["params"]  # sync mode: one model
    assert mixed[0]["kv_total"] > 0
