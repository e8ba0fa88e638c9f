"""rdmaflow.graph end to end: pipeline jobs of real processes over UCX tcp.

- After N steps every stage's parameters equal single-process training on the same batches
  (MLP and small CNN, 2 and 3 stages, GPipe and 1F1B); inference returns the model's outputs.
- In steady state every static edge's send is zero-copy unless explain() gives a reason,
  counted by the stages themselves; copy mode (allocation-site placement off) counts copies.
- The executor's event trace shows a compute running while a receive is pending; a rank whose
  only work is a pending receive uses almost no CPU (process CPU time during its waits).
- Every error a pipeline job can meet: split points that differ between ranks, a batch whose shape
  or dtype differs from the plan, a stage killed mid-step: every rank exits with a clear error,
  never a hang. (A model that cannot be captured: test_graph.py.)
- A model made and captured on the meta device, each stage loading only its own part, trains
  like one process.
- A two-stage job across two network-namespace hosts.
- Shapes that change per batch: a transformer whose sequence length changes every step trains like one process
  over 2 and 3 stages, its boundary tensors on the bounded path; a length beyond the declared
  bound fails every rank; a data-dependent shape (boolean mask) on the dynamic path trains and
  infers like one process.

The job script is tests/graph_jobs/train.py; ranks get torchrun's variables directly.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import sys

import pytest
import torch
from conftest import HERE, QUIET_PLACEMENT_COSTS
from test_ps import Job, free_port

from rdmaflow.bench.perftest import ucx_env
from rdmaflow.graph.placement import COSTS_ENV
from rdmaflow.testing.netns import TwoHosts, netns_unavailable_reason

TRAIN = os.path.join(HERE, "graph_jobs", "train.py")
_spec = importlib.util.spec_from_file_location("graph_train_job", TRAIN)
job = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(job)

RTOL, ATOL = 1e-5, 1e-6       # float32, a few steps, sums in another order
DETECT_TIMEOUT = 40.0         # from a failure to every rank's exit (a loaded 2-core machine)
GRAPH_TIMEOUT = "90"          # the stages' own waits: far longer, so a pass saw the failure detected
LIB_ERROR = r"rdmaflow\.(graph\.)?\w*Error: "


def start(j: Job, stages: int, hosts=None, transport_env: dict | None = None, script: str = TRAIN) -> Job:
    port = free_port() if hosts is None else 29810
    for rank in range(stages):
        extra = {"GRAPH_TEST_CONFIG": json.dumps(j.cfg), "RANK": str(rank), "WORLD_SIZE": str(stages),
                     "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(stages), "MASTER_PORT": str(port),
                     "MASTER_ADDR": "127.0.0.1" if hosts is None else hosts[0].addr,
                     "RDMAFLOW_GRAPH_TIMEOUT": GRAPH_TIMEOUT}
        if hosts is None:
            j.spawn(f"rank{rank}", [sys.executable, script], j.env(extra, transport_env=transport_env))
        else:
            host = hosts[rank]
            j.spawn(f"rank{rank}", host.argv([sys.executable, TRAIN]),
                    j.env(extra, transport_env=ucx_env("tcp", net_device=host.ifname)))
    return j


def results(j: Job, stages: int) -> list[dict]:
    return [torch.load(j.dir / f"rank{r}.pt", weights_only=False) for r in range(stages)]


def reference(cfg: dict) -> tuple[dict, list, list]:
    """Single-process training of the same model on the same batches: parameters by name, the
    mean loss of each step, and (inference) the outputs."""
    model = job.make_model(cfg["model"], cfg.get("seed", 1))
    opt = torch.optim.SGD(model.parameters(), lr=cfg.get("lr", 0.05))
    losses, outputs = [], []
    for t in range(cfg.get("steps", 3)):
        x, y = job.make_batch(cfg["model"], cfg.get("seed", 1), t, cfg.get("batch", 16))
        # a model whose batch is not one computation: each microbatch, as the pipeline runs it
        M = cfg.get("microbatches", 4) if cfg["model"] in job.PER_MICROBATCH else 1
        if cfg.get("inference"):
            with torch.no_grad():
                outputs.append(torch.cat([model(xm) for xm in x.tensor_split(M)]))
            continue
        opt.zero_grad()
        loss = sum(job.loss_fn(model(xm), ym) for xm, ym in zip(x.tensor_split(M), y.tensor_split(M))) / M
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return {k: v.detach() for k, v in model.named_parameters()}, losses, outputs


def assert_matches_reference(j: Job, stages: int) -> list[dict]:
    res = results(j, stages)
    params, losses, outputs = reference(j.cfg)
    frozen = {k for k, v in job.make_model(j.cfg["model"], 1).named_parameters() if not v.requires_grad}
    got = {}
    for r in res:
        assert not (set(got) & set(r["params"])) - frozen, "a trained parameter is held by two stages"
        got.update(r["params"])
    assert sorted(got) == sorted(params)
    for k, v in params.items():
        torch.testing.assert_close(got[k], v, rtol=RTOL, atol=ATOL, msg=f"parameter {k}")
    M = j.cfg.get("microbatches", 4)
    if j.cfg.get("inference"):
        for a, b in zip(res[-1]["outputs"], outputs, strict=True):
            torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
    else:  # the mean of the microbatch losses of a step is the loss of the whole batch
        per_step = [sum(res[-1]["losses"][t * M:(t + 1) * M]) / M for t in range(len(losses))]
        assert per_step == pytest.approx(losses, rel=1e-5)
    return res


def assert_steady_zero_copy(res: list[dict]) -> int:
    """Every edge's steady-state sends are all zero-copy, or explain() gives the reason."""
    counted = 0
    for r in res:
        for name, st in r["stats"].items():
            assert st["steady_sends"] > 0, (name, st)
            row = next(line for line in r["explain"].splitlines() if line.startswith(name + " "))
            if st["copy_reason"] is None:
                assert st["steady_zero_copy"] == st["steady_sends"], (name, st, r["explain"])
                counted += st["steady_sends"]
            else:
                assert st["copy_reason"] in row and "copy" in row, (name, row)
    return counted


