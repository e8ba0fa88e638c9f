"""The job's c10d store, as the pipeline ranks use it: small JSON documents and an abort key.

Rank 0 serves the store at ``MASTER_ADDR:MASTER_PORT`` unless a torchrun agent already does
(``TORCHELASTIC_USE_AGENT_STORE``). Every wait is bounded and watches the abort key, so that a
rank that fails makes every other rank raise instead of waiting. Keys live under ``graph/``,
apart from the parameter server's.

(rdmaflow.ps has a store of its own; the graph layer may not import it, since both sit on the
same level. A shared one belongs below them both.)
"""
from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import socket
import time
import weakref
from datetime import timedelta

import rdmaflow

KEYS = "rdmaflow/graph/"
ABORT = KEYS + "abort"
LEFT = KEYS + "left"
POLL = 0.02  # seconds between looks at keys not yet set
LINGER = 15.0  # at most this long the serving rank outlives the others at exit


def env_int(name: str, default: int) -> int:
    v = os.environ.get(name, "")
    try:
        return int(v) if v else default
    except ValueError:
        raise rdmaflow.InvalidArgumentError(f"${name}={v!r} is not an integer") from None


def route_address(master_addr: str) -> str:
    """This host's address on the route to the store (a UDP connect sends nothing)."""
    if os.environ.get("RDMAFLOW_HOST"):
        return os.environ["RDMAFLOW_HOST"]
    try:
        family, _, _, _, addr = socket.getaddrinfo(master_addr, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def shared_secret(world_size: int) -> str:
    """The job's secret: every process of a multi-process job must be given the same one."""
    value = os.environ.get("RDMAFLOW_JOB_SECRET")
    if value:
        return value
    if world_size > 1:
        raise rdmaflow.InvalidArgumentError(
            "RDMAFLOW_JOB_SECRET is not set: every process of a pipeline job needs the same secret "
            "(rdmaflow launch sets one; with another launcher, export a random one on every node)")
    os.environ["RDMAFLOW_JOB_SECRET"] = value = secrets.token_hex(16)
    return value


class JobStore:
    """The c10d TCPStore of the job, with bounded waits that watch the abort key."""

    def __init__(self, rank: int, world_size: int, timeout: float):
        import torch.distributed as dist

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = env_int("MASTER_PORT", 29500)
        serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self.address, self.timeout, self.world_size, self.serving = f"{host}:{port}", timeout, world_size, serve
        try:
            self.tcp = dist.TCPStore(host, port, world_size, serve, timeout=timedelta(seconds=timeout),
                                     wait_for_workers=False)
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            raise rdmaflow.PeerError(f"cannot reach the job's c10d store at {self.address} within "
                                     f"{timeout:.0f} s: {e}") from None
        atexit.register(_leave_at_exit, weakref.ref(self))

    def leave(self) -> None:
        """Counts this process out; the serving one then waits (bounded) for the others, so that
        a rank failing after it can still read why the job was aborted."""
        with contextlib.suppress(RuntimeError):  # torch's store errors
            left = self.tcp.add(LEFT, 1)
            until = time.monotonic() + min(self.timeout, LINGER)
            while self.serving and left < self.world_size and time.monotonic() < until:
                time.sleep(POLL)
                left = self.tcp.add(LEFT, 0)

    def _do(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError and others
            raise rdmaflow.PeerError(f"the job's c10d store at {self.address} is unreachable ({what}): {e}") from None

    def set(self, key: str, value: str) -> None:
        self._do("set", self.tcp.set, KEYS + key, value)

    def get(self, key: str) -> str:
        self.wait([key])
        return self._do("get", self.tcp.get, KEYS + key).decode()

    def wait(self, keys: list[str]) -> None:
        """Returns once every key is set; raises when the job is aborted or after the timeout."""
        full = [KEYS + k for k in keys]
        give_up = time.monotonic() + self.timeout
        while not self._do("check", self.tcp.check, full):
            reason = self.aborted()
            if reason:
                raise rdmaflow.PeerError(f"the job was aborted: {reason}")
            if time.monotonic() > give_up:
                missing = [k for k in keys if not self._do("check", self.tcp.check, [KEYS + k])]
                raise rdmaflow.TimeoutError(f"timed out after {self.timeout:.0f} s waiting for {missing} in the "
                                            f"job's store")
            time.sleep(POLL)

    def abort(self, reason: str) -> None:
        """Records why the job stops (the first reason wins); best effort."""
        with contextlib.suppress(RuntimeError):  # the store may be gone already
            if not self.tcp.check([ABORT]):
                self.tcp.set(ABORT, reason)

    def aborted(self) -> str | None:
        """The reason recorded by the rank that aborted the job, or None."""
        try:
            return self.tcp.get(ABORT).decode() if self.tcp.check([ABORT]) else None
        except Exception:  # noqa: BLE001 - torch's store errors
            return "the job's c10d store is unreachable"


def _leave_at_exit(ref: weakref.ref) -> None:
    store = ref()
    if store is not None:
        store.leave()
