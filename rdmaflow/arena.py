"""The registered arena: one region, registered once, carved up by an allocator.

Xue et al., EuroSys '19, §3.4 ("Preallocate data buffers"): registering buffers one by one
costs kernel work and NIC resources, so a device registers one large region up front and
allocates tensors in it. A tensor allocated here can be sent with no copy (the paper's
RDMA.zerocp).

An ``Arena`` is an allocator over a region it is given; it knows nothing of the device that
registered it. The device keeps its arenas (``device.create_arena``, ``device.arena``,
``device.gpu_arena``, ``device.empty``); the transfer layer re-exports the class.

A device may also have one GPU arena (``device.create_arena(nbytes, device="cuda")``): GPU memory
of one CUDA device, registered once the same way, whose tensors are CUDA tensors. Its descriptor
is published under :data:`CUDA_ARENA_NAME`, so that a peer that meets one of its tensors in a
metadata record (dynamic transfers) can look its address up once, through the side RPC.
"""
from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from rdmaflow._args import byte_count, shape_of
from rdmaflow._core import Arena as _CoreArena
from rdmaflow._core import ArenaBlock, ArenaFullError, MemRegion
from rdmaflow.errors import InvalidArgumentError

ARENA_ENV = "RDMAFLOW_ARENA_BYTES"
CUDA_ARENA_ENV = "RDMAFLOW_CUDA_ARENA_BYTES"
DEFAULT_ARENA_BYTES = 256 << 20
CUDA_ARENA_NAME = "rdmaflow.arena.cuda"  # where a device publishes its GPU arena's descriptor
CUDA_IPC_NAME = "rdmaflow.arena.cuda.ipc"  # ... and what a peer on its host needs to map it
ALIGNMENT = 256  # keeps every tensor cache-line and vector aligned


def default_bytes(gpu: bool) -> int:
    """An arena's size when none is asked for: $RDMAFLOW_ARENA_BYTES (``gpu``:
    $RDMAFLOW_CUDA_ARENA_BYTES) or 256 MiB."""
    env_name = CUDA_ARENA_ENV if gpu else ARENA_ENV
    env = os.environ.get(env_name)
    return byte_count(env, f"${env_name}") if env else DEFAULT_ARENA_BYTES


class Arena:
    """A thread-safe allocator over ``region``, one registered region: host memory, or GPU
    memory of ``cuda_device`` (a CUDA torch.device)."""

    def __init__(self, region: MemRegion, cuda_device: torch.device | None = None):
        if region.nbytes <= 0:
            raise InvalidArgumentError(f"arena size must be positive, got {region.nbytes}")
        self.cuda_device = cuda_device
        self.region = region
        self._arena = _CoreArena(self.region, ALIGNMENT)
        self.base = self.region.address
        self.nbytes = self.region.nbytes
        self._type = "cpu" if cuda_device is None else "cuda"

    def allocate(self, nbytes: int) -> ArenaBlock:
        """A raw block of at least ``nbytes``; returned to the arena when it is garbage."""
        if nbytes >= 1 << 63:  # a shape whose dimensions fit 64 bits each, but not their product
            raise ArenaFullError(f"arena full: cannot allocate {nbytes} bytes (past 64 bits) in an arena of "
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
