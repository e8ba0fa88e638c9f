"""rdmaflow as a torch.distributed backend ("rdmaflow"): jobs of real processes over UCX tcp and sm,
each running every op on the rdmaflow group and on a gloo group of the same ranks side by side
(tests/distributed_jobs/job.py says what each scenario checks).

- every op's results equal gloo's: dtypes, 0-element and 0-dim tensors, shapes that change,
  direct and ring sizes, tags, recv from any source, a sub-group, the wrong-size and the
  unsupported-op errors (3 ranks);
- DistributedDataParallel and torch.distributed.pipelining GPipe train to gloo's parameters;
- a rank that dies makes a recv from it raise naming it, within the group's timeout;
- under torchrun with no RDMAFLOW_JOB_SECRET, the ranks agree a secret through the store;
- the backend registers on import, and refuses a device-backend string that names another
  backend beside it.
"""
from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time

import pytest
from conftest import HERE

from rdmaflow._ucx import ucx_env
from rdmaflow.bench.processes import free_port

JOB = os.path.join(HERE, "distributed_jobs", "job.py")
JOB_TIMEOUT = 150.0  # a loaded 2-core machine; an idle one takes a fraction of it


def run_job(tmp_path, scenario: str, world: int, transport: str, timeout: float = 60.0,
            expect_rc: dict | None = None) -> list[str]:
    """Runs ``world`` ranks of the job; returns each rank's output. Every rank must exit 0
    (or as ``expect_rc`` says) within JOB_TIMEOUT."""
    port, secret = free_port(), secrets.token_hex(16)
    procs, logs = [], []
    for rank in range(world):
        env = ucx_env(transport)
        for k in ("TORCHELASTIC_USE_AGENT_STORE", "RDMAFLOW_HOST", "LOCAL_RANK", "GROUP_RANK"):
            env.pop(k, None)
        env.update(RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   RDMAFLOW_JOB_SECRET=secret, RDMAFLOW_SAME_HOST="auto", OMP_NUM_THREADS="1",
                   PYTHONUNBUFFERED="1", DIST_TEST_CONFIG=json.dumps({"scenario": scenario, "timeout": timeout}))
        log = tmp_path / f"{scenario}-{transport}-rank{rank}.log"
        logs.append(log)
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, JOB], env=env, stdout=f, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          cwd=os.path.dirname(HERE)))
    deadline = time.monotonic() + JOB_TIMEOUT
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    outs = [log.read_text(errors="replace") for log in logs]
    report = "\n".join(f"--- rank {r} (rc {p.returncode}) ---\n{o[-4000:]}" for r, (p, o) in
                       enumerate(zip(procs, outs)))
    for rank, p in enumerate(procs):
        want = (expect_rc or {}).get(rank, 0)
        assert p.returncode == want, f"rank {rank} exited {p.returncode}, expected {want}\n{report}"
    return outs


@pytest.mark.parametrize("transport", ["tcp", "sm"])
def test_every_op_equals_gloo(tmp_path, transport):
    outs = run_job(tmp_path, "ops", 3, transport)
    assert all("OK ops" in o for o in outs)


@pytest.mark.parametrize("transport", ["tcp", "sm"])
def test_ddp_trains_like_gloo(tmp_path, transport):
    outs = run_job(tmp_path, "ddp", 2, transport)
    assert all("OK ddp" in o for o in outs)


@pytest.mark.parametrize(("transport", "world"), [("tcp", 3), ("sm", 2)])
def test_pipelining_gpipe_trains_like_gloo(tmp_path, transport, world):
    outs = run_job(tmp_path, "pipe", world, transport)
    assert all("OK pipe" in o for o in outs)


@pytest.mark.parametrize("transport", ["tcp", "sm"])
def test_a_dead_peer_raises_naming_it(tmp_path, transport):
    timeout = 20.0
    outs = run_job(tmp_path, "dead", 2, transport, timeout=timeout, expect_rc={1: 3})
    line = next(ln for ln in outs[0].splitlines() if ln.startswith("DEAD_PEER_ERROR"))
    assert "rank 1" in line
    took = float(line.split()[2])
    assert took < timeout / 2, line  # noticed, not the group's timeout running out


def test_import_registers_the_backend_and_mixed_strings_are_refused(monkeypatch):
    import torch.distributed as dist

    import rdmaflow
    import rdmaflow.distributed

    assert "RDMAFLOW" in dist.Backend._plugins
    monkeypatch.setenv("RDMAFLOW_JOB_SECRET", secrets.token_hex(16))
    with pytest.raises(rdmaflow.InvalidArgumentError, match="C\\+\\+ c10d backend"):
        dist.init_process_group("cpu:rdmaflow,cuda:gloo", store=dist.HashStore(), rank=0, world_size=1)
    if dist.is_initialized():
        dist.destroy_process_group()


def test_torchrun_without_a_job_secret(tmp_path):
    env = ucx_env("tcp")
    for k in [k for k in env if k.startswith(("TORCHELASTIC_", "RDMAFLOW_JOB_SECRET"))] + [
            "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "RDMAFLOW_HOST"]:
        env.pop(k, None)
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DIST_TEST_CONFIG=json.dumps({"scenario": "smoke"}))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", JOB],
                         env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=os.path.dirname(HERE),
                         check=False)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    assert out.stdout.count("OK smoke") == 2, out.stdout[-4000:]


def test_a_group_of_one_rank(monkeypatch):
    """World size 1 in this process: every op is a copy or nothing, and recv from any source
    refuses to wait forever."""
    import torch
    import torch.distributed as dist

    import rdmaflow
    import rdmaflow.distributed  # registers "rdmaflow"

    monkeypatch.setenv("RDMAFLOW_JOB_SECRET", secrets.token_hex(16))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("rdmaflow", store=dist.HashStore(), rank=0, world_size=1)
    try:
        assert dist.get_backend() == rdmaflow.distributed.BACKEND
        t = torch.arange(6.0)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        dist.broadcast(t, 0)
        dist.reduce(t, 0)
        assert torch.equal(t, torch.arange(6.0))
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, t)
        dist.reduce_scatter_tensor(out, t)
        dist.all_to_all_single(out, t)
        assert torch.equal(out, t)
        got = [None]
        dist.all_gather_object(got, {"a": 1})
        assert got == [{"a": 1}]
        dist.barrier()
        with pytest.raises(rdmaflow.InvalidArgumentError, match="any source"):
            dist.recv(torch.empty(1))
        with pytest.raises(rdmaflow.InvalidArgumentError, match="is on meta"):
            dist.all_reduce(torch.empty(1, device="meta"))
    finally:
        dist.destroy_process_group()
