"""``local`` of ``rdmaflow bench train``: single-process training (``torch.optim.SGD`` in the
process), no communication: the "Local" line of Figure 11."""
from __future__ import annotations

from rdmaflow.bench.train_job import (
    ProcessRole,
    Watchdog,
    build_model,
    dump_state,
    make_sgd,
    result,
    train_loop,
)


def run(cfg: dict, me: ProcessRole, wd: Watchdog) -> dict:
    model = build_model(cfg)
    opt = make_sgd(model.parameters(), cfg)
    times, losses = train_loop(cfg, 0, model, opt.zero_grad, opt.step, lambda: None, wd)
    dump_state(cfg, 0, model)
    return result(cfg, 0, times, losses)
