"""The registered arena: one region per device, registered once, carved up by an allocator.

Seed 000 §3.4 ("Preallocate data buffers"): registering buffers one by one costs kernel work
and NIC resources, so a device registers one large region up front and allocates tensors in
it. A tensor allocated here can be sent with no copy (the paper's RDMA.zerocp).

The arena belongs to the device layer (``device.empty``, ``device.create_arena`` and
``device.arena`` use it); the transfer layer re-exports it.

A device may also have one GPU arena (``device.create_arena(nbytes, device="cuda")``): GPU memory
of one CUDA device, registered once the same way, whose tensors are CUDA tensors. Its descriptor
is published under :data:`CUDA_ARENA_NAME`, so that a peer that meets one of its tensors in a
metadata record (dynamic transfers) can look its address up once, through the side RPC.
"""
from __future__ import annotations

import json
import operator
import os
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rdmaflow import _core
from rdmaflow.errors import InvalidArgumentError

if TYPE_CHECKING:
    from rdmaflow.device import Device

ARENA_ENV = "RDMAFLOW_ARENA_BYTES"
CUDA_ARENA_ENV = "RDMAFLOW_CUDA_ARENA_BYTES"
DEFAULT_ARENA_BYTES = 256 << 20
CUDA_ARENA_NAME = "rdmaflow.arena.cuda"  # where a device publishes its GPU arena's descriptor
CUDA_IPC_NAME = "rdmaflow.arena.cuda.ipc"  # ... and what a peer on its host needs to map it
GPU_IPC_ENV = "RDMAFLOW_GPU_IPC"  # 0: GPU memory of same-host peers only through UCX
ALIGNMENT = 256  # keeps every tensor cache-line and vector aligned
MAX_BYTES = 1 << 62  # the largest region asked for (the core's sizes are 64-bit)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)((K|M|G)I?B?|B)?")


def _as_index(value) -> int:
    """``operator.index(value)``, but TypeError for a bool and a bool tensor too (whose
    ``__index__`` gives 0 or 1): True is no count and no size."""
    if isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError("a bool is no integer")
    return operator.index(value)


def integer(value, what: str) -> int:
    """``value`` as an int (anything with ``__index__``: numpy's and 0-d integer tensors too);
    InvalidArgumentError naming ``what`` for anything else. A bool is no count, and int() would
    take "3" and cut 2.7 to 2."""
    try:
        return _as_index(value)
    except TypeError:
        raise InvalidArgumentError(f"{what} must be an integer, got {value!r}") from None


