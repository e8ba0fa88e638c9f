"""Transfer with dynamic allocation (Xue et al. §3.3).

For tensors whose shape changes from call to call. The receiver preallocates only a
fixed-size metadata record per slot. The sender writes the record (rank, dims, dtype, size,
and where its data lies in its registered arena), then the slot's flag, ordered behind it. The receiver
checks the record, allocates the tensor in its own arena, fetches the data with a one-sided
READ and acknowledges; only then does the sender release its buffer.

Record layout (little endian, 128 bytes): seq u64 | dtype u32 | rank u32 | dims 8 x i64 |
nbytes u64 | source offset u64 | source region id u64 | source memory u32 (0: host, d + 1: CUDA
device d) | zero padding.
The maximum rank is 8.

GPU tensors (Xue et al. §3.5: dynamic allocation is the default for them): the record stays in
host memory, where the receiving CPU polls its flag; the data is in the sender's GPU arena
(source memory d + 1 in the record), whose descriptor the receiver looks up once through the side
RPC (``CUDA_ARENA_NAME``). The receiver allocates the tensor in its own GPU arena and READs it
there; the READ completes once UCX's copy has finished, so the tensor is safe on any stream.
"""
from __future__ import annotations

import json
import struct

import torch

from rdmaflow import READ, Future, InvalidArgumentError, RdmaflowError, RemoteRegion
from rdmaflow._cuda_ipc import map_gpu_ipc
from rdmaflow.arena import CUDA_ARENA_NAME, CUDA_IPC_NAME
from rdmaflow.deadline import ENDPOINT_TIMEOUT, Deadline, call_timeout
from rdmaflow.transfer.common import KIND_DYNAMIC, check_tensor, keep_until_device_closes, stream_done
from rdmaflow.transfer.dtypes import CODE_DTYPE, dtype_code
from rdmaflow.transfer.pair import Receiver, Sender

MAX_RANK = 8
RECORD = struct.Struct("<QII8qQQQI")
RECORD_BYTES = 128
MODES = ("auto", "zerocopy", "copy")


