"""Training features of the parameter server: overlap, worker failure, checkpoints.

- Overlap (pushes during backward, weights delivered chunk by chunk under the next forward)
  gives exactly the parameters of the plain synchronous path, with and without zero copy.
- Asynchronous overlap (buffer switching) trains, and adaptive pulling delays the pull of a
  worker whose computation is long (the "bubble" is counted, never timed in an assertion).
- A worker SIGKILLed mid-training: the others finish the job (min_workers), the shards name it.
- A job killed mid-training and resumed from its latest checkpoint ends with the parameters
  and optimizer state of an uninterrupted job, bit for bit.
- The memory layout of CUDA workers and GPU shards, emulated in host memory (the GPU runs
  themselves are in test_ps_cuda.py).

Jobs use tests/ps_jobs/train.py and the Job helper of test_ps.py.
"""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
from test_ps import (
    DETECT_TIMEOUT,
    JOBS,
    TRAIN,
    Job,
    assert_matches_reference,
    async_cfg,
    eval_loss,
    job,
    reference,
    sync_cfg,
)

from rdmaflow.ps import checkpoint
from rdmaflow.ps.worker import log_line

# Chunks of 256 bytes: the tiny test model's weights arrive in many chunks (MAX_CHUNKS).
CHUNKS = {"RDMAFLOW_PS_CHUNK_BYTES": "256"}


def _params(j: Job, w: int) -> dict[str, torch.Tensor]:
    return j.worker_result(w)["params"]


def test_overlap_equals_plain_sync(tmp_path):
    """The same job with overlap off, on, and on without zero copy: identical parameters, and
    those of single-process training."""
    results = {}
    for name, extra in (("plain", {"overlap": False}), ("overlap", {"overlap": True}),
                        ("overlap_copy", {"overlap": True, "zero_copy": False})):
        cfg = dict(sync_cfg("block", "sgd", steps=6), **extra)
        with Job(tmp_path, cfg, name) as j:
            j.start_local(2, 2, extra=CHUNKS)
            j.check_ok(j.wait())
            assert_matches_reference(j, 2, 2)
            results[name] = [_params(j, w) for w in range(2)]
    for name in ("overlap", "overlap_copy"):
        for w in range(2):
            for k, v in results["plain"][w].items():
                assert torch.equal(results[name][w][k], v), f"{name}: worker {w}'s {k} differs from the plain path"


@pytest.mark.parametrize("read,zero_copy", [("state_dict", True), ("state_dict", False), ("synchronize", False)])
def test_weights_saved_right_after_the_last_step_are_the_trained_ones(tmp_path, read, zero_copy):
    """With overlap, step() returns before the step's weights land. A worker saves right after
    the last step(), before close(): ``torch.save(model.state_dict())`` (a state-dict pre-hook
    waits), or the parameters read directly after ``opt.synchronize()``; what it saved equals
    the parameters after close(). Without zero copy the parameters are a copy that only a wait
    refreshes, so a save that did not wait would hold the previous step's weights every time."""
    cfg = dict(sync_cfg("block", "sgd", steps=4), overlap=True, zero_copy=zero_copy, after_last_step=read)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 1, extra=CHUNKS)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 1)
        for w in range(2):
            saved = torch.load(j.dir / f"state{w}.pt")
            final = _params(j, w)
            assert list(saved) == list(final)
            for k, v in final.items():
                assert torch.equal(saved[k], v), f"worker {w}'s saved {k} is not the trained one ({read})"


def test_lr_schedulers_take_the_distributed_optimizer(tmp_path):
    """``StepLR(opt)`` and ``CosineAnnealingLR(opt)`` on the DistributedOptimizer itself, as
    users write them: the lr they set reaches the wrapped optimizer, step by step as on a torch
    optimizer, and the shards train with it (the parameters are those of single-process
    training under the same schedule, which differ from those without it)."""
    cfg = dict(sync_cfg("block", "sgd", steps=5), wrapper_schedule=True)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 1)
        j.check_ok(j.wait())
        assert_matches_reference(j, 2, 1)
        plain_opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=cfg["lr"])
        schedulers, want = job.make_schedulers(plain_opt), []
        for _ in range(cfg["steps"]):
            plain_opt.step()
            for sch in schedulers:
                sch.step()
            want.append(plain_opt.param_groups[0]["lr"])
        assert len(set(want)) == len(want)  # a new lr at every step
        for w in range(2):
            assert j.worker_result(w)["lrs"] == pytest.approx(want, rel=1e-12)
        # Its optimizer state is on the shards: opt.state_dict() says so instead of returning none.
        refused = j.worker_result(0)["state_refused"]
        assert refused.startswith("InvalidArgumentError") and "lives on the shards" in refused, refused
    plain = reference(dict(cfg, wrapper_schedule=False), 2)
    scheduled = reference(cfg, 2)
    assert any(not torch.allclose(plain[k], scheduled[k], rtol=1e-3, atol=1e-4) for k in plain)


