"""The systems of ``rdmaflow bench transfer`` as its driver sees them (:mod:`rdmaflow.bench.transfer`).

Each is a :class:`System` with ``measure(size, count, warmup, window, timeout, tag)``:

* :class:`WorkerPair`: a sender and a receiver process of one system (the rdmaflow modes,
  gRPC, TensorPipe, gloo, NIXL), ``python -m rdmaflow.bench.transfer --worker SYSTEM ROLE``
  (:mod:`rdmaflow.bench._transfer_worker` has the protocol), driven by JSON lines;
* :class:`Memcpy`: one process timing ``dst.copy_(src)``, the machine's ceiling;
* :class:`Perftest`: ``ucx_perftest`` put (:func:`rdmaflow.bench.perftest.run_perftest`),
  the UCX transport's ceiling.
"""
from __future__ import annotations

import itertools
import signal
import statistics
import sys
import time
from collections.abc import Mapping, Sequence

from rdmaflow.bench.perftest import run_perftest
from rdmaflow.bench.processes import BenchError, ChildProcess, free_port, process_env

RDMAFLOW_SYSTEMS = ("rdmaflow-zerocopy", "rdmaflow-copy", "rdmaflow-dynamic")
#: Systems whose processes run on UCX with the transport's environment and get an --arena-bytes.
UCX_SYSTEMS = (*RDMAFLOW_SYSTEMS, "nixl")
START_TIMEOUT = 90.0