CASES = [  # model, stages, schedule
    ("mlp", 2, "gpipe"), ("mlp", 3, "1f1b"), ("cnn", 2, "1f1b"), ("cnn", 3, "gpipe"),
]


@pytest.mark.parametrize("model,stages,schedule", CASES)
def test_training_equals_single_process(tmp_path, model, stages, schedule):
    cfg = {"model": model, "stages": stages, "schedule": schedule, "microbatches": 4, "batch": 16, "steps": 3,
           "zero_copy": "always"}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, stages).wait())
        res = assert_matches_reference(j, stages)
    # placed wherever it can be: these models have no reason to copy, every steady-state send is zero-copy
    assert assert_steady_zero_copy(res) == sum(st["steady_sends"] for r in res for st in r["stats"].values())
    assert all(r["placed"] > 0 for r in res), "no output was born in the arena"


@pytest.mark.parametrize("inference", [False, True])
def test_one_microbatch_per_step(tmp_path, inference):
    """n_microbatches=1: each edge has one transfer in flight per step. The second step hung
    until the stages' timeout (a one-slot receiver handed its slot back only once it took the
    next transfer, which the sender held back for that slot)."""
    cfg = {"model": "mlp", "stages": 2, "microbatches": 1, "batch": 8, "steps": 3, "inference": inference}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 2).wait())
        assert_matches_reference(j, 2)


def test_a_stage_dropped_when_main_returns_closes_with_the_others(tmp_path):
    """Rank 0 serves the job's store: its stage, dropped when main() returned, took the store
    server with it while rank 1 still read the close barrier. Rank 1 then warned that not every
    stage had closed, under c10d's "recvValue failed"."""
    with Job(tmp_path, {}) as j:
        j.check_ok(start(j, 2, script=os.path.join(HERE, "graph_jobs", "close_in_main.py")).wait())
        logs = j.logs()
    assert "rank 0 closed" in logs and "rank 1 closed" in logs, logs
    assert "without every stage of the job closing" not in logs and "recvValue failed" not in logs, logs


def test_a_constant_buffer_and_a_frozen_parameter_used_by_both_stages(tmp_path):
    """Each stage holds its own copy of what no stage changes; training matches one process."""
    cfg = {"model": "shared", "stages": 2, "steps": 3}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 2).wait())
        res = assert_matches_reference(j, 2)
    assert all("shift" in r["params"] for r in res)


