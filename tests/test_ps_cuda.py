"""The parameter server on CUDA: real jobs of shard and worker processes, run
where a CUDA device is visible and skipped, with the reason, elsewhere.

- A PS run of FCN-5 with its worker on CUDA trains 100 steps, and its loss matches the same run
  (same seed, same data, Adam on the shards) with the worker on the CPU, step by step.
- The same with the shards on the GPU too (``shard_device="cuda"``).
- A CUDA worker keeps its parameters and gradients in its device's GPU arena (registered GPU
  memory), and backward accumulates straight into the gradient send buffer.

Three jobs run, all at once (a module fixture), each of one worker and one shard:

==================  ======  =====  ==========================================================
job                 worker  shard  what moves how
==================  ======  =====  ==========================================================
``cpu``             CPU     CPU    the reference; over shared memory ("sm")
``cuda``            CUDA    CPU    gradients WRITten from GPU memory into the shard's host
                                   memory; weights copied into the GPU from the host copy the
                                   shard writes (UCX's CUDA transports: "cuda")
``cuda_gpu_shard``  CUDA    CUDA   gradients GPU to GPU; weights from the shard's GPU memory
                                   into the worker's host copy, then into its GPU
==================  ======  =====  ==========================================================

Jobs use tests/ps_jobs/train_fcn5.py and the Job helper of test_ps.py.
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch
from test_ps import JOBS, Job

from rdmaflow._ucx import ucx_env

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device is visible (torch.cuda.is_available() is False); "
           "the parameter server's GPU workers and shards are tested on a host with an NVIDIA GPU")

FCN5 = os.path.join(JOBS, "train_fcn5.py")
STEPS = 100
# Adam at 1e-4 over 4 fixed mini-batches of 16: FCN-5's loss falls from 2.23 to 0.73 in 100
# steps (measured on the CPU), so the runs are compared along a real learning curve.
CFG = {"steps": STEPS, "batch": 16, "batches": 4, "seed": 3, "lr": 1e-4}
# name -> (the worker's device, the shards' device, the UCX transports)
RUNS = {"cpu": ("cpu", "cpu", "sm"), "cuda": ("cuda", "cpu", "cuda"), "cuda_gpu_shard": ("cuda", "cuda", "cuda")}
# Tolerances. Every run is float32 (TF32 off) with the same model, data and optimizer; what
# differs is the order in which cuBLAS and the CPU's BLAS sum FCN-5's 4096-long dot products (and
# the GPU's Adam kernels), a relative error of order sqrt(4096) * 6e-8 = 4e-6 per matmul. On the
# CPU, float32 and float64 runs of these 100 steps differ by at most 6e-7 relative per step (and
# 1.3e-6 on a run that overfits to a loss of 0.04), so this training does not amplify rounding.
# 1e-3 on the final loss is over 100 times that; 1e-2 on every step leaves room for an early
# step's larger swing. A PS bug (a gradient pushed before backward finished, a stale or
# half-copied weight, a chunk in the wrong place) moves the loss far more: one step of this
# training changes it by 1e-2 or more.
FINAL_RTOL = 1e-3
STEP_RTOL = 1e-2
JOB_TIMEOUT = 240.0  # all three jobs together; expected well under a minute on a 16-core GPU host


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """All three jobs, at the same time: each one's worker result and shard statistics, or why
    it failed."""
    tmp = tmp_path_factory.mktemp("ps_cuda")
    threads = str(max(1, (os.cpu_count() or 4) // 4))
    out = {}
    with contextlib.ExitStack() as stack:
        jobs = {}
        for name, (device, shard_device, transport) in RUNS.items():
            j = stack.enter_context(Job(tmp, dict(CFG, device=device, shard_device=shard_device), name))
            # The CPU worker computes with a quarter of the cores, and each CPU shard's Adam too.
            extra = {"RDMAFLOW_SHARD_THREADS": threads}
            if device == "cpu":
                extra["OMP_NUM_THREADS"] = threads
            j.start_local(1, 1, script=FCN5, transport_env=ucx_env(transport), extra=extra)
            jobs[name] = j
        for name, j in jobs.items():
            rcs = j.wait(JOB_TIMEOUT)
            if all(rc == 0 for rc in rcs.values()):
                out[name] = dict(j.worker_result(0), shard=j.shard_stats(0))
            else:
                out[name] = {"failed": f"exit codes {rcs}\n" + j.logs()}
    return out


def result(runs: dict, name: str) -> dict:
    r = runs[name]
    if "failed" in r:
        pytest.fail(f"the {name} job failed: {r['failed']}")
    assert r["shard"]["steps"] == STEPS, r["shard"]
    assert len(r["losses"]) == STEPS
    times = sorted(r["times"])
    print(f"{name}: final loss {r['losses'][-1]:.6f}, median step {1e3 * times[len(times) // 2]:.1f} ms")
    return r


def assert_losses_match(runs: dict, name: str) -> None:
    cpu, gpu = result(runs, "cpu"), result(runs, name)
    assert cpu["device"] == "cpu" and gpu["device"].startswith("cuda"), (cpu["device"], gpu["device"])
    a, b = cpu["losses"], gpu["losses"]
    assert a[-1] < 0.5 * a[0], f"the CPU run did not train: {a[0]:.4f} -> {a[-1]:.4f}"
    worst = max(range(STEPS), key=lambda t: abs(b[t] - a[t]) / abs(a[t]))
    assert abs(b[worst] - a[worst]) <= STEP_RTOL * abs(a[worst]), (
        f"{name}: step {worst + 1}'s loss is {b[worst]:.6f}, {a[worst]:.6f} on the CPU")
    assert abs(b[-1] - a[-1]) <= FINAL_RTOL * abs(a[-1]), (
        f"{name}: final loss {b[-1]:.6f}, {a[-1]:.6f} on the CPU")


def test_cuda_worker_matches_cpu_run(runs):
    """FCN-5, 100 steps of a PS job with its worker on CUDA and its shard on the CPU: every
    step's loss matches the same job with the worker on the CPU, and the job trained."""
    assert_losses_match(runs, "cuda")


def test_gpu_shards_match_cpu_run(runs):
    """The same with the shard on the GPU as well (shard_device="cuda")."""
    assert_losses_match(runs, "cuda_gpu_shard")


@pytest.mark.parametrize("name", ["cuda", "cuda_gpu_shard"])
def test_cuda_worker_grads_live_in_registered_gpu_memory(runs, name):
    """On every step, after zero_grad and after backward, each parameter and its gradient lie
    inside the worker's GPU arena (a registered region of GPU memory), and backward accumulated
    into the gradient buffer in place: it is the send buffer."""
    gpu = result(runs, name)
    assert gpu["region_cuda_device"] is not None and gpu["region_cuda_device"] >= 0, gpu["region_cuda_device"]
    assert gpu["grad_device"].startswith("cuda"), gpu["grad_device"]
    assert gpu["outside"] == [], "\n".join(gpu["outside"])
