"""One stage of one ``rdmaflow bench pipeline`` job: ``python -m rdmaflow.bench._pipeline_worker``.

The driver (:mod:`rdmaflow.bench.pipeline`) starts one process per stage with torchrun's
variables (``RANK`` = stage, ``WORLD_SIZE`` = stages, ``MASTER_ADDR``, ``MASTER_PORT``),
``RDMAFLOW_JOB_SECRET`` and ``RDMAFLOW_PIPELINE_CFG``, a JSON object:

    system      "rdmaflow" | "rdmaflow-copy" (allocation-site placement off) | "pipelining-gloo"
    model       "comm" | "compute" | "varlen" (:mod:`rdmaflow.bench.pipeline_models`)
    stages, warmup, steps, seed, timeout (the stages' own waits, seconds)

and ``OMP_NUM_THREADS`` (torch's threads in this stage).

Every system trains the same model, split the same way, on the same batches, 8 microbatches
per step on a GPipe schedule, SGD on each stage's own parameters. pipelining-gloo runs the
varlen model padded to the bound (it cannot carry a shape that changes); rdmaflow unpadded.

Output: rank 0 prints one line on stdout, ``RDMAFLOW_PIPELINE_RESULT {"system", "model",
"stages", "times", "lengths"}``: ``times`` the seconds of each of the ``steps`` steps after
``warmup`` (one schedule step and the optimizer's step; rank 0's step ends when the last
backward reached it), ``lengths`` their sequence lengths (varlen). Every rank exits 0; on an
error, a traceback on stderr and exit status 1.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback

CFG_ENV = "RDMAFLOW_PIPELINE_CFG"
RESULT_TAG = "RDMAFLOW_PIPELINE_RESULT"
SYSTEMS = ("rdmaflow", "rdmaflow-copy", "pipelining-gloo")


def _schedule(system: str, work, model, loss_fn, cfg: dict):
    """(step(x, y), optimizer, close, sends) of this rank's stage under ``system``; sends() is
    rdmaflow's per-edge send counts (``PipelineStage.send_stats``), None for pipelining."""
    import torch

    from rdmaflow.bench.pipeline_models import SEQ_MAX

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if system == "pipelining-gloo":
        import datetime

        import torch.distributed as dist
        from torch.distributed import pipelining

        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg["timeout"]))
        split = {n: pipelining.SplitPoint.BEGINNING for n in work.split_names()}
        pipe = pipelining.pipeline(model, mb_args=(work.example(SEQ_MAX),), split_spec=split)
        stage = pipe.build_stage(rank, torch.device("cpu"))
        sched = pipelining.ScheduleGPipe(stage, n_microbatches=cfg["microbatches"], loss_fn=loss_fn)
        opt = torch.optim.SGD(stage.submod.parameters(), lr=cfg["lr"])

        def step(x, y):
            if rank == 0:
                sched.step(x)
            elif rank == world - 1:
                sched.step(target=y)
            else:
                sched.step()
        return step, opt, dist.destroy_process_group, lambda: None

    from rdmaflow import graph

    split = {n: graph.SplitPoint.BEGINNING for n in work.split_names()}
    pipe = graph.pipeline(model, (work.example(),), split_spec=split, dynamic_shapes=work.dynamic_shapes())
    stage = pipe.build_stage(zero_copy=system == "rdmaflow", timeout=cfg["timeout"])
    sched = graph.ScheduleGPipe(stage, cfg["microbatches"], loss_fn=loss_fn)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=cfg["lr"])
    return (lambda x, y: sched.step(x, target=y)), opt, stage.close, lambda: stage.send_stats


def run(cfg: dict) -> dict | None:
    from rdmaflow.bench.pipeline_models import MICROBATCHES, SEQ_MAX, Workload, masked_mse

    system = cfg["system"]
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")
    cfg.setdefault("microbatches", MICROBATCHES)
    cfg.setdefault("lr", 0.01)
    work = Workload(cfg["model"], int(cfg["stages"]), int(cfg.get("seed", 0)))
    padded = system == "pipelining-gloo" and work.name == "varlen"
    real_length = [0]
    step, opt, close, sends = _schedule(system, work, work.model(), masked_mse(real_length), cfg)
    n = cfg["warmup"] + cfg["steps"]
    lengths = work.lengths(n)
    # Made before the clock starts, as a data loader would have them ready: varlen's batches
    # are small, one per step; the fixed-shape models' are large, so two alternate.
    distinct = n if work.name == "varlen" else min(n, 2)
    batches = [work.batch(t, lengths[t], SEQ_MAX if padded else None) for t in range(distinct)]
    times = []
    try:
        for t in range(n):
            x, y = batches[t % distinct]
            real_length[0] = lengths[t]
            t0 = time.perf_counter()
            step(x, y)
            opt.step()
            opt.zero_grad(set_to_none=False)
            times.append(time.perf_counter() - t0)
    finally:
        stats = sends()
        close()
    if int(os.environ["RANK"]) != 0:
        return None
    return {"system": system, "model": work.name, "stages": work.stages,
            "times": times[cfg["warmup"]:], "lengths": lengths[cfg["warmup"]:], "sends": stats}


def main() -> None:
    out = os.fdopen(os.dup(1), "w")   # the result line only; everything else goes to stderr
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        res = run(json.loads(os.environ[CFG_ENV]))
    except BaseException:  # noqa: BLE001 - reported, then the process exits nonzero
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if res is not None:
        out.write(f"{RESULT_TAG} {json.dumps(res)}\n")
        out.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
