"""A parameter-server job: run with `rdmaflow launch --nproc-per-node 2 examples/ps_mlp.py [OUT.pt]`."""
import os
import sys
import tempfile

import torch

from rdmaflow import ps

ctx = ps.init()                  # shards serve inside init() and exit when the job ends
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = ps.DistributedOptimizer(
    model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
    mode="sync", policy="block", log_every=50)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100, gamma=0.5)  # takes the DistributedOptimizer

g = torch.Generator().manual_seed(1 + ctx.role.index)   # each worker its own data
w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
for step in range(200):
    x = torch.randn(64, 32, generator=g)
    y = x @ w_true
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step(loss=loss)          # loss: for the log_every lines
    sched.step()
print(f"worker {ctx.role.index}: loss {loss.item():.4f}")
if ctx.role.index == 0:          # sync mode: every worker holds the same weights
    out = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.gettempdir(), "ps_mlp.pt")
    torch.save(model.state_dict(), out)   # waits for the last step's weights, still on the wire
    print(f"worker 0: saved the trained model to {out}")
opt.close()
