"""examples/ctr.py, the click-through-rate model: its embeddings in a SparseTable and its MLP
through DistributedOptimizer in one job (2 workers x 2 shards, UCX shared memory: the tables'
pulls are mapped gathers), against the same model trained in one process with plain torch on
the same samples and seed (--single)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

from rdmaflow._ucx import ucx_env
from rdmaflow.bench.processes import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--steps", "40", "--batch", "128", "--raw-ids", "2000", "--log-every", "0", "--tail", "10"]


def results(p: subprocess.Popen, count: int, timeout: float = 150) -> list[dict]:
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        out, _ = p.communicate()
        raise AssertionError(f"{p.args} did not finish in {timeout} s:\n{out[-4000:]}") from None
    assert p.returncode == 0, out[-4000:]
    found = [json.loads(ln.split("ctr result: ", 1)[1]) for ln in out.splitlines() if "ctr result: " in ln]
    assert len(found) == count, out[-4000:]
    return found


def test_the_ctr_job_learns_as_the_single_process_model_does():
    env = ucx_env("sm", {k: v for k, v in os.environ.items() if not k.startswith(("RDMAFLOW_", "TORCHELASTIC_"))})
    env.update(OMP_NUM_THREADS="1", RDMAFLOW_PS_TIMEOUT="90", RDMAFLOW_PS_STEP_TIMEOUT="90")
    common = {"cwd": ROOT, "env": env, "stdin": subprocess.DEVNULL, "stdout": subprocess.PIPE,
              "stderr": subprocess.STDOUT, "text": True, "start_new_session": True}
    job = subprocess.Popen([sys.executable, "-m", "rdmaflow", "launch", "--master-port", str(free_port()),
                            "--nproc-per-node", "2", "--shards-per-node", "2", "examples/ctr.py", *SMALL], **common)
    one = subprocess.Popen([sys.executable, "examples/ctr.py", "--single", "--workers", "2", *SMALL], **common)
    try:
        workers = results(job, 2)
        (single,) = results(one, 1)
    finally:
        for p in (job, one):
            if p.poll() is None:
                os.killpg(p.pid, 9)
    # Equal batches: the job's loss is the mean of its workers', the single model's of their union.
    loss = sum(r["loss"] for r in workers) / 2
    first = sum(r["first_loss"] for r in workers) / 2
    assert abs(loss - single["loss"]) <= 0.05 * single["loss"], (workers, single)
    assert abs(first - single["first_loss"]) <= 1e-5, (workers, single)  # the same samples, the same start
    assert loss < first - 0.03, (workers, single)  # it learned