def window_of(size: int, window: int, max_inflight: int) -> int:
    return max(1, min(window, max_inflight // size))


def arena_bytes(system: str, role: str, sizes: Sequence[int], window: int, max_inflight: int) -> int:
    """The registered arena an rdmaflow process of ``system`` needs for these sizes.

    Each size has its own pair for the whole run (made once, reused by every repeat): a static
    receiver holds ``window`` slots per size, a copy-mode sender as many staging buffers, a
    zero-copy or dynamic sender one source tensor per size; a dynamic receiver allocates
    each received tensor and frees it after the reduce_max.
    """
    def slot(s: int) -> int:
        return (s + 255) // 256 * 256

    if system == "nixl":  # one registered buffer, reused by every size: no control blocks
        if role == "receiver":
            return max(window_of(s, window, max_inflight) * s for s in sizes)
        return max(sizes)
    if role == "receiver" and system == "rdmaflow-dynamic":
        need = max(slot(s) for s in sizes)
    elif role == "receiver" or system == "rdmaflow-copy":
        need = sum(window_of(s, window, max_inflight) * slot(s) for s in sizes)
    else:
        need = sum(slot(s) for s in sizes)
    return need + (16 << 20) + len(sizes) * (64 << 10)  # control blocks, flags, acks, records


class System:
    """A system under test on one transport: ``measure(size, count, warmup, window)``."""

    def __init__(self, name: str, transport: str):
        self.name = name
        self.transport = transport

    def spawn(self) -> None:
        """Starts its processes without waiting for them (so that start-ups overlap)."""

    def start(self) -> None:
        """Starts its processes (if :meth:`spawn` did not) and waits until they are up."""

    def processes(self) -> list[ChildProcess]:
        return []

    def pause(self) -> None:
        """SIGSTOPs this system's processes while another system is measured: an idle
        process must not take the CPU (TensorPipe's shm transport polls even when idle)."""
        for p in self.processes():
            p.signal(signal.SIGSTOP)

    def resume(self) -> None:
        for p in self.processes():
            p.signal(signal.SIGCONT)

    def measure(self, size: int, count: int, warmup: int, window: int, timeout: float,
                tag: int) -> dict[str, float | None]:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _stream_metrics(times: Sequence[float], size: int, count: int) -> dict[str, float]:
    """gb_per_s and p50_us from receiver-side consume instants t_0 .. t_count."""
    if len(times) != count + 1:
        raise BenchError(f"expected {count + 1} timestamps, got {len(times)}")
    elapsed = times[-1] - times[0]
    if elapsed <= 0:
        raise BenchError("non-positive elapsed time")
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {"gb_per_s": count * size / elapsed / 1e9, "p50_us": statistics.median(gaps) * 1e6}


class WorkerPair(System):
    """A sender and a receiver process of one system."""

    def __init__(self, name: str, transport: str, env: Mapping[str, str], *, sizes: Sequence[int],
                 window: int, max_inflight: int, busy_poll: bool, sock_dir: str, timeout: float,
                 torch_threads: int, reduce: bool = True):
        super().__init__(name, transport)
        self.reduce = reduce
        self.env = dict(env)
        self.sizes = sizes
        self.window = window
        self.max_inflight = max_inflight
        self.busy_poll = busy_poll
        self.sock_dir = sock_dir
        self.timeout = timeout
        self.torch_threads = torch_threads
        self.rx: ChildProcess | None = None
        self.tx: ChildProcess | None = None
        self.peer: dict = {}         # the receiver's hello info
        self.sender_info: dict = {}  # the sender's
        self._hello_pending = False

    def _argv(self, role: str, port: int) -> list[str]:
        argv = [sys.executable, "-m", "rdmaflow.bench.transfer", "--worker", self.name, role,
                "--transport", self.transport, "--port", str(port), "--sock-dir", self.sock_dir,
                "--timeout", str(self.timeout), "--torch-threads", str(self.torch_threads)]
        if self.name in UCX_SYSTEMS:
            argv += ["--arena-bytes", str(arena_bytes(self.name, role, self.sizes, self.window,
                                                      self.max_inflight))]
        if self.name in RDMAFLOW_SYSTEMS and self.busy_poll:
            argv.append("--busy-poll")
        return argv

    def spawn(self) -> None:
        """Starts both processes without waiting for them (so that start-ups overlap)."""
        if self.rx is not None:
            return
        port = free_port()  # torch.distributed rendezvous (racy: a clash fails the start)
        try:
            self.rx = ChildProcess(self._argv("receiver", port), self.env, f"{self.name} receiver")
            self.tx = ChildProcess(self._argv("sender", port), self.env, f"{self.name} sender")
        except BaseException:
            self.close()
            raise
        self._hello_pending = True

    def start(self) -> None:
        self.spawn()
        if not self._hello_pending:
            return
        assert self.rx is not None and self.tx is not None
        try:
            deadline = time.monotonic() + START_TIMEOUT
            hello = self.rx.read(deadline - time.monotonic())
            self.sender_info = self.tx.read(deadline - time.monotonic()).get("info", {})
            self.peer = hello.get("info", {})
            self._hello_pending = False
        except BaseException:
            self.close()
            raise

    def measure(self, size, count, warmup, window, timeout, tag):
        self.start()
        assert self.rx is not None and self.tx is not None
        cmd = {"size": size, "count": warmup + count, "window": window, "tag": tag,
               "timeout": timeout, "reduce": self.reduce}
        deadline = time.monotonic() + timeout
        self.rx.send({"cmd": "recv", "peer": self.sender_info, **cmd})
        self.rx.read(min(timeout, 60.0))  # ready
        self.tx.send({"cmd": "send", "peer": self.peer, **cmd})
        self.tx.read(deadline - time.monotonic())
        res = self.rx.read(deadline - time.monotonic() + 5.0)
        if res.get("bad"):
            raise BenchError(f"{res['bad']} of {warmup + count} received tensors had a wrong max")
        return _stream_metrics(res["times"][warmup - 1:], size, count)

    def processes(self) -> list[ChildProcess]:
        return [p for p in (self.rx, self.tx) if p is not None]

    def close(self) -> None:
        procs = [p for p in (self.tx, self.rx) if p is not None]
        for p in procs:
            p.signal(signal.SIGCONT)
            try:
                p.send({"cmd": "exit"})
            except BenchError:
                pass  # gone already
        end = time.monotonic() + 5.0
        for p in procs:
            p.wait(max(0.01, end - time.monotonic()))
            p.kill()
        self.rx = self.tx = None
        self._hello_pending = False


class Memcpy(System):
    def __init__(self, transport: str, env: Mapping[str, str]):
        super().__init__("memcpy", transport)
        self.env = dict(env)
        self.proc: ChildProcess | None = None

    def start(self) -> None:
        if self.proc is None:
            argv = [sys.executable, "-m", "rdmaflow.bench.transfer", "--worker", "memcpy", "local",
                    "--transport", self.transport, "--torch-threads", "1"]
            self.proc = ChildProcess(argv, self.env, "memcpy")
            try:
                self.proc.read(START_TIMEOUT)
            except BaseException:
                self.close()
                raise

    def processes(self) -> list[ChildProcess]:
        return [] if self.proc is None else [self.proc]

    def measure(self, size, count, warmup, window, timeout, tag):
        self.start()
        assert self.proc is not None
        self.proc.send({"cmd": "memcpy", "size": size, "count": count, "loops": 3, "tag": tag})
        res = self.proc.read(timeout)
        if res.get("bad"):
            raise BenchError("memcpy destination has a wrong max")
        return _stream_metrics(res["times"], size, count)

    def close(self) -> None:
        if self.proc is not None:
            self.proc.close()
            self.proc = None


class Perftest(System):
    def __init__(self, transport: str):
        super().__init__("ucx-perftest-put", transport)

    def measure(self, size, count, warmup, window, timeout, tag):
        bw = run_perftest(self.transport, "put", size, iters=count, warmup=warmup, timeout=timeout)
        return {"gb_per_s": bw / 1e9, "p50_us": None}


def system_env(name: str, transport: str, secret: str, torch_threads: int) -> dict[str, str]:
    """rdmaflow's processes get the transport's UCX environment and the job secret; the others
    take their transport from their own options (``--transport``), on loopback."""
    ucx = name in UCX_SYSTEMS
    env = process_env(transport if ucx else None, secret=secret if ucx else None, threads=torch_threads)
    env.update(GLOO_SOCKET_IFNAME="lo", TP_SOCKET_IFNAME="lo")
    return env


def make_system(name: str, transport: str, *, secret: str, sizes: Sequence[int], window: int,
                max_inflight: int, busy_poll: bool, sock_dir: str, timeout: float,
                torch_threads: int, reduce: bool = True) -> System:
    if name == "ucx-perftest-put":
        return Perftest(transport)
    env = system_env(name, transport, secret, torch_threads)
    if name == "memcpy":
        return Memcpy(transport, env)
    return WorkerPair(name, transport, env, sizes=sizes, window=window, max_inflight=max_inflight,
                      busy_poll=busy_poll, sock_dir=sock_dir, timeout=timeout,
                      torch_threads=torch_threads, reduce=reduce)
