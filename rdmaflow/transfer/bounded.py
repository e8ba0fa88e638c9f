"""Transfer with bounded shapes: static placement at the maxima, the actual shape beside the data
(the "bounded" class of Xue et al., EuroSys '19, §3.4's analysis).

A tensor whose dimensions change per call but never exceed declared maxima (a sequence length
from a ``Dim(min, max)``) goes to a slot preallocated at the maxima, like a static transfer, with
no handshake and no READ. Each slot starts with a size record, then the data:

    slot i:  [size record, SIZE_RECORD_BYTES] [data: up to prod(max_shape) elements]
    size record (little endian): seq u64 | rank u32 | zero u32 | dims 8 x i64

The sender writes the size record, then the data (the tensor's actual bytes, at the start of the
data area), then the slot's flag, on the static transfer's paths: over UCX a WRITE of the record,
then the data and the flag in one ``write_flagged``; on one host one call that copies both and
stores the flag. The receiver reads the record only after the flag, so it sees this transfer's
shape, checks it against the maxima and returns a view of the slot's first ``prod(shape)``
elements (no copy). Credits and acks are the static transfer's.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import torch

from rdmaflow import WRITE, InvalidArgumentError, RdmaflowError
from rdmaflow.transfer.common import KIND_BOUNDED, check_tensor
from rdmaflow.transfer.dtypes import describe
from rdmaflow.transfer.static import StaticReceiver, StaticSender

MAX_RANK = 8
SIZE = struct.Struct("<QII8q")
SIZE_RECORD_BYTES = 128


def _within(shape: Sequence[int], max_shape: Sequence[int]) -> bool:
    return len(shape) == len(max_shape) and all(0 <= d <= m for d, m in zip(shape, max_shape))


class BoundedReceiver(StaticReceiver):
    """Receives tensors of one dtype whose shape is at most ``max_shape`` (same rank, each
    dimension at most its maximum) into preallocated slots at the maxima; ``recv()`` returns a
    view of the slot sized to the transfer's actual shape."""

    kind = KIND_BOUNDED
    header_bytes = SIZE_RECORD_BYTES

    def __init__(self, device, name: str, max_shape: Sequence[int] | int, dtype: torch.dtype,
                 depth: int = 1, timeout: float | None = 60.0):
        if len(tuple(max_shape) if not isinstance(max_shape, int) else (max_shape,)) > MAX_RANK:
            raise InvalidArgumentError(f"a bounded transfer has at most {MAX_RANK} dimensions, got {max_shape}")
        super().__init__(device, name, max_shape, dtype, depth, timeout)

    def _landed(self, slot: int, k: int) -> torch.Tensor:
        start = self.data_off + slot * self.slot_stride
        seq, rank, _, *dims = SIZE.unpack(bytes(self._raw[start : start + SIZE.size].numpy()))
        shape = tuple(dims[:rank]) if rank <= MAX_RANK else ()
        if seq != k or rank > MAX_RANK or not _within(shape, self.shape):
            raise RdmaflowError(f"'{self.name}': the size record of transfer {k} says transfer {seq}, shape "
                                f"{list(dims[:min(rank, MAX_RANK)])}; the maxima are {list(self.shape)}")
        numel = 1
        for d in shape:
            numel *= d
        return self._views[slot].view(-1)[:numel].view(shape)


class BoundedSender(StaticSender):
    """Writes tensors of the receiver's dtype and at most its maximal shape into its slots,
    each followed by its shape. ``mode`` as for StaticSender."""

    kind = KIND_BOUNDED
    header_bytes = SIZE_RECORD_BYTES
    header_record_bytes = SIZE.size

    def __init__(self, device, remote_endpoint: str, name: str, max_shape: Sequence[int] | int | None = None,
                 dtype: torch.dtype | None = None, mode: str = "auto", qp_idx: int = 0,
                 timeout: float | None = 60.0):
        super().__init__(device, remote_endpoint, name, max_shape, dtype, mode, qp_idx, timeout)
        self._sizes = self.arena.allocate(SIZE_RECORD_BYTES * self.depth)
        self._size_cells = torch.frombuffer(self._sizes, dtype=torch.uint8, count=SIZE_RECORD_BYTES * self.depth)

    def _refuse(self, tensor) -> None:
        """Raises InvalidArgumentError naming why ``tensor`` cannot be sent; returns if it can."""
        check_tensor(tensor)
        if tensor.dtype != self.dtype or not _within(tuple(tensor.shape), self.shape):
            raise InvalidArgumentError(
                f"tensor {describe(tuple(tensor.shape), tensor.dtype)} exceeds the bound of receiver "
                f"'{self.name}' ({describe(self.shape, self.dtype)} at most)"
            )

    def _size_record(self, slot: int, k: int, tensor: torch.Tensor) -> int:
        """Packs transfer k's size record into the slot's cell; returns the cell's arena offset.
        The cell is free: over UCX the previous transfer's flag, ordered behind it, completed;
        on one host its send returned after copying it."""
        dims = list(tensor.shape) + [0] * (MAX_RANK - tensor.dim())
        record = SIZE.pack(k, tensor.dim(), 0, *dims)
        start = slot * SIZE_RECORD_BYTES
        self._size_cells[start : start + SIZE.size] = torch.frombuffer(bytearray(record), dtype=torch.uint8)
        return self._sizes.offset + start

    def _write_size(self, slot: int, k: int, tensor: torch.Tensor) -> None:
        self.channel.memcpy(self.arena.region, self._size_record(slot, k, tensor), self.remote,
                            self._slot_at[slot], SIZE.size, WRITE)
