"""The RDMA device (Xue et al., EuroSys '19, §3.1, Table 1) in Python, with torch tensors.

``Device`` is the C++ ``_core.Device`` with what needs Python added: the job secret and the
same-host and copy-thread settings from the environment, registering memory a tensor owns,
the device's arenas (``empty``, ``create_arena``, ``arena``, ``gpu_arena``), publishing regions
by name, the thread that runs completion callbacks, and what the layers above keep per device
(the transfer receivers published on it, memory a peer may still touch). ``MemRegion``,
``RemoteRegion``, ``Channel`` and ``Future`` are the C++ classes as they are.
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterable, Sequence

import torch
from typing_extensions import Self

from rdmaflow import _core, _ucx
from rdmaflow._args import as_torch_device, byte_count, cuda_device_of, integer
from rdmaflow._core import Channel, FlaggedWrites, Future, MemRegion, RemoteRegion, SameHost
from rdmaflow._cuda_ipc import gpu_ipc_info
from rdmaflow.arena import CUDA_ARENA_NAME, CUDA_IPC_NAME, Arena, default_bytes
from rdmaflow.deadline import Deadline, positive_seconds
from rdmaflow.errors import InvalidArgumentError

SECRET_ENV = "RDMAFLOW_JOB_SECRET"
SAME_HOST_ENV = "RDMAFLOW_SAME_HOST"
COPY_THREADS_ENV = "RDMAFLOW_COPY_THREADS"
INLINE_POSTS_ENV = "RDMAFLOW_INLINE_POSTS"
FLAGGED_WRITES_ENV = "RDMAFLOW_FLAGGED_WRITES"
TCP_CONGESTION_ENV = "RDMAFLOW_TCP_CONGESTION"

_callback_thread: threading.Thread | None = None
_callback_lock = threading.Lock()


def _start_callback_thread() -> None:
    global _callback_thread
    with _callback_lock:
        if _callback_thread is None:
            _callback_thread = threading.Thread(target=_core.run_callbacks, name="rdmaflow-callbacks", daemon=True)
            _callback_thread.start()


def _job_secret(secret: str | bytes | None) -> str:
    if secret is None:
        secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise InvalidArgumentError(
            f"a job secret is required: pass secret=... or set {SECRET_ENV}; devices only hand "
            "remote keys to peers that prove they know it"
        )
    return secret.decode("latin-1") if isinstance(secret, bytes) else secret


def _same_host(same_host: bool | SameHost | None) -> SameHost:
    if isinstance(same_host, SameHost):
        return same_host
    if isinstance(same_host, bool):
        return SameHost.ON if same_host else SameHost.OFF
    if same_host is not None:
        raise InvalidArgumentError(f"same_host must be None, a bool or a SameHost, got {same_host!r}")
    env = os.environ.get(SAME_HOST_ENV, "").strip().lower()
    modes = {"": SameHost.AUTO, "auto": SameHost.AUTO, "0": SameHost.OFF, "1": SameHost.ON}
    if env not in modes:
        raise InvalidArgumentError(f"{SAME_HOST_ENV} must be 0, 1 or auto, got {env!r}")
    return modes[env]


def _inline_posts(inline_posts: bool | None) -> bool:
    if inline_posts is not None:
        return bool(inline_posts)
    env = os.environ.get(INLINE_POSTS_ENV, "1").strip()
    if env not in ("0", "1"):
        raise InvalidArgumentError(f"{INLINE_POSTS_ENV} must be 0 or 1, got {env!r}")
    return env == "1"


def _flagged_writes(flagged_writes: FlaggedWrites | str | None) -> FlaggedWrites:
    if isinstance(flagged_writes, FlaggedWrites):
        return flagged_writes
    if flagged_writes is None:
        flagged_writes = os.environ.get(FLAGGED_WRITES_ENV, "auto").strip() or "auto"
        where = FLAGGED_WRITES_ENV
    else:
        where = "flagged_writes"
    modes = {"auto": FlaggedWrites.AUTO, "put": FlaggedWrites.PUT, "message": FlaggedWrites.MESSAGE}
    if not isinstance(flagged_writes, str) or flagged_writes.lower() not in modes:
        raise InvalidArgumentError(f"{where} must be auto, put or message, got {flagged_writes!r}")
    return modes[flagged_writes.lower()]


def _tcp_congestion(tcp_congestion: str | None) -> str:
    where = "tcp_congestion"
    if tcp_congestion is None:
        tcp_congestion = os.environ.get(TCP_CONGESTION_ENV, "auto").strip() or "auto"
        where = TCP_CONGESTION_ENV
    if not isinstance(tcp_congestion, str) or not tcp_congestion:
        raise InvalidArgumentError(
            f"{where} must be auto, system or a congestion control's name (e.g. cubic), got {tcp_congestion!r}"
        )
    return tcp_congestion


def _net_devices(net_devices: str | None, endpoint) -> str:
    if net_devices is None:
        return _ucx.net_devices_for(endpoint) if isinstance(endpoint, str) else ""
    if not isinstance(net_devices, str) or not net_devices.strip():
        raise InvalidArgumentError(f"net_devices must be UCX device names (e.g. 'eth0', 'lo,mlx5_0:1') or 'all', "
                                   f"got {net_devices!r}")
    return net_devices.strip()


def _spin_us(spin_us: int) -> int:
    if not isinstance(spin_us, int) or isinstance(spin_us, bool) or not 0 <= spin_us <= 10**6:
        raise InvalidArgumentError(f"spin_us must be an integer number of microseconds in [0, 1000000], got {spin_us!r}")
    return spin_us


def _copy_threads(copy_threads: int | None) -> int:
    if copy_threads is not None:
        return integer(copy_threads, "copy_threads")
    env = os.environ.get(COPY_THREADS_ENV, "").strip()
    if env:
        try:
            return int(env)
        except ValueError:
            raise InvalidArgumentError(f"{COPY_THREADS_ENV} must be an integer, got {env!r}") from None
    try:
        local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    except ValueError:
        raise InvalidArgumentError(f"$LOCAL_WORLD_SIZE must be an integer (processes on this host), got "
                                   f"{os.environ['LOCAL_WORLD_SIZE']!r}") from None
    return max(1, min(2, (os.cpu_count() or 1) // local))


def tcp_congestion_of(tcp_congestion: str | None = None) -> str:
    """The congestion control a :class:`Device` made with ``tcp_congestion`` (default
    ``$RDMAFLOW_TCP_CONGESTION``, else ``"auto"``) gives UCX's tcp data sockets on this host."""
    return _core.tcp_congestion_of(_tcp_congestion(tcp_congestion))


