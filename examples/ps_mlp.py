"""A parameter-server job: run with `rdmaflow launch --nproc-per-node 2 examples/ps_mlp.py`."""
import torch

from rdmaflow import ps

ctx = ps.init()                  # shards serve inside init() and exit when the job ends
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = ps.DistributedOptimizer(
    model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4),
    mode="sync", policy="block", log_every=50)

g = torch.Generator().manual_seed(1 + ctx.role.index)   # each worker its own data
w_true = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
for step in range(200):
    x = torch.randn(64, 32, generator=g)
    y = x @ w_true
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
print(f"worker {ctx.role.index}: loss {loss.item():.4f}")
opt.close()
