"""The processes of ``rdmaflow bench transfer``: one sender or receiver of one system.

Started by :mod:`rdmaflow.bench.transfer` as
``python -m rdmaflow.bench.transfer --worker SYSTEM ROLE ...`` (so that this module is
imported under its own name, not as ``__main__``: TensorPipe pickles ``consume`` by
reference and the receiver must find the very module whose state it updates).

Protocol: JSON lines. The worker's first line is its hello (``{"ok": true, "info": ...}``; a
receiver's info is what its sender needs, e.g. the rdmaflow endpoint or the gRPC address).
Then each command read on stdin is answered on stdout:

* receiver ``{"cmd": "recv", "size", "count", "window", "tag", "timeout"}``: sets up, answers
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

import collections
import json
import os
import sys
import threading
import time
import traceback
import warnings

ROLES = ("sender", "receiver", "local")
RDMAFLOW_MODES = {"rdmaflow-zerocopy": "zerocopy", "rdmaflow-copy": "copy",
                  "rdmaflow-dynamic": "zerocopy"}
GRPC_METHOD = "/rdmaflow.bench.Transfer/Send"
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
TENSORPIPE_OPTIONS = {
    # transport, channel: what TensorPipe may use. "uv" is its libuv TCP transport, "basic"
    # sends tensor data over the transport's connection; "shm" is a shared-memory ring,
    # "cma" copies with process_vm_readv.
    "tcp": (["uv"], ["basic"]),
    "sm": (["shm", "uv"], ["cma", "basic"]),
}

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


CONSUMER = Consumer()


# ------------------------------------------------------------------------------------------
# rdmaflow: StaticSender/StaticReceiver (zerocopy, copy), DynamicSender/DynamicReceiver


class RdmaflowWorker:
    """One pair (receiver, sender) per tensor size, made at its first measurement and reused
    by every later one, as a model reuses a static pair every iteration. The sender's source
    tensor of each size is made once too (in the arena, except for copy mode)."""

    def __init__(self, system: str, role: str, arena_bytes: int, busy_poll: bool) -> None:
        import rdmaflow
        import rdmaflow.transfer  # noqa: F401  (adds Device.empty)

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
        for p in self.pairs.values():
            try:
                p.close()
            except Exception:  # noqa: BLE001
                pass
        self.pairs.clear()
        self.sources.clear()
        self.dev.close()


# ------------------------------------------------------------------------------------------
# gRPC (Python grpcio), tensor bytes in a protobuf bytes field


class GrpcWorker:
    def __init__(self, system: str, role: str, transport: str, sock_dir: str) -> None:
        import grpc
        from google.protobuf.wrappers_pb2 import BytesValue

        self.grpc = grpc
        self.BytesValue = BytesValue
        self.transport = transport
        self.server = None
        self.channel = None
        self.stub = None
        self.info: dict = {}
        if role == "receiver":
            from concurrent.futures import ThreadPoolExecutor

            import torch

            empty = BytesValue()

            def handle(request, context):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")  # the bytes are read-only; we only read
                    t = torch.frombuffer(request.value, dtype=torch.float32)
                CONSUMER.consume(t)
                return empty

            handler = grpc.method_handlers_generic_handler("rdmaflow.bench.Transfer", {
                "Send": grpc.unary_unary_rpc_method_handler(
                    handle, request_deserializer=BytesValue.FromString,
                    response_serializer=BytesValue.SerializeToString)})
            self.server = grpc.server(ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
            self.server.add_generic_rpc_handlers((handler,))
            if transport == "sm":
                target = f"unix:{os.path.join(sock_dir, f'grpc-{os.getpid()}.sock')}"
                self.server.add_insecure_port(target)
            else:
                port = self.server.add_insecure_port("127.0.0.1:0")
                if not port:
                    raise RuntimeError("gRPC server could not bind a port on 127.0.0.1")
                target = f"127.0.0.1:{port}"
            self.server.start()
            self.info = {"target": target}

    def recv(self, cmd: dict, ready) -> dict:
        CONSUMER.reset(cmd["count"], cmd["tag"], cmd.get("reduce", True))
        ready()
        CONSUMER.wait(cmd["timeout"])
        return CONSUMER.result()

    def send(self, cmd: dict) -> dict:
        import torch

        grpc = self.grpc
        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        timeout = cmd["timeout"]
        if self.channel is None:
            self.channel = grpc.insecure_channel(cmd["peer"]["target"], options=GRPC_OPTIONS)
            grpc.channel_ready_future(self.channel).result(timeout=timeout)
            self.stub = self.channel.unary_unary(
                GRPC_METHOD, request_serializer=self.BytesValue.SerializeToString,
                response_deserializer=self.BytesValue.FromString)
        src = fill(torch.empty(size // 4, dtype=torch.float32), tag)
        pending: collections.deque = collections.deque()
        deadline = now() + timeout
        for _ in range(count):
            if len(pending) >= window:
                pending.popleft().result(timeout=max(0.001, deadline - now()))
            # What TensorFlow's gRPC path does per tensor: its bytes into a protobuf message.
            msg = self.BytesValue(value=src.numpy().tobytes())
            pending.append(self.stub.future(msg, timeout=max(0.001, deadline - now())))
            del msg
        while pending:
            pending.popleft().result(timeout=max(0.001, deadline - now()))
        return {}

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if self.server is not None:
            self.server.stop(grace=1.0).wait(5.0)


# ------------------------------------------------------------------------------------------
# torch.distributed.rpc over TensorPipe


def consume(t):
    """Runs on the receiver, called by the sender through ``rpc_async``: reduce_max."""
    return CONSUMER.consume(t)


class TensorPipeWorker:
    def __init__(self, system: str, role: str, transport: str, port: int, timeout: float) -> None:
        import torch.distributed.rpc as rpc

        self.rpc = rpc
        transports, channels = TENSORPIPE_OPTIONS[transport]
        opts = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=timeout, num_worker_threads=4,
            _transports=transports, _channels=channels)
        rank = 0 if role == "sender" else 1
        rpc.init_rpc(role, rank=rank, world_size=2, rpc_backend_options=opts)
        self.info = {"transports": transports, "channels": channels}

    def recv(self, cmd: dict, ready) -> dict:
        CONSUMER.reset(cmd["count"], cmd["tag"], cmd.get("reduce", True))
        ready()
        CONSUMER.wait(cmd["timeout"])
        return CONSUMER.result()

    def send(self, cmd: dict) -> dict:
        import torch

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        timeout = cmd["timeout"]
        src = fill(torch.empty(size // 4, dtype=torch.float32), tag)
        pending: collections.deque = collections.deque()
        for _ in range(count):
            if len(pending) >= window:
                pending.popleft().wait()
            pending.append(self.rpc.rpc_async("receiver", consume, args=(src,), timeout=timeout))
        while pending:
            pending.popleft().wait()
        return {}

    def close(self) -> None:
        self.rpc.shutdown(graceful=True)


# ------------------------------------------------------------------------------------------
# torch.distributed, gloo send/recv


class GlooWorker:
    def __init__(self, system: str, role: str, transport: str, port: int, timeout: float) -> None:
        import datetime

        import torch.distributed as dist

        self.dist = dist
        rank = 0 if role == "sender" else 1
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=timeout))
        self.info = {}

    def recv(self, cmd: dict, ready) -> dict:
        import torch

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        want = marker(tag)
        reduce = cmd.get("reduce", True)
        bufs = [torch.empty(size // 4, dtype=torch.float32) for _ in range(min(window, count))]
        # Keep `window` receives posted, as rdmaflow keeps `window` slots: the sender may run
        # that far ahead while the receiver reduces.
        works = [self.dist.irecv(b, src=0) for b in bufs]
        times: list[float] = []
        bad = 0
        ready()
        for i in range(count):
            j = i % len(bufs)
            works[j].wait()
            v = float(bufs[j].max()) if reduce else want
            times.append(now())
            bad += v != want
            if i + len(bufs) < count:
                works[j] = self.dist.irecv(bufs[j], src=0)
        return {"times": times, "bad": bad}

    def send(self, cmd: dict) -> dict:
        import torch

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        src = fill(torch.empty(size // 4, dtype=torch.float32), tag)
        pending: collections.deque = collections.deque()
        for _ in range(count):
            if len(pending) >= window:
                pending.popleft().wait()
            pending.append(self.dist.isend(src, dst=1))
        while pending:
            pending.popleft().wait()
        return {}

    def close(self) -> None:
        self.dist.destroy_process_group()


# ------------------------------------------------------------------------------------------
# memcpy: the machine's ceiling


class MemcpyWorker:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.info = {"threads": torch.get_num_threads()}
        self._src = self._dst = None

    def _buffers(self, numel: int):
        import torch

        # One pair of buffers, grown to the largest size seen: no page faults per measurement.
        if self._src is None or self._src.numel() < numel:
            self._src = self._dst = None
            self._src = torch.empty(numel, dtype=torch.float32).fill_(1.0)
            self._dst = torch.empty(numel, dtype=torch.float32).fill_(0.0)
        return self._src[:numel], self._dst[:numel]

    def memcpy(self, cmd: dict) -> dict:
        size, count, loops, tag = cmd["size"], cmd["count"], cmd.get("loops", 3), cmd.get("tag", 0)
        src, dst = self._buffers(size // 4)
        fill(src, tag)
        dst.copy_(src)  # warm
        best: list[float] | None = None
        for _ in range(loops):
            stamps = [now()]
            for _ in range(count):
                dst.copy_(src)
                stamps.append(now())
            if best is None or stamps[-1] - stamps[0] < best[-1] - best[0]:
                best = stamps
        return {"times": best, "bad": int(float(dst.max()) != marker(tag))}

    def close(self) -> None:
        pass


# ------------------------------------------------------------------------------------------


def make_worker(args):
    system, role = args.system, args.role
    if system in RDMAFLOW_MODES:
        return RdmaflowWorker(system, role, args.arena_bytes, args.busy_poll)
    if system == "grpc-protobuf":
        return GrpcWorker(system, role, args.transport, args.sock_dir)
    if system == "tensorpipe":
        return TensorPipeWorker(system, role, args.transport, args.port, args.timeout)
    if system == "gloo":
        return GlooWorker(system, role, args.transport, args.port, args.timeout)
    if system == "memcpy":
        return MemcpyWorker()
    raise ValueError(f"unknown system {system!r}")


def serve(args) -> int:
    # Protocol lines go to a private copy of stdout; fd 1 becomes stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def reply(**kw) -> None:
        proto.write(json.dumps(kw) + "\n")
        proto.flush()

    try:
        worker = make_worker(args)
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
                if op == "recv":
                    res = worker.recv(cmd, lambda: reply(ok=True, ready=True))
                elif op == "send":
                    res = worker.send(cmd)
                elif op == "memcpy":
                    res = worker.memcpy(cmd)
                else:
                    raise ValueError(f"unknown command {op!r}")
                reply(ok=True, **res)
            except Exception as e:  # noqa: BLE001
                reply(ok=False, error=f"{type(e).__name__}: {e}", tb=traceback.format_exc()[-2000:])
                status = 1
                break  # the driver kills and restarts the pair
    finally:
        try:
            worker.close()
        except Exception:  # noqa: BLE001
            pass
    return status
