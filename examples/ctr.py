"""A click-through-rate model: embedding bags over several sparse features with hashed int64 ids,
and an MLP on top; the embeddings live on the parameter server's shards, the MLP trains through
DistributedOptimizer, in one job (docs/parameter-server.md, "Several services in one job"):

    rdmaflow launch --nproc-per-node 2 --shards-per-node 2 examples/ctr.py [--steps 300]
    python examples/ctr.py --single --workers 2 [--steps 300]     # the same model in one process
    rdmaflow launch --nproc-per-node 2 --shards-per-node 0 examples/ctr.py --ddp   # DDP over gloo
    python examples/ctr.py --compare-ddp [--raw-ids 100000 --dim 16]   # both jobs' samples/s side by side

Data: every sample has a bag of ids per feature, drawn from a Zipf distribution over that
feature's raw ids (a few ids are in most samples, most ids are rare), and a click label drawn
from a fixed hidden model of those ids (so the loss can fall below log 2). A raw id is hashed
into the embedding table's key space. Worker w's batch at step t depends on (seed, t, w) only.

A step on each worker: pull the rows of the batch's unique keys (one-sided where the table allows), pool
them per feature (sum or mean, as ``nn.EmbeddingBag``), run the MLP, backward; push the
gradient rows' update ``-lr * grad / workers`` (the shards add it: plain SGD on the mean of the
workers' gradients), ``opt.step()`` for the MLP, then a barrier so that the next pull sees
every worker's update. ``--single`` trains the same model in plain torch on the concatenation
of the workers' batches; its loss matches the job's up to rounding. ``--ddp`` trains it with the
table replicated on every worker and its dense gradient allreduced by DDP over gloo every step,
as a user without a parameter server would.

The embeddings are a ``ps.SparseTable``: keys are the 64-bit hashed ids themselves, rows are made
on the shards when first pushed and read as zeros before. ``--table kv`` keeps them in a declared
``KVStore`` of ``--rows`` keys instead (the hashed ids modulo ``--rows``: ids that collide share
a row, in ``--single`` alike).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

MODES = ("sum", "mean")


def options(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--single", action="store_true", help="train the same model in one process, plain torch")
    p.add_argument("--ddp", action="store_true", help="train the same model by DDP over gloo (under a launcher)")
    p.add_argument("--compare-ddp", action="store_true",
                   help="run the job and the DDP job one after the other; print their samples/s")
    p.add_argument("--workers", type=int, default=2,
                   help="--single: the job's worker count to reproduce; --compare-ddp: the workers (and shards)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=256, help="samples per worker and step")
    p.add_argument("--features", type=int, default=4, help="sparse features (bags of ids) per sample")
    p.add_argument("--bag", type=int, default=3, help="ids per bag (feature f has 1 + f %% BAG)")
    p.add_argument("--raw-ids", type=int, default=20000, help="raw ids per feature")
    p.add_argument("--zipf", type=float, default=1.1, help="the Zipf exponent of the ids")
    p.add_argument("--table", choices=("sparse", "kv"), default="sparse",
                   help="the embeddings' service: a SparseTable keyed by the 64-bit hashed ids (default), or a "
                        "declared KVStore of --rows keys (the hashed ids modulo --rows)")
    p.add_argument("--rows", type=int, default=1 << 16, help="--table kv: the declared key space")
    p.add_argument("--dim", type=int, default=8, help="embedding dimension")
    p.add_argument("--hidden", type=int, default=64, help="the MLP's hidden width")
    p.add_argument("--lr", type=float, default=0.05, help="the MLP's SGD learning rate (momentum 0.9)")
    p.add_argument("--emb-lr", type=float, default=2.0, help="the embeddings' SGD learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--tail", type=int, default=50, help="the reported loss: the mean of the last TAIL steps")
    args = p.parse_args(argv)
    for name in ("workers", "steps", "batch", "features", "bag", "raw_ids", "rows", "dim", "hidden", "tail"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def mix64(x: int) -> int:
    """splitmix64's finalizer: a bijection of 64-bit integers that scatters neighbours."""
    x &= (1 << 64) - 1
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