class DynamicReceiver(Receiver):
    """Receives tensors of any shape (rank <= 8) and dtype; each lands in a fresh arena tensor."""

    kind = KIND_DYNAMIC

    def __init__(self, device, name: str, depth: int = 1, timeout: float | None = 60.0):
        super().__init__(device, name, depth, RECORD_BYTES, {"max_rank": MAX_RANK, "record": RECORD_BYTES}, timeout)
        self._sender_gpu = None  # the sender's GPU arena, looked up on its first CUDA tensor
        self._sender_gpu_map = None  # ... mapped, when the sender is on this host

    def _source_region(self, gpu: int, channel, deadline: Deadline):
        """The sender's arena that a record's data lies in: its host arena, or (``gpu`` >= 0)
        its GPU arena, looked up once through the side RPC."""
        if gpu < 0:
            return self._connect_sender(deadline)[1]
        if self._sender_gpu is None:
            left = deadline.left()
            left = -1.0 if left is None else left
            desc = self.device.lookup(channel.remote_endpoint, CUDA_ARENA_NAME, left)
            self._sender_gpu = RemoteRegion.from_descriptor(desc)
            try:  # on this host: mapped, and read by a copy kernel (arena.py)
                info = json.loads(self.device.lookup(channel.remote_endpoint, CUDA_IPC_NAME, left))
                self._sender_gpu_map = map_gpu_ipc(info, self._sender_gpu.nbytes)
            except (RdmaflowError, ValueError):
                self._sender_gpu_map = None
        return self._sender_gpu

    def _parse(self, slot: int, k: int, channel, deadline: Deadline) -> tuple:
        start = self.data_off + slot * self.slot_stride
        raw = bytes(self._raw[start : start + RECORD.size].numpy())
        seq, code, rank, *rest = RECORD.unpack(raw)
        dims, (nbytes, src_off, src_region, memory) = rest[:MAX_RANK], rest[MAX_RANK:]
        gpu, sender_arena = memory - 1, None
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
            elif memory > 1 << 16:
                bad = f"unknown source memory {memory}"
        if bad is None:
            sender_arena = self._source_region(gpu, channel, deadline)
            if nbytes and src_region != sender_arena.region_id:
                bad = (f"it names region {src_region}, not the sender's registered "
                       f"{'GPU ' if gpu >= 0 else ''}arena ({sender_arena.region_id})")
            elif nbytes and (src_off > sender_arena.nbytes or nbytes > sender_arena.nbytes - src_off):
                bad = (f"it names bytes [{src_off}, {src_off + nbytes}) outside the sender's registered "
                       f"arena of {sender_arena.nbytes} bytes")
        if bad is not None:
            raise InvalidArgumentError(f"malformed metadata record for transfer {k} on '{self.name}': {bad}")
        return dtype, tuple(dims[:rank]), nbytes, src_off, sender_arena, gpu

    def recv(self, timeout: float | None = ENDPOINT_TIMEOUT) -> torch.Tensor:
        """Waits for the next transfer, allocates its tensor in the arena and READs the data in.
        A CUDA tensor sent lands in this device's GPU arena (on the current CUDA device when the
        device has none yet) as a CUDA tensor."""
        if self.closed:
            raise InvalidArgumentError(f"recv: receiver '{self.name}' is closed")
        deadline = Deadline(call_timeout(timeout, self.timeout))
        k = self.seq + 1
        slot = self._wait_flag(k, deadline)
        channel = self._connect_sender(deadline)[0]
        dtype, shape, nbytes, src_off, source, gpu = self._parse(slot, k, channel, deadline)
        arena = self.arena if gpu < 0 else self.device.gpu_arena("cuda")
        out = arena.empty(shape, dtype)
        if nbytes and gpu >= 0 and self._sender_gpu_map is not None:
            out.view(-1).view(torch.uint8).copy_(self._sender_gpu_map[src_off : src_off + nbytes])
            stream_done(out)  # before the ack frees the source
        elif nbytes:
            off = arena.offset_of(out)
            channel.memcpy(arena.region, off, source, src_off, nbytes, READ).result(deadline.left())
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
        keep_until_device_closes(device, self._held)  # what is left in it when this sender goes

    def _release_consumed(self) -> None:
        done = self.ack.get()
        for k in [k for k in self._held if k <= done]:
            del self._held[k]

    def send(self, tensor: torch.Tensor, timeout: float | None = ENDPOINT_TIMEOUT) -> Future:
        """Writes the metadata record of ``tensor`` and its flag; the receiver READs the data.

        The buffer read by the receiver is held until it acknowledges. With zero copy that is
        the tensor itself: do not modify it before ``wait_consumed()``.
        """
        timeout = call_timeout(timeout, self.timeout)
        if self.closed:
            raise InvalidArgumentError(f"send: the sender to '{self.name}' is closed")
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
        src, off, arena, gpu = tensor, 0, self.arena, -1
        if tensor.is_cuda:
            arena, gpu = self.device.gpu_arena(tensor.device), tensor.device.index
            off = None if self.mode == "copy" or not nbytes else self._gpu_offset(arena, tensor)
        elif nbytes:
            off = self._arena_offset(tensor, nbytes)
        if nbytes and off is None:
            src = arena.empty(tuple(tensor.shape), tensor.dtype)
            src.copy_(tensor)
            off = arena.offset_of(src)
        if gpu >= 0:
            stream_done(src)  # the receiver's READ must find the data written
        dims = list(tensor.shape) + [0] * (MAX_RANK - tensor.dim())
        rec = RECORD.pack(k, code, tensor.dim(), *dims, nbytes, off or 0, arena.region.id, gpu + 1)
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
        """Lets go of the buffers the receiver has READ; the others stay until the device closes
        (a receiver may still READ them)."""
        super().close()
        self._release_consumed()
