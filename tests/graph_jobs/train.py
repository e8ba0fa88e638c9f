"""A pipeline job for tests/test_graph_*.py: one process per stage, models and batches that the
test process rebuilds for its single-process reference.

Configuration: a JSON object in ``$GRAPH_TEST_CONFIG``:

    model       "mlp" | "cnn" | "transformer" (sequence length changes per step, Dim(16, 512)) |
                "masked" (stage 0 sends the rows a boolean mask selects: a data-dependent shape) |
                "shared" (a constant buffer and a frozen parameter used by both stages)
                                         stages      2 | 3 (split points of that model)
    schedule    "gpipe" | "1f1b"         inference   true: forward only, no loss
    microbatches, batch, steps, lr, seed, zero_copy (allocation-site placement: true/"auto", "always", false)
    trace       record the executor's events
    out         directory for the results: rank{r}.pt (parameters by name, losses, outputs,
                the send statistics, explain(), the trace)
    split_differs  {rank: "alt" | n}: that rank cuts the model at other points (same number of
                   stages), or into n stages
    bad_input      a rank 0 whose batch in step 1 has another shape (dtype with "dtype")
    die            {"rank": r, "step": t}: rank r SIGKILLs itself in the forward of microbatch 1
                   of step t (mid-step: its peers have transfers in flight)
    slow_forward   seconds stage 0 sleeps before each forward after the first (stage 1 computes
                   microbatch 0 while the receive of microbatch 1 is pending)
    slow_start     seconds stage 0 sleeps before its first step (others wait on receives)
    too_long       {"step": t, "length": n}: rank 0's batch of step t has sequence length n
    no_target      the last rank calls step() of step 1 without its target=
    rank_steps     {rank: n}: that rank runs n steps, not steps
    meta           every rank makes and captures the model on the meta device; "materialize":
                   each stage then gives its part memory and loads that part's weights
    second_pipeline  every rank also builds a forward-only pipeline of a fresh copy of the model
                   while the first one lives, runs batch 0 through it before training, and
                   closes it last (rank{r}.pt's "second_outputs": the last stage's output)

Every rank prints ``rank {r} step {t}`` after each step.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

from rdmaflow import graph
from rdmaflow.bench import pipeline_models

IN, HIDDEN, OUT = 8, 32, 4
D_MODEL, HEADS = 16, 2
MIN_LEN, MAX_LEN = 16, 512    # the transformer's declared sequence lengths (the bounded path)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(
            torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, OUT))

    def forward(self, x):
        return self.layers(x)


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(4, 8, 3, padding=1)
        self.pool = torch.nn.MaxPool2d(2)
        self.fc = torch.nn.Linear(8 * 4 * 4, OUT)

    def forward(self, x):
        h = self.pool(torch.relu(self.conv1(x)))
        h = self.pool(torch.relu(self.conv2(h)))
        return self.fc(torch.flatten(h, 1))


class Transformer(pipeline_models.Transformer):
    """[batch, length, IN] -> [batch, length, OUT], three blocks (the benchmark's model, smaller);
    the length changes from batch to batch."""

    def __init__(self):
        super().__init__(IN, D_MODEL, HEADS, 3, OUT)


class Masked(torch.nn.Module):
    """Stage 0 keeps the rows whose features sum above zero: how many depends on the data."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(IN, HIDDEN)
        self.b = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        rows = h[h.sum(1) > 0]
        return self.b(rows).mean(0, keepdim=True)


class Shared(torch.nn.Module):
    """A constant buffer (as a causal mask or a rotary table is) and a frozen parameter, each
    used by both stages: each stage holds them."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(IN, HIDDEN)
        self.b = torch.nn.Linear(HIDDEN, OUT)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, HIDDEN))
        self.shift = torch.nn.Parameter(torch.randn(HIDDEN), requires_grad=False)

    def forward(self, x):
        h = torch.tanh(self.a(x) * self.scale + self.shift)
        return self.b(h) * self.scale[:OUT] + self.shift[:OUT]


# split_spec of each model for 2 and 3 stages
SPLITS = {
    "mlp": {2: {"layers.2": graph.SplitPoint.BEGINNING}, "alt": {"layers.4": graph.SplitPoint.BEGINNING},
            3: {"layers.2": graph.SplitPoint.BEGINNING, "layers.4": graph.SplitPoint.BEGINNING}},
    "cnn": {2: {"conv2": graph.SplitPoint.BEGINNING},
            3: {"conv2": graph.SplitPoint.BEGINNING, "fc": graph.SplitPoint.BEGINNING}},
    "transformer": {2: {"blocks.1": graph.SplitPoint.BEGINNING},
                    3: {"blocks.1": graph.SplitPoint.BEGINNING, "blocks.2": graph.SplitPoint.BEGINNING}},
    "masked": {2: {"b": graph.SplitPoint.BEGINNING}},
    "shared": {2: {"b": graph.SplitPoint.BEGINNING}},
}
# models whose loss over a batch is the mean of their microbatches' losses, not one loss of the batch
PER_MICROBATCH = {"masked"}


def make_model(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return {"mlp": MLP, "cnn": CNN, "transformer": Transformer, "masked": Masked,
            "shared": Shared}[name]()


def seq_length(seed: int, step: int) -> int:
    """The transformer's sequence length in step ``step``: a different one every step."""
    return MIN_LEN + (seed * 31 + step * 53) % 49


def make_batch(name: str, seed: int, step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 7919 + step)
    if name == "transformer":
        n = seq_length(seed, step)
        return torch.randn(batch, n, IN, generator=g), torch.randn(batch, n, OUT, generator=g)
    x = torch.randn(batch, 1, 16, 16, generator=g) if name == "cnn" else torch.randn(batch, IN, generator=g)
    y = torch.randn(batch, OUT, generator=g)
    return x, y


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output.expand_as(target), target)  # masked: one output row


