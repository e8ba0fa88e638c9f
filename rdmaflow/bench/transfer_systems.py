"""The systems of ``rdmaflow bench transfer`` as its driver sees them (:mod:`rdmaflow.bench.transfer`).

Each is a :class:`System` with ``measure(size, count, warmup, window, timeout, tag)``:

* :class:`WorkerPair`: a sender and a receiver process of one system (the rdmaflow modes,
  gRPC, TensorPipe, gloo, NIXL), ``python -m rdmaflow.bench.transfer --worker SYSTEM ROLE``
  (:mod:`rdmaflow.bench._transfer_worker` has the protocol), driven by JSON lines;
* :class:`Memcpy`: one process timing ``dst.copy_(src)``, the machine's ceiling (``d2d-copy``:
  the same on the GPU, timed with CUDA events);
* :class:`Perftest`: ``ucx_perftest`` put (:func:`rdmaflow.bench.perftest.run_perftest`),
  the UCX transport's ceiling.

With ``device="cuda"`` (``bench transfer --device cuda``) every process moves CUDA tensors; the
"transport" is then ``"cuda"``: rdmaflow's processes run with ``ucx_env("cuda")``
(:func:`transport_env`).
"""
from __future__ import annotations

import itertools
import signal
import statistics
import sys
import time
from collections.abc import Mapping, Sequence

from rdmaflow._ucx import TRANSPORT_ENV, ucx_env
from rdmaflow.bench.perftest import run_perftest
from rdmaflow.bench.processes import BenchError, ChildProcess, free_port, process_env

RDMAFLOW_SYSTEMS = ("rdmaflow-zerocopy", "rdmaflow-zerocopy-ucx", "rdmaflow-copy", "rdmaflow-dynamic",
                    "rdmaflow-staging")
#: Systems whose processes run on UCX with the transport's environment and get an --arena-bytes.
UCX_SYSTEMS = (*RDMAFLOW_SYSTEMS, "nixl")
#: Systems of one process: a copy within it, the ceiling.
LOCAL_SYSTEMS = ("memcpy", "d2d-copy")
START_TIMEOUT = 90.0

#: UCX_TLS of the "cuda" transport, used only while ``rdmaflow._ucx.TRANSPORT_ENV`` has no
#: "cuda" entry (that is the one definition where it has one): "sm" plus CUDA copies and IPC.
CUDA_FALLBACK_TLS = "cuda_copy,cuda_ipc,cma,posix,self,tcp"


def transport_env(transport: str) -> dict[str, str]:
    """:func:`rdmaflow._ucx.ucx_env` of ``transport``; "cuda" falls back to "sm" with
    :data:`CUDA_FALLBACK_TLS` where ``rdmaflow._ucx`` does not define it yet."""
    if transport == "cuda" and transport not in TRANSPORT_ENV:
        return {**ucx_env("sm"), "UCX_TLS": CUDA_FALLBACK_TLS}
    return ucx_env(transport)


