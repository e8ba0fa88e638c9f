"""The processes of ``rdmaflow bench transfer``: one sender or receiver of one system.

Started by :mod:`rdmaflow.bench.transfer_systems` as
``python -m rdmaflow.bench.transfer --worker SYSTEM ROLE ...`` (so that this module is
imported under its own name, not as ``__main__``: TensorPipe pickles ``consume`` by
reference and the receiver must find the very module whose state, :data:`CONSUMER`, it
updates). rdmaflow's own worker is here; the baselines' are in :mod:`rdmaflow.bench.baselines`.

Protocol: JSON lines. The worker's first line is its hello (``{"ok": true, "info": ...}``; a
receiver's info is what its sender needs, e.g. the rdmaflow endpoint or the gRPC address).
Then each command read on stdin is answered on stdout:

* receiver ``{"cmd": "recv", "size", "count", "window", "tag", "timeout", "peer"}`` (``peer``:
  the sender's hello info): sets up, answers
  ``{"ok": true, "ready": true}``, consumes ``count`` tensors (``tensor.max()`` each), then
  answers ``{"ok": true, "times": [...], "bad": n}``: the CLOCK_MONOTONIC instant at which
  each reduce_max finished, and how many maxima were wrong.
* sender ``{"cmd": "send", "size", "count", "window", "tag", "timeout", "peer"}``: sends
  ``count`` tensors back to back, at most ``window`` in flight, answers ``{"ok": true}``.
* local ``{"cmd": "memcpy", "size", "count", "loops"}``: times ``count`` single-thread
  ``dst.copy_(src)``, ``loops`` times; answers the per-copy times of the fastest loop.
* ``{"cmd": "exit"}``.

Failures answer ``{"ok": false, "error": ...}``; the driver then kills the pair. The process
writes its protocol lines on a private duplicate of stdout: file descriptor 1 itself is
pointed at stderr, so that nothing a library prints can corrupt the protocol.

The tensor sent in measurement ``tag`` holds 1.0 everywhere but its last element, which is
``tag + 2``; the receiver checks that the max is exactly that.
"""
from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
import traceback

ROLES = ("sender", "receiver", "local")
RDMAFLOW_MODES = {"rdmaflow-zerocopy": "zerocopy", "rdmaflow-copy": "copy",
                  "rdmaflow-dynamic": "zerocopy"}
now = time.monotonic  # CLOCK_MONOTONIC: one clock for every process on the host


def marker(tag: int) -> float:
    return float(tag + 2)


def fill(t, tag: int):
    t.fill_(1.0)
    t.view(-1)[-1] = marker(tag)
    return t


