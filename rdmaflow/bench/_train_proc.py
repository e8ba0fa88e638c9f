"""One process of one ``rdmaflow bench train`` cell: ``python -m rdmaflow.bench._train_proc``.

The driver (:mod:`rdmaflow.bench.train_cells`) starts every process of a cell with
(:mod:`rdmaflow.bench.train_job` reads them, :mod:`rdmaflow.bench.train_systems` runs the
system):

* ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
  ``RDMAFLOW_JOB_SECRET``;
* ``RDMAFLOW_TRAIN_CFG``: a JSON object ``{"system", "model", "batch", "workers", "shards",
  "warmup", "iters", "zero_copy", "overlap", "mode", "lr", "seed", "timeout"}``; system is one
  of rdmaflow, tensorpipe, grpc, ddp, local. Required: system, model, batch, workers, iters;
  the others default to shards 1, warmup 0, zero_copy and overlap true, mode "sync", lr 0.01,
  a seed of 0, timeout 300 (seconds). Optional: ``threads`` (torch.set_num_threads; else torch's
  default), ``dump`` (a path: worker 0 ``torch.save``\\ s its model's final ``state_dict``, tensors
  cloned, there: what tests compare with single-process training), ``policy`` and
  ``staleness`` (rdmaflow's placement and bounded-staleness bound, else its defaults),
  ``transport`` (tensorpipe only: "tcp" = uv/basic, "sm" = shm,uv/cma,basic; else
  TensorPipe's own choice). Unknown fields are reported on stderr and
  ignored.

Processes: parameter-server systems (rdmaflow, tensorpipe, grpc) have WORLD_SIZE = shards +
workers, ranks 0..shards-1 shards, the rest workers (worker index = RANK - shards); ddp has
WORLD_SIZE = workers; local is one process (RANK 0). tensorpipe and grpc are synchronous
(mode must be "sync"); zero_copy and overlap concern rdmaflow only (passed to
DistributedOptimizer when it accepts them).

Output: each worker prints exactly one line on stdout, ``RDMAFLOW_TRAIN_RESULT {"system",
"model", "worker", "times", "losses", "batch"}``, and exits 0: ``times`` has the ``iters``
iteration times after warmup (seconds; from the start of one iteration to the start of the
next, making the next batch not counted; the last one ends when its step and its
communication completed), ``losses`` the loss of every iteration, warmup included
(warmup + iters values). Shards print nothing on stdout and exit 0 when the job ends. Nothing
else is written on stdout (fd 1 is pointed at stderr; the result goes to a private copy).

Errors: a message on stderr (its last line ``rdmaflow bench train: ...``) and exit status 2
for a bad configuration or environment, 1 for a failure, 3 when the watchdog ended a process
that made no progress for longer than the timeout (plus a margin).
"""
from __future__ import annotations

import json
import os
import sys


def main() -> None:
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    from rdmaflow.bench import train_job as job
    from rdmaflow.bench import train_systems

    me = None
    wd = None
    try:
        cfg = job.parse_config(os.environ.get(job.CFG_ENV))
        me = job.resolve_role(cfg)
        job.check_model(cfg)
    except job.ConfigError as e:
        print(f"rdmaflow bench train: bad configuration: {e}", file=sys.stderr, flush=True)
        os._exit(2)
    except BaseException as e:  # noqa: BLE001 - e.g. the models module failed to import
        print(job.format_tb() + job.describe_error(me, e), file=sys.stderr, flush=True)
        os._exit(1)
    try:
        wd = job.Watchdog(job.watchdog_limit(cfg["timeout"]), f"{cfg['system']} {me.name} (rank {me.rank})")
        res = train_systems.run(cfg, me, wd)
        if res is not None:
            out.write(job.RESULT_PREFIX + json.dumps(res) + "\n")
            out.flush()
    except BaseException as e:  # noqa: BLE001 - reported, then the process exits nonzero
        if isinstance(e, SystemExit) and e.code in (0, None):
            job.exit_process(0, wd)
        print(job.format_tb() + job.describe_error(me, e), file=sys.stderr, flush=True)
        job.exit_process(1, wd)
    job.exit_process(0, wd)


if __name__ == "__main__":
    main()