def byte_count(value, what: str) -> int:
    """``value``, an integer or a size such as "256M" or "1GiB" (K, M, G: powers of 1024), as a
    positive number of bytes; InvalidArgumentError naming ``what`` when it is not one."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        if isinstance(value, str):
            m = _SIZE.fullmatch(value.strip().upper())
            if m is None or "." in m[1] and not m[3]:  # a fraction of a byte is no size
                raise ValueError
            n = int(float(m[1]) * units[m[3] or ""])
        else:
            n = _as_index(value)
    except (ValueError, TypeError, OverflowError):
        raise InvalidArgumentError(f"{what} must be a number of bytes (an integer, or a size such as '256M'), "
                                   f"got {value!r}") from None
    if not 0 < n <= MAX_BYTES:
        raise InvalidArgumentError(f"{what} must be positive and at most 2**62, got {value!r}")
    return n


def shape_of(shape) -> tuple[int, ...]:
    """``shape`` (an integer or a sequence of them) as a tuple; InvalidArgumentError for anything
    else (a bool too: True is no size), a negative dimension or one past 64 bits. Integers
    only: int() would take "3" and cut 2.7 to 2."""
    given = shape
    try:
        shape = (_as_index(shape),)
    except TypeError:
        try:
            if isinstance(shape, (str, bytes)):
                raise TypeError
            shape = tuple(_as_index(s) for s in shape)
        except TypeError:
            raise InvalidArgumentError(f"a shape is an integer or a sequence of integers, got {given!r}") from None
    if any(s < 0 for s in shape):
        raise InvalidArgumentError(f"shape {shape} has a negative dimension")
    if any(s >= 1 << 63 for s in shape):
        raise InvalidArgumentError(f"shape {shape} has a dimension past 64 bits")
    return shape


def as_torch_device(device) -> torch.device:
    """``device`` ("cpu", "cuda:1", a torch.device, or an ordinal: a CUDA device) as a
    torch.device; InvalidArgumentError when it names none."""
    try:
        return torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise InvalidArgumentError(f"not a device: {device!r} ({e})") from None


def cuda_device_of(device) -> torch.device:
    """``device`` ("cuda", "cuda:1", a torch.device or an ordinal) as a CUDA torch.device with an
    index; InvalidArgumentError when it is no CUDA device or none is visible."""
    d = as_torch_device(device)
    if d.type != "cuda":
        raise InvalidArgumentError(f"expected a CUDA device, got {d}")
    if not torch.cuda.is_available():
        raise InvalidArgumentError(f"{d} was asked for, but no CUDA device is visible to this process")
    return torch.device("cuda", torch.cuda.current_device() if d.index is None else d.index)


class Arena:
    """A thread-safe allocator over one registered region of ``nbytes``: host memory, or GPU
    memory of ``cuda_device`` (a CUDA torch.device)."""

    def __init__(self, device: Device, nbytes: int, cuda_device: torch.device | None = None):
        if nbytes <= 0:
            raise InvalidArgumentError(f"arena size must be positive, got {nbytes}")
        self.device = device
        self.cuda_device = cuda_device
        self.region = device.alloc_region(nbytes, cuda_device)
        self._arena = _core.Arena(self.region, ALIGNMENT)
        self.base = self.region.address
        self.nbytes = self.region.nbytes
        self._type = "cpu" if cuda_device is None else "cuda"

    def allocate(self, nbytes: int) -> _core.ArenaBlock:
        """A raw block of at least ``nbytes``; returned to the arena when it is garbage."""
        if nbytes >= 1 << 63:  # a shape whose dimensions fit 64 bits each, but not their product
            raise _core.ArenaFullError(f"arena full: cannot allocate {nbytes} bytes (past 64 bits) in an arena of "
                                       f"{self.nbytes} bytes")
        return self._arena.allocate(nbytes)

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized tensor living in the arena; its memory returns when it dies."""
        shape = shape_of(shape)
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
        if str(dtype).startswith(("torch.qint", "torch.quint")):  # frombuffer makes one with no quantizer
            raise InvalidArgumentError(f"dtype {dtype} is quantized: an arena holds plain tensors (quantize one "
                                       "made of its integer values instead)")
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0:
            return torch.empty(shape, dtype=dtype, device=self.cuda_device)  # no bytes to place or send
        block = self.allocate(numel * dtype.itemsize)
        if self.cuda_device is not None:  # the tensor holds the block through its interface
            raw = torch.as_tensor(block, device=self.cuda_device)
            return raw[: numel * dtype.itemsize].view(dtype).view(shape)
        return torch.frombuffer(block, dtype=dtype, count=numel).view(shape)

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of a contiguous tensor's data inside the arena, or None if outside."""
        if tensor.device.type != self._type or not tensor.is_contiguous():
            return None
        nbytes = tensor.numel() * tensor.element_size()
        ptr = tensor.data_ptr()
        if nbytes == 0:
            return None
        if self.base <= ptr and ptr + nbytes <= self.base + self.nbytes:
            return ptr - self.base
        return None

    def contains(self, tensor: torch.Tensor) -> bool:
        return self.offset_of(tensor) is not None

    @property
    def used(self) -> int:
        return self._arena.used

    @property
    def largest_free(self) -> int:
        return self._arena.largest_free

    @property
    def num_allocations(self) -> int:
        return self._arena.num_allocations

    @property
    def num_free_blocks(self) -> int:
        return self._arena.num_free_blocks

    def __repr__(self) -> str:
        return f"<Arena {self.nbytes} bytes, {self.used} used, {self.num_allocations} allocations>"