def test_a_model_made_on_the_meta_device_trains_like_one_process(tmp_path):
    """No rank holds the whole model: every rank makes and captures it on the meta device, and
    each stage loads only its own part's weights (as from a checkpoint) before training."""
    cfg = {"model": "cnn", "stages": 3, "schedule": "1f1b", "microbatches": 2, "batch": 8, "steps": 2,
           "meta": "materialize"}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 3).wait())
        assert_matches_reference(j, 3)


def test_inference_returns_the_models_outputs(tmp_path):
    cfg = {"model": "cnn", "stages": 3, "inference": True, "microbatches": 2, "batch": 8, "steps": 2}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 3).wait())
        assert_matches_reference(j, 3)


def test_a_second_pipeline_built_while_the_first_lives(tmp_path):
    """Every rank builds a forward-only pipeline of the same model beside the one it trains (rank
    0 serves both pipelines' stores): it returns the model's outputs, and training is unaffected."""
    cfg = {"model": "mlp", "stages": 2, "steps": 2, "second_pipeline": True}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 2).wait())
        res = assert_matches_reference(j, 2)
    x0, _ = job.make_batch("mlp", 1, 0, 16)
    with torch.no_grad():
        want = job.make_model("mlp", 1)(x0)
    (got,) = res[-1]["second_outputs"]
    torch.testing.assert_close(got, want, rtol=RTOL, atol=ATOL)


def test_copy_mode_copies_every_send_and_says_why(tmp_path):
    cfg = {"model": "mlp", "stages": 2, "microbatches": 2, "batch": 8, "steps": 2, "zero_copy": False}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 2).wait())
        res = assert_matches_reference(j, 2)
    for r in res:
        for name, st in r["stats"].items():
            assert st["zero_copy"] == 0 and "copy mode" in st["copy_reason"], (name, st)
        assert r["placed"] == 0


@pytest.mark.parametrize("transport", ["tcp", "sm"])
def test_default_placement_copies_where_placing_saves_nothing_or_costs_more(tmp_path, transport):
    """zero_copy=True (auto). A 3-block transformer of d_model 16 sends a few KiB per microbatch
    after about a hundred ops per phase: over tcp the placement mode would cost more than the
    copies, so each phase is declined; on one host (sm) a send copies from any memory into the
    receiver's mapped slot, so placement would save nothing. Either way every send copies, says
    why in explain(), and training equals one process. The weighing is given this machine's
    quiet figures (QUIET_PLACEMENT_COSTS) rather than timing microseconds in two processes that share two
    cores: a busy moment once measured the mode as nearly free, and placement was kept."""
    cfg = {"model": "transformer", "stages": 2, "microbatches": 2, "batch": 4, "steps": 3}
    with Job(tmp_path, cfg) as j:
        env = {**ucx_env(transport), COSTS_ENV: QUIET_PLACEMENT_COSTS}
        j.check_ok(start(j, 2, transport_env=env).wait())
        res = assert_matches_reference(j, 2)
    why = "placement declined" if transport == "tcp" else "placement would save none"
    for r in res:  # each edge first, with the stage's explain(), which says what it decided
        for name, st in r["stats"].items():
            assert why in (st["copy_reason"] or ""), (name, st, r["explain"])
    assert assert_steady_zero_copy(res) == 0
    for r in res:
        assert r["placed"] == 0


def test_compute_runs_while_a_receive_is_pending(tmp_path):
    """Stage 0 sleeps before each forward after the first: stage 1 computes microbatch 0 while
    its receive of microbatch 1 is posted and has not landed (polls that missed around it)."""
    cfg = {"model": "mlp", "stages": 2, "microbatches": 3, "batch": 12, "steps": 1, "trace": True, "slow_forward": 1.0}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 2).wait())
        trace = results(j, 2)[1]["trace"]
    starts = {e["name"]: e for e in trace if e["kind"] == "compute_start"}
    assert "recv f0 mb1" in starts["F0"]["pending"], starts["F0"]
    t0, t1 = starts["F0"]["t"], next(e["t"] for e in trace if e["kind"] == "landed" and e["name"] == "recv f0 mb1")
    assert any(e["kind"] == "poll_miss" and e["name"] == "recv f0 mb1" and t0 < e["t"] < t1 for e in trace)


