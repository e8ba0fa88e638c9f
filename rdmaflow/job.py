"""A multi-process job's shared ground: the launcher's environment, the job secret, and the
job's c10d store. The parameter server (``rdmaflow.ps``) and the pipeline (``rdmaflow.graph``)
both build on it, each under a namespace of its own in the one store.

The store carries only endpoints and small JSON documents; region descriptors (remote keys) go
through the devices' authenticated side RPC, never through the store.

Rank 0 serves the store at ``MASTER_ADDR:MASTER_PORT``, on that address only (torch's own
binds every interface), unless a launcher already does (``TORCHELASTIC_USE_AGENT_STORE=True``):
torchrun's agent (it binds every interface: docs/security.md), or ``rdmaflow launch
--shard-replicas`` on node 0 (``StoreHost``, on that address only), so that the store outlives
every shard. Every wait is bounded and watches the abort key, so that a process that fails
makes every other one raise instead of waiting.

Leaving. A process that fails late must still be able to read why the job was aborted, so the
process serving the store outlives the others, boundedly. Keys under the namespace:

    any process                                   the serving process, at exit
    -----------                                   ----------------------------
    count_out(): left += 1, once (at exit, when   leave(): count_out(), then wait
      its store is dropped, or once it has read     until left + dead == world_size
      why the job failed)                           or LINGER s have passed,
    declare_dead(kind, index): it found that        looking every POLL s (it holds
      process dead (a dead one never leaves):       its store until then)
      dead/KIND/INDEX += 1; the first to name
      that process adds 1 to dead

Where a launcher serves the store (``StoreHost``), no process serves it and none waits: each
node's launcher knows when its own processes are gone (dead ones included), and says so under
``rdmaflow/launch/``; node 0's outlives the others, boundedly:

    the launcher of node N > 0, once every      node 0's launcher, once its own processes
    process of its node has ended               have ended
    -----------------------------               ------------------------------------------
    node_done(): nodes_done += 1, once          wait_nodes(): wait until nodes_done ==
                                                  nnodes - 1 or LINGER s have passed, then
                                                  stop serving
"""
from __future__ import annotations

import atexit
import contextlib
import os
import secrets
import socket
import threading
import time
import weakref
from datetime import timedelta

from rdmaflow.errors import InvalidArgumentError, PeerError, TimeoutError

POLL = 0.02  # seconds between looks at keys not yet set
LINGER = 15.0  # at most this long the serving process outlives the others at exit
PART_BYTES = 4 << 20  # set_large's parts: half of what torch's TCPStore takes in one message
# (store address, namespace, rank) that this process counted out of / waited for: once each,
# however many JobStores it holds (a pipeline's stages, a parameter-server context).
_counted_out: set[tuple[str, str, int]] = set()
_waited: set[tuple[str, str, int]] = set()
_once_lock = threading.Lock()


def env_int(name: str, default: int | None = None) -> int:
    """The launcher's integer ``$name``; ``default`` when unset (an error when there is none)."""
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


def job_secret(world_size: int | None = None) -> str:
    """The job's secret (``$RDMAFLOW_JOB_SECRET``): every process of a multi-process job must be
    given the same one. A single process (``world_size``, default ``$WORLD_SIZE``, of 1) makes
    one up."""
    value = os.environ.get("RDMAFLOW_JOB_SECRET")
    if value:
        return value
    if (env_int("WORLD_SIZE", 1) if world_size is None else world_size) > 1:
        raise InvalidArgumentError(
            "RDMAFLOW_JOB_SECRET is not set: every process of a job needs the same secret "
            "(rdmaflow launch sets one; with another launcher, export a random one on every node)"
        )
    os.environ["RDMAFLOW_JOB_SECRET"] = value = secrets.token_hex(16)
    return value


def _short(e: BaseException) -> str:
    """A c10d error's first line: torch appends some 70 lines of C++ stack frames to it."""
    text = str(e).split("Exception raised from", 1)[0].strip()
    return text.splitlines()[0] if text else type(e).__name__


