"""Who this process is in a parameter-server job, and the rendezvous through the c10d store.

Roles follow the launcher's environment, the way torchrun sets it: ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node), ``MASTER_ADDR``,
``MASTER_PORT``. On every node the first ``RDMAFLOW_SHARDS_PER_NODE`` local ranks (default 1)
are parameter-server shards and the others are workers, so by default each host runs one
shard and one worker (Xue et al. §5.2). ``RDMAFLOW_ROLE=shard|worker`` with
``RDMAFLOW_ROLE_INDEX``, ``RDMAFLOW_NUM_SHARDS`` and ``RDMAFLOW_NUM_WORKERS`` overrides that for
launchers that place roles themselves.

The store carries only endpoints and small JSON documents; region descriptors (remote keys)
go through the devices' authenticated side RPC, never through the store.
"""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import secrets
import socket
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

from rdmaflow import InvalidArgumentError, PeerError, RdmaflowError, TimeoutError

PREFIX = "rdmaflow/ps/"


@dataclass
class Role:
    kind: str        # "shard" or "worker"
    index: int       # shard id or worker id
    num_shards: int
    num_workers: int
    rank: int
    world_size: int


def _env_int(name: str, default: int | None = None) -> int:
    v = os.environ.get(name)
    if v is None or v == "":
        if default is None:
            raise InvalidArgumentError(
                f"${name} is not set: start the job with `rdmaflow launch` or torchrun, or set it yourself"
            )
        return default
    try:
        return int(v)
    except ValueError:
        raise InvalidArgumentError(f"${name}={v!r} is not an integer") from None


