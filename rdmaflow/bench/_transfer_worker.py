"""The processes of ``rdmaflow bench transfer``: one sender or receiver of one system.

Started by :mod:`rdmaflow.bench.transfer_systems` as
``python -m rdmaflow.bench.transfer --worker SYSTEM ROLE ...`` (so that this module is
imported under its own name, not as ``__main__``: TensorPipe pickles ``consume`` by
reference and the receiver must find the very module whose state, :data:`CONSUMER`, it
updates). rdmaflow's own worker is here; the baselines' are in :mod:`rdmaflow.bench.baselines`.

Protocol: JSON lines. The worker's first line is its hello (``{"ok": true, "info": ...}``; a
receiver's info is what its sender needs, e.g. the rdmaflow endpoint or the gRPC address).
Then each command read on stdin is answered on stdout:

* receiver ``{"cmd": "recv", "size", "count", "window", "tag", "timeout", "consume", "peer"}``
  (``peer``: the sender's hello info): sets up, answers ``{"ok": true, "ready": true}``,
  consumes ``count`` tensors (:func:`consume`: ``tensor.max()`` each, or a CUDA stream
  synchronize), then answers ``{"ok": true, "times": [...], "bad": n}``: the CLOCK_MONOTONIC
  instant at which each consume step finished, and how many maxima were wrong.
* sender ``{"cmd": "send", "size", "count", "window", "tag", "timeout", "peer"}``: sends
  ``count`` tensors back to back, at most ``window`` in flight, answers ``{"ok": true}``.
* local ``{"cmd": "memcpy", "size", "count", "loops"}``: times ``count`` single-thread
  ``dst.copy_(src)`` (with ``--device cuda``: device-to-device, timed with CUDA events),
  ``loops`` times; answers the per-copy times of the fastest loop.
* ``{"cmd": "exit"}``.

Failures answer ``{"ok": false, "error": ...}``; the driver then kills the pair. The process
writes its protocol lines on a private duplicate of stdout: file descriptor 1 itself is
pointed at stderr, so that nothing a library prints can corrupt the protocol.

The tensor sent in measurement ``tag`` holds 1.0 everywhere but its last element, which is
``tag + 2``; the receiver checks that the max is exactly that (every tensor with ``consume``
"max", the last one of a measurement with "sync").

With ``--device cuda`` (``rdmaflow bench transfer --device cuda``) the tensors are CUDA tensors
on the current device: the sender's source and the tensor the receiver consumes.
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
#: system -> the StaticSender/DynamicSender mode. "rdmaflow-staging" (CUDA tensors only) sends a
#: host arena tensor the CUDA tensor was copied into.
RDMAFLOW_MODES = {"rdmaflow-zerocopy": "zerocopy", "rdmaflow-zerocopy-ucx": "zerocopy", "rdmaflow-copy": "copy",
                  "rdmaflow-dynamic": "zerocopy", "rdmaflow-staging": "zerocopy"}
#: The receiver's consume step (:func:`consume`).
CONSUME_MODES = ("max", "sync", "none")
now = time.monotonic  # CLOCK_MONOTONIC: one clock for every process on the host


def marker(tag: int) -> float:
    return float(tag + 2)


def fill(t, tag: int):
    t.fill_(1.0)
    t.view(-1)[-1] = marker(tag)
    return t


def consume_mode(cmd: dict) -> str:
    """The consume step a ``recv`` command asks for (``"consume"``; a command of before it had
    ``"reduce"``, a bool)."""
    mode = cmd.get("consume") or ("max" if cmd.get("reduce", True) else "none")
    if mode not in CONSUME_MODES:
        raise ValueError(f"unknown consume step {mode!r}; expected one of {CONSUME_MODES}")
    return mode


def consume(t, mode: str, want: float, last: bool) -> tuple[float, bool, object]:
    """The receiver's consume step of a received tensor: returns the instant it finished,
    whether the tensor's max was right, and the max (a 0-dim tensor, None where not computed).

    ``"max"``: a reduce_max (``float(t.max())``), checked (Xue et al.'s micro-benchmark).
    ``"sync"``: ``torch.cuda.current_stream().synchronize()``: the CUDA tensor has landed and
    whatever the transfer queued on the consumer's stream is done, so the time is the
    transfer's (comparable with a device-to-device copy); the max of the ``last`` tensor of a
    measurement is checked after its instant. ``"none"``: nothing, nothing checked (diagnostic).
    """
    if mode == "max":
        m = t.max()
        v = float(m)
        return now(), v == want, m
    if mode == "sync":
        import torch

        torch.cuda.current_stream().synchronize()
        t1 = now()
        return t1, (not last) or float(t.max()) == want, None
    return now(), True, None


class Consumer:
    """Counts consumed tensors and records when each reduce_max finished (thread-safe)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.reset(0, 0)

    def reset(self, count: int, tag: int, mode: str = "max") -> None:
        with self.lock:
            self.mode = mode
            self.times: list[float] = []
            self.bad = 0
            self.count = count
            self.want = marker(tag)
            self.done.clear()
            if count == 0:
                self.done.set()

    def consume(self, t) -> object:
        """:func:`consume` of ``t``; returns its max on the host with "max" (TensorPipe's reply),
        else None (nothing heavy goes back)."""
        with self.lock:
            last = len(self.times) + 1 >= self.count
        t1, ok, m = consume(t, self.mode, self.want, last)
        with self.lock:
            self.times.append(t1)
            if not ok:
                self.bad += 1
            if len(self.times) >= self.count:
                self.done.set()
        return None if t.is_cuda else m

    def wait(self, timeout: float) -> None:
        if not self.done.wait(timeout):
            raise TimeoutError(f"received {len(self.times)} of {self.count} tensors in {timeout:.0f} s")

    def result(self) -> dict:
        with self.lock:
            return {"times": sorted(self.times), "bad": self.bad}

    def receive(self, cmd: dict, ready) -> dict:
        """A receiver's ``recv`` command when the sender's calls run :meth:`consume`: expects
        ``count`` tensors, says it is ready, waits for them (bounded) and returns the times."""
        self.reset(cmd["count"], cmd["tag"], consume_mode(cmd))
        ready()
        self.wait(cmd["timeout"])
        return self.result()


CONSUMER = Consumer()


# ------------------------------------------------------------------------------------------
# rdmaflow: StaticSender/StaticReceiver (zerocopy, copy), DynamicSender/DynamicReceiver


class RdmaflowWorker:
    """One pair (receiver, sender) per tensor size, made at its first measurement and reused
    by every later one, as a model reuses a static pair every iteration. The sender's source
    tensor of each size is made once too (in the arena, except for copy mode).

    ``device="cuda"``: CUDA tensors. Zero copy and dynamic keep their data in the registered
    CUDA arena (``cuda_arena_bytes``): the sender's source is born there
    (``dev.empty(..., device="cuda")``), a static receiver's slots are there
    (``StaticReceiver(..., cuda="cuda")``), and a dynamic receiver READs into it; flags, acks
    and metadata records stay in the host arena.
    ``rdmaflow-staging`` sends through the host: the sender copies the CUDA tensor into one of
    ``window`` host arena tensors and sends that over a host static pair; the receiver copies
    the received host tensor to a CUDA tensor and consumes that.
    """

    def __init__(self, system: str, role: str, arena_bytes: int, busy_poll: bool, device: str = "cpu",
                 cuda_arena_bytes: int = 0) -> None:
        import rdmaflow
        import rdmaflow.transfer

        self.system = system
        self.role = role
        self.mode = RDMAFLOW_MODES[system]
        self.dynamic = system == "rdmaflow-dynamic"
        self.staging = system == "rdmaflow-staging"
        if self.staging and device != "cuda":
            raise ValueError("rdmaflow-staging moves CUDA tensors: run it with --device cuda")
        self.device = device
        self.on_cuda = device == "cuda" and not self.staging  # the pair's data is in CUDA memory
        self.dev = rdmaflow.Device("127.0.0.1:0", busy_poll=busy_poll)
        self.dev.create_arena(arena_bytes)
        if self.on_cuda and cuda_arena_bytes:
            self.dev.create_arena(cuda_arena_bytes, device="cuda")
        self.info = {"endpoint": self.dev.endpoint}
        self.pairs: dict[int, object] = {}   # size -> receiver or sender
        self.sources: dict[int, object] = {}  # size -> tensor (sender); staging: (CUDA tensor, host tensors)

    def _where(self, key: str = "device") -> dict:
        """The keyword that puts an arena tensor (``device=``) or a static receiver's slots
        (``cuda=``) in CUDA memory, on CUDA runs."""
        return {key: "cuda"} if self.on_cuda else {}

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
                                   timeout=cmd["timeout"], **self._where("cuda"))
            self.pairs[size] = r
        want = marker(tag)
        mode = consume_mode(cmd)
        times: list[float] = []
        bad = 0
        ready()
        for i in range(count):
            t = r.recv()           # static: this recv also releases the previous slot
            if self.staging:
                t = t.to("cuda")   # host slot -> a CUDA tensor (synchronous: the slot is free after)
            t1, ok, _ = consume(t, mode, want, i == count - 1)
            times.append(t1)
            bad += not ok
            del t                  # dynamic: the tensor goes back to the arena
        r.release()                # the last one is consumed too: the sender may go on
        return {"times": times, "bad": bad}

    def _source(self, size: int, window: int):
        import torch

        n = size // 4
        if self.staging:  # the CUDA tensor, and `window` host arena tensors to stage it in, in turn
            return (torch.empty(n, dtype=torch.float32, device="cuda"),
                    [self.dev.empty((n,), torch.float32) for _ in range(window)])
        if self.mode == "zerocopy":
            return self.dev.empty((n,), torch.float32, **self._where())
        return torch.empty(n, dtype=torch.float32)

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
            self.sources[size] = self._source(size, cmd["window"])
        # send() waits for a free slot (credits): at most `window` (the receiver's depth)
        # transfers are in flight. The previous measurement's sends are all consumed.
        f = None
        if self.staging:
            src, stages = self.sources[size]
            fill(src, tag)
            sent: list = [None] * len(stages)
            for i in range(count):
                j = i % len(stages)
                if sent[j] is not None:
                    sent[j].result(timeout)  # its previous send has left: it may be rewritten
                stages[j].copy_(src)         # device to host, done when copy_ returns
                f = sent[j] = s.send(stages[j])
        else:
            src = fill(self.sources[size], tag)  # on CUDA: queued on the current stream, which send() waits for
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
    device = getattr(args, "device", "cpu")
    if system in RDMAFLOW_MODES:
        return RdmaflowWorker(system, role, args.arena_bytes, args.busy_poll, device,
                              getattr(args, "cuda_arena_bytes", 0))
    # The baselines import this module (the consumer); imported here, when a worker is made.
    if system == "grpc-protobuf":
        from rdmaflow.bench.baselines.grpc_transfer import GrpcWorker

        return GrpcWorker(system, role, args.transport, args.sock_dir)
    if system == "tensorpipe":
        from rdmaflow.bench.baselines.tensorpipe_transfer import TensorPipeWorker

        return TensorPipeWorker(system, role, args.transport, args.port, args.timeout, device)
    if system == "gloo":
        from rdmaflow.bench.baselines.gloo_transfer import GlooWorker

        return GlooWorker(system, role, args.transport, args.port, args.timeout, device)
    if system == "nixl":
        from rdmaflow.bench.baselines.nixl_transfer import NixlTransferWorker

        return NixlTransferWorker(role, args.arena_bytes)
    if system in ("memcpy", "d2d-copy"):
        from rdmaflow.bench.baselines.memcpy import MemcpyWorker

        return MemcpyWorker(device)
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
