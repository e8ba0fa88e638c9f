"""Steps/s of a model of many small tensors (docs/benchmarks.md, "Many small tensors"):
POLICY=variable rdmaflow launch --nproc-per-node 2 --shards-per-node 2 examples/ps_small_tensors.py

LAYERS scale-and-shift layers of WIDTH floats (two tensors each) between two linear layers:
a step moves little data in many tensors, so what it costs is the number of messages."""
import json
import os
import time

import torch

from rdmaflow import ps


class ScaleShift(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(n))
        self.b = torch.nn.Parameter(torch.zeros(n))

    def forward(self, h):
        return h * (1 + self.a) + self.b


ctx = ps.init()
torch.manual_seed(0)
layers, width = int(os.environ.get("LAYERS", "200")), int(os.environ.get("WIDTH", "64"))
model = torch.nn.Sequential(torch.nn.Linear(width, width), *[ScaleShift(width) for _ in range(layers)],
                            torch.nn.Linear(width, 10))
policy = os.environ.get("POLICY", "variable")
opt = ps.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), policy=policy)
x = torch.randn(8, width)
y = torch.randint(0, 10, (8,))
warmup, steps = 10, int(os.environ.get("STEPS", "100"))
for i in range(warmup + steps):
    if i == warmup:
        t0 = time.monotonic()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
dt = time.monotonic() - t0
if ctx.role.index == 0:
    print(json.dumps({"policy": policy, "tensors": len(list(model.parameters())),
                      "push_writes_per_step": getattr(opt.worker, "push_writes", -1) / (warmup + steps),
                      "steps_per_s": steps / dt}), flush=True)
opt.close()
