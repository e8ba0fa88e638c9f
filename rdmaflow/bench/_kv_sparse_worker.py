"""The processes of ``rdmaflow bench kv --sparse`` (driven by :mod:`rdmaflow.bench.kv_sparse`).

Roles (``--role``):

* ``rdmaflow``: a process of an rdmaflow job of one shard and one worker (torchrun's variables
  from the driver). The shard serves inside ``ps.init`` and exits; the worker holds the systems
  named by ``--system``: ``declared`` (a ``KVStore`` declaring keys 0..rows-1), or
  ``sparse-read`` and/or ``sparse-request`` (a ``SparseTable`` each, rows 0..rows-1 pushed once).
* ``dict-server``: the dictionary-of-rows servers (:mod:`.baselines.dict_server`), TensorPipe
  and gRPC, in one process, each with its own dictionary.
* ``dict-client``: their clients.

A process holding systems (the rdmaflow worker, ``dict-client``) prints one JSON line when
ready, then answers commands read from stdin, one JSON line each:

* ``{"cmd": "measure", "system", "start", "iters", "warmup"}``: ``warmup`` untimed calls, then
  ``iters`` timed pulls, then as many timed pushes, of requests ``start..`` (request i: the key
  pool's set i mod its size, the values of :func:`push_values`); answers the milliseconds.
* ``{"cmd": "check", "system"}``: pulls the check keys (:func:`check_keys`) and answers their
  rows' SHA-256 and sum: after the same pushes every system answers the same.
* ``{"cmd": "exit"}``.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence

import torch

POOL = 32  # distinct key sets a run cycles through
_MIX = 2654435761  # a prime: rank -> key is a bijection of 0..rows-1 (hot ids scattered, as hashed ids are)


# -- the requests ----------------------------------------------------------------------------------
def _mixer(rows: int) -> int:
    a = _MIX % rows or 1
    while math.gcd(a, rows) != 1:
        a += 1
    return a


def zipf_pool(rows: int, keys: int, s: float, seed: int, pool: int = POOL) -> list[torch.Tensor]:
    """``pool`` requests of ``keys`` ids each, drawn from a Zipf distribution of exponent ``s``
    over the ranks 1..rows (rank r with probability proportional to r^-s), rank r being key
    ``(r-1) * a mod rows``. Deterministic in (rows, keys, s, seed): every system gets the same."""
    g = torch.Generator().manual_seed(seed)
    cdf = torch.cumsum(torch.arange(1, rows + 1, dtype=torch.float64).pow_(-s), 0)
    cdf /= cdf[-1].clone()
    a = _mixer(rows)
    out = []
    for _ in range(pool):
        ranks = torch.searchsorted(cdf, torch.rand(keys, generator=g, dtype=torch.float64)).clamp_(max=rows - 1)
        out.append(ranks * a % rows)
    return out


def push_values(keys: torch.Tensor, i: int, dim: int) -> torch.Tensor:
    """Request i's rows: small integers (exact in float32 however a system sums duplicates)."""
    v = ((keys + i) % 5 + 1).to(torch.float32)
    return v[:, None].expand(len(keys), dim).contiguous()


def check_keys(pool: list[torch.Tensor], rows: int) -> torch.Tensor:
    """Request 0's keys (the hot ones, pushed most) and the first ids."""
    return torch.cat([pool[0], torch.arange(min(rows, len(pool[0])))])


def digest(rows: torch.Tensor) -> dict:
    rows = rows.detach().to(torch.float32).contiguous()
    return {"sha256": hashlib.sha256(rows.view(torch.uint8).numpy().tobytes()).hexdigest(),
            "sum": float(rows.sum()), "shape": list(rows.shape)}


# -- the systems ---------------------------------------------------------------------------------
class Declared:
    """The declared ``KVStore``, batched form: keys 0..rows-1 of ``dim`` floats, declared with one
    key tensor and one shared shape (no per-key objects built here). It refuses a key twice in
    one call, so a request's duplicates are merged first (``unique``; a push sums them with
    ``index_add_``), inside the timed call: a user of the declared store has to."""

    def __init__(self, rows: int, dim: int) -> None:
        from rdmaflow import ps

        self.dim = dim
        self.kv = ps.KVStore(torch.arange(rows), [(dim,)] * rows, torch.float32)

    def pull(self, keys: torch.Tensor) -> torch.Tensor:
        uniq, inv = torch.unique(keys, return_inverse=True)
        flat = self.kv.wait(self.kv.pull(uniq))
        return flat.view(-1, self.dim).index_select(0, inv)

    def push(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        uniq, inv = torch.unique(keys, return_inverse=True)
        summed = torch.zeros(len(uniq), self.dim).index_add_(0, inv, values)
        self.kv.wait(self.kv.push(uniq, summed.view(-1)))

    def close(self) -> None:
        self.kv.close()


class Sparse:
    """A ``SparseTable`` (zeros, add; sized for its rows, ``initial_rows``, as a user expecting
    them would) with rows 0..rows-1 pushed once (zeros), made with one ``read_path``: "read" (one-sided: the shard's region mapped on one host, READs over UCX) or
    "request" (one batched request per shard). Each system has a table of its own, so that
    their pushes are timed and their values compared apart."""

    def __init__(self, rows: int, dim: int, read_path: str, fill_batch: int = 65536) -> None:
        from rdmaflow import ps

        self.table = ps.SparseTable(f"bench-{read_path}", dim=dim, dtype=torch.float32, initializer="zeros",
                                    handler="add", read_path=read_path, initial_rows=rows)
        zeros = torch.zeros(fill_batch, dim)
        for lo in range(0, rows, fill_batch):
            keys = torch.arange(lo, min(rows, lo + fill_batch))
            self.table.wait(self.table.push(keys, zeros[: len(keys)]))

    def pull(self, keys: torch.Tensor) -> torch.Tensor:
        return self.table.wait(self.table.pull(keys))

    def push(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.table.wait(self.table.push(keys, values))

    def stats(self) -> dict:
        """The worker's and the shards' counters (rows read one-sided, by request; requests served)."""
        return {k: v for k, v in self.table.stats().items() if isinstance(v, int)}

    def close(self) -> None:
        self.table.close()


# -- the command loop ------------------------------------------------------------------------------
def _reply(**kw) -> None:
    print(json.dumps({"ok": True, **kw}), flush=True)


def serve(systems: dict, pool: list[torch.Tensor], rows: int, dim: int, info: dict) -> int:
    _reply(ready=True, systems=sorted(systems), info=info,
           unique=sum(len(torch.unique(k)) for k in pool) / len(pool))
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "exit":
            break
        try:
            system = systems[cmd["system"]]
            if cmd["cmd"] == "measure":
                _reply(**measure(system, pool, dim, cmd["start"], cmd["iters"], cmd["warmup"]))
            elif cmd["cmd"] == "check":
                _reply(**digest(system.pull(check_keys(pool, rows))))
            else:
                raise ValueError(f"unknown command {cmd['cmd']!r}")
        except Exception as e:  # noqa: BLE001 - reported to the driver, which records the cell as failed
            print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}), flush=True)
    for s in systems.values():
        s.close()
    return 0


