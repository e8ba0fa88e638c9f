"""The cells of ``rdmaflow bench train`` and how one runs: its processes, their environment,
their results (:mod:`rdmaflow.bench.train` has the method and the output).

A cell is one short training job ``(system, model, batch, workers, shards)``. Its processes
are ``python -m rdmaflow.bench._train_proc`` (see there for the contract), each a
:class:`rdmaflow.bench.processes.ChildProcess` (own process group, dies with the driver), with
torchrun's variables, a fresh job secret and the cell's configuration as JSON in
``RDMAFLOW_TRAIN_CFG``; with ``hosts`` (:class:`rdmaflow.testing.netns.Hosts`) worker ``i``
and shard ``i`` run in host ``i``.
"""
from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rdmaflow.bench.processes import ChildProcess, free_port, new_secret, one_line, process_env, wait_all

PS_SYSTEMS = ("rdmaflow", "rdmaflow-copy", "tensorpipe", "grpc")
RDMAFLOW_SYSTEMS = ("rdmaflow", "rdmaflow-copy")
PROC_MODULE = "rdmaflow.bench._train_proc"
RESULT_TAG = "RDMAFLOW_TRAIN_RESULT"
RESULT_KEYS = ("system", "model", "worker", "times", "losses", "batch")


class CellError(RuntimeError):
    pass


Key = tuple[str, str, int, int, int]  # (system, model, batch, workers, shards)
Config = tuple[str, int, int, int]    # (model, batch, workers, shards)


def cell_key(system: str, model: str, batch: int, workers: int, shards: int) -> Key:
    """The cell a system measures for a configuration: ddp ignores shards, local both."""
    if system == "local":
        return (system, model, batch, 1, 0)
    if system == "ddp":
        return (system, model, batch, workers, 0)
    return (system, model, batch, workers, shards)


@dataclass(frozen=True)
class Member:
    """One process of a cell."""
    rank: int
    role: str    # "shard" or "worker"
    index: int   # shard or worker index
    host: int    # the host (netns) it runs on; 0 for --hosts local
    local_rank: int
    local_world: int


def layout(key: Key, netns: bool) -> list[Member]:
    """The processes of a cell, by rank. PS systems: shards first (ranks 0..S-1), then the
    workers; with netns, shard i and worker i share host i."""
    system, _, _, workers, shards = key
    if system in PS_SYSTEMS:
        world = shards + workers
        out = []
        for s in range(shards):
            out.append(Member(s, "shard", s, s if netns else 0, 0 if netns else s,
                              2 if netns else world))
        for w in range(workers):
            out.append(Member(shards + w, "worker", w, w if netns else 0,
                              1 if netns else shards + w, 2 if netns else world))
        return out
    return [Member(w, "worker", w, w if netns else 0, 0 if netns else w, 1 if netns else workers)
            for w in range(workers)]


def train_cfg(key: Key, *, warmup: int, iters: int, lr: float, seed: int, timeout: float,
              threads: int | None, transport: str = "tcp") -> dict[str, Any]:
    system, model, batch, workers, shards = key
    cfg: dict[str, Any] = {
        "system": "rdmaflow" if system == "rdmaflow-copy" else system, "model": model,
        "batch": batch, "workers": workers, "shards": shards, "warmup": warmup, "iters": iters,
        "zero_copy": system != "rdmaflow-copy", "overlap": True, "mode": "sync", "lr": lr,
        "seed": seed, "timeout": timeout,
    }
    if threads is not None:
        cfg["threads"] = threads
    if system == "tensorpipe":
        cfg["transport"] = transport  # tcp: uv/basic (TCP like the others); sm: shm/cma
    return cfg