class Data:
    """The synthetic click log: Zipf-distributed ids per feature, hashed keys, hidden-model labels."""

    def __init__(self, args):
        self.args = args
        nf, raw = args.features, args.raw_ids
        self.bags = [1 + f % args.bag for f in range(nf)]
        self.modes = [MODES[f % 2] for f in range(nf)]
        ranks = torch.arange(1, raw + 1, dtype=torch.float64)
        self.cdf = torch.cumsum(ranks.pow(-args.zipf), 0)
        self.cdf /= self.cdf[-1].clone()
        # Key of (feature f, raw id r): a 64-bit mix (splitmix64's) of f * raw + r, as an int64
        # (any int64 is a SparseTable key); a declared KVStore takes it modulo --rows.
        mixed = [mix64(i + args.seed * 0x632BE59BD9B4E019) for i in range(nf * raw)]
        if args.table == "kv":
            mixed = [m % args.rows for m in mixed]
        else:
            mixed = [m - (1 << 64) if m >= 1 << 63 else m for m in mixed]
        self.keys = torch.tensor(mixed, dtype=torch.int64).view(nf, raw)
        hidden = torch.Generator().manual_seed(10_007 + args.seed)
        self.weight = torch.randn(nf, raw, generator=hidden) * 1.5  # the hidden model: a score per id
        self.bias = -1.0

    def batch(self, step: int, worker: int):
        """Worker ``worker``'s samples of ``step``: per feature its keys [batch, bag], and the labels."""
        g = torch.Generator().manual_seed(((self.args.seed * 1_000_003 + step) * 1009 + worker) & (2**63 - 1))
        n = self.args.batch
        keys, logit = [], torch.full((n,), self.bias)
        for f, (bag, mode) in enumerate(zip(self.bags, self.modes)):
            raw = torch.searchsorted(self.cdf, torch.rand(n, bag, generator=g, dtype=torch.float64)).clamp_(
                max=self.args.raw_ids - 1)
            keys.append(self.keys[f][raw])
            w = self.weight[f][raw]
            logit += w.sum(1) if mode == "sum" else w.mean(1)
        labels = torch.bernoulli(torch.sigmoid(logit), generator=g)
        return keys, labels


