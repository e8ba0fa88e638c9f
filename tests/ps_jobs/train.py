"""A parameter-server training job for tests/test_ps.py: a small deterministic MLP.

Run it as one process of a job (any launcher that sets torchrun's variables, or the test's own
direct start); it reads its configuration, a JSON object, from ``$PS_TEST_CONFIG``:

    mode, staleness, policy, block_bytes    -> DistributedOptimizer
    optim ("sgd" | "adam"), lr              -> the torch optimizer (see make_optimizer)
    head_only                               -> it holds only the last layer's parameters
    schedule                                -> hyperparameters change during training (see reschedule)
    wrapper_schedule                        -> LR schedulers made on the DistributedOptimizer itself
              (make_schedulers), stepped after each step()
    after_last_step "state_dict" | "synchronize": right after the last step(), before close(), a
              worker saves ``state{w}.pt``: its model.state_dict(), or after opt.synchronize() its
              parameters read directly (what a checkpoint saved at the end of training holds)
    steps, batch, seed                      -> worker w's batch of step t is make_batch(seed, w, t, batch)
    out                                     -> directory for the results (below)
    model     "many": every process builds the many-small-tensors model (make_model);
              "unused": the MLP and a layer its forward never uses; "unused_large": that layer
              large enough that backward pushes it on its own (above BATCH_BYTES); "wide": an
              MLP whose first layer (1 MiB) is the last gradient backward pushes before step()
    clip                                    -> torch.nn.utils.clip_grad_norm_(params, clip)
              between backward and step() (the worker's own gradient, as clip_reference does)
    inplace_zero                            -> gradients zeroed with the model's
              zero_grad(set_to_none=False), in place, right after step() (not the optimizer's)
    discard                                 -> each step first runs a backward that also reaches
              the unused layer, then zeroes (the step's loss was thrown away), as discarded_backward
    model_zero                              -> with keep_grads, zeroed with the model's
              zero_grad(set_to_none=False) before backward, in place (the optimizer never sees it)
    variant   {worker: "extra"|"names"|"shape"|"dtype"}: that worker builds a different model
    setup_after_store_gone {worker: seconds}: that worker creates its DistributedOptimizer only
              once the job's store is unreachable (or after that many seconds)
    slow      {"worker": w, "delay": s}: worker w sleeps s seconds before each step
    step_delay                              -> every worker sleeps that long before each step
    track_gap                               -> workers count how far ahead of the others they run
    fast_exit                               -> os._exit(0) once everything is closed and written
    init_exit_shards                        -> ps.init() exits the shards (the library's own path)
    stats_from_store                        -> worker 0 writes the shards' statistics from the store
    overlap, zero_copy, min_workers, checkpoint_dir, checkpoint_every, log_every -> DistributedOptimizer
    die       {"worker": w, "step": t}: worker w SIGKILLs itself after step t (a worker failure)

A resumed job (RDMAFLOW_RESUME=1) runs from the optimizer's step_count to ``steps``, so its
batches are those the interrupted job would have used.

Results: a worker writes ``worker{w}.pt`` (torch.save of its final parameters, losses and the
largest gap it observed); a shard writes ``shard{i}.json`` (its statistics). Every worker
prints ``worker {w} step {t}`` after each step, so a test can see the job is training. On odd
steps a worker clears its gradients with ``model.zero_grad(set_to_none=True)``, on even steps
with the optimizer's ``zero_grad()``; with ``keep_grads`` always the optimizer's
``zero_grad(set_to_none=False)``.

The model, the batches and the optimizer are module functions so that the test process can
build the single-process reference from exactly the same definitions.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

IN, HIDDEN, OUT = 8, 16, 2


WIDE = 32768  # the "wide" model's hidden layer
MANY = 60  # scale-and-shift layers of the "many" model: 2 * 60 + 4 tensors, most of 16 floats


class ScaleShift(torch.nn.Module):
    """h * (1 + a) + b, elementwise: two small tensors per layer."""

    def __init__(self, n: int, seed: int):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(0.1 * torch.randn(n, generator=g))
        self.b = torch.nn.Parameter(0.1 * torch.randn(n, generator=g))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * (1 + self.a) + self.b


class WithUnused(torch.nn.Module):
    """The MLP, and a layer that its forward never uses."""

    def __init__(self, unused_out: int = OUT):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
        self.unused = torch.nn.Linear(IN, unused_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def make_model(seed: int, variant: str | None = None) -> torch.nn.Module:
    """The job's model; ``variant`` builds a model that differs from it (an extra layer, other
    parameter names, a different shape, a different dtype), or "many": the same MLP with MAX
    scale-and-shift layers between, a model of many small tensors."""
    torch.manual_seed(seed)
    if variant == "many":
        return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                                   *[ScaleShift(HIDDEN, seed * 1000 + i) for i in range(MANY)],
                                   torch.nn.Linear(HIDDEN, OUT))
    if variant == "unused":  # a layer the forward never reaches (an unused head): no gradients
        return WithUnused()
    if variant == "unused_large":  # its weight, 8 x 8200 floats, is over BATCH_BYTES
        return WithUnused(8200)
    if variant == "wide":
        return torch.nn.Sequential(torch.nn.Linear(IN, WIDE), torch.nn.Tanh(), torch.nn.Linear(WIDE, OUT))
    if variant == "extra":
        model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT),
                                    torch.nn.Linear(OUT, OUT))
    elif variant == "names":
        from collections import OrderedDict

        model = torch.nn.Sequential(OrderedDict(inp=torch.nn.Linear(IN, HIDDEN), act=torch.nn.Tanh(),
                                                out=torch.nn.Linear(HIDDEN, OUT)))
    elif variant == "shape":
        model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN + 1), torch.nn.Tanh(), torch.nn.Linear(HIDDEN + 1, OUT))
    else:
        model = torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))
    if variant == "dtype":
        model = model.double()
    elif variant not in (None, "", "extra", "names", "shape"):
        raise ValueError(f"unknown model variant {variant!r}")
    return model


TARGET = torch.tensor([[0.5, -1.0], [1.0, 0.25], [-0.5, 0.5], [0.25, 1.0],
                       [-1.0, -0.25], [0.75, 0.0], [0.0, -0.75], [0.5, 0.5]])


def make_batch(seed: int, worker: int, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker ``worker``'s batch for step ``step`` (0-based): a function of (seed, worker, step) only."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + worker * 10_007 + step)
    x = torch.randn(batch, IN, generator=g)
    y = torch.tanh(x @ TARGET)
    return x, y


def eval_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return make_batch(seed + 7919, 99, 0, 256)


def make_optimizer(params, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, betas=(0.9, 0.99), weight_decay=0.001)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    raise ValueError(f"unknown optimizer {name!r}")


def optimized_parameters(model: torch.nn.Module, cfg: dict):
    """What the torch optimizer holds: every parameter, or with ``head_only`` the last layer's
    (the others still require gradients, and stay as they are)."""
    return model[-1].parameters() if cfg.get("head_only") else model.parameters()


def reschedule(opt: torch.optim.Optimizer, scheduler, t: int) -> None:
    """After step t (0-based) of a ``schedule`` job: StepLR halves lr every two steps, and the
    weight decay is changed by hand after step 1."""
    scheduler.step()
    if t == 1:
        opt.param_groups[0]["weight_decay"] = 0.05


def make_schedulers(opt) -> list:
    """A ``wrapper_schedule`` job's LR schedulers, as users write them: StepLR halves lr every two
    steps, and CosineAnnealingLR on top anneals it over ten steps."""
    return [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), torch.optim.lr_scheduler.CosineAnnealingLR(opt, 10)]


def loss_fn(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dtype = next(model.parameters()).dtype  # a float64 variant gets float64 data
    return torch.nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype))


def discarded_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    """A backward whose gradients the loop then zeroes: every parameter, the unused layer too."""
    (3 * loss_fn(model, x, y) + model.unused(x).square().mean()).backward()


def save_after_last_step(cfg: dict, model: torch.nn.Module, opt, path: str) -> None:
    """What a user saves at the end of training, right after the last step() (overlap: the
    step's weights may still be on the wire)."""
    if cfg["after_last_step"] == "state_dict":
        torch.save(model.state_dict(), path)
    else:
        opt.synchronize()
        torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, path)