class Consumer:
    """Counts consumed tensors and records when each reduce_max finished (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.reset(0, 0)

    def reset(self, count: int, tag: int, reduce: bool = True) -> None:
        with self.lock:
            self.reduce = reduce
            self.times: list[float] = []
            self.bad = 0
            self.count = count
            self.want = marker(tag)
            self.done.clear()
            if count == 0:
                self.done.set()

    def consume(self, t) -> object:
        if self.reduce:
            m = t.max()
            v = float(m)
        else:
            m, v = None, self.want
        t1 = now()
        with self.lock:
            self.times.append(t1)
            if v != self.want:
                self.bad += 1
            if len(self.times) >= self.count:
                self.done.set()
        return m

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise TimeoutError(f"received {len(self.times)} of {self.count} tensors in {timeout:.0f} s")

    def result(self) -> dict:
        with self.lock:
            return {"times": sorted(self.times), "bad": self.bad}

    def receive(self, cmd: dict, ready) -> dict:
        """A receiver's ``recv`` command when the sender's calls run :meth:`consume`: expects
        ``count`` tensors, says it is ready, waits for them (bounded) and returns the times."""
        self.reset(cmd["count"], cmd["tag"], cmd.get("reduce", True))
        ready()
        self.wait(cmd["timeout"])
        return self.result()


CONSUMER = Consumer()


# ------------------------------------------------------------------------------------------
# rdmaflow: StaticSender/StaticReceiver (zerocopy, copy), DynamicSender/DynamicReceiver


class RdmaflowWorker:
    """One pair (receiver, sender) per tensor size, made at its first measurement and reused
    by every later one, as a model reuses a static pair every iteration. The sender's source
    tensor of each size is made once too (in the arena, except for copy mode)."""

    def __init__(self, system: str, role: str, arena_bytes: int, busy_poll: bool) -> None:
        import rdmaflow
        import rdmaflow.transfer

        self.system = system
        self.role = role
        self.mode = RDMAFLOW_MODES[system]
        self.dynamic = system == "rdmaflow-dynamic"
        self.dev = rdmaflow.Device("127.0.0.1:0", busy_poll=busy_poll)
        self.dev.create_arena(arena_bytes)
        self.info = {"endpoint": self.dev.endpoint}
        self.pairs: dict[int, object] = {}   # size -> receiver or sender
        self.sources: dict[int, object] = {}  # size -> tensor (sender)

    def recv(self, cmd: dict, ready) -> dict:
        import torch

        from rdmaflow.transfer import DynamicReceiver, StaticReceiver

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        r = self.pairs.get(size)
        if r is None:
            name = f"bench-{size}"
            if self.dynamic:
                r = DynamicReceiver(self.dev, name, depth=window, timeout=cmd["timeout"])
            else:
                r = StaticReceiver(self.dev, name, (size // 4,), torch.float32, depth=window,
                                   timeout=cmd["timeout"])
            self.pairs[size] = r
        want = marker(tag)
        reduce = cmd.get("reduce", True)
        times: list[float] = []
        bad = 0
        ready()
        for _ in range(count):
            t = r.recv()           # static: this recv also releases the previous slot
            v = float(t.max()) if reduce else want
            times.append(now())
            bad += v != want
            del t                  # dynamic: the tensor goes back to the arena
        r.release()                # the last one is consumed too: the sender may go on
        return {"times": times, "bad": bad}

    def send(self, cmd: dict) -> dict:
        import torch

        from rdmaflow.transfer import DynamicSender, StaticSender

        size, count, tag, timeout = cmd["size"], cmd["count"], cmd["tag"], cmd["timeout"]
        s = self.pairs.get(size)
        if s is None:
            peer, name = cmd["peer"]["endpoint"], f"bench-{size}"
            if self.dynamic:
                s = DynamicSender(self.dev, peer, name, mode=self.mode, timeout=timeout)
            else:
                s = StaticSender(self.dev, peer, name, (size // 4,), torch.float32, mode=self.mode,
                                 timeout=timeout)
            self.pairs[size] = s
            if self.mode == "zerocopy":
                self.sources[size] = self.dev.empty((size // 4,), torch.float32)
            else:
                self.sources[size] = torch.empty(size // 4, dtype=torch.float32)
        src = fill(self.sources[size], tag)  # the previous measurement's sends are all consumed
        # send() waits for a free slot (credits): at most `window` (the receiver's depth)
        # transfers are in flight.
        f = None
        for _ in range(count):
            f = s.send(src)
        if f is not None:
            f.result(timeout)
        s.wait_consumed(s.seq, timeout)
        return {}

    def close(self) -> None:
        from rdmaflow import RdmaflowError

        for p in self.pairs.values():
            with contextlib.suppress(RdmaflowError):  # best effort: the peer may be gone already
                p.close()
        self.pairs.clear()
        self.sources.clear()
        self.dev.close()


def make_worker(args):
    system, role = args.system, args.role
    if system in RDMAFLOW_MODES:
        return RdmaflowWorker(system, role, args.arena_bytes, args.busy_poll)
    # The baselines import this module (the consumer); imported here, when a worker is made.
    if system == "grpc-protobuf":
        from rdmaflow.bench.baselines.grpc_transfer import GrpcWorker

        return GrpcWorker(system, role, args.transport, args.sock_dir)
    if system == "tensorpipe":
        from rdmaflow.bench.baselines.tensorpipe_transfer import TensorPipeWorker

        return TensorPipeWorker(system, role, args.transport, args.port, args.timeout)
    if system == "gloo":
        from rdmaflow.bench.baselines.gloo_transfer import GlooWorker

        return GlooWorker(system, role, args.transport, args.port, args.timeout)
    if system == "nixl":
        from rdmaflow.bench.baselines.nixl_transfer import NixlTransferWorker

        return NixlTransferWorker(role, args.arena_bytes)
    if system == "memcpy":
        from rdmaflow.bench.baselines.memcpy import MemcpyWorker

        return MemcpyWorker()
    raise ValueError(f"unknown system {system!r}")


#: The commands a worker may have (a method each): bench transfer's, then bench latency's.
COMMANDS = ("recv", "send", "memcpy", "ping", "pong")
#: Commands whose handler takes a ``ready`` callback (it answers ``{"ok": true, "ready": true}``
#: once set up, before the measured part).
READY_COMMANDS = ("recv", "pong")


def serve(args, make=None) -> int:
    """Runs the worker ``make(args)`` (default :func:`make_worker`) on the JSON-lines protocol:
    each command ``{"cmd": NAME, ...}`` is answered with what ``worker.NAME(cmd)`` returns
    (``worker.NAME(cmd, ready)`` for :data:`READY_COMMANDS`). ``rdmaflow bench latency``
    serves its workers with it too."""
    # Protocol lines go to a private copy of stdout; fd 1 becomes stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**kw) -> None:
        proto.write(json.dumps(kw) + "\n")
        proto.flush()

    try:
        worker = (make or make_worker)(args)
    except BaseException as e:  # noqa: BLE001  (reported, then the process exits)
        reply(ok=False, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-2000:])
        return 1
    reply(ok=True, info=worker.info, pid=os.getpid())
    status = 0
    try:
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            cmd = json.loads(line)
            op = cmd.get("cmd")
            if op == "exit":
                break
            try:
                handler = getattr(worker, op, None) if op in COMMANDS else None
                if handler is None:
                    raise ValueError(f"unknown command {op!r}")
                if op in READY_COMMANDS:
                    res = handler(cmd, lambda: reply(ok=True, ready=True))
                else:
                    res = handler(cmd)
                reply(ok=True, **res)
            except Exception as e:  # noqa: BLE001
                reply(ok=False, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-2000:])
                status = 1
                break  # the driver kills and restarts the pair
    finally:
        # Any worker (the baselines' libraries raise their own errors): the process exits anyway.
        with contextlib.suppress(Exception):
            worker.close()
    return status