def check_dense(tensor: torch.Tensor, what: str) -> None:
    """Raises InvalidArgumentError unless ``tensor`` is dense (strided, not nested): a sparse
    or nested tensor's memory is not its values in order, so it cannot be registered or sent."""
    if tensor.layout is not torch.strided or tensor.is_nested:
        if tensor.is_nested:
            raise InvalidArgumentError(f"{what} is a nested tensor; rdmaflow moves dense tensors: send its "
                                       "components (.unbind()) or a padded form (.to_padded_tensor(0.0))")
        raise InvalidArgumentError(f"{what} is a {str(tensor.layout).removeprefix('torch.')} tensor; rdmaflow moves "
                                   "dense tensors: send its dense form (.to_dense()) or its indices and values")


def cache_line_handoff_ns(cpu_a: int, cpu_b: int, seconds: float) -> float:
    """Nanoseconds one cache line takes to move between two cpus, averaged over ``seconds`` of
    two threads pinned to them handing it back and forth (the benchmarks' probe for the host's
    phases, :class:`rdmaflow.bench.processes.HostPhases`). Blocks for about ``seconds``;
    :class:`InvalidArgumentError` for a cpu this process may not run on."""
    return _core.cache_line_handoff_ns(cpu_a, cpu_b, seconds)


class Device(_core.Device):
    """An RDMA device listening on ``endpoint`` (``host:port``; port 0 picks one). A fixed port
    is free again as soon as the device holding it closed (its handshake listener binds with
    ``SO_REUSEADDR``); two live devices on one port are refused (``InvalidArgumentError``).

    ``num_cqs`` completion queues, each a UCX worker with its own progress thread, and
    ``qps_per_peer`` queue pairs per peer, spread round-robin over them (Xue et al., Figure 4).
    The default of two lets a static send of 4 MiB or more over tcp travel as two halves on two
    workers' connections (docs/transfer.md); an idle worker's thread sleeps.
    Peers must share ``secret`` (default: ``$RDMAFLOW_JOB_SECRET``) before any remote key is
    handed out; one shorter than 16 bytes, or only whitespace, is refused (make one with
    ``secrets.token_hex(16)``; docs/security.md). The handshake listener binds ``endpoint``'s
    address alone and closes a connection that has not proved the secret within
    ``$RDMAFLOW_HANDSHAKE_TIMEOUT`` seconds (default 5). Progress threads sleep on UCX's wakeup fd when idle unless ``busy_poll``.
    ``data_error_handling`` turns on UCX's peer-failure mode for data endpoints as well as the
    control link; it costs TCP puts much of their bandwidth, and a dead peer is detected
    without it.

    ``same_host`` is the same-host fast path: regions from ``alloc_region`` are then shared
    memory that a peer on the same host maps, so a memcpy to or from them is one CPU copy
    instead of a transport operation (docs/architecture.md). ``SameHost.AUTO`` is on unless
    ``UCX_TLS`` rules out shared-memory transports (e.g. ``UCX_TLS=tcp``); ``True``/``False``
    mean ``ON``/``OFF``; ``None`` (default) reads ``$RDMAFLOW_SAME_HOST`` (``0``, ``1`` or
    ``auto``, the default). ``copy_threads`` threads share each large same-host copy (default
    ``$RDMAFLOW_COPY_THREADS``, else this process's share of the cores:
    ``cpu_count // LOCAL_WORLD_SIZE``, at most 2); the helpers sleep when idle.

    ``inline_posts`` (default ``$RDMAFLOW_INLINE_POSTS``, else on): a memcpy, fence or flush
    makes its UCX calls on the caller's thread when the worker is free, instead of handing them
    to the progress thread (docs/architecture.md, "Threads"); off is for measuring the difference.

    ``flagged_writes`` (default ``$RDMAFLOW_FLAGGED_WRITES``, else ``"auto"``): how a transfer's
    data and flag travel over UCX: ``"put"`` (two puts, the flag's once the data's flush
    completed), ``"message"`` (one active message
    that the receiving side applies data first, flag last; only where every lane is tcp, put
    elsewhere, as on other transports a flush does not say the message was applied) or
    ``"auto"`` (message on endpoints whose every lane is tcp, put elsewhere; on one tcp lane a
    write above the message size puts its flag right behind its data); docs/transfer.md,
    "Flagged writes".

    ``tcp_congestion`` (default ``$RDMAFLOW_TCP_CONGESTION``, else ``"auto"``): the congestion
    control of UCX's tcp data sockets. ``"auto"`` gives them cubic (reno where this process may
    not choose cubic, bbr where it may choose neither) when the system's is bbr, whose pacing
    holds back a stream of bursts, and leaves any other; ``"system"`` leaves the system's; a name (``tcp(7)``, ``TCP_CONGESTION``)
    sets that one, and InvalidArgumentError says why when this process may not.
    ``Device.tcp_congestion`` is the one in effect (docs/transfer.md, "The congestion control of
    the data sockets").

    ``net_devices``: the network devices UCX may use (``UCX_NET_DEVICES``), where the
    environment sets none. By default the interface that holds ``endpoint``'s address, plus the
    host's RDMA ports: UCX's tcp data ports then listen on that interface only (a loopback
    device on loopback only), not on every interface; "all" where the address is a wildcard
    (``0.0.0.0``) or not this host's. ``"all"`` restores UCX's default. ``Device.net_devices``
    is the setting in effect (docs/security.md).

    A device is a context manager: leaving the ``with`` block closes it.
    """

    # What the device keeps for itself and the layers above, declared here so that no layer
    # hangs state of its own on a device: its arenas, made on first use; the transfer receivers
    # published on it (``receivers``); memory a peer may still touch (``keep_until_closed``).
    _host_arena: Arena | None
    _gpu_arena: Arena | None
    _receivers: dict[str, tuple]
    _quarantine: list

    def __init__(
        self,
        endpoint: str = "127.0.0.1:0",
        num_cqs: int = 2,
        qps_per_peer: int = 1,
        *,
        secret: str | bytes | None = None,
        busy_poll: bool = False,
        spin_us: int = 50,
        connect_timeout: float = 10.0,
        rpc_timeout: float = 10.0,
        data_error_handling: bool = False,
        same_host: bool | SameHost | None = None,
        copy_threads: int | None = None,
        inline_posts: bool | None = None,
        flagged_writes: FlaggedWrites | str | None = None,
        tcp_congestion: str | None = None,
        net_devices: str | None = None,
    ):
        super().__init__(endpoint, num_cqs=integer(num_cqs, "num_cqs"), qps_per_peer=integer(qps_per_peer, "qps_per_peer"),
                         secret=_job_secret(secret),
                         busy_poll=bool(busy_poll), spin_us=_spin_us(spin_us),
                         connect_timeout=positive_seconds(connect_timeout, "connect_timeout"),
                         rpc_timeout=positive_seconds(rpc_timeout, "rpc_timeout"), data_error_handling=bool(data_error_handling),
                         same_host=_same_host(same_host), copy_threads=_copy_threads(copy_threads),
                         inline_posts=_inline_posts(inline_posts),
                         flagged_writes=_flagged_writes(flagged_writes),
                         tcp_congestion=_tcp_congestion(tcp_congestion),
                         net_devices=_net_devices(net_devices, endpoint))
        self._host_arena = self._gpu_arena = None
        self._receivers = {}
        self._quarantine = []
        _start_callback_thread()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def register(self, tensor: torch.Tensor) -> MemRegion:
        """Registers the memory ``tensor`` already owns, host or GPU (a CUDA tensor: its region's
        ``cuda_device`` is the tensor's device); the region keeps the tensor alive. Raises
        InvalidArgumentError for GPU memory where this UCX has no CUDA transport."""
        if not isinstance(tensor, torch.Tensor):
            raise InvalidArgumentError(f"register() takes a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type not in ("cpu", "cuda"):
            raise InvalidArgumentError(f"register() takes host or CUDA tensors; got one on {tensor.device}")
        check_dense(tensor, "register()'s tensor")
        if not tensor.is_contiguous():
            raise InvalidArgumentError("register() needs a contiguous tensor; call .contiguous() first")
        if tensor.is_neg() or tensor.is_conj():  # its memory holds the values before the lazy operation
            raise InvalidArgumentError(f"register()'s tensor has its {'conjugate' if tensor.is_conj() else 'negative'} "
                                       "bit set: call .resolve_conj() / .resolve_neg() first (that copies)")
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes == 0:
            raise InvalidArgumentError("cannot register an empty tensor")
        ordinal = -1 if tensor.device.type == "cpu" else tensor.device.index
        region = self.register_memory(tensor.data_ptr(), nbytes, ordinal)
        region._owner = tensor
        return region

    def alloc_region(self, nbytes: int, cuda=None) -> MemRegion:
        """A new registered region of ``nbytes`` (an integer, or a size such as "64M"):
        page-aligned host memory (shared memory when the same-host path is on), or, with
        ``cuda`` ("cuda", "cuda:1", a torch.device), GPU memory of that CUDA device, allocated
        through PyTorch's allocator and kept by the region."""
        nbytes = byte_count(nbytes, "alloc_region's nbytes")
        if cuda is None:
            return super().alloc_region(nbytes)
        return self.register(torch.empty(int(nbytes), dtype=torch.uint8, device=cuda_device_of(cuda)))

    def publish_region(self, name: str, region: MemRegion) -> None:
        """Hands ``region``'s descriptor out under ``name`` through the side RPC."""
        if not isinstance(name, str) or not isinstance(region, MemRegion):
            raise InvalidArgumentError(f"publish_region takes a name (str) and a MemRegion, got "
                                       f"{type(name).__name__} and {type(region).__name__}")
        self.publish(name, region.descriptor())

    def lookup_region(self, remote_endpoint: str, name: str, timeout: float = -1.0) -> RemoteRegion:
        """Fetches the descriptor a peer published under ``name`` (``timeout`` -1: the device's
        rpc_timeout)."""
        return RemoteRegion.from_descriptor(self.lookup(remote_endpoint, name, timeout))

    def create_arena(self, nbytes: int | None = None, device=None) -> Arena:
        """Registers this device's arena (once); ``nbytes`` (an integer, or a size such as "1G")
        defaults to $RDMAFLOW_ARENA_BYTES or 256 MiB. Asking again returns the same arena.
        ``device`` is where the arena's memory lives, as in ``torch.empty(..., device=)``: None,
        host memory; a CUDA device ("cuda", "cuda:1"), this device's GPU arena instead (one, on
        that CUDA device; $RDMAFLOW_CUDA_ARENA_BYTES)."""
        return self._registered_arena(nbytes, cuda=device)

    def _registered_arena(self, nbytes, cuda) -> Arena:
        """The host arena (``cuda`` None) or the GPU arena on CUDA device ``cuda``: the one this
        device has (InvalidArgumentError where ``nbytes`` or ``cuda`` differs from it), else a new
        one of ``nbytes`` (None: :func:`rdmaflow.arena.default_bytes`)."""
        existing, what = (self._host_arena, "arena") if cuda is None else (self._gpu_arena, "GPU arena")
        if cuda is not None:
            if cuda == "cuda" and existing is not None:  # no index: the one there is
                cuda = existing.cuda_device
            cuda = cuda_device_of(cuda)
        if nbytes is not None:
            nbytes = byte_count(nbytes, f"the {what}'s nbytes")
        if existing is not None:
            if nbytes is not None and nbytes != existing.nbytes:
                raise InvalidArgumentError(
                    f"this device already has {'a' if cuda is not None else 'an'} {what} of {existing.nbytes} "
                    f"bytes; one {what} per device"
                )
            if cuda is not None and cuda != existing.cuda_device:
                raise InvalidArgumentError(
                    f"this device's GPU arena is on {existing.cuda_device}, not {cuda}; one per device"
                )
            return existing
        if nbytes is None:
            nbytes = default_bytes(gpu=cuda is not None)
        arena = Arena(self.alloc_region(nbytes, cuda), cuda)
        if cuda is None:
            self._host_arena = arena
        else:
            self._gpu_arena = arena
            self.publish(CUDA_ARENA_NAME, arena.region.descriptor())
            self.publish(CUDA_IPC_NAME, json.dumps(gpu_ipc_info(arena.base, arena.nbytes, cuda)).encode())
        return arena

    @property
    def arena(self) -> Arena:
        """This device's arena, created with the default size on first use."""
        return self._host_arena if self._host_arena is not None else self._registered_arena(None, None)

    def gpu_arena(self, cuda="cuda") -> Arena:
        """This device's GPU arena (whichever CUDA device it is on), created with the default size
        on CUDA device ``cuda`` on first use."""
        return self._gpu_arena if self._gpu_arena is not None else self._registered_arena(None, cuda)

    def ensure_arena(self, nbytes: int) -> Arena:
        """This device's arena: the one it has, whatever its size, else a new one of ``nbytes``."""
        return self._host_arena if self._host_arena is not None else self.create_arena(nbytes)

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
        """An uninitialized tensor born in this device's registered arena: it can be sent with
        no copy. Its memory returns to the arena when it dies. ``device`` ("cuda", "cuda:1"):
        a CUDA tensor born in this device's GPU arena."""
        if device is not None and as_torch_device(device).type == "cpu":
            device = None
        return (self.arena if device is None else self.gpu_arena(device)).empty(shape, dtype)

    @property
    def receivers(self) -> dict[str, tuple]:
        """The transfer layer's receivers published on this device: name -> (a weak reference to
        the live receiver published under it, its token)."""
        return self._receivers

    def keep_until_closed(self, obj) -> None:
        """Keeps ``obj`` (memory a peer may still write or read) alive as long as this device."""
        self._quarantine.append(obj)


def wait_all(futures: Iterable[Future], timeout: float | None = None) -> None:
    """Waits for every future; raises the first error. ``timeout`` bounds the whole wait."""
    deadline = Deadline(timeout)
    for f in futures:
        if not isinstance(f, Future):
            raise InvalidArgumentError(f"wait_all takes the futures of transfers, got {type(f).__name__}")
        f.result(deadline.left())


__all__ = ["Channel", "Device", "FlaggedWrites", "Future", "MemRegion", "RemoteRegion", "SameHost", "tcp_congestion_of",
           "wait_all"]
