"""Transfer with dynamic allocation (Xue et al. §3.3).

For tensors whose shape changes from call to call. The receiver preallocates only a
fixed-size metadata record per slot. The sender writes the record (rank, dims, dtype, size,
and where its data lies in its registered arena), a fence, then the slot's flag. The receiver
checks the record, allocates the tensor in its own arena, fetches the data with a one-sided
READ and acknowledges; only then does the sender release its buffer.

Record layout (little endian, 128 bytes): seq u64 | dtype u32 | rank u32 | dims 8 x i64 |
nbytes u64 | source offset u64 | source region id u64 | zero padding. The maximum rank is 8.
"""
from __future__ import annotations

import struct

import torch

from rdmaflow import READ, Future, InvalidArgumentError
from rdmaflow.deadline import Deadline
from rdmaflow.transfer.common import KIND_DYNAMIC, check_tensor
from rdmaflow.transfer.dtypes import CODE_DTYPE, dtype_code
from rdmaflow.transfer.pair import Receiver, Sender

MAX_RANK = 8
RECORD = struct.Struct("<QII8qQQQ")
RECORD_BYTES = 128
MODES = ("auto", "zerocopy", "copy")


class DynamicReceiver(Receiver):
    """Receives tensors of any shape (rank <= 8) and dtype; each lands in a fresh arena tensor."""

    kind = KIND_DYNAMIC

    def __init__(self, device, name: str, depth: int = 1, timeout: float | None = 60.0):
        super().__init__(device, name, depth, RECORD_BYTES, {"max_rank": MAX_RANK, "record": RECORD_BYTES}, timeout)

    def _parse(self, slot: int, k: int, sender_arena) -> tuple:
        start = self.data_off + slot * self.slot_stride
        raw = bytes(self._raw[start : start + RECORD.size].numpy())
        seq, code, rank, *rest = RECORD.unpack(raw)
        dims, (nbytes, src_off, src_region) = rest[:MAX_RANK], rest[MAX_RANK:]
        bad = None
        if seq != k:
            bad = f"its sequence number is {seq}, expected {k}"
        elif code not in CODE_DTYPE:
            bad = f"unknown dtype code {code}"
        elif rank > MAX_RANK:
            bad = f"rank {rank} exceeds the maximum of {MAX_RANK}"
        elif any(d < 0 for d in dims[:rank]) or any(d != 0 for d in dims[rank:]):
            bad = f"bad dimensions {dims[:rank]}"
        if bad is None:
            dtype = CODE_DTYPE[code]
            numel = 1
            for d in dims[:rank]:
                numel *= d
            itemsize = dtype.itemsize
            if numel * itemsize != nbytes:
                bad = f"{nbytes} bytes do not match {dtype}{list(dims[:rank])}"
            elif nbytes and src_region != sender_arena.region_id:
                bad = f"it names region {src_region}, not the sender's registered arena ({sender_arena.region_id})"
            elif nbytes and (src_off > sender_arena.nbytes or nbytes > sender_arena.nbytes - src_off):
                bad = (f"it names bytes [{src_off}, {src_off + nbytes}) outside the sender's registered "
                       f"arena of {sender_arena.nbytes} bytes")
        if bad is not None:
            raise InvalidArgumentError(f"malformed metadata record for transfer {k} on '{self.name}': {bad}")
        return dtype, tuple(dims[:rank]), nbytes, src_off

    def recv(self, timeout: float | None = -1.0) -> torch.Tensor:
        """Waits for the next transfer, allocates its tensor in the arena and READs the data in."""
        timeout = self.timeout if timeout == -1.0 else timeout
        deadline = Deadline(timeout)
        k = self.seq + 1
        slot = self._wait_flag(k, deadline)
        channel, sender_arena, _ = self._connect_sender(deadline)
        dtype, shape, nbytes, src_off = self._parse(slot, k, sender_arena)
        out = self.arena.empty(shape, dtype)
        if nbytes:
            off = self.arena.offset_of(out)
            channel.memcpy(self.arena.region, off, sender_arena, src_off, nbytes, READ).result(deadline.left())
        self.seq = k
        self._ack(k, deadline)  # the sender may release its buffer; the slot may be rewritten
        return out


class DynamicSender(Sender):
    """Sends tensors of any shape: metadata record + flag by WRITE, data fetched by the receiver."""

    kind = KIND_DYNAMIC

    def __init__(self, device, remote_endpoint: str, name: str, mode: str = "auto", qp_idx: int = 0,
                 timeout: float | None = 60.0):
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        super().__init__(device, remote_endpoint, name, qp_idx, timeout)
        self.mode = mode
        self._records = self.arena.allocate(RECORD_BYTES * self.depth)
        self._held: dict[int, object] = {}  # transfer -> buffer the receiver will READ

    def _release_consumed(self) -> None:
        done = self.ack.get()
        for k in [k for k in self._held if k <= done]:
            del self._held[k]

    def send(self, tensor: torch.Tensor, timeout: float | None = -1.0) -> Future:
        """Writes the metadata record of ``tensor`` and its flag; the receiver READs the data.

        The buffer read by the receiver is held until it acknowledges. With zero copy that is
        the tensor itself: do not modify it before ``wait_consumed()``.
        """
        timeout = self.timeout if timeout == -1.0 else timeout
        check_tensor(tensor)
        code = dtype_code(tensor.dtype)
        if tensor.dim() > MAX_RANK:
            raise InvalidArgumentError(f"rank {tensor.dim()} exceeds the maximum of {MAX_RANK}")
        with self._send_lock:
            return self._send(tensor, code, timeout)

    def _validate(self, meta: dict) -> None:
        if meta.get("record") != RECORD_BYTES or meta.get("max_rank") != MAX_RANK or self.r_stride < RECORD_BYTES:
            raise InvalidArgumentError(
                f"the header published as '{self.name}' describes records this sender does not write "
                f"(record {meta.get('record')!r}, max_rank {meta.get('max_rank')!r}, stride {self.r_stride})"
            )

    def _send(self, tensor: torch.Tensor, code: int, timeout: float | None) -> Future:
        deadline = Deadline(timeout)
        k = self.seq + 1
        slot = self._wait_credit(k, deadline)
        self._release_consumed()
        nbytes = tensor.numel() * tensor.element_size()
        src, off = tensor, 0
        if nbytes:
            off = self._arena_offset(tensor, nbytes)
            if off is None:
                src = self.arena.empty(tuple(tensor.shape), tensor.dtype)
                src.copy_(tensor)
                off = self.arena.offset_of(src)
        dims = list(tensor.shape) + [0] * (MAX_RANK - tensor.dim())
        rec = RECORD.pack(k, code, tensor.dim(), *dims, nbytes, off, self.arena.region.id)
        prev = self._pending[slot]
        if prev is not None:
            prev[0].result(deadline.left())  # the record cell of this slot is free again
        cell = torch.frombuffer(self._records, dtype=torch.uint8, count=RECORD_BYTES * self.depth)
        cell[slot * RECORD_BYTES : slot * RECORD_BYTES + RECORD.size] = torch.frombuffer(bytearray(rec),
                                                                                         dtype=torch.uint8)
        f = self._post(k, slot, self._records.offset + slot * RECORD_BYTES,
                       self.r_base + self.r_data + slot * self.r_stride, RECORD.size)
        self._pending[slot] = (f, None)
        self._held[k] = src
        self.seq = k
        return f

    def close(self) -> None:
        super().close()
        self._held.clear()