def window_of(size: int, window: int, max_inflight: int) -> int:
    return max(1, min(window, max_inflight // size))


#: What a process's host arena holds besides tensor data: control blocks, flags, acks,
#: metadata records (and per size a pair's own).
CONTROL_BYTES = 16 << 20
CONTROL_BYTES_PER_SIZE = 64 << 10


def _slot(s: int) -> int:
    return (s + 255) // 256 * 256


def _data_bytes(system: str, role: str, sizes: Sequence[int], window: int, max_inflight: int) -> int:
    """The tensor data an rdmaflow process of ``system`` keeps in its arena (host or CUDA).

    Each size has its own pair for the whole run (made once, reused by every repeat): a static
    receiver holds ``window`` slots per size, a copy-mode (or staging) sender as many buffers, a
    zero-copy or dynamic sender one source tensor per size; a dynamic receiver allocates each
    received tensor and frees it once consumed (room for ``window`` of the largest).
    """
    if role == "receiver" and system == "rdmaflow-dynamic":
        return max(window_of(s, window, max_inflight) * _slot(s) for s in sizes)
    if role == "receiver" or system in ("rdmaflow-copy", "rdmaflow-staging"):
        return sum(window_of(s, window, max_inflight) * _slot(s) for s in sizes)
    return sum(_slot(s) for s in sizes)


def arena_bytes(system: str, role: str, sizes: Sequence[int], window: int, max_inflight: int,
                device: str = "cpu") -> int:
    """The registered host arena an rdmaflow (or NIXL) process of ``system`` needs for these
    sizes: the tensor data (:func:`_data_bytes`) where it is in host memory (not for zero copy
    and dynamic with ``device="cuda"``: see :func:`cuda_arena_bytes`), and the control blocks."""
    if system == "nixl":  # one registered buffer, reused by every size: no control blocks
        if role == "receiver":
            return max(window_of(s, window, max_inflight) * s for s in sizes)
        return max(sizes)
    control = CONTROL_BYTES + len(sizes) * CONTROL_BYTES_PER_SIZE
    if cuda_arena_bytes(system, role, sizes, window, max_inflight, device):
        return control
    return _data_bytes(system, role, sizes, window, max_inflight) + control


def cuda_arena_bytes(system: str, role: str, sizes: Sequence[int], window: int, max_inflight: int,
                     device: str = "cuda") -> int:
    """The registered CUDA arena of an rdmaflow process of ``system`` (0: none): zero copy and
    dynamic on CUDA keep their tensor data there; staging keeps it in host memory."""
    if device != "cuda" or system not in ("rdmaflow-zerocopy", "rdmaflow-zerocopy-ucx", "rdmaflow-dynamic"):
        return 0
    return _data_bytes(system, role, sizes, window, max_inflight) + CONTROL_BYTES


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
                 torch_threads: int, consume: str = "max", device: str = "cpu"):
        super().__init__(name, transport)
        self.consume = consume
        self.device = device
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
                "--timeout", str(self.timeout), "--torch-threads", str(self.torch_threads),
                "--device", self.device]
        if self.name in UCX_SYSTEMS:
            plan = (self.name, role, self.sizes, self.window, self.max_inflight, self.device)
            argv += ["--arena-bytes", str(arena_bytes(*plan))]
            if cuda_arena_bytes(*plan):
                argv += ["--cuda-arena-bytes", str(cuda_arena_bytes(*plan))]
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
               "timeout": timeout, "consume": self.consume}
        deadline = time.monotonic() + timeout
        self.rx.send({"cmd": "recv", "peer": self.sender_info, **cmd})
        self.rx.read(min(timeout, 60.0))  # ready
        self.tx.send({"cmd": "send", "peer": self.peer, **cmd})
        try:
            self.tx.read(deadline - time.monotonic())
        except BenchError as e:  # the receiver's error or exit, if it has one, says more
            try:
                self.rx.read(2.0)
            except BenchError as r:
                if self.rx.proc.poll() is not None or "did not answer" not in str(r):
                    raise BenchError(f"{e}; {r}") from None
            raise
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
    """``memcpy`` (host) or ``d2d-copy`` (``device="cuda"``): one process copying."""

    def __init__(self, transport: str, env: Mapping[str, str], name: str = "memcpy", device: str = "cpu"):
        super().__init__(name, transport)
        self.env = dict(env)
        self.device = device
        self.proc: ChildProcess | None = None

    def start(self) -> None:
        if self.proc is None:
            argv = [sys.executable, "-m", "rdmaflow.bench.transfer", "--worker", self.name, "local",
                    "--transport", self.transport, "--torch-threads", "1", "--device", self.device]
            self.proc = ChildProcess(argv, self.env, self.name)
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
            raise BenchError(f"{self.name} destination has a wrong max")
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
    """rdmaflow's processes get the transport's UCX environment (:func:`transport_env`) and the
    job secret; the others take their transport from their own options (``--transport``), on
    loopback."""
    ucx = name in UCX_SYSTEMS
    env = process_env(base=transport_env(transport) if ucx else None, secret=secret if ucx else None,
                      threads=torch_threads)
    env.update(GLOO_SOCKET_IFNAME="lo", TP_SOCKET_IFNAME="lo")
    if name == "rdmaflow-zerocopy-ucx":  # GPU slots through UCX (cuda_ipc), not mapped (arena.py)
        env["RDMAFLOW_GPU_IPC"] = "0"
    return env


def make_system(name: str, transport: str, *, secret: str, sizes: Sequence[int], window: int,
                max_inflight: int, busy_poll: bool, sock_dir: str, timeout: float,
                torch_threads: int, consume: str = "max", device: str = "cpu") -> System:
    if name == "ucx-perftest-put":
        return Perftest(transport)
    env = system_env(name, transport, secret, torch_threads)
    if name in LOCAL_SYSTEMS:
        return Memcpy(transport, env, name, device)
    return WorkerPair(name, transport, env, sizes=sizes, window=window, max_inflight=max_inflight,
                      busy_poll=busy_poll, sock_dir=sock_dir, timeout=timeout,
                      torch_threads=torch_threads, consume=consume, device=device)