def make_mlp(args) -> torch.nn.Module:
    torch.manual_seed(args.seed)
    return torch.nn.Sequential(torch.nn.Linear(args.features * args.dim, args.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(args.hidden, 1))


def forward(data: Data, mlp, index, labels, rows: torch.Tensor):
    """The loss of one batch: ``rows`` the embedding rows, ``index[f]`` where feature f's ids' rows
    are in it ([batch, bag]): nn.EmbeddingBag's computation, one bag per sample and feature."""
    pooled = [F.embedding_bag(i, rows, mode=mode) for i, mode in zip(index, data.modes)]
    logits = mlp(torch.cat(pooled, 1)).squeeze(1)
    return F.binary_cross_entropy_with_logits(logits, labels)


def lap(ms: dict, what: str, since: float) -> float:
    """Adds the milliseconds since ``since`` to ``ms[what]``; returns now."""
    now = time.perf_counter()
    ms[what] += 1e3 * (now - since)
    return now


def say(line: str) -> None:
    """One write per line: the workers share the launcher's pipe, and lines must not interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def report(losses: list[float], args, seconds: float, **extra) -> None:
    tail = losses[-args.tail:]
    res = {"loss": sum(tail) / len(tail), "first_loss": losses[0], "steps": len(losses),
           "samples_per_s": args.steps * args.batch * extra.pop("workers") / seconds, **extra}
    say("ctr result: " + json.dumps(res))


def single(args) -> None:
    """The same model in one process: one embedding table (every key of the hashed space that
    the data can produce), nn.EmbeddingBag's computation, the workers' batches concatenated."""
    data = Data(args)
    mlp = make_mlp(args)
    opt = torch.optim.SGD(mlp.parameters(), lr=args.lr, momentum=0.9)
    every = torch.unique(data.keys)  # every key the data can produce, a row each (ids that collide share it)
    table = torch.zeros(len(every), args.dim, requires_grad=True)  # the job's rows start at zero too
    losses, t0 = [], time.monotonic()
    for step in range(args.steps):
        parts = [data.batch(step, w) for w in range(args.workers)]
        keys = [torch.cat([p[0][f] for p in parts]) for f in range(args.features)]
        labels = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        table.grad = None
        loss = forward(data, mlp, [torch.searchsorted(every, k) for k in keys], labels, table)
        loss.backward()
        opt.step()
        with torch.no_grad():
            table -= args.emb_lr * table.grad
        losses.append(loss.item())
        if args.log_every and (step + 1) % args.log_every == 0:
            say(f"ctr single: step {step + 1}: loss {sum(losses[-args.log_every:]) / args.log_every:.4f}")
    report(losses, args, time.monotonic() - t0, workers=args.workers, mode="single")


def distributed(args) -> None:
    from rdmaflow import ps

    ctx = ps.init(services=("optimizer", args.table))  # shards serve both inside init() and exit when done
    w, nw = ctx.role.index, ctx.role.num_workers
    data = Data(args)
    mlp = make_mlp(args)  # the same initial weights on every worker (and in --single)
    opt = ps.DistributedOptimizer(mlp, torch.optim.SGD(mlp.parameters(), lr=args.lr, momentum=0.9),
                                  policy="variable")
    if args.table == "sparse":  # rows made on first touch, zeros until pushed; the shards add what comes
        table = ps.SparseTable("ctr", dim=args.dim, dtype=torch.float32, initializer="zeros", handler="add")
    else:
        table = ps.KVStore(range(args.rows), [(args.dim,)] * args.rows, torch.float32)  # zeros
    losses, t0 = [], time.monotonic()
    ms = dict.fromkeys(("data", "pull", "compute", "push", "step", "barrier"), 0.0)  # where a step's time goes
    for step in range(args.steps):
        t = time.perf_counter()
        keys, labels = data.batch(step, w)
        uniq, inverse = torch.unique(torch.cat([k.reshape(-1) for k in keys]), return_inverse=True)
        t = lap(ms, "data", t)
        rows = table.wait(table.pull(uniq)).view(-1, args.dim).requires_grad_()
        t = lap(ms, "pull", t)
        index = list(inverse.split([k.numel() for k in keys]))
        index = [i.view(k.shape) for i, k in zip(index, keys)]  # where each id's row is in `rows`
        opt.zero_grad()
        loss = forward(data, mlp, index, labels, rows)
        loss.backward()
        t = lap(ms, "compute", t)
        # The rows' update: the shards add every worker's, so each sends its share of the mean.
        update = rows.grad * (-args.emb_lr / nw)
        table.push(uniq, update if args.table == "sparse" else update.reshape(-1))  # returns at once
        t = lap(ms, "push", t)
        opt.step()
        t = lap(ms, "step", t)
        table.barrier()  # every worker's update is in before anyone's next pull
        lap(ms, "barrier", t)
        losses.append(loss.item())
        if args.log_every and (step + 1) % args.log_every == 0:
            recent = losses[-args.log_every:]
            say(f"ctr worker {w}: step {step + 1}: loss {sum(recent) / len(recent):.4f}")
    seconds = time.monotonic() - t0
    report(losses, args, seconds, workers=nw, mode="job", worker=w, table=args.table,
           ms_per_step={k: round(v / args.steps, 3) for k, v in ms.items()})
    table.close()
    opt.close()


def ddp(args) -> None:
    """The same model with its embedding table replicated on every worker and trained by
    DistributedDataParallel over gloo: every step allreduces the whole table's dense gradient
    (nn.EmbeddingBag without sparse gradients), the MLP's too."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    w, nw = dist.get_rank(), dist.get_world_size()
    data = Data(args)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = make_mlp(args)
            self.every = torch.unique(data.keys)  # a row for every key the data can produce, as --single
            self.table = torch.nn.Parameter(torch.zeros(len(self.every), args.dim))

        def forward(self, keys, labels):
            return forward(data, self.mlp, [torch.searchsorted(self.every, k) for k in keys], labels, self.table)

    model = torch.nn.parallel.DistributedDataParallel(Model())
    opt = torch.optim.SGD([{"params": model.module.mlp.parameters(), "lr": args.lr, "momentum": 0.9},
                           {"params": [model.module.table], "lr": args.emb_lr}])
    losses, t0 = [], time.monotonic()
    for step in range(args.steps):
        keys, labels = data.batch(step, w)
        opt.zero_grad()
        loss = model(keys, labels)
        loss.backward()  # allreduces the mean gradient: the table's rows all, touched or not
        opt.step()
        losses.append(loss.item())
        if args.log_every and (step + 1) % args.log_every == 0:
            recent = losses[-args.log_every:]
            say(f"ctr ddp worker {w}: step {step + 1}: loss {sum(recent) / len(recent):.4f}")
    report(losses, args, time.monotonic() - t0, workers=nw, mode="ddp", worker=w)
    dist.destroy_process_group()


def compare_ddp(args, argv) -> None:
    """Runs the job (2 workers x 2 shards) and the DDP job (2 workers) one after the other on this
    host with the same arguments, and prints their training throughput side by side."""
    import subprocess

    from rdmaflow.bench.processes import free_port

    rest = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--compare-ddp"]
    launch = [sys.executable, "-m", "rdmaflow", "launch", "--nproc-per-node", str(args.workers)]
    runs = {"ps": ["--shards-per-node", str(args.workers), __file__, *rest],
            "ddp": ["--shards-per-node", "0", __file__, "--ddp", *rest]}
    rates = {}
    for name, cmd in runs.items():
        out = subprocess.run(launch + ["--master-port", str(free_port())] + cmd, capture_output=True, text=True, check=False)
        found = [json.loads(ln.split("ctr result: ", 1)[1]) for ln in out.stdout.splitlines() if "ctr result: " in ln]
        if out.returncode != 0 or not found:
            raise SystemExit(f"ctr: the {name} job failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
        rates[name] = min(r["samples_per_s"] for r in found)  # the slowest worker's view of the job
        loss = sum(r["loss"] for r in found) / len(found)
        say(f"ctr {name}: {rates[name]:,.0f} samples/s, loss {loss:.4f}")
    rows = args.features * args.raw_ids if args.table == "sparse" else args.rows
    print(f"ctr: the parameter server ({args.table} table) trains {rates['ps'] / rates['ddp']:.2f}x the samples per "
          f"second of DDP over gloo (up to {rows} rows x {args.dim} floats, {args.workers} workers)", flush=True)


def main(argv=None) -> None:
    args = options(argv)
    torch.set_num_threads(1)
    if args.compare_ddp:
        compare_ddp(args, argv)
    else:
        (single if args.single else ddp if args.ddp else distributed)(args)


if __name__ == "__main__":
    main()