def test_a_waiting_rank_uses_almost_no_cpu(tmp_path):
    """Stage 0 starts its step 3 s late; stage 1's executor waits on its receives meanwhile."""
    cfg = {"model": "mlp", "stages": 2, "microbatches": 2, "batch": 8, "steps": 1, "trace": True, "slow_start": 3.0}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 2).wait())
        trace = results(j, 2)[1]["trace"]
    waits = [e for e in trace if e["kind"] == "wait"]
    wall, cpu = sum(e["wall"] for e in waits), sum(e["cpu"] for e in waits)
    assert wall > 2.0, waits
    # A busy-polling rank would use about `wall` CPU seconds (process CPU time, every thread).
    assert cpu < 0.1 * wall, (cpu, wall)


# -- errors ------------------------------------------------------------------------------------

def assert_every_rank_fails(j: Job, stages: int, patterns: dict[int, str]) -> None:
    rcs = j.wait(timeout=DETECT_TIMEOUT + 30)
    assert all(rc != 0 for rc in rcs.values()), f"{rcs}\n" + j.logs()
    for rank, pattern in patterns.items():
        out = j.proc(f"rank{rank}").output()
        assert re.search(pattern, out), f"rank {rank} does not say {pattern!r}:\n{out[-3000:]}"


@pytest.mark.parametrize("differs", ["alt", 3])
def test_split_points_that_differ_between_ranks(tmp_path, differs):
    """Rank 1 cuts the model at another layer (same number of stages), or into three stages."""
    cfg = {"model": "mlp", "stages": 2, "split_differs": {"1": differs}}
    with Job(tmp_path, cfg) as j:
        start(j, 2)
        if differs == "alt":
            what = r"PlanMismatchError: rank \d's pipeline plan differs from rank \d's at plan\."
            assert_every_rank_fails(j, 2, {0: what, 1: what})
        else:
            what = r"rank 1 split the model into 3 stages but the job has WORLD_SIZE=2 processes"
            assert_every_rank_fails(j, 2, {0: r"PeerError: the job was aborted: " + what,
                                           1: r"InvalidArgumentError: " + what})


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_a_batch_that_differs_from_the_plan(tmp_path, bad):
    cfg = {"model": "mlp", "stages": 2, "steps": 3, "bad_input": bad}
    with Job(tmp_path, cfg) as j:
        start(j, 2)
        said = r"float32\[4, 7\]" if bad == "shape" else r"float64\[4, 8\]"
        assert_every_rank_fails(j, 2, {
            0: r"InvalidArgumentError: microbatch 0 of input 0 is " + said + r"; the plan says float32\[4, 8\]",
            1: LIB_ERROR + r".*the job was aborted: stage 0 \(rank 0\): InvalidArgumentError: microbatch 0",
        })


def test_a_step_without_its_target_fails_every_rank(tmp_path):
    """A misuse of step() on one rank (the last stage's target left out) is that rank's
    InvalidArgumentError, recorded in the abort key: the other rank raises it too, at once."""
    cfg = {"model": "mlp", "stages": 2, "steps": 3, "no_target": True}
    with Job(tmp_path, cfg) as j:
        start(j, 2)
        what = r"InvalidArgumentError: the last stage's step\(\) takes target= for its loss_fn"
        assert_every_rank_fails(j, 2, {
            1: what,
            0: LIB_ERROR + r".*the job was aborted: stage 1 \(rank 1\): " + what,
        })


@pytest.mark.parametrize("fewer", [0, 1])
def test_a_rank_that_runs_fewer_steps(tmp_path, fewer):
    """One rank stops after 2 steps and closes: the other raises in its third step, naming the
    rank and the steps (it waited out its timeout), and records why; the early rank's close()
    warns with that reason (it returned silently)."""
    cfg = {"model": "mlp", "stages": 2, "steps": 3, "rank_steps": {str(fewer): 2}}
    other = 1 - fewer
    with Job(tmp_path, cfg) as j:
        start(j, 2)
        rcs = j.wait(timeout=DETECT_TIMEOUT + 30)
        out, early = j.proc(f"rank{other}").output(), j.proc(f"rank{fewer}").output()
        said = rf"stage {other}: stage {fewer} \(rank {fewer}\) closed after 2 steps while this stage runs step 3"
        assert rcs[f"rank{other}"] != 0 and re.search(r"PeerError: " + said, out), out[-3000:]
        assert rcs[f"rank{fewer}"] == 0, early[-3000:]
        assert re.search(rf"RuntimeWarning: stage {fewer} closes after 2 steps without every stage of the job "
                         r"closing: the job was aborted: .*" + said, early), early[-3000:]