def test_async_overlap_adapts_the_pull(tmp_path):
    """Buffer switching with a slow computation: the job trains, and the workers learn to
    request their pulls late (a positive bubble) instead of right after the push."""
    cfg = dict(async_cfg("async"), step_delay=0.25, steps=20, overlap=True)
    cfg.pop("slow", None)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 2)
        j.check_ok(j.wait())
        initial = eval_loss(cfg, dict(job.make_model(cfg["seed"]).named_parameters()))
        for w in range(2):
            res = j.worker_result(w)
            assert res["steps"] == cfg["steps"]
            assert eval_loss(cfg, res["params"]) < initial / 4
            bubbles = res["bubbles"]
            assert len(bubbles) == cfg["steps"]
            late = sorted(bubbles[5:])[len(bubbles[5:]) // 2]
            assert late > 0.0, f"worker {w} never delayed its pull: bubbles {bubbles}"


def test_worker_death_is_survived(tmp_path):
    """3 workers, min_workers=2: worker 2 SIGKILLs itself after step 4; the shards go on with
    workers 0 and 1, which finish every step; the shards record the death."""
    cfg = dict(sync_cfg("block", "sgd", steps=12), min_workers=2, die={"worker": 2, "step": 4},
               step_delay=0.05)
    with Job(tmp_path, cfg) as j:
        j.start_local(3, 2)
        rcs = j.wait()
        assert rcs["worker2"] != 0, rcs
        assert all(rc == 0 for n, rc in rcs.items() if n != "worker2"), f"exit codes {rcs}\n" + j.logs()
        initial = eval_loss(cfg, dict(job.make_model(cfg["seed"]).named_parameters()))
        for w in range(2):
            res = j.worker_result(w)
            assert res["steps"] == cfg["steps"]
            assert eval_loss(cfg, res["params"]) < initial
        p0, p1 = _params(j, 0), _params(j, 1)
        assert all(torch.equal(p0[k], p1[k]) for k in p0), "the survivors ended with different parameters"
        for s in range(2):
            st = j.shard_stats(s)
            assert st["dead"] == [2], st
            assert st["applied"][:2] == [cfg["steps"]] * 2, st
            assert re.search(r"worker 2 at \S+ died .*going on with the 2 remaining workers",
                             j.proc(f"shard{s}").output()), j.logs()


def test_worker_death_below_minimum_ends_the_job(tmp_path):
    """min_workers=2 of 2: the death of one ends the job with an error naming the minimum."""
    cfg = dict(sync_cfg("block", "sgd", steps=100000), min_workers=2, die={"worker": 1, "step": 3},
               step_delay=0.02)
    with Job(tmp_path, cfg) as j:
        j.start_local(2, 1)
        rcs = j.wait(DETECT_TIMEOUT + 30)
        assert all(rc != 0 for rc in rcs.values()), rcs
        assert re.search(r"worker 1 at \S+ died.*fewer than min_workers=2", j.proc("shard0").output()), j.logs()


def test_resume_restores_parameters_and_optimizer_state(tmp_path):
    """Job A trains 8 steps uninterrupted (checkpoints every 2). Job B is SIGKILLed during
    step 6, then resumed (RDMAFLOW_RESUME=1) from its latest complete checkpoint and trained to
    step 8. B ends with A's parameters, and the shards' final checkpoints hold the same
    weights and optimizer state, bit for bit."""
    steps = 8
    base = dict(sync_cfg("block", "adam", steps=steps), checkpoint_every=2)
    a_dir, b_dir = str(tmp_path / "ckpt_a"), str(tmp_path / "ckpt_b")
    with Job(tmp_path, dict(base, checkpoint_dir=a_dir), "a") as ja:
        ja.start_local(2, 2)
        ja.check_ok(ja.wait())
        final_a = _params(ja, 0)
    assert checkpoint.steps(a_dir, 2) == [2, 4, 6, 8]

    with Job(tmp_path, dict(base, checkpoint_dir=b_dir, step_delay=0.3), "b1") as jb:
        jb.start_local(2, 2)
        jb.wait_output("worker0", r"worker 0 step 5\b")
        for p in jb.procs:
            p.kill()
    latest = checkpoint.latest(b_dir, 2)
    assert latest == 4, checkpoint.steps(b_dir, 2)
    # What was saved at step 4 is what the uninterrupted job had at step 4.
    for s in range(2):
        fp = checkpoint.load(a_dir, 4, s, 2, torch.load(checkpoint.shard_file(a_dir, 4, s, 2))["fingerprint"])
        got = torch.load(checkpoint.shard_file(b_dir, 4, s, 2))
        assert torch.equal(got["weights"], fp["weights"])

    with Job(tmp_path, dict(base, checkpoint_dir=b_dir), "b2") as jr:
        jr.start_local(2, 2, extra={"RDMAFLOW_RESUME": "1"})
        jr.check_ok(jr.wait())
        res = jr.worker_result(0)
        assert res["start"] == latest and res["steps"] == steps
        for k, v in final_a.items():
            assert torch.equal(res["params"][k], v), f"{k} differs from the uninterrupted job's"
    for s in range(2):
        a = torch.load(checkpoint.shard_file(a_dir, steps, s, 2))
        b = torch.load(checkpoint.shard_file(b_dir, steps, s, 2))
        assert torch.equal(a["weights"], b["weights"])
        assert len(a["optimizer"]) == len(b["optimizer"]) >= 1  # one state per chunk
        for oa, ob in zip(a["optimizer"], b["optimizer"]):
            sa, sb = oa["state"], ob["state"]
            assert sa.keys() == sb.keys() and sa
            for i in sa:
                for key in sa[i]:
                    assert torch.equal(torch.as_tensor(sa[i][key]), torch.as_tensor(sb[i][key])), (s, i, key)


def test_resume_refuses_another_jobs_checkpoint(tmp_path):
    """A checkpoint of a job with another placement cannot be resumed: a clear error."""
    ckpt = str(tmp_path / "ckpt")
    with Job(tmp_path, dict(sync_cfg("block", "sgd", steps=2), checkpoint_dir=ckpt, checkpoint_every=2), "a") as ja:
        ja.start_local(1, 1)
        ja.check_ok(ja.wait())
    with Job(tmp_path, dict(sync_cfg("variable", "sgd", steps=4), checkpoint_dir=ckpt, checkpoint_every=2), "b") as jb:
        jb.start_local(1, 1, extra={"RDMAFLOW_RESUME": "1"})
        rcs = jb.wait()
        assert all(rc != 0 for rc in rcs.values()), rcs
        assert "was written by a different job" in jb.proc("shard0").output(), jb.logs()
    assert os.path.isdir(ckpt)


def test_an_unwritable_checkpoint_dir_fails_the_job_at_its_start(tmp_path):
    """A checkpoint directory that cannot be written (here under a regular file) ends the job
    at setup with the reason, before any step: the shard used to find out at its first save,
    which may come hours in. Nothing is left in a directory that can be written."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    cfg = dict(sync_cfg("block", "sgd", steps=2), checkpoint_dir=str(blocker / "ckpt"), checkpoint_every=2,
               log_every=1)  # a step taken would print its line
    with Job(tmp_path, cfg, "bad") as j:
        j.start_local(1, 1)
        rcs = j.wait()
        assert all(rc != 0 for rc in rcs.values()), rcs
        said = f"checkpoint_dir {blocker / 'ckpt'} cannot be written here (NotADirectoryError"
        assert said in j.proc("shard0").output(), j.logs()
        assert "rdmaflow ps: worker 0 step" not in j.proc("worker0").output(), j.logs()
    assert checkpoint.unwritable(str(tmp_path / "fine")) is None
    assert os.listdir(tmp_path / "fine") == []

def test_worker_death_under_rdmaflow_launch(tmp_path):
    """`rdmaflow launch --min-workers 1`: worker 1 of 2 dies; the launcher keeps the shard and
    worker 0 running, they finish the job, and the launcher exits 0."""
    import sys

    from test_ps import TRAIN, free_port

    cfg = dict(sync_cfg("block", "sgd", steps=10), die={"worker": 1, "step": 3}, step_delay=0.05)
    with Job(tmp_path, cfg) as j:
        j.spawn("launch", [sys.executable, "-m", "rdmaflow.launch", "--nproc-per-node", "2", "--min-workers", "1",
                           "--master-port", str(free_port()), TRAIN], j.env())
        j.check_ok(j.wait())
        assert j.worker_result(0)["steps"] == cfg["steps"]
        assert "worker 1 (rank 2) exited with -9; the others go on" in j.proc("launch").output(), j.logs()


def test_step_log_reports_each_interval_not_the_total(tmp_path):
    """``log_every=N`` prints the mean push, pull and compute time of the last N steps. A step's
    three parts tile the time since the first step began, so the log's intervals, added up,
    can never exceed the time elapsed: a log that reported sums since the start would (its
    k-th line counting the first interval k times)."""
    n, steps = 2, 10
    cfg = dict(sync_cfg("block", "sgd", steps=steps), log_every=n, step_delay=0.02)
    with Job(tmp_path, cfg) as j:
        j.start_local(1, 1, extra={"RDMAFLOW_PS_LOG": "json"})
        j.check_ok(j.wait())
        lines = [json.loads(line) for line in j.proc("worker0").output().splitlines()
                 if line.startswith('{"event": "ps_step"')]
        losses = j.worker_result(0)["losses"]
    assert [r["step"] for r in lines] == list(range(n, steps + 1, n)), lines
    for r in lines:  # step(loss=...): the mean over the line's interval
        assert r["loss"] == pytest.approx(sum(losses[r["step"] - n : r["step"]]) / n, rel=1e-6), (r, losses)
    logged = 0.0
    for r in lines:
        assert r["compute_ms"] >= 1e3 * cfg["step_delay"], r  # each step slept that long before it
        logged += n * (r["push_ms"] + r["pull_ms"] + r["compute_ms"]) / 1e3
        elapsed = r["step"] / r["steps_per_s"]
        assert logged <= elapsed * (1 + 1e-9), (
            f"the log through step {r['step']} accounts for {logged:.4f} s of {elapsed:.4f} s elapsed: {lines}")


def test_step_log_line_is_for_people():
    """Without RDMAFLOW_PS_LOG=json a log_every line is text: the loss first, then rates and times."""
    rec = {"event": "ps_step", "worker": 1, "step": 50, "loss": 0.012345, "push_ms": 0.91, "pull_ms": 3.1,
           "compute_ms": 0.7, "steps_per_s": 180.24, "bytes_per_s": 9.3e6}
    assert log_line(rec) == ("rdmaflow ps: worker 1 step 50: loss 0.01235 | 180.2 steps/s, 9.3 MB/s | "
                             "per step: compute 0.70 ms, push 0.91 ms, pull 3.10 ms")
    assert log_line(dict(rec, loss=None)).startswith("rdmaflow ps: worker 1 step 50: 180.2 steps/s")


# Workers on the CUDA path and shards on the GPU path, their "GPU arenas" registered host memory.
GPU_LAYOUT = [os.path.join(JOBS, "gpu_layout_on_host.py"), TRAIN]


def test_gpu_layout_emulated_on_host(tmp_path):
    """The CUDA worker's and the GPU shard's memory layout, emulated in host memory
    (tests/ps_jobs/gpu_layout_on_host.py) so that machines without a GPU test it: gradients,
    parameters and the shards' weights and slots in other regions than the flags, flags written
    through word regions, weights copied in from the host copy. Synchronous training with overlap
    gives the parameters of single-process training; asynchronous overlap trains."""
    cfg = sync_cfg("block", "adam", steps=6)
    with Job(tmp_path, cfg, "sync") as j:
        j.start_local(2, 2, script=GPU_LAYOUT, extra=dict(CHUNKS, RDMAFLOW_PS_SHARD_DEVICE="cuda"))
        j.check_ok(j.wait())
        assert all("emulated GPU arena" in p.output() for p in j.procs), j.logs()
        assert_matches_reference(j, 2, 2)
    cfg = dict(async_cfg("async"), steps=30, overlap=True)
    cfg.pop("slow", None)
    with Job(tmp_path, cfg, "async") as j:
        j.start_local(2, 2, script=GPU_LAYOUT, extra={"RDMAFLOW_PS_SHARD_DEVICE": "cuda"})
        j.check_ok(j.wait())
        assert all("emulated GPU arena" in p.output() for p in j.procs), j.logs()
        initial = eval_loss(cfg, dict(job.make_model(cfg["seed"]).named_parameters()))
        for w in range(2):
            # A worker's last pull holds however many of the other's updates had landed by then,
            # so its loss varies from run to run (more on a loaded machine): 30 steps, not 20,
            # leave room for that below the same bar.
            assert eval_loss(cfg, j.worker_result(w)["params"]) < initial / 4
