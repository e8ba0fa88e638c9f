"""Steps/s of a 25 MB MLP for one PS block size: BS=1048576 rdmaflow launch --nproc-per-node 2 --shards-per-node 2 examples/ps_block_size.py"""
import json
import os
import time

import torch

from rdmaflow import ps

ctx = ps.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 10))
bs = int(os.environ["BS"])
opt = ps.DistributedOptimizer(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), policy="block", block_bytes=bs)
x = torch.randn(8, 1024); y = torch.randint(0, 10, (8,))
for i in range(25):
    if i == 5: t0 = time.monotonic()
    opt.zero_grad(); torch.nn.functional.cross_entropy(model(x), y).backward(); opt.step()
dt = time.monotonic() - t0
if ctx.role.index == 0:
    print(json.dumps({"block_bytes": bs, "steps_per_s": 20 / dt, "model_mb": sum(p.numel() for p in model.parameters()) * 4 / 1e6}), flush=True)
opt.close()
