"""The one table of tensor dtypes: the codes transfer headers and records carry on the wire,
and the names the parameter server and the key-value store write in their specs."""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rdmaflow import InvalidArgumentError

# A dtype's wire code is its index here plus one (0 means none): append, never reorder.
WIRE_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.complex64, torch.complex128,
)
DTYPE_CODE = {d: i + 1 for i, d in enumerate(WIRE_DTYPES)}
CODE_DTYPE = {i + 1: d for i, d in enumerate(WIRE_DTYPES)}


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``: the name specs and messages use."""
    return str(dtype).replace("torch.", "")


# The floating dtypes by name: what a model's parameters (and a key-value store's values) may be.
FLOAT_DTYPES: dict[str, torch.dtype] = {dtype_name(d): d for d in WIRE_DTYPES if d.is_floating_point}


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODE[dtype]
    except KeyError:
        raise InvalidArgumentError(f"dtype {dtype} cannot be transferred") from None


def describe(shape: Sequence[int], dtype: torch.dtype) -> str:
    """``float32[2, 3]``: a tensor's dtype and shape, as messages name them."""
    return f"{dtype_name(dtype)}[{', '.join(str(s) for s in shape)}]"