def create_arena(device: Device, nbytes: int | None = None, cuda=None) -> Arena:
    """Registers the device's arena (once). ``nbytes`` defaults to $RDMAFLOW_ARENA_BYTES or 256 MiB.
    ``cuda`` (a CUDA device: "cuda", "cuda:0", ...): the device's GPU arena instead, one per device,
    on that CUDA device; ``nbytes`` defaults to $RDMAFLOW_CUDA_ARENA_BYTES or 256 MiB."""
    attr, env_name, what = "_rdmaflow_arena", ARENA_ENV, "arena"
    if cuda is not None:
        attr, env_name, what = "_rdmaflow_cuda_arena", CUDA_ARENA_ENV, "GPU arena"
        if cuda == "cuda" and getattr(device, attr, None) is not None:  # no index: the one there is
            cuda = getattr(device, attr).cuda_device
        cuda = cuda_device_of(cuda)
    if nbytes is not None:
        nbytes = byte_count(nbytes, f"the {what}'s nbytes")
    existing = getattr(device, attr, None)
    if existing is not None:
        if nbytes is not None and nbytes != existing.nbytes:
            raise InvalidArgumentError(
                f"this device already has {'a' if cuda is not None else 'an'} {what} of {existing.nbytes} bytes; "
                f"one {what} per device"
            )
        if cuda is not None and cuda != existing.cuda_device:
            raise InvalidArgumentError(
                f"this device's GPU arena is on {existing.cuda_device}, not {cuda}; one per device"
            )
        return existing
    if nbytes is None:
        env = os.environ.get(env_name)
        nbytes = byte_count(env, f"${env_name}") if env else DEFAULT_ARENA_BYTES
    arena = Arena(device, nbytes, cuda)
    setattr(device, attr, arena)
    if cuda is not None:
        device.publish(CUDA_ARENA_NAME, arena.region.descriptor())
        device.publish(CUDA_IPC_NAME, json.dumps(gpu_ipc_info(arena)).encode())
    return arena


# -- the same-host GPU path ---------------------------------------------------------------------
# A peer on this host maps a GPU arena through CUDA IPC and moves the data with a copy kernel on
# its own stream, as the same-host path does for host memory with a CPU copy: UCX's cuda_ipc put
# moves about 0.6 of a kernel's bandwidth within one GPU, and its reads are off on GPUs without
# NVLink (docs/transfer.md, "GPU tensors").
def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def gpu_ipc_info(arena: Arena) -> dict | None:
    """What a peer on this host needs to map ``arena`` (a GPU arena); None where CUDA IPC cannot
    export it (the peer then goes through UCX) or $RDMAFLOW_GPU_IPC is 0."""
    if os.environ.get(GPU_IPC_ENV, "1").strip() == "0":
        return None
    try:
        handle, offset = _core.cuda_ipc_export(arena.base, arena.cuda_device.index)
    except _core.RdmaflowError:
        return None
    return {"handle": handle.hex(), "offset": offset, "nbytes": arena.nbytes, "boot_id": _boot_id()}


class _Mapped:
    """GPU memory as torch.as_tensor takes it (a peer's arena, mapped for the process's life)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}


def map_gpu_ipc(info, nbytes: int) -> torch.Tensor | None:
    """A uint8 CUDA tensor over a peer's GPU arena described by ``info`` (:func:`gpu_ipc_info`),
    opened on the current CUDA device; None when the peer is on another host, its arena cannot be
    mapped, ``info`` does not describe ``nbytes`` (the size its authenticated descriptor says), or
    $RDMAFLOW_GPU_IPC is 0: the caller then goes through UCX."""
    if (not isinstance(info, dict) or os.environ.get(GPU_IPC_ENV, "1").strip() == "0"
            or not torch.cuda.is_available() or info.get("boot_id") != _boot_id()
            or info.get("nbytes") != nbytes):
        return None
    here = torch.device("cuda", torch.cuda.current_device())
    try:
        base = _core.cuda_ipc_open(bytes.fromhex(str(info["handle"])), here.index)
        return torch.as_tensor(_Mapped(base + int(info["offset"]), nbytes), device=here)
    except (_core.RdmaflowError, ValueError, KeyError, TypeError, RuntimeError):
        return None


def arena_of(device: Device, cuda=None) -> Arena:
    """The device's arena (``cuda`` given: its GPU arena), created with the default size on first use."""
    a = getattr(device, "_rdmaflow_arena" if cuda is None else "_rdmaflow_cuda_arena", None)
    return a if a is not None else create_arena(device, None, cuda)