def dynamic_shapes(name: str):
    return ({1: torch.export.Dim("seq", min=MIN_LEN, max=MAX_LEN)},) if name == "transformer" else None


def main() -> int:
    cfg = json.loads(os.environ["GRAPH_TEST_CONFIG"])
    rank = int(os.environ["RANK"])
    name, seed, batch, M = cfg["model"], cfg.get("seed", 1), cfg.get("batch", 16), cfg.get("microbatches", 4)
    stages = cfg.get("stages", 2)
    split = SPLITS[name][cfg.get("split_differs", {}).get(str(rank), stages)]
    x0, _ = make_batch(name, seed, 0, batch)
    meta = cfg.get("meta")
    if meta:  # made and captured on the meta device: no rank holds the whole model's weights
        with torch.device("meta"):
            model = make_model(name, seed)
        example = x0[: batch // M].to("meta")
    else:
        model, example = make_model(name, seed), x0[: batch // M]
    pipe = graph.pipeline(model, (example,), split_spec=split, dynamic_shapes=dynamic_shapes(name))
    stage = pipe.build_stage(zero_copy=cfg.get("zero_copy", True), trace=cfg.get("trace", False))
    if meta == "materialize":  # each stage makes its own part, then loads it (as from a checkpoint)
        stage.submod.to_empty(device="cpu")
        whole = make_model(name, seed).state_dict()
        stage.submod.load_state_dict({k: whole[k] for k in stage.submod.state_dict()})
    sched_cls = graph.Schedule1F1B if cfg.get("schedule") == "1f1b" else graph.ScheduleGPipe
    inference = cfg.get("inference", False)
    schedule = sched_cls(stage, M, loss_fn=None if inference else loss_fn)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=cfg.get("lr", 0.05))
    forwards = [0]

    def before_forward(*_):
        forwards[0] += 1
        die = cfg.get("die", {})
        if die.get("rank") == rank and forwards[0] == die["step"] * M + 2:
            os.kill(os.getpid(), 9)
        if cfg.get("slow_forward") and stage.is_first and forwards[0] > 1:
            time.sleep(cfg["slow_forward"])

    stage.submod.register_forward_pre_hook(before_forward)
    second, second_outputs = None, []
    if cfg.get("second_pipeline"):  # a second pipeline of this job, built while the first lives
        model2 = make_model(name, seed)
        pipe2 = graph.pipeline(model2, (x0[: batch // M],), split_spec=split, dynamic_shapes=dynamic_shapes(name))
        second = pipe2.build_stage(zero_copy=cfg.get("zero_copy", True))
        with torch.no_grad():
            second_outputs.append(graph.ScheduleGPipe(second, M).step(x0))
    if cfg.get("slow_start") and stage.is_first:
        time.sleep(cfg["slow_start"])
    losses, outputs = [], []
    try:  # closed on the way out of a failed step too, as `with`/finally code does
        for t in range(cfg.get("rank_steps", {}).get(str(rank), cfg.get("steps", 3))):
            x, y = make_batch(name, seed, t, batch)
            if cfg.get("bad_input") and rank == 0 and t == 1:
                x = x.double() if cfg["bad_input"] == "dtype" else x[:, :-1]
            if cfg.get("too_long", {}).get("step") == t and rank == 0:
                x = torch.randn(x.shape[0], cfg["too_long"]["length"], *x.shape[2:])
            opt.zero_grad()
            target = {} if cfg.get("no_target") and stage.is_last and t == 1 else {"target": y}
            out = schedule.step(x, losses=losses, **target)
            if inference:
                outputs.append(out)
            else:
                opt.step()
            print(f"rank {rank} step {t}", flush=True)
        result = {
            "params": {k: v.detach().clone() for k, v in stage.submod.named_parameters()},
            "losses": [float(v) for v in losses],
            "outputs": outputs,
            "stats": stage.send_stats,
            "explain": stage.explain(),
            "trace": stage.trace,
            "placed": stage.placement.placed,
            "second_outputs": second_outputs,
        }
        torch.save(result, os.path.join(cfg["out"], f"rank{rank}.pt"))
    finally:
        stage.close()
        if second is not None:
            second.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
