"""A parameter-server job that trains FCN-5 on CPU or on CUDA, for tests/test_ps_cuda.py.

Run it as one process of a job (the tests start it with torchrun's variables, like
tests/ps_jobs/train.py); it reads its configuration, a JSON object, from ``$PS_TEST_CONFIG``:

    device    "cpu" or "cuda": where the worker's model lives
    shard_device  "cpu" (default) or "cuda": where the shards keep weights and run the optimizer
    steps, batch, batches, seed, lr, out
              worker w trains ``steps`` steps of Adam (lr) on the shards; step t's mini-batch is
              batch t % batches of a fixed set drawn from ``seed`` (the same on every device)
    policy    DistributedOptimizer's placement (default "block")

The model, the data and the loss are module functions so that the test (and a single-process
run) use exactly the same definitions. A worker writes ``worker{w}.pt``: its loss of every
step, the seconds its steps took, and on CUDA where its parameters and gradients were: inside
the GPU arena's registered region or not, and whether backward accumulated into the gradient
buffer in place (the same address before and after). A shard writes ``shard{i}.json``.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from rdmaflow.bench import models

MODEL = "fcn5"


def make_model(seed: int) -> torch.nn.Module:
    """FCN-5 (784 -> 4096 x 4 -> 10, sigmoid), initialised on the CPU from ``seed``."""
    return models.build(MODEL, seed)


def make_batches(seed: int, batch: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``count`` fixed mini-batches of random inputs and labels, drawn on the CPU."""
    g = torch.Generator().manual_seed(seed + 1)
    return [models.synthetic_batch(MODEL, batch, g) for _ in range(count)]


loss_fn = models.loss_fn(MODEL)


def make_optimizer(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=lr)


def in_region(t: torch.Tensor, region) -> bool:
    ptr, n = t.data_ptr(), t.numel() * t.element_size()
    return region.address <= ptr and ptr + n <= region.address + region.nbytes


def main() -> None:
    cfg = json.loads(os.environ["PS_TEST_CONFIG"])
    out = cfg["out"]
    # Full float32 matmuls on the GPU (no TF32): the CPU run is the reference.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from rdmaflow import ps

    res = ps.init(exit_shards=False)
    if isinstance(res, dict):  # a shard: its statistics
        ctx = res.pop("ctx")
        with open(os.path.join(out, f"shard{ctx.role.index}.json"), "w") as f:
            json.dump(res, f)
        ctx.close()
        sys.stdout.flush()
        os._exit(0)
    ctx = res
    w = ctx.role.index
    device = torch.device(cfg["device"])
    seed = int(cfg["seed"])
    model = make_model(seed).to(device)
    opt = ps.DistributedOptimizer(model, make_optimizer(model.parameters(), float(cfg["lr"])),
                                  policy=cfg.get("policy", "block"), shard_device=cfg.get("shard_device", "cpu"))
    params = list(model.parameters())
    region = ctx.device.gpu_arena().region if device.type == "cuda" else None
    where: list[str] = []  # what was found outside the GPU arena, or moved

    def check(when: str, step: int) -> None:
        for i, p in enumerate(params):
            if not in_region(p.data, region):
                where.append(f"step {step} {when}: parameter {i} is not in the GPU arena")
            if p.grad is None or not in_region(p.grad, region):
                where.append(f"step {step} {when}: the gradient of parameter {i} is not in the GPU arena")

    batches = [(x.to(device), y.to(device)) for x, y in make_batches(seed, int(cfg["batch"]), int(cfg["batches"]))]
    losses, times = [], []
    for t in range(int(cfg["steps"])):
        t0 = time.monotonic()
        x, y = batches[t % len(batches)]
        opt.zero_grad()
        if region is not None:
            check("after zero_grad", t)
            before = [p.grad.data_ptr() for p in params]
        loss = loss_fn(model(x), y)
        loss.backward()
        if region is not None:
            check("after backward", t)
            if [p.grad.data_ptr() for p in params] != before:
                where.append(f"step {t}: backward did not accumulate into the registered gradient buffer")
        opt.step()
        losses.append(loss.item())
        times.append(time.monotonic() - t0)
        print(f"worker {w} step {t + 1} loss {losses[-1]:.6f}", flush=True)
    opt.close()
    torch.save({"losses": losses, "times": times, "device": str(device), "outside": where[:20],
                "region_cuda_device": None if region is None else region.cuda_device,
                "grad_device": str(params[0].grad.device)},
               os.path.join(out, f"worker{w}.pt"))
    print(f"worker {w} done", flush=True)
    ctx.close()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
