"""Argument checks the device layer and the layers above share: counts, byte sizes, shapes and
devices as Python takes them, each refused with an InvalidArgumentError that names it."""
from __future__ import annotations

import operator
import re

import torch

from rdmaflow.errors import InvalidArgumentError

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