def member_env(key: Key, m: Member, members: Sequence[Member], *, cfg: Mapping[str, Any],
                master_addr: str, port: int, secret: str, transport: str,
                ifname: str | None, host_addr: str, threads: int | None,
                base: Mapping[str, str] | None = None) -> dict[str, str]:
    system, _, _, workers, shards = key
    env = process_env(transport if system in RDMAFLOW_SYSTEMS else None, base=base, net_device=ifname,
                      secret=secret, threads=threads)
    if system in RDMAFLOW_SYSTEMS:
        # rdmaflow.ps places roles by these when set (ranks 0..S-1 shards, then workers).
        env.update(RDMAFLOW_ROLE=m.role, RDMAFLOW_ROLE_INDEX=str(m.index),
                   RDMAFLOW_NUM_SHARDS=str(shards), RDMAFLOW_NUM_WORKERS=str(workers))
    env.update({
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(port), "RANK": str(m.rank),
        "WORLD_SIZE": str(len(members)), "LOCAL_RANK": str(m.local_rank),
        "LOCAL_WORLD_SIZE": str(m.local_world),
        "RDMAFLOW_TRAIN_CFG": json.dumps(cfg), "RDMAFLOW_HOST": host_addr,
        "GLOO_SOCKET_IFNAME": ifname or "lo", "TP_SOCKET_IFNAME": ifname or "lo",
    })
    return env


def parse_results(lines: Iterable[str]) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        line = line.strip()
        if line.startswith(RESULT_TAG):
            out.append(json.loads(line[len(RESULT_TAG):].strip()))
    return out


def check_result(r: Any, key: Key, index: int) -> None:
    _, model, batch, _, _ = key
    if not isinstance(r, dict) or any(k not in r for k in RESULT_KEYS):
        raise CellError(f"worker {index}: result lacks {[k for k in RESULT_KEYS if k not in (r or {})]}")
    if r["worker"] != index:
        raise CellError(f"worker {index} (rank order) reported itself as worker {r['worker']}")
    if r["model"] != model or int(r["batch"]) != batch:
        raise CellError(f"worker {index} reports model {r['model']!r} batch {r['batch']}, "
                        f"expected {model!r} batch {batch}")
    times = r["times"]
    if not isinstance(times, list) or not times or not all(
            isinstance(t, (int, float)) and t > 0 for t in times):
        raise CellError(f"worker {index}: times must be a non-empty list of positive seconds")


def run_cell(key: Key, *, cfg: Mapping[str, Any], timeout: float, transport: str = "tcp",
             hosts: Any = None, threads: int | None = None, proc_module: str = PROC_MODULE,
             log: Callable[[str], None] = lambda s: None) -> list[dict[str, Any]]:
    """Runs one cell to its end; returns the workers' results (by worker index) or raises
    CellError. Every process it starts is killed before it returns or raises."""
    members = layout(key, hosts is not None)
    secret = new_secret()
    port = free_port()
    master = hosts[0].addr if hosts is not None else "127.0.0.1"
    argv = [sys.executable, "-m", proc_module]
    procs: list[tuple[Member, ChildProcess]] = []
    try:
        for m in members:
            h = hosts[m.host] if hosts is not None else None
            env = member_env(key, m, members, cfg=cfg, master_addr=master, port=port,
                             secret=secret, transport=transport,
                             ifname=h.ifname if h else None,
                             host_addr=h.addr if h else "127.0.0.1", threads=threads)
            label = f"{m.role} {m.index}" + (f" (host {m.host})" if h else "")
            p = ChildProcess(h.argv(argv) if h else argv, env, label, stdin=False)
            procs.append((m, p))
            log(f"  {key[0]}: started {label}, rank {m.rank} of {len(members)}, pid {p.pid}")
        wait_all([p for _, p in procs], timeout, CellError)
        results = []
        for m, p in procs:
            lines = p.drain(5.0)
            if m.role != "worker":
                continue
            try:
                found = parse_results(lines)
            except ValueError as e:
                raise CellError(f"{p.label} printed a malformed {RESULT_TAG} line: {e}") from None
            if len(found) != 1:
                tail = one_line("".join(lines[-5:]) or p.stderr_tail(2000), 300)
                raise CellError(f"{p.label} printed {len(found)} {RESULT_TAG} lines, expected 1"
                                + (f"; output: {tail}" if tail else ""))
            check_result(found[0], key, m.index)
            results.append(found[0])
        return results
    finally:
        for _, p in procs:
            p.kill()


def lookup(cells: Mapping[Key, dict[str, Any]], system: str, cfg: Config) -> dict[str, Any] | None:
    """The metrics a system measured for a configuration, or None."""
    cell = cells.get(cell_key(system, *cfg))
    return cell["metrics"] if cell else None
