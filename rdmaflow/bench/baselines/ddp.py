"""``ddp`` of ``rdmaflow bench train``: ``DistributedDataParallel`` over gloo (all-reduce of the
gradients, SGD on every worker)."""
from __future__ import annotations

from datetime import timedelta

from rdmaflow.bench.train_job import (
    ProcessRole,
    Watchdog,
    build_model,
    dump_state,
    leave_store,
    make_sgd,
    make_store,
    point_at_interface,
    result,
    train_loop,
)


def run(cfg: dict, me: ProcessRole, wd: Watchdog) -> dict:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    timeout = cfg["timeout"]
    point_at_interface(me.master_addr, "GLOO_SOCKET_IFNAME")
    store = make_store(me, timeout)
    dist.init_process_group("gloo", store=store, rank=me.rank, world_size=me.world_size,
                            timeout=timedelta(seconds=timeout))
    wd.kick("DistributedDataParallel setup")
    model = build_model(cfg)
    ddp = DistributedDataParallel(model)
    opt = make_sgd(ddp.parameters(), cfg)
    wd.kick("training")
    times, losses = train_loop(cfg, me.index, ddp, opt.zero_grad, opt.step, lambda: None, wd)
    dump_state(cfg, me.index, model)
    # Rank 0 serves the store: it leaves last, once every rank is past its last collective.
    dist.destroy_process_group()
    leave_store(store, me, timeout)
    return result(cfg, me.index, times, losses)
