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

Replicated shards (``rdmaflow launch --shard-replicas R``): ``shard_replicas``,
``max_shard_restarts`` and ``shard_incarnation`` read what the launcher set
(``RDMAFLOW_SHARD_REPLICAS``, ``RDMAFLOW_MAX_SHARD_RESTARTS``, ``RDMAFLOW_SHARD_INCARNATION``).
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


def _check(ok: bool, problem: str) -> None:
    if not ok:
        raise InvalidArgumentError(f"this process's launcher environment is impossible: {problem}")


def resolve_role() -> Role:
    """This process's role from the launcher's environment; InvalidArgumentError naming the
    variables when they cannot describe a job (a rank outside the world, a local size that
    does not divide it, a shard or worker index beyond their number)."""
    rank = env_int("RANK", 0)
    world = env_int("WORLD_SIZE", 1)
    _check(world >= 1 and 0 <= rank < world, f"$RANK={rank} is not in [0, $WORLD_SIZE={world})")
    if os.environ.get("RDMAFLOW_ROLE"):
        kind = os.environ["RDMAFLOW_ROLE"]
        if kind not in ("shard", "worker"):
            raise InvalidArgumentError(f"$RDMAFLOW_ROLE must be 'shard' or 'worker', got {kind!r}")
        role = Role(kind, env_int("RDMAFLOW_ROLE_INDEX"), env_int("RDMAFLOW_NUM_SHARDS"),
                    env_int("RDMAFLOW_NUM_WORKERS"), rank, world)
        count = role.num_shards if kind == "shard" else role.num_workers
        _check(role.num_shards >= 1 and role.num_workers >= 1, f"$RDMAFLOW_NUM_SHARDS={role.num_shards} and "
               f"$RDMAFLOW_NUM_WORKERS={role.num_workers} must both be at least 1")
        _check(0 <= role.index < count, f"$RDMAFLOW_ROLE_INDEX={role.index} is not in [0, {count}) {kind}s")
        _check(role.num_shards + role.num_workers == world, f"$RDMAFLOW_NUM_SHARDS={role.num_shards} and "
               f"$RDMAFLOW_NUM_WORKERS={role.num_workers} make {role.num_shards + role.num_workers} processes; "
               f"$WORLD_SIZE={world}")
        return role
    local_world = env_int("LOCAL_WORLD_SIZE", world)
    _check(1 <= local_world <= world and world % local_world == 0,
           f"$LOCAL_WORLD_SIZE={local_world} does not divide $WORLD_SIZE={world} into nodes")
    local_rank = env_int("LOCAL_RANK", rank % local_world)
    _check(0 <= local_rank < local_world, f"$LOCAL_RANK={local_rank} is not in [0, $LOCAL_WORLD_SIZE={local_world})")
    nnodes = world // local_world
    node = env_int("GROUP_RANK", rank // local_world)
    _check(0 <= node < nnodes, f"$GROUP_RANK={node} is not in [0, {nnodes}) nodes")
    spn = env_int("RDMAFLOW_SHARDS_PER_NODE", 1)
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:  # run as `python script.py`
        raise InvalidArgumentError(
            "this is a parameter-server job, one process of several (at least a shard and a worker), and no "
            "launcher started it: run it with `rdmaflow launch --nproc-per-node 1 SCRIPT [its arguments]` "
            "(1 worker + 1 shard; .venv/bin/rdmaflow outside the venv)")
    if spn == 0:
        raise InvalidArgumentError(
            "this job was started without a parameter-server shard (rdmaflow launch --shards-per-node 0, for a "
            "pipeline): start it with --shards-per-node 1 or more")
    if not 1 <= spn < local_world:
        raise InvalidArgumentError(
            f"$RDMAFLOW_SHARDS_PER_NODE={spn} must be at least 1 and leave a worker among the {local_world} "
            f"processes per node: start at least {max(spn, 1) + 1} processes per node (rdmaflow launch "
            "--nproc-per-node counts workers only; run by hand, set RANK, WORLD_SIZE and the others as torchrun does)"
        )
    wpn = local_world - spn
    if local_rank < spn:
        return Role("shard", node * spn + local_rank, nnodes * spn, nnodes * wpn, rank, world)
    return Role("worker", node * wpn + local_rank - spn, nnodes * spn, nnodes * wpn, rank, world)


def store_outlives_shards() -> bool:
    """Whether a launcher serves the job's store (``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun's
    agent, or ``rdmaflow launch --shard-replicas`` on node 0), so that it outlives every shard;
    else rank 0, a shard, serves it and the store goes with that shard."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


REPLICAS_ENV = "RDMAFLOW_SHARD_REPLICAS"


def replica_count(value, num_shards: int | None) -> int:
    """How many shard processes hold each unit or key range (a primary and R-1 backups): ``value``
    (``KVStore(replicas=)``, ``ps.init(shard_replicas=)``), else ``$RDMAFLOW_SHARD_REPLICAS``
    (which ``rdmaflow launch --shard-replicas`` sets), else 1. InvalidArgumentError when it is no
    whole number, below 1, above ``num_shards`` (if given), or above 1 while rank 0, a shard,
    serves the job's store (it would go with that shard)."""
    name = "replicas"
    if value is None:
        value, name = os.environ.get(REPLICAS_ENV) or "1", f"${REPLICAS_ENV}"
    try:
        if isinstance(value, (bool, float)):
            raise TypeError
        r = int(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{name} must be a whole number of copies, got {value!r}") from None
    if r < 1 or (num_shards is not None and r > num_shards):
        shards = "" if num_shards is None else f" in a job of {num_shards} shard{'s' if num_shards > 1 else ''}"
        raise InvalidArgumentError(f"{name}={r}: a unit has 1 to {num_shards or 'as many as shards'} copies"
                                   f"{shards} (one per shard process)")
    if r > 1 and not store_outlives_shards():
        raise InvalidArgumentError(
            f"{name}={r}, but rank 0, a shard, serves the job's store, which would go with it: "
            "start the job with `rdmaflow launch --shard-replicas`, or serve the store elsewhere and set "
            "TORCHELASTIC_USE_AGENT_STORE=True")
    return r


def shard_replicas(role: Role | None = None) -> int:
    """The job's replica count from the environment (``replica_count``), checked against
    ``role``'s shard count if given."""
    return replica_count(None, None if role is None else role.num_shards)


def max_shard_restarts() -> int:
    """How many times the launcher restarts each dead shard process (``$RDMAFLOW_MAX_SHARD_RESTARTS``,
    ``rdmaflow launch --max-shard-restarts``; 0 when unset: nobody restarts it)."""
    n = env_int("RDMAFLOW_MAX_SHARD_RESTARTS", 0)
    if n < 0:
        raise InvalidArgumentError(f"$RDMAFLOW_MAX_SHARD_RESTARTS={n} must be at least 0")
    return n


def shard_incarnation() -> int:
    """0 for a shard process's first start, n for its n-th restart with the same rank
    (``$RDMAFLOW_SHARD_INCARNATION``, which the launcher sets on a restart; a shard started by
    hand in place of a dead one sets it too). A process of incarnation n > 0 rejoins a running job."""
    n = env_int("RDMAFLOW_SHARD_INCARNATION", 0)
    if n < 0:
        raise InvalidArgumentError(f"$RDMAFLOW_SHARD_INCARNATION={n} must be at least 0")
    return n


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