def resolve_role() -> Role:
    rank = _env_int("RANK", 0)
    world = _env_int("WORLD_SIZE", 1)
    if os.environ.get("RDMAFLOW_ROLE"):
        kind = os.environ["RDMAFLOW_ROLE"]
        if kind not in ("shard", "worker"):
            raise InvalidArgumentError(f"$RDMAFLOW_ROLE must be 'shard' or 'worker', got {kind!r}")
        return Role(kind, _env_int("RDMAFLOW_ROLE_INDEX"), _env_int("RDMAFLOW_NUM_SHARDS"),
                    _env_int("RDMAFLOW_NUM_WORKERS"), rank, world)
    local_rank = _env_int("LOCAL_RANK", rank)
    local_world = _env_int("LOCAL_WORLD_SIZE", world)
    node = _env_int("GROUP_RANK", rank // max(local_world, 1))
    nnodes = max(world // max(local_world, 1), 1)
    spn = _env_int("RDMAFLOW_SHARDS_PER_NODE", 1)
    if not 1 <= spn < local_world:
        raise InvalidArgumentError(
            f"{spn} shards per node leave no worker among {local_world} processes per node: "
            f"start at least {spn + 1} processes per node (rdmaflow launch --nproc-per-node counts workers only)"
        )
    wpn = local_world - spn
    if local_rank < spn:
        return Role("shard", node * spn + local_rank, nnodes * spn, nnodes * wpn, rank, world)
    return Role("worker", node * wpn + local_rank - spn, nnodes * spn, nnodes * wpn, rank, world)


def local_address(master_addr: str) -> str:
    """The address of this host on the route to the master (no packet is sent)."""
    if os.environ.get("RDMAFLOW_HOST"):
        return os.environ["RDMAFLOW_HOST"]
    try:
        infos = socket.getaddrinfo(master_addr, 1, type=socket.SOCK_DGRAM)
        fam, _, _, _, addr = infos[0]
        with socket.socket(fam, socket.SOCK_DGRAM) as s:
            s.connect(addr)  # UDP connect only picks the route
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class Store:
    """The job's c10d TCPStore, with bounded waits and an abort key every wait watches."""

    def __init__(self, role: Role, timeout: float):
        import torch.distributed as dist

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = _env_int("MASTER_PORT", 29500)
        # Under torchrun the agent already serves the store; otherwise rank 0 does.
        is_master = role.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self.timeout = timeout
        self.address = f"{host}:{port}"
        self.world_size = role.world_size
        self.num_workers = role.num_workers
        self.num_shards = role.num_shards
        self.is_master = is_master
        try:
            self.store = dist.TCPStore(host, port, role.world_size, is_master,
                                       timeout=timedelta(seconds=timeout), wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            raise PeerError(
                f"cannot reach the job's c10d store at {host}:{port} within {timeout:.0f} s: {e}"
            ) from None
        # The process serving the store outlives the others (bounded), so that a process that
        # fails late can still read why the job was aborted.
        ref = weakref.ref(self)

        def leave() -> None:
            store = ref()
            if store is not None:
                store._leave()

        atexit.register(leave)

    def _leave(self) -> None:
        # Leaving is best effort; torch's store errors (DistError and plain) are RuntimeErrors.
        with contextlib.suppress(RuntimeError):
            self.store.add(PREFIX + "left", 1)
            if self.is_master:
                deadline = time.monotonic() + min(self.timeout, 15.0)
                while time.monotonic() < deadline and self._gone() < self.world_size:
                    time.sleep(0.05)

    def _gone(self) -> int:
        """Processes that left, plus those declared dead (they never leave): workers a shard lost,
        shards a worker lost."""
        dead = sum(self.store.check([PREFIX + f"dead/worker/{w}"]) for w in range(self.num_workers))
        dead += sum(self.store.check([PREFIX + f"dead/shard/{s}"]) for s in range(self.num_shards))
        return self.store.add(PREFIX + "left", 0) + dead

    def declare_dead(self, kind: str, index: int) -> None:
        """Records that ``kind`` ("worker" or "shard") ``index`` died, so that the process serving
        the store does not wait at exit for it to leave. Best effort: the store may be gone."""
        with contextlib.suppress(RuntimeError):
            self.store.set(PREFIX + f"dead/{kind}/{index}", "1")

    def fail_with(self, msg: str, dead: tuple[str, int] | None = None) -> str | None:
        """The job's abort reason if one is recorded already (the failure seen here may be its
        consequence: nothing is recorded then); else records ``msg`` as the reason and ``dead``
        (kind, index), if given, as a process that died (``declare_dead``)."""
        reason = self.abort_reason()
        if reason:
            return reason
        if dead is not None:
            self.declare_dead(*dead)
        self.abort(msg)
        return None

    def _call(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError and others
            raise PeerError(f"the job's c10d store at {self.address} is unreachable ({what}): {e}") from None

    def set(self, key: str, value: str) -> None:
        self._call("set", self.store.set, PREFIX + key, value)

    def get(self, key: str, timeout: float | None = None) -> str:
        self.wait([key], timeout)
        return self._call("get", self.store.get, PREFIX + key).decode()

    def check(self, key: str) -> bool:
        return self._call("check", self.store.check, [PREFIX + key])

    def abort(self, reason: str) -> None:
        with contextlib.suppress(RuntimeError):  # the store may be gone already
            if not self.store.check([PREFIX + "abort"]):
                self.store.set(PREFIX + "abort", reason)

    def abort_reason(self) -> str | None:
        """The reason some process recorded for aborting the job; None if none or unreadable."""
        with contextlib.suppress(RuntimeError):  # the store may be gone already
            if self.store.check([PREFIX + "abort"]):
                return self.store.get(PREFIX + "abort").decode()
        return None

    def aborted(self) -> str | None:
        try:
            if self.store.check([PREFIX + "abort"]):
                return self.store.get(PREFIX + "abort").decode()
        except Exception:  # noqa: BLE001
            return "the job's c10d store is unreachable"
        return None

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        full = [PREFIX + k for k in keys]
        while True:
            try:
                if self.store.check(full):
                    return
            except Exception as e:  # noqa: BLE001
                raise PeerError(f"the job's c10d store became unreachable: {e}") from None
            reason = self.aborted()
            if reason:
                raise RdmaflowError(f"the job was aborted: {reason}")
            if time.monotonic() > deadline:
                missing = [k for k in keys if not self.store.check([PREFIX + k])]
                raise TimeoutError(f"timed out waiting for {missing} in the job's store")
            time.sleep(0.02)


def job_secret() -> str:
    s = os.environ.get("RDMAFLOW_JOB_SECRET")
    if s:
        return s
    if _env_int("WORLD_SIZE", 1) > 1:
        raise InvalidArgumentError(
            "RDMAFLOW_JOB_SECRET is not set: every process of a job needs the same secret "
            "(rdmaflow launch sets one; with another launcher, export a random one on every node)"
        )
    s = secrets.token_hex(16)
    os.environ["RDMAFLOW_JOB_SECRET"] = s
    return s


def dumps(obj) -> str:
    return json.dumps(obj, sort_keys=True)


def profile_stream():
    """Where RDMAFLOW_PS_PROFILE sends a process's step-time breakdown: ``1`` for stderr, any
    other value a file to append to."""
    import sys

    dest = os.environ.get("RDMAFLOW_PS_PROFILE", "1")
    return sys.stderr if dest == "1" else open(dest, "a")
