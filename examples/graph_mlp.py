"""Pipeline-parallel training of an MLP in two stages over rdmaflow.graph.

    rdmaflow launch --nproc-per-node 1 examples/graph_mlp.py      # 2 processes: 2 stages
    RDMAFLOW_JOB_SECRET=$(openssl rand -hex 16) torchrun --nproc-per-node 2 examples/graph_mlp.py
    python examples/graph_mlp.py --single                          # the same training in one process

(``rdmaflow launch`` starts ``--nproc-per-node`` + ``--shards-per-node`` processes; a pipeline
job uses every one of them as a stage.) Rank 0 prints explain() with its observed sends; the last stage
prints its loss and every rank its steps per second.
"""
import argparse
import time

import torch

from rdmaflow import graph

p = argparse.ArgumentParser()
p.add_argument("--single", action="store_true", help="train in this process, without a pipeline")
p.add_argument("--steps", type=int, default=200)
p.add_argument("--batch", type=int, default=256)
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--microbatches", type=int, default=4)
args = p.parse_args()

torch.manual_seed(0)
H = args.hidden
model = torch.nn.Sequential(
    torch.nn.Linear(64, H), torch.nn.ReLU(), torch.nn.Linear(H, H), torch.nn.ReLU(),
    torch.nn.Linear(H, H), torch.nn.ReLU(), torch.nn.Linear(H, 1))
w_true = torch.randn(64, 1, generator=torch.Generator().manual_seed(7))
data = torch.Generator().manual_seed(1)


def batch():
    x = torch.randn(args.batch, 64, generator=data)
    return x, x @ w_true


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


if args.single:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    losses: list = []

    def step(x, y):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        losses.append(loss.detach())
        opt.step()

    last = True
else:
    # The changed lines: capture and split, build this rank's stage, a schedule, the stage's optimizer.
    mb = args.batch // args.microbatches
    pipe = graph.pipeline(model, (torch.randn(mb, 64),), split_spec={"4": graph.SplitPoint.BEGINNING})
    stage = pipe.build_stage()
    schedule = graph.ScheduleGPipe(stage, args.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.01)
    losses = []

    def step(x, y):
        opt.zero_grad()
        schedule.step(x, target=y, losses=losses)  # stage 0 uses x, the last stage y
        opt.step()

    last = stage.is_last

for t in range(args.steps):
    if t == 10:  # the first steps trace allocation sites and warm up
        t0 = time.perf_counter()
    step(*batch())
rate = (args.steps - 10) / (time.perf_counter() - t0)
if last:  # the mean of the last step's microbatch losses is the loss of its whole batch
    final = losses[-1:] if args.single else losses[-args.microbatches:]
    print(f"loss {sum(float(v) for v in final) / len(final):.4f}")
print(f"{'single process' if args.single else f'stage {stage.stage_index}'}: {rate:.1f} steps/s", flush=True)
if not args.single:
    if stage.is_first:  # the plan, with the sends this stage observed
        print(stage.explain(), flush=True)
    stage.close()
