"""The five systems of ``rdmaflow bench train`` (Xue et al. §5.2, Figures 9, 11, 12): which
function runs one process of each.

One process of one benchmark cell runs :func:`run` (through ``python -m
rdmaflow.bench._train_proc``, see there for the contract with the harness, and
:mod:`rdmaflow.bench.train_job` for what every system's process shares). Every system trains
the same model with the same data and the same optimizer; only how gradients and weights
move differs:

* ``local``: single-process training (:mod:`rdmaflow.bench.baselines.local`).
* ``ddp``: ``DistributedDataParallel`` over gloo (:mod:`rdmaflow.bench.baselines.ddp`).
* ``tensorpipe``: a synchronous parameter server over ``torch.distributed.rpc``
  (:mod:`rdmaflow.bench.baselines.tensorpipe_ps`).
* ``grpc``: the same parameter server over gRPC (:mod:`rdmaflow.bench.baselines.grpc_ps`).
* ``rdmaflow``: :class:`rdmaflow.ps.DistributedOptimizer` (one-sided WRITEs over UCX), here.
"""
from __future__ import annotations

import importlib
import inspect
import os

import torch

from rdmaflow.bench.train_job import ProcessRole, Watchdog, build_model, dump_state, make_sgd, result, train_loop

PENDING_METHODS = ("wait_weights", "synchronize")  # the first that DistributedOptimizer has


def run_rdmaflow(cfg: dict, me: ProcessRole, wd: Watchdog) -> dict | None:
    os.environ.update(RDMAFLOW_ROLE=me.role, RDMAFLOW_ROLE_INDEX=str(me.index),
                      RDMAFLOW_NUM_SHARDS=str(cfg["shards"]), RDMAFLOW_NUM_WORKERS=str(cfg["workers"]))
    from rdmaflow import ps

    timeout = cfg["timeout"]
    if me.role == "shard":
        # A shard serves inside init(); its waits are the library's own, bounded by the timeouts.
        wd.limit = float("inf")
        stats = ps.init(timeout=timeout, step_timeout=timeout, exit_shards=False)
        stats["ctx"].close()
        return None
    ctx = ps.init(timeout=timeout, step_timeout=timeout)
    model = build_model(cfg)
    wd.kick("DistributedOptimizer setup")
    accepted = inspect.signature(ps.DistributedOptimizer.__init__).parameters
    kw = {"mode": cfg["mode"], "progress": False}
    if cfg.get("policy"):
        kw["policy"] = cfg["policy"]
    if cfg.get("staleness") is not None:
        kw["staleness"] = cfg["staleness"]
    for k in ("overlap", "zero_copy"):
        if k in accepted:
            kw[k] = cfg[k]
    opt = ps.DistributedOptimizer(model, make_sgd(model.parameters(), cfg), **kw)
    state = {"closed": False}

    def finish():
        # The last iteration ends when its communication is complete.
        for name in PENDING_METHODS:
            fn = getattr(opt, name, None)
            if callable(fn):
                fn()
                return
        if cfg["overlap"] and "overlap" in accepted:
            opt.close()  # no explicit wait: close() completes what is pending
            state["closed"] = True

    wd.kick("training")
    times, losses = train_loop(cfg, me.index, model, opt.zero_grad, opt.step, finish, wd)
    if not state["closed"]:
        opt.close()
    dump_state(cfg, me.index, model)
    ctx.close()
    return result(cfg, me.index, times, losses)


#: system -> the module whose ``run(cfg, me, wd)`` runs one process of it (imported when used:
#: a process imports only its own system's dependencies).
RUNNERS = {"local": "rdmaflow.bench.baselines.local", "ddp": "rdmaflow.bench.baselines.ddp",
           "tensorpipe": "rdmaflow.bench.baselines.tensorpipe_ps", "grpc": "rdmaflow.bench.baselines.grpc_ps"}


def run(cfg: dict, me: ProcessRole, wd: Watchdog) -> dict | None:
    """Runs this process's part of the cell: a worker's result dict, or None for a shard."""
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    if cfg["system"] == "rdmaflow":
        return run_rdmaflow(cfg, me, wd)
    return importlib.import_module(RUNNERS[cfg["system"]]).run(cfg, me, wd)