def route_address(master_addr: str) -> str:
    """This host's address on the route to the store (``$RDMAFLOW_HOST`` if set; a UDP connect
    only picks the route and sends nothing)."""
    if os.environ.get("RDMAFLOW_HOST"):
        return os.environ["RDMAFLOW_HOST"]
    try:
        family, _, _, _, addr = socket.getaddrinfo(master_addr, 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect(addr)
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class JobStore:
    """The job's c10d TCPStore under ``namespace`` (every key this class takes is relative to
    it), with bounded waits that watch the abort key. ``tcp`` is the TCPStore itself, for keys
    given in full. Every call returns within ``timeout`` seconds (``leave``: LINGER); threads may
    share one object, as they may share the TCPStore client."""

    def __init__(self, rank: int, world_size: int, timeout: float, namespace: str):
        """A process may hold several (each pipeline it builds holds one; the parameter server
        one more): on the serving rank they share one server (``multi_tenant``), and the
        process counts out once per namespace."""
        import torch.distributed as dist

        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = env_int("MASTER_PORT", 29500)
        if not 1 <= port <= 65535:  # torch's TCPStore would refuse it with its own signature dump
            raise InvalidArgumentError(f"$MASTER_PORT={port} is not a port in [1, 65535]")
        self.serving = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
        self.address, self.timeout, self.world_size, self.ns = f"{host}:{port}", timeout, world_size, namespace
        self._me = (self.address, namespace, rank)
        listen_fd = _store_socket(host, port) if self.serving else None
        try:
            self.tcp = dist.TCPStore(host, port, world_size, self.serving, timeout=timedelta(seconds=timeout),
                                     wait_for_workers=False, multi_tenant=True,
                                     **({} if listen_fd is None else {"master_listen_fd": listen_fd}))
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            raise PeerError(f"cannot reach the job's c10d store at {self.address} within {timeout:.0f} s: "
                            f"{_short(e)}") from None
        # The serving process's store is held until exit, where it lingers for the others: a
        # pipeline stage dropped when main() returned took the server with it while the other
        # ranks still read their close barrier. A client counts out at exit, or once dropped
        # (it cannot be used again): else the serving process lingered its whole LINGER for it.
        if self.serving:
            _SERVING.append(self)
        else:
            weakref.finalize(self, _count_out, self.tcp, self.ns, self._me)

    def _do(self, what: str, fn, *args):
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError and others
            raise PeerError(f"the job's c10d store at {self.address} is unreachable ({what}): {_short(e)}") from None

    def set(self, key: str, value: str) -> None:
        self._do("set", self.tcp.set, self.ns + key, value)

    def set_large(self, key: str, value: str) -> None:
        """``set`` for a value of any size: torch's TCPStore drops a message over 8 MiB (and the
        connection with it), so the value goes in parts, then their count under ``key``."""
        data = value.encode()
        parts = [data[i : i + PART_BYTES] for i in range(0, len(data), PART_BYTES)] or [b""]
        for i, part in enumerate(parts):
            self._do("set", self.tcp.set, f"{self.ns}{key}/{i}", part)
        self.set(key, str(len(parts)))

    def get_large(self, key: str, timeout: float | None = None) -> str:
        """A value ``set_large`` stored, once it is set (``wait``)."""
        n = int(self.get(key, timeout))
        return b"".join(self._do("get", self.tcp.get, f"{self.ns}{key}/{i}") for i in range(n)).decode()

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Sets ``key`` to ``desired`` if it holds ``expected`` ("": not set), atomically; returns
        what it holds afterwards (``desired``, or the value another process set first)."""
        return self._do("compare_set", self.tcp.compare_set, self.ns + key, expected, desired).decode()

    def check(self, key: str) -> bool:
        """Whether ``key`` is set; never waits."""
        return self._do("check", self.tcp.check, [self.ns + key])

    def get(self, key: str, timeout: float | None = None) -> str:
        """``key``'s value once it is set (``wait``)."""
        self.wait([key], timeout)
        return self._do("get", self.tcp.get, self.ns + key).decode()

    def wait(self, keys: list[str], timeout: float | None = None) -> None:
        """Returns once every key is set. Raises PeerError when the job was aborted (with its
        reason) or the store is unreachable, TimeoutError after ``timeout`` (default: the
        store's) seconds."""
        t = self.timeout if timeout is None else timeout
        give_up = time.monotonic() + t
        full = [self.ns + k for k in keys]
        while not self._do("check", self.tcp.check, full):
            reason = self.aborted()
            if reason:
                raise PeerError(f"the job was aborted: {reason}")
            if time.monotonic() > give_up:
                missing = [k for k in keys if not self.check(k)]
                raise TimeoutError(f"timed out after {t:.0f} s waiting for {missing} in the job's store")
            time.sleep(POLL)

    def abort(self, reason: str) -> str | None:
        """Records why the job stops unless a reason is recorded already: the first wins, in one
        atomic compare-and-set. Returns the reason on record now (``reason`` or the earlier one);
        None if the store is gone (best effort)."""
        with contextlib.suppress(RuntimeError):  # torch's store errors are RuntimeErrors
            return self.tcp.compare_set(self.ns + "abort", "", reason).decode()
        return None

    def _recorded_abort(self) -> str | None:
        key = self.ns + "abort"
        return self.tcp.get(key).decode() if self.tcp.check([key]) else None

    def abort_reason(self) -> str | None:
        """The reason some process recorded for aborting the job; None if none or unreadable."""
        with contextlib.suppress(RuntimeError):
            return self._recorded_abort()
        return None

    def aborted(self) -> str | None:
        """Like ``abort_reason``, but an unreachable store is a reason too."""
        try:
            return self._recorded_abort()
        except Exception:  # noqa: BLE001 - torch's store errors
            return "the job's c10d store is unreachable"

    def declare_dead(self, kind: str, index: int) -> None:
        """Records that process ``kind`` ``index`` (a "worker", a "shard", ...) died, so that the
        serving process does not wait at exit for it to leave. Best effort: the store may be gone."""
        with contextlib.suppress(RuntimeError):
            if self.tcp.add(self.ns + f"dead/{kind}/{index}", 1) == 1:
                self.tcp.add(self.ns + "dead", 1)

    def fail_with(self, msg: str, dead: tuple[str, int] | None = None) -> str | None:
        """The one rule for a failure found here: returns the job's abort reason if one is
        recorded already (this failure may be its consequence: nothing is recorded then); else
        records ``msg`` as the reason and ``dead`` (kind, index), if given, as a process that
        died, and returns None."""
        recorded = self.abort(msg)
        if recorded is not None and recorded != msg:
            return recorded
        if dead is not None:
            self.declare_dead(*dead)
        return None

    def _gone(self) -> int:
        """Processes that left, plus those declared dead."""
        return self.tcp.add(self.ns + "left", 0) + self.tcp.add(self.ns + "dead", 0)

    def count_out(self) -> None:
        """Counts this process out, once, and never waits: it is leaving, or it has read why the
        job failed and needs the store no more. Best effort."""
        _count_out(self.tcp, self.ns, self._me)

    def leave(self) -> None:
        """``count_out``; the serving process then waits, at most LINGER seconds, until every
        process has left or was declared dead. Runs at exit, if not called before (the serving
        process holds its store until then); waits once; best effort."""
        self.count_out()
        with _once_lock:
            first = self.serving and self._me not in _waited
            _waited.add(self._me)
        if not first:
            return
        with contextlib.suppress(RuntimeError):
            until = time.monotonic() + min(self.timeout, LINGER)
            while time.monotonic() < until and self._gone() < self.world_size:
                time.sleep(POLL)


LAUNCH_NS = "rdmaflow/launch/"  # the launchers' own keys


class StoreHost:
    """The job's c10d store served by a launcher (``rdmaflow launch --shard-replicas`` on node
    0) instead of rank 0, at ``host:port`` on that address only, as rank 0 binds it. The job's
    processes connect as clients (the launcher sets ``TORCHELASTIC_USE_AGENT_STORE=True``). On
    another node, ``serve=False`` connects to node 0's store as a client, for ``node_done``."""

    def __init__(self, host: str, port: int, timeout: float, serve: bool = True):
        import torch.distributed as dist

        fd = _store_socket(host, port) if serve else None
        self.address = f"{host}:{port}"
        try:
            self.tcp = dist.TCPStore(host, port, None, serve, timeout=timedelta(seconds=timeout),
                                     wait_for_workers=False,
                                     **({} if fd is None else {"master_listen_fd": fd}))
        except Exception as e:  # noqa: BLE001 - torch raises several types here
            raise PeerError(f"cannot {'serve' if serve else 'reach'} the job's c10d store at {self.address}: "
                            f"{_short(e)}") from None

    def abort(self, namespace: str, reason: str) -> str | None:
        """Records ``reason`` as the job's abort reason under ``namespace`` (as ``JobStore.abort``:
        the first wins), so that every process, on every node, raises with it. Best effort."""
        with contextlib.suppress(RuntimeError):
            return self.tcp.compare_set(namespace + "abort", "", reason).decode()
        return None

    def node_done(self) -> None:
        """Says that every process of this node has ended (a node other than 0). Best effort."""
        with contextlib.suppress(RuntimeError):
            self.tcp.add(LAUNCH_NS + "nodes_done", 1)

    def wait_nodes(self, others: int, linger: float = LINGER) -> int:
        """Waits, at most ``linger`` seconds, until ``others`` nodes said ``node_done``; returns
        how many did."""
        until, done = time.monotonic() + linger, 0
        with contextlib.suppress(RuntimeError):
            while (done := self.tcp.add(LAUNCH_NS + "nodes_done", 0)) < others and time.monotonic() < until:
                time.sleep(POLL * 5)
        return done


_SERVING: list[JobStore] = []  # the stores this process serves, held until exit


def _store_socket(host: str, port: int) -> int | None:
    """A socket listening on the store's own address only, for the TCPStore this process
    serves: torch's binds every interface otherwise, and the store is unauthenticated
    (docs/security.md). None where that address cannot be bound here (the store of another
    namespace of this process holds the port, and torch shares it; a name that is no address
    of this host): torch then binds as it would."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        s = socket.socket(family, kind, proto)
    except OSError:
        return None
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(512)
    except OSError:
        s.close()
        return None
    return s.detach()  # the TCPStore owns it now


@atexit.register
def _leave_at_exit() -> None:
    for store in _SERVING:
        store.leave()


def _count_out(tcp, ns: str, me: tuple) -> None:
    with _once_lock:
        first = me not in _counted_out
        _counted_out.add(me)
    if first:
        with contextlib.suppress(RuntimeError):
            tcp.add(ns + "left", 1)