def measure(system, pool: list[torch.Tensor], dim: int, start: int, iters: int, warmup: int) -> dict:
    before = system.stats() if hasattr(system, "stats") else None
    i = start
    for _ in range(warmup):  # pushes too: every system sees the same pushes
        keys = pool[i % len(pool)]
        system.pull(keys)
        system.push(keys, push_values(keys, i, dim))
        i += 1
    out: dict = {"pull": [], "push": [], "next": 0}
    first = i
    for j in range(iters):
        keys = pool[(first + j) % len(pool)]
        t0 = time.perf_counter()
        system.pull(keys)
        out["pull"].append((time.perf_counter() - t0) * 1e3)
    for j in range(iters):
        keys = pool[(first + j) % len(pool)]
        values = push_values(keys, first + j, dim)
        t0 = time.perf_counter()
        system.push(keys, values)
        out["push"].append((time.perf_counter() - t0) * 1e3)
    out["next"] = first + iters
    out["pulls"] = warmup + iters  # the calls the counters' change covers
    if before is not None:
        after = system.stats()
        out["stats"] = {k: after[k] - before[k] for k in after if k in before and isinstance(after[k], (int, float))}
    return out


# -- the roles -----------------------------------------------------------------------------------
def run_rdmaflow(args: argparse.Namespace) -> int:
    from rdmaflow import ps

    ps.init()  # a shard serves here and exits
    pool = zipf_pool(args.rows, args.keys, args.zipf, args.seed)
    t0 = time.perf_counter()
    systems = {}
    for name in args.system.split(","):
        systems[name] = (Declared(args.rows, args.dim) if name == "declared"
                         else Sparse(args.rows, args.dim, name.removeprefix("sparse-")))
    return serve(systems, pool, args.rows, args.dim, {"setup_s": time.perf_counter() - t0})


def run_dict_server(args: argparse.Namespace) -> int:
    from rdmaflow.bench.baselines import dict_server

    names = args.system.split(",")
    server = dict_server.GrpcDictServer(args.target) if "grpc-dict" in names else None
    if "tensorpipe-dict" in names:
        dict_server.init_tensorpipe("server", args.transport, args.port, args.timeout)
    sys.stdin.readline()  # the driver's exit, after the client's
    if "tensorpipe-dict" in names:
        from torch.distributed import rpc

        rpc.shutdown(graceful=True)
    if server:
        server.close()
    return 0


def run_dict_client(args: argparse.Namespace) -> int:
    from rdmaflow.bench.baselines import dict_server

    names = args.system.split(",")
    pool = zipf_pool(args.rows, args.keys, args.zipf, args.seed)
    t0 = time.perf_counter()
    systems: dict = {}
    info: dict = {}
    if "tensorpipe-dict" in names:
        info["tensorpipe"] = dict_server.init_tensorpipe("client", args.transport, args.port, args.timeout)
        systems["tensorpipe-dict"] = dict_server.TensorPipeDict(args.dim, args.rows, args.timeout)
    if "grpc-dict" in names:
        info["grpc"] = args.target
        systems["grpc-dict"] = dict_server.GrpcDict(args.target, args.dim, args.rows, args.timeout)
    info["setup_s"] = time.perf_counter() - t0
    try:
        return serve(systems, pool, args.rows, args.dim, info)
    finally:
        if "tensorpipe-dict" in names:
            from torch.distributed import rpc

            rpc.shutdown(graceful=True)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("rdmaflow", "dict-server", "dict-client"), required=True)
    ap.add_argument("--system", required=True)
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--rows", type=int, required=True)
    ap.add_argument("--dim", type=int, required=True)
    ap.add_argument("--keys", type=int, default=4096)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--target", default="", help="the gRPC server's address: host:port or unix:path")
    ap.add_argument("--timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    role = {"rdmaflow": run_rdmaflow, "dict-server": run_dict_server, "dict-client": run_dict_client}[args.role]
    return role(args)


if __name__ == "__main__":
    sys.exit(main())
