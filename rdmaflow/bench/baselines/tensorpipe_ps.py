"""``tensorpipe`` of ``rdmaflow bench train``: a synchronous parameter server over
``torch.distributed.rpc`` (TensorPipe), the pattern of PyTorch's batch-updating parameter
server tutorial. Each step a worker sends each shard the gradients of its variables
(``rpc_async`` of an ``@rpc.functions.async_execution`` function); once every worker's
gradients of the step are there the shard averages them, runs SGD and answers every worker
with its new weights, which the workers copy into their model (:mod:`.sync_shard`).

rpc pickles the functions it calls by reference: shards and workers both import this module
(the system's runner) before ``init_rpc``."""
from __future__ import annotations

import warnings

import torch
from torch.distributed import rpc

from rdmaflow.bench.baselines import TENSORPIPE_OPTIONS
from rdmaflow.bench.baselines.sync_shard import SyncShard, copy_weights, grads_of, ps_setup
from rdmaflow.bench.train_job import (
    ProcessRole,
    Watchdog,
    build_model,
    dump_state,
    leave_store,
    make_store,
    point_at_interface,
    result,
    train_loop,
)

_TP_SHARD: SyncShard | None = None


def _tp_push_impl(step: int, worker: int, grads: list):
    fut = torch.futures.Future()

    def deliver(weights, exc):
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(weights)

    if _TP_SHARD is None:
        fut.set_exception(RuntimeError("this process is no tensorpipe shard"))
    else:
        _TP_SHARD.push(step, worker, grads, deliver)
    return fut


def _tp_pull(worker: int) -> list:
    return _TP_SHARD.weights()


def _tp_done(worker: int) -> bool:
    _TP_SHARD.finish(worker)
    return True


@rpc.functions.async_execution
def _tp_push(step: int, worker: int, grads: list):
    """Runs on a shard, called by each worker every step: answers (a future) the shard's new
    weights once every worker's gradients of the step are in and applied."""
    return _tp_push_impl(step, worker, grads)


_RPC_SCHEME = "rdmaflowtrain"
_RPC_STORE = None


def _rpc_rendezvous(url: str, **kwargs):
    """torch.distributed rendezvous handler that hands rpc this process's own store, so that
    rank 0 can keep serving it until every process is through rpc.shutdown (whose join still
    uses the store)."""
    from urllib.parse import parse_qsl, urlparse

    q = dict(parse_qsl(urlparse(url).query))
    yield (_RPC_STORE, int(q["rank"]), int(q["world_size"]))


def _tp_init(cfg: dict, me: ProcessRole, store) -> None:
    global _RPC_STORE
    import torch.distributed as dist

    _RPC_STORE = store
    try:
        dist.register_rendezvous_handler(_RPC_SCHEME, _rpc_rendezvous)
    except RuntimeError:
        pass  # registered already
    point_at_interface(me.master_addr, "TP_SOCKET_IFNAME")
    point_at_interface(me.master_addr, "GLOO_SOCKET_IFNAME")  # rpc's own gloo group
    kw = {}
    if cfg.get("transport"):
        transports, channels = TENSORPIPE_OPTIONS[cfg["transport"]]
        kw = {"_transports": transports, "_channels": channels}
    opts = rpc.TensorPipeRpcBackendOptions(
        init_method=f"{_RPC_SCHEME}://", rpc_timeout=cfg["timeout"],
        num_worker_threads=max(16, 2 * cfg["workers"] + 4), **kw)
    with warnings.catch_warnings():
        # rpc's own use of a gloo group as a ProcessGroup (a deprecation warning of torch's)
        warnings.filterwarnings("ignore", message="You are using a Backend")
        rpc.init_rpc(me.name, rank=me.rank, world_size=me.world_size, rpc_backend_options=opts)


def run(cfg: dict, me: ProcessRole, wd: Watchdog) -> dict | None:
    global _TP_SHARD
    timeout = cfg["timeout"]
    store = make_store(me, timeout)
    if me.role == "shard":
        _TP_SHARD = SyncShard(cfg, me.index, wd.kick)
        wd.kick("rpc setup")
        _tp_init(cfg, me, store)
        wd.kick("serving")
        _TP_SHARD.wait_done()
        wd.kick("rpc shutdown")
        rpc.shutdown(graceful=True, timeout=timeout)
        leave_store(store, me, timeout)
        return None

    model = build_model(cfg)
    params, placement = ps_setup(cfg, model)
    _tp_init(cfg, me, store)
    wd.kick("initial weights")
    shards = [(f"shard{s}", idx) for s, idx in enumerate(placement) if idx]
    for name, idx in shards:
        copy_weights(params, idx, rpc.rpc_sync(name, _tp_pull, args=(me.index,), timeout=timeout))
    state = {"t": 0}

    def step():
        state["t"] += 1
        futs = [(rpc.rpc_async(name, _tp_push, args=(state["t"], me.index, grads_of(params, idx)),
                               timeout=timeout), idx) for name, idx in shards]
        for fut, idx in futs:
            copy_weights(params, idx, fut.wait())

    wd.kick("training")
    times, losses = train_loop(cfg, me.index, model, model.zero_grad, step, lambda: None, wd)
    dump_state(cfg, me.index, model)
    for s in range(cfg["shards"]):
        rpc.rpc_sync(f"shard{s}", _tp_done, args=(me.index,), timeout=timeout)
    wd.kick("rpc shutdown")
    rpc.shutdown(graceful=True, timeout=timeout)
    leave_store(store, me, timeout)
    return result(cfg, me.index, times, losses)
