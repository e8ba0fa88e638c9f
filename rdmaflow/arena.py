"""The registered arena: one region per device, registered once, carved up by an allocator.

Seed 000 §3.4 ("Preallocate data buffers"): registering buffers one by one costs kernel work
and NIC resources, so a device registers one large region up front and allocates tensors in
it. A tensor allocated here can be sent with no copy (the paper's RDMA.zerocp).

The arena belongs to the device layer (``device.empty``, ``device.create_arena`` and
``device.arena`` use it); the transfer layer re-exports it.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from rdmaflow import _core
from rdmaflow.errors import InvalidArgumentError

if TYPE_CHECKING:
    from rdmaflow.device import Device

ARENA_ENV = "RDMAFLOW_ARENA_BYTES"
DEFAULT_ARENA_BYTES = 256 << 20
ALIGNMENT = 256  # keeps every tensor cache-line and vector aligned


def _parse_bytes(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().rstrip("B").rstrip("I")
    if t and t[-1] in units:
        return int(float(t[:-1]) * units[t[-1]])
    return int(t)


class Arena:
    """A thread-safe allocator over one registered region of ``nbytes``."""

    def __init__(self, device: Device, nbytes: int):
        if nbytes <= 0:
            raise InvalidArgumentError(f"arena size must be positive, got {nbytes}")
        self.device = device
        self.region = device.alloc_region(nbytes)
        self._arena = _core.Arena(self.region, ALIGNMENT)
        self.base = self.region.address
        self.nbytes = self.region.nbytes

    def allocate(self, nbytes: int) -> _core.ArenaBlock:
        """A raw block of at least ``nbytes``; returned to the arena when it is garbage."""
        return self._arena.allocate(nbytes)

    def empty(self, shape: Sequence[int] | int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialized tensor living in the arena; its memory returns when it dies."""
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise InvalidArgumentError(f"shape {shape} has a negative dimension")
        if not isinstance(dtype, torch.dtype):
            raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
        numel = 1
        for s in shape:
            numel *= s
        if numel == 0:
            return torch.empty(shape, dtype=dtype)  # no bytes to place or send
        block = self._arena.allocate(numel * dtype.itemsize)
        return torch.frombuffer(block, dtype=dtype, count=numel).view(shape)

    def offset_of(self, tensor: torch.Tensor) -> int | None:
        """Byte offset of a contiguous tensor's data inside the arena, or None if outside."""
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
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


def create_arena(device: Device, nbytes: int | None = None) -> Arena:
    """Registers the device's arena (once). ``nbytes`` defaults to $RDMAFLOW_ARENA_BYTES or 256 MiB."""
    existing = getattr(device, "_rdmaflow_arena", None)
    if existing is not None:
        if nbytes is not None and nbytes != existing.nbytes:
            raise InvalidArgumentError(
                f"this device already has an arena of {existing.nbytes} bytes; one arena per device"
            )
        return existing
    if nbytes is None:
        env = os.environ.get(ARENA_ENV)
        nbytes = _parse_bytes(env) if env else DEFAULT_ARENA_BYTES
    arena = Arena(device, nbytes)
    device._rdmaflow_arena = arena
    return arena


def arena_of(device: Device) -> Arena:
    """The device's arena, created with the default size on first use."""
    a = getattr(device, "_rdmaflow_arena", None)
    return a if a is not None else create_arena(device)

