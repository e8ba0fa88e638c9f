"""Who this process is in a parameter-server job, and the rendezvous through the c10d store.

Roles follow the launcher's environment, the way torchrun sets it: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node), ``MASTER_ADDR``,
``MASTER_PORT``. On every node the first ``RDMAFLOW_SHARDS_PER_NODE`` local ranks (default 1)
are parameter-server shards and the others are workers, so by default each host runs one
shard and one worker (Xue et al. §5.2). ``RDMAFLOW_ROLE=shard|worker`` with
``RDMAFLOW_ROLE_INDEX``, ``RDMAFLOW_NUM_SHARDS`` and ``RDMAFLOW_NUM_WORKERS`` overrides that for
launchers that place roles themselves.

The job's c10d store, its secret and the leaving protocol are ``rdmaflow.job``'s; the parameter
server's keys live under ``PREFIX``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from rdmaflow import InvalidArgumentError
from rdmaflow.job import JobStore, env_int

PREFIX = "rdmaflow/ps/"


@dataclass
class Role:
    kind: str        # "shard" or "worker"
    index: int       # shard id or worker id
    num_shards: int
    num_workers: int
    rank: int
    world_size: int


def resolve_role() -> Role:
    rank = env_int("RANK", 0)
    world = env_int("WORLD_SIZE", 1)
    if os.environ.get("RDMAFLOW_ROLE"):
        kind = os.environ["RDMAFLOW_ROLE"]
        if kind not in ("shard", "worker"):
            raise InvalidArgumentError(f"$RDMAFLOW_ROLE must be 'shard' or 'worker', got {kind!r}")
        return Role(kind, env_int("RDMAFLOW_ROLE_INDEX"), env_int("RDMAFLOW_NUM_SHARDS"),
                    env_int("RDMAFLOW_NUM_WORKERS"), rank, world)
    local_rank = env_int("LOCAL_RANK", rank)
    local_world = env_int("LOCAL_WORLD_SIZE", world)
    node = env_int("GROUP_RANK", rank // max(local_world, 1))
    nnodes = max(world // max(local_world, 1), 1)
    spn = env_int("RDMAFLOW_SHARDS_PER_NODE", 1)
    if not 1 <= spn < local_world:
        raise InvalidArgumentError(
            f"{spn} shards per node leave no worker among {local_world} processes per node: "
            f"start at least {spn + 1} processes per node (rdmaflow launch --nproc-per-node counts workers only)"
        )
    wpn = local_world - spn
    if local_rank < spn:
        return Role("shard", node * spn + local_rank, nnodes * spn, nnodes * wpn, rank, world)
    return Role("worker", node * wpn + local_rank - spn, nnodes * spn, nnodes * wpn, rank, world)


class Store(JobStore):
    """The job's c10d store under the parameter server's keys (``rdmaflow.job.JobStore``)."""

    def __init__(self, role: Role, timeout: float):
        super().__init__(role.rank, role.world_size, timeout, PREFIX)


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)


def profile_stream():
    """Where RDMAFLOW_PS_PROFILE sends a process's step-time breakdown: ``1`` for stderr, any
    other value a file to append to."""
    import sys

    dest = os.environ.get("RDMAFLOW_PS_PROFILE", "1")
    return sys.stderr if dest == "1" else open(dest, "a")
