"""The synchronous parameter-server shard that the tensorpipe and grpc baselines of
``rdmaflow bench train`` share: variables round-robin over the shards; a step is applied (the
mean of every worker's gradients, SGD) once every worker's gradients for it are in, and the new
weights go to every worker of the step."""
from __future__ import annotations

import threading

import torch

from rdmaflow.bench.train_job import build_model, make_sgd


def variables_of(params: list, shard: int, shards: int) -> list[int]:
    """Indices of the variables shard ``shard`` holds: round-robin over the model's parameters."""
    return [i for i in range(len(params)) if i % shards == shard]


class SyncShard:
    """A shard's variables and its SGD; applies a step once every worker's gradients for it
    arrived (their mean), then delivers the new weights to every worker of the step."""

    def __init__(self, cfg: dict, shard: int, on_progress=None):
        model = build_model(cfg)
        params = list(model.parameters())
        self.index = shard
        self.workers = cfg["workers"]
        self.vars = [torch.nn.Parameter(params[i].detach().clone()) for i in variables_of(params, shard, cfg["shards"])]
        del model, params
        self.acc = [torch.zeros_like(p) for p in self.vars]
        self.opt = make_sgd(self.vars, cfg) if self.vars else None
        self.lock = threading.Lock()
        self.step = 0
        self.arrived: set[int] = set()
        self.waiters: list = []
        self.done: set[int] = set()
        self.all_done = threading.Event()
        self.failed: str | None = None
        self.on_progress = on_progress or (lambda what: None)

    def weights(self) -> list:
        return [p.detach() for p in self.vars]

    def push(self, step: int, worker: int, grads: list, deliver) -> None:
        """``deliver(weights, None)`` once step ``step`` is applied, or ``deliver(None, exc)``."""
        with self.lock:
            err = self.failed
            if err is None and (step != self.step + 1 or worker in self.arrived):
                err = f"shard {self.index}: worker {worker} pushed step {step}, the shard is at step {self.step + 1}"
            if err is None and (not 0 <= worker < self.workers or len(grads) != len(self.vars)):
                err = (f"shard {self.index}: bad push from worker {worker} ({len(grads)} gradients, "
                       f"{len(self.vars)} variables)")
            if err is not None:
                self.failed = self.failed or err
                waiters, self.waiters = self.waiters, []
            else:
                first = not self.arrived
                with torch.no_grad():
                    for a, g in zip(self.acc, grads):
                        g = g.reshape(a.shape)
                        if first:
                            a.copy_(g)
                        else:
                            a.add_(g)
                self.arrived.add(worker)
                self.waiters.append(deliver)
                if len(self.arrived) < self.workers:
                    return
                for p, a in zip(self.vars, self.acc):
                    p.grad = a.div_(self.workers)
                if self.opt is not None:
                    self.opt.step()
                self.step += 1
                self.arrived = set()
                waiters, self.waiters = self.waiters, []
        if err is not None:
            exc = RuntimeError(err)
            for d in waiters + [deliver]:
                d(None, exc)
            return
        self.on_progress(f"step {self.step}")
        w = self.weights()
        for d in waiters:
            d(w, None)

    def finish(self, worker: int) -> None:
        with self.lock:
            self.done.add(worker)
            if len(self.done) >= self.workers:
                self.all_done.set()
        self.on_progress(f"worker {worker} done")

    def wait_done(self) -> None:
        # Bounded by the watchdog: every step or finished worker is progress.
        while not self.all_done.wait(0.2):
            pass


def ps_setup(cfg: dict, model) -> tuple[list, list[list[int]]]:
    params = list(model.parameters())
    return params, [variables_of(params, s, cfg["shards"]) for s in range(cfg["shards"])]


def grads_of(params: list, idx: list[int]) -> list:
    out = []
    for i in idx:
        g = params[i].grad
        out.append(torch.zeros_like(params[i]) if g is None else g.detach())
    return out


def copy_weights(params: list, idx: list[int], weights: list) -> None:
    if len(weights) != len(idx):
        raise RuntimeError(f"a shard answered {len(weights)} tensors for {len(idx)} variables")
    with torch.no_grad():
        for i, w in zip(idx, weights):
            params[i].copy_(w.reshape(params[i].shape))
