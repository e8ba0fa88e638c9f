"""Who this process is in a pipeline job, and the agreement every rank reaches before execution.

Ranks come from the launcher's environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, as torchrun and ``rdmaflow launch`` set them); rank ``r`` runs stage ``r``.
The job's c10d store carries only small JSON documents (each rank's plan, its device's
endpoint) and the abort key; transfer addresses go through the devices' authenticated side
RPC when the pairs connect.

"""
from __future__ import annotations

import itertools
import json
import os

import rdmaflow
from rdmaflow.job import JobStore, env_int, job_secret, route_address

NAMESPACE = "rdmaflow/graph/"  # this layer's keys in the job's store (rdmaflow.job)
PREFIX = "graph/"
_setups = itertools.count()  # every rank builds its pipelines in the same order


class PlanMismatchError(rdmaflow.InvalidArgumentError):
    """The ranks of a job computed different plans (another split, model, batch or schedule)."""


def env_rank() -> tuple[int, int]:
    return env_int("RANK", 0), env_int("WORLD_SIZE", 1)


def first_difference(a, b, path: str = "plan") -> tuple[str, object, object] | None:
    """The first place two JSON documents differ: (path, value in a, value in b)."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k not in a or k not in b:
                return f"{path}.{k}", a.get(k, "<missing>"), b.get(k, "<missing>")
            d = first_difference(a[k], b[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(a, list) and isinstance(b, list):
        for i, (x, y) in enumerate(zip(a, b)):
            d = first_difference(x, y, f"{path}[{i}]")
            if d:
                return d
        return None if len(a) == len(b) else (f"{path} (length)", len(a), len(b))
    return None if a == b else (path, a, b)


class Rendezvous:
    """The job's store, the plan agreement and the endpoint exchange of one pipeline."""

    def __init__(self, rank: int, world_size: int, timeout: float):
        self.rank, self.world_size, self.timeout = rank, world_size, timeout
        self.store = JobStore(rank, world_size, timeout, NAMESPACE)
        self.prefix = f"{PREFIX}{next(_setups)}/"
        self.host = route_address(os.environ.get("MASTER_ADDR", "127.0.0.1"))
        self.secret = job_secret(world_size)

    def agree(self, plan_json: dict) -> None:
        """Publishes this rank's plan and checks it against every other rank's; raises
        PlanMismatchError on every rank when any two differ."""
        mine = json.dumps(plan_json, sort_keys=True)
        self.store.set(f"{self.prefix}plan/{self.rank}", mine)
        for r in range(self.world_size):
            if r == self.rank:
                continue
            theirs = self.store.get(f"{self.prefix}plan/{r}")
            if theirs != mine:
                path, here, there = first_difference(plan_json, json.loads(theirs)) or ("plan", "?", "?")
                raise PlanMismatchError(
                    f"rank {self.rank}'s pipeline plan differs from rank {r}'s at {path}: {_short(here)} here, "
                    f"{_short(there)} on rank {r} (every rank must capture the same model with the same split "
                    f"points, microbatch shapes, number of microbatches and schedule)"
                )

    def exchange(self, endpoint: str) -> list[str]:
        self.store.set(f"{self.prefix}endpoint/{self.rank}", endpoint)
        return [self.store.get(f"{self.prefix}endpoint/{r}") for r in range(self.world_size)]

    def barrier(self, name: str) -> None:
        self.store.set(f"{self.prefix}{name}/{self.rank}", "1")
        self.store.wait([f"{self.prefix}{name}/{r}" for r in range(self.world_size)])

    def closing(self, steps: int) -> None:
        """Says this rank is done after ``steps`` steps, then waits for every rank to be."""
        self.store.set(f"{self.prefix}closing/{self.rank}", str(steps))
        self.store.wait([f"{self.prefix}closing/{r}" for r in range(self.world_size)])

    def closed(self) -> dict[int, int]:
        """{rank: steps} of the other ranks that are done (``closing``); never waits long."""
        keys = {r: f"{self.prefix}closing/{r}" for r in range(self.world_size) if r != self.rank}
        return {r: int(self.store.get(k)) for r, k in keys.items() if self.store.check(k)}

    def abort(self, reason: str) -> str | None:
        """Records ``reason`` unless one is on record; returns the one on record (None: the
        store is gone)."""
        return self.store.abort(reason)

    def aborted(self) -> str | None:
        return self.store.aborted()


def _short(v, n: int = 300) -> str:
    s = json.dumps(v) if not isinstance(v, str) else repr(v)
    return s if len(s) <= n else s[:n] + "..."
