"""One rank of ``rdmaflow bench c10d``: the same torch.distributed calls on an "rdmaflow" group
and a gloo group of the same ranks, interleaved per repeat, each timed on rank 0.

Arguments come as JSON in ``C10D_BENCH`` (sizes, systems, repeats, ops, out); ranks get
torchrun's variables. Rank 0 writes one JSON line per (op, system, size, repeat) to ``out``.
"""
from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

import rdmaflow.distributed  # noqa: F401  registers "rdmaflow"

ITER_BYTES = 64 << 20  # bytes each timed run moves at least (a run of a small size repeats more)


def _iters(size: int, least: int, most: int) -> int:
    return max(least, min(most, ITER_BYTES // max(size, 1)))


def pingpong(g, t: torch.Tensor, n: int) -> float:
    """One way: a round trip of dist.send then dist.recv (rank 0) / recv then send (rank 1), / 2."""
    rank = dist.get_rank(g)
    dist.barrier(group=g)
    t0 = time.perf_counter()
    for _ in range(n):
        if rank == 0:
            dist.send(t, group_dst=1, group=g)
            dist.recv(t, group_src=1, group=g)
        elif rank == 1:
            dist.recv(t, group_src=0, group=g)
            dist.send(t, group_dst=0, group=g)
    return (time.perf_counter() - t0) / n / 2


def stream(g, t: torch.Tensor, n: int) -> float:
    """Rank 0 isends n tensors to rank 1, which irecvs them; ends with a one-element reply."""
    rank = dist.get_rank(g)
    ack = torch.zeros(1)
    dist.barrier(group=g)
    t0 = time.perf_counter()
    if rank == 0:
        works = [dist.isend(t, group_dst=1, group=g) for _ in range(n)]
        for w in works:
            w.wait()
        dist.recv(ack, group_src=1, group=g)
    elif rank == 1:
        for _ in range(n):
            dist.recv(t, group_src=0, group=g)
        dist.send(ack, group_dst=0, group=g)
    return (time.perf_counter() - t0) / n


def all_reduce(g, t: torch.Tensor, n: int) -> float:
    dist.barrier(group=g)
    t0 = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(t, group=g)
    return (time.perf_counter() - t0) / n


OPS = {"pingpong": pingpong, "stream": stream, "all_reduce": all_reduce}


def main() -> None:
    cfg = json.loads(os.environ["C10D_BENCH"])
    dist.init_process_group("rdmaflow")
    groups = {"rdmaflow": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for op in cfg["ops"]:
        if op != "all_reduce" and world != 2:
            continue
        for size in cfg["sizes"]:
            t = torch.ones(max(size // 4, 1))
            # stream: every isend is in flight at once; keep the window within the pair's credits
            most = cfg.get("iterations", 2000)
            n = min(_iters(size, 2, most), 24) if op == "stream" else _iters(size, 2, most)
            for system in cfg["systems"]:  # warm-up: pairs, arena blocks, gloo's connections
                OPS[op](groups[system], t, 2)
            for rep in range(cfg["repeats"]):
                order = cfg["systems"][rep % len(cfg["systems"]):] + cfg["systems"][:rep % len(cfg["systems"])]
                for system in order:
                    s = OPS[op](groups[system], t, n)
                    rows.append({"op": op, "system": system, "bytes": t.numel() * 4, "ranks": world,
                                 "repeat": rep, "seconds": s, "iterations": n})
    if rank == 0:
        with open(cfg["out"], "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    dist.barrier(group=groups["gloo"])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