def trace(msg: str) -> None:
    """Timestamps on stderr with $PS_TEST_TRACE=1 (to see where a slow job spends its time)."""
    if os.environ.get("PS_TEST_TRACE"):
        print(f"[{time.time():.3f} cpu {time.process_time():.2f}] {msg}", file=sys.stderr, flush=True)


def finish(cfg: dict) -> None:
    """Ends a process that has closed everything and written its results. ``fast_exit`` skips
    the interpreter's teardown of torch (most of a second of CPU per process on a small machine);
    tests that check the ordinary exit path leave it off."""
    sys.stdout.flush()
    sys.stderr.flush()
    if cfg.get("fast_exit"):
        os._exit(0)


def main() -> None:
    cfg = json.loads(os.environ["PS_TEST_CONFIG"])
    out = cfg["out"]
    trace("started")
    from rdmaflow import ps

    # With init_exit_shards a shard serves inside ps.init() and exits the process there (the
    # library's own path); otherwise ps.init() returns the shard's statistics.
    res = ps.init(exit_shards=bool(cfg.get("init_exit_shards")))
    if isinstance(res, dict):  # a shard: its statistics
        ctx = res.pop("ctx")
        with open(os.path.join(out, f"shard{ctx.role.index}.json"), "w") as f:
            json.dump(res, f)
        ctx.close()
        trace("shard done")
        return finish(cfg)
    ctx = res
    w = ctx.role.index
    seed = int(cfg.get("seed", 0))
    model = make_model(seed, (cfg.get("variant") or {}).get(str(w)) or cfg.get("model"))
    linger = (cfg.get("setup_after_store_gone") or {}).get(str(w))
    if linger:
        # Joins late: once the process serving the job's store has exited (bounded).
        deadline = time.monotonic() + float(linger)
        while time.monotonic() < deadline:
            try:
                ctx.store.tcp.check(["rdmaflow/ps/config"])
            except Exception:  # noqa: BLE001 - the store is gone
                break
            time.sleep(0.05)
        trace("joining")
    torch_opt = make_optimizer(optimized_parameters(model, cfg), cfg.get("optim", "sgd"), float(cfg["lr"]))
    scheduler = torch.optim.lr_scheduler.StepLR(torch_opt, 2, 0.5) if cfg.get("schedule") else None
    opt = ps.DistributedOptimizer(model, torch_opt,
                                  mode=cfg.get("mode", "sync"), staleness=int(cfg.get("staleness", 0)),
                                  policy=cfg.get("policy", "block"), block_bytes=int(cfg.get("block_bytes", 256)),
                                  **{k: cfg[k] for k in ("overlap", "zero_copy", "min_workers", "checkpoint_dir",
                                                         "checkpoint_every", "log_every") if k in cfg})
    trace("optimizer ready")
    schedulers = make_schedulers(opt) if cfg.get("wrapper_schedule") else []
    state_refused = None
    if schedulers:  # the optimizer state is the shards': the wrapper's state_dict() says where it is
        try:
            opt.state_dict()
        except Exception as e:  # noqa: BLE001 - the test checks what was raised
            state_refused = f"{type(e).__name__}: {e}"
    lrs = []
    slow = cfg.get("slow") or {}
    delay = float(cfg.get("step_delay", 0.0)) + (float(slow["delay"]) if slow.get("worker") == w else 0.0)
    track = bool(cfg.get("track_gap"))
    nw = ctx.role.num_workers
    losses, observed_gap = [], None
    die = cfg.get("die") or {}
    start = opt.step_count
    for t in range(start, int(cfg["steps"])):
        if delay:
            time.sleep(delay)
        x, y = make_batch(seed, w, t, int(cfg.get("batch", 4)))
        if cfg.get("discard"):
            discarded_backward(model, x, y)
        if cfg.get("inplace_zero"):
            pass  # after the previous step() (below)
        elif cfg.get("keep_grads") and cfg.get("model_zero"):
            model.zero_grad(set_to_none=False)  # after a step(), which waited until its push left
        elif cfg.get("keep_grads"):
            # Through the optimizer, which switches send buffers: the model's zero_grad would zero
            # in place the buffer the last push may still be sending (docs/parameter-server.md).
            opt.zero_grad(set_to_none=False)
        elif t % 2:
            # What many loops do: gradients set to None, then fresh tensors from backward (the
            # worker copies them back into its registered buffer).
            model.zero_grad(set_to_none=True)
        else:
            opt.zero_grad()
        loss = loss_fn(model, x, y)
        loss.backward()
        if cfg.get("clip"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), float(cfg["clip"]))
        if track:
            # Announced before the push: once a shard has applied this worker's step t+1,
            # the store already says so.
            ctx.store.set(f"test/pushed/{w}", str(t + 1))
        opt.step(loss=loss)  # for the log_every lines
        if cfg.get("inplace_zero"):
            model.zero_grad(set_to_none=False)  # the buffers the push just sent from
        if t == int(cfg["steps"]) - 1 and cfg.get("after_last_step"):
            save_after_last_step(cfg, model, opt, os.path.join(out, f"state{w}.pt"))
        if scheduler is not None:
            reschedule(torch_opt, scheduler, t)
        for s in schedulers:
            s.step()
        lrs.append(torch_opt.param_groups[0]["lr"])  # the wrapped optimizer's: what the shards get
        losses.append(loss.item())
        if track:
            # How far ahead of every other still-running worker this one got, counted: its
            # step t+1 is done, and each other worker has pushed `pushed` steps.
            for v in range(nw):
                if v == w or ctx.store.check(f"test/done/{v}"):
                    continue
                pushed = int(ctx.store.get(f"test/pushed/{v}")) if ctx.store.check(f"test/pushed/{v}") else 0
                gap = t + 1 - pushed
                observed_gap = gap if observed_gap is None else max(observed_gap, gap)
        print(f"worker {w} step {t + 1} loss {loss.item():.6f}", flush=True)
        if die.get("worker") == w and die.get("step") == t + 1:
            os.kill(os.getpid(), 9)
    if track:
        ctx.store.set(f"test/done/{w}", "1")
    trace("trained")
    opt.close()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.save({"params": params, "losses": losses, "observed_gap": observed_gap, "steps": opt.step_count,
                "start": start, "bubbles": list(getattr(opt.worker, "bubbles", [])),
                "push_writes": opt.worker.push_writes, "lrs": lrs,
                "state_refused": state_refused},
               os.path.join(out, f"worker{w}.pt"))
    if cfg.get("stats_from_store") and w == 0:
        # The shards publish their statistics in the store when the job ends (Shard.run).
        for s in range(ctx.role.num_shards):
            stats = ctx.store.get(f"stats/shard/{s}", timeout=30.0)
            with open(os.path.join(out, f"shard{s}.json"), "w") as f:
                f.write(stats)
    print(f"worker {w} done", flush=True)
    ctx.close()
    trace("worker done")
    finish(cfg)


if __name__ == "__main__":
    main()
