"""The RDMA device of seed 000 §3.1 (Table 1), in Python, with torch tensor views.

``Device``, ``MemRegion`` and ``Channel`` are the C++ classes of ``rdmaflow._core``; this module
adds what needs Python: the job secret from the environment, tensor views of regions,
registering memory that a tensor owns, and the thread that runs completion callbacks.
"""
from __future__ import annotations

import os
import threading
from typing import Iterable, Sequence

import torch

from rdmaflow import _core
from rdmaflow._core import Channel, Future, MemRegion, RemoteRegion

SECRET_ENV = "RDMAFLOW_JOB_SECRET"
SAME_HOST_ENV = "RDMAFLOW_SAME_HOST"
COPY_THREADS_ENV = "RDMAFLOW_COPY_THREADS"

_callback_thread: threading.Thread | None = None
_callback_lock = threading.Lock()


def _start_callback_thread() -> None:
    global _callback_thread
    with _callback_lock:
        if _callback_thread is None:
            _callback_thread = threading.Thread(
                target=_core.run_callbacks, name="rdmaflow-callbacks", daemon=True
            )
            _callback_thread.start()


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _region_tensor(self: MemRegion, dtype: torch.dtype, shape: Sequence[int] | int, offset: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` viewing this region at byte ``offset``, with no copy.

    The tensor keeps the region's memory alive, also after ``free()``.
    """
    if self.freed:
        raise _core.RegionError(f"region {self.id} was freed")
    if not isinstance(dtype, torch.dtype):
        raise _core.InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
    shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape):
        raise _core.InvalidArgumentError(f"shape {shape} has a negative dimension")
    esize = _dtype_size(dtype)
    count = 1
    for s in shape:
        count *= s
    if offset < 0:
        raise _core.OutOfBoundsError(f"offset must not be negative, got {offset}")
    if offset % esize:
        raise _core.InvalidArgumentError(f"offset {offset} is not a multiple of {dtype}'s size {esize}")
    if offset + count * esize > self.nbytes:
        raise _core.OutOfBoundsError(
            f"a {dtype} tensor of shape {shape} at offset {offset} needs "
            f"{offset + count * esize} bytes; the region has {self.nbytes}"
        )
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(self, dtype=dtype, count=count, offset=offset)
    return flat.view(shape)


MemRegion.tensor = _region_tensor


def Device(
    endpoint: str = "127.0.0.1:0",
    num_cqs: int = 1,
    qps_per_peer: int = 1,
    *,
    secret: str | bytes | None = None,
    busy_poll: bool = False,
    spin_us: int = 50,
    connect_timeout: float = 10.0,
    rpc_timeout: float = 10.0,
    data_error_handling: bool = False,
    same_host: bool | None = None,
    copy_threads: int | None = None,
) -> _core.Device:
    """Creates an RDMA device listening on ``endpoint`` (``host:port``; port 0 picks one).

    ``num_cqs`` completion queues, each a UCX worker with its own progress thread, and
    ``qps_per_peer`` queue pairs per peer, spread round-robin over them (seed 000, Figure 4).
    Peers must share ``secret`` (default: ``$RDMAFLOW_JOB_SECRET``) before any remote key is
    handed out. Progress threads sleep on UCX's wakeup fd when idle unless ``busy_poll``.
    ``data_error_handling`` turns on UCX's peer-failure mode for data endpoints as well as the
    control link; it costs TCP puts much of their bandwidth, and a dead peer is detected
    without it.

    ``same_host`` is the same-host fast path: regions from ``alloc_region`` are then shared
    memory that a peer on the same host maps, so a memcpy to or from them is one CPU copy
    instead of a transport operation (docs/architecture.md). ``None`` (default) reads
    ``$RDMAFLOW_SAME_HOST`` (``0``/``1``), else is on unless ``UCX_TLS`` rules out
    shared-memory transports (e.g. ``UCX_TLS=tcp``). ``copy_threads`` threads share each
    large same-host copy (default ``$RDMAFLOW_COPY_THREADS``, else this process's share of the
    cores: ``cpu_count // LOCAL_WORLD_SIZE``, at most 2); the helpers sleep when idle.
    """
    if secret is None:
        secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise _core.InvalidArgumentError(
            f"a job secret is required: pass secret=... or set {SECRET_ENV}; devices only hand "
            "remote keys to peers that prove they know it"
        )
    if isinstance(secret, bytes):
        secret = secret.decode("latin-1")
    if same_host is None:
        env = os.environ.get(SAME_HOST_ENV, "").strip().lower()
        if env in ("", "auto"):
            mode = 2
        elif env in ("0", "1"):
            mode = int(env)
        else:
            raise _core.InvalidArgumentError(f"{SAME_HOST_ENV} must be 0, 1 or auto, got {env!r}")
    else:
        mode = 1 if same_host else 0
    if copy_threads is None:
        env = os.environ.get(COPY_THREADS_ENV, "").strip()
        if env:
            try:
                copy_threads = int(env)
            except ValueError:
                raise _core.InvalidArgumentError(f"{COPY_THREADS_ENV} must be an integer, got {env!r}") from None
        else:
            local = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
            copy_threads = max(1, min(2, (os.cpu_count() or 1) // local))
    _start_callback_thread()
    return _core.Device(
        endpoint, int(num_cqs), int(qps_per_peer), secret, bool(busy_poll), int(spin_us),
        float(connect_timeout), float(rpc_timeout), bool(data_error_handling), mode,
        int(copy_threads),
    )


def _register(self: _core.Device, tensor: torch.Tensor) -> MemRegion:
    """Registers the memory ``tensor`` already owns; the region keeps the tensor alive."""
    if not isinstance(tensor, torch.Tensor):
        raise _core.InvalidArgumentError(f"register() takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise _core.InvalidArgumentError(
            f"register() takes host tensors; got one on {tensor.device} (GPU memory needs UCX built with CUDA support)"
        )
    if not tensor.is_contiguous():
        raise _core.InvalidArgumentError("register() needs a contiguous tensor; call .contiguous() first")
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        raise _core.InvalidArgumentError("cannot register an empty tensor")
    region = self.register_memory(tensor.data_ptr(), nbytes)
    region._owner = tensor
    return region


def _publish_region(self: _core.Device, name: str, region: MemRegion) -> None:
    """Hands ``region``'s descriptor out under ``name`` through the side RPC."""
    self.publish(name, region.descriptor())


def _lookup_region(self: _core.Device, remote_endpoint: str, name: str, timeout: float = -1.0) -> RemoteRegion:
    """Fetches the descriptor a peer published under ``name``."""
    return RemoteRegion.from_descriptor(self.lookup(remote_endpoint, name, timeout))


def _enter(self):
    return self


def _exit(self, *exc):
    self.close()


_core.Device.register = _register
_core.Device.publish_region = _publish_region
_core.Device.lookup_region = _lookup_region
_core.Device.__enter__ = _enter
_core.Device.__exit__ = _exit


def wait_all(futures: Iterable[Future], timeout: float | None = None) -> None:
    """Waits for every future; raises the first error. ``timeout`` bounds the whole wait."""
    import time

    deadline = None if timeout is None else time.monotonic() + timeout
    for f in futures:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        f.result(left)


__all__ = ["Channel", "Device", "MemRegion", "RemoteRegion", "wait_all"]