def test_a_stage_killed_mid_step(tmp_path):
    """The middle one of three stages SIGKILLs itself in the forward of a microbatch of step 1:
    both neighbours raise (the peer failed, or the job was aborted by the other), none hangs."""
    cfg = {"model": "mlp", "stages": 3, "steps": 3, "die": {"rank": 1, "step": 1}}
    with Job(tmp_path, cfg) as j:
        start(j, 3)
        j.wait_output("rank0", r"rank 0 step 0")
        assert_every_rank_fails(j, 3, {0: LIB_ERROR + r".*(failed|aborted)", 2: LIB_ERROR + r".*(failed|aborted)"})
        assert j.proc("rank1").popen.returncode == -9


# -- shapes that change per batch ------------------------------------------------------------------

def edge_rows(r: dict, cls: str) -> list[str]:
    return [line for line in r["explain"].splitlines() if line[:1] in "fb" and f" {cls} " in line]


@pytest.mark.parametrize("stages,schedule", [(2, "gpipe"), (3, "1f1b")])
def test_variable_sequence_lengths_train_like_one_process(tmp_path, stages, schedule):
    """A 3-block transformer, Dim("seq", min=16, max=512); every step has another length."""
    steps = 4
    assert len({job.seq_length(1, t) for t in range(steps)}) == steps
    cfg = {"model": "transformer", "stages": stages, "schedule": schedule, "microbatches": 2, "batch": 4,
           "steps": steps, "zero_copy": "always"}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, stages).wait())
        res = assert_matches_reference(j, stages)
    for r in res:  # every boundary tensor, forward and backward, planned at the maxima
        rows = edge_rows(r, "bounded")
        assert len(rows) == 2 * (stages - 1), r["explain"]
        assert all("max slot + size" in row for row in rows) and "<= 512" in r["explain"]
        assert not edge_rows(r, "static") and not edge_rows(r, "dynamic"), r["explain"]
    # each site's arena buffer holds the maxima: every steady-state send is zero-copy, whatever the length
    assert assert_steady_zero_copy(res) == sum(st["steady_sends"] for r in res for st in r["stats"].values())


def test_a_sequence_beyond_the_declared_bound_fails_every_rank(tmp_path):
    cfg = {"model": "transformer", "stages": 3, "microbatches": 2, "batch": 4, "steps": 3,
           "too_long": {"step": 1, "length": 600}}
    with Job(tmp_path, cfg) as j:
        start(j, 3)
        what = (r"InvalidArgumentError: microbatch 0 of input 0 is float32\[2, 600, 8\]: dimension 1 \(\w+\) is "
                r"600, outside its declared bound \[16, 512\]")
        aborted = LIB_ERROR + r".*the job was aborted: stage 0 \(rank 0\): " + what
        assert_every_rank_fails(j, 3, {0: what, 1: aborted, 2: aborted})


@pytest.mark.parametrize("inference", [False, True])
def test_a_data_dependent_shape_goes_dynamic_end_to_end(tmp_path, inference):
    """Stage 0 sends the rows a boolean mask keeps (how many depends on the data; here 2 to 6
    of 8 per microbatch), and in training gets their gradient back: both on the dynamic path."""
    cfg = {"model": "masked", "stages": 2, "microbatches": 2, "batch": 16, "steps": 3, "inference": inference}
    with Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 2).wait())
        res = assert_matches_reference(j, 2)
    rows = edge_rows(res[0], "dynamic")
    assert len(rows) == (1 if inference else 2) and all("dynamic (READ)" in row for row in rows), res[0]["explain"]


NETNS = netns_unavailable_reason()


@pytest.mark.skipif(NETNS is not None, reason=f"network namespaces unavailable: {NETNS}")
def test_two_stages_on_two_hosts(tmp_path):
    cfg = {"model": "mlp", "stages": 2, "schedule": "1f1b", "steps": 3, "zero_copy": "always"}
    with TwoHosts() as hosts, Job(tmp_path, cfg) as j:
        j.check_ok(start(j, 2, hosts=list(hosts)).wait())
        res = assert_matches_reference(j, 2)
    assert assert_steady_zero_copy(res) > 0
