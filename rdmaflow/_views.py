"""Tensor views of registered memory: what ``MemRegion.tensor`` returns."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rdmaflow._args import integer, shape_of
from rdmaflow._core import InvalidArgumentError, MemRegion, OutOfBoundsError, RegionError


def _dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def region_tensor(region: MemRegion, dtype: torch.dtype, shape: Sequence[int] | int,
                  offset: int = 0) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` viewing ``region`` at byte ``offset``, with no copy.

    The tensor keeps the region's memory alive, also after ``free()``. A region of GPU memory
    gives a CUDA tensor.
    """
    if region.freed:
        raise RegionError(f"region {region.id} was freed")
    if not isinstance(dtype, torch.dtype):
        raise InvalidArgumentError(f"dtype must be a torch.dtype, got {dtype!r}")
    shape, offset = shape_of(shape), integer(offset, "offset")
    esize = _dtype_size(dtype)
    count = 1
    for s in shape:
        count *= s
    if offset < 0:
        raise OutOfBoundsError(f"offset must not be negative, got {offset}")
    if offset % esize:
        raise InvalidArgumentError(f"offset {offset} is not a multiple of {dtype}'s size {esize}")
    if offset + count * esize > region.nbytes:
        raise OutOfBoundsError(
            f"a {dtype} tensor of shape {shape} at offset {offset} needs "
            f"{offset + count * esize} bytes; the region has {region.nbytes}"
        )
    if region.cuda_device >= 0:  # GPU memory: a view of the tensor that owns it
        owner = getattr(region, "_owner", None)
        if owner is None:
            raise InvalidArgumentError(
                f"region {region.id} is GPU memory registered by address: only a region made from a "
                "tensor (Device.register, Device.alloc_region) can be viewed as one")
        raw = owner.view(-1).view(torch.uint8)
        return raw[offset : offset + count * esize].view(dtype).view(shape)
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(region, dtype=dtype, count=count, offset=offset)
    return flat.view(shape)
