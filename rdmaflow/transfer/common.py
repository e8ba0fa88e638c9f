"""What static and dynamic transfers share: dtype codes, the published header, the control
block through which a sender introduces itself, and the credit (ack) word.

Memory layout of a receiver's block in its arena (offsets in bytes):

    [0, 64*depth)          flag of slot i at 64*i: the sequence number last delivered there
    [ctl, ctl+CTL_BYTES)   control block: sender's ready word, then its introduction
    [data, ...)            static: depth data slots; dynamic: depth metadata records

A sender's block in its own arena:

    [0, 8)                 ack word: the receiver writes the number of transfers it consumed
    [64, 64+64*depth)      flag sources: the 8-byte values the sender writes into the flags
    [.., +CTL_BYTES)       staging for its introduction
"""
from __future__ import annotations

import json
import struct
import threading
import time

import torch

from rdmaflow import _core
from rdmaflow.transfer.arena import Arena, arena_of

MAGIC = b"RFX1"
CTL_BYTES = 4096
FLAG_STRIDE = 64
KIND_STATIC = "static"
KIND_DYNAMIC = "dynamic"

DTYPES: list[torch.dtype] = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool,
    torch.complex64, torch.complex128,
]
DTYPE_CODE = {d: i + 1 for i, d in enumerate(DTYPES)}
CODE_DTYPE = {i + 1: d for i, d in enumerate(DTYPES)}


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPE_CODE[dtype]
    except KeyError:
        raise _core.InvalidArgumentError(f"dtype {dtype} cannot be transferred") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def describe(shape, dtype) -> str:
    return f"{dtype_name(dtype)}[{', '.join(str(s) for s in shape)}]"


def align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def pack_header(meta: dict, descriptor: bytes) -> bytes:
    body = json.dumps(meta, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(body)) + body + descriptor


def unpack_header(value: bytes, name: str) -> tuple[dict, bytes]:
    if len(value) < 8 or value[:4] != MAGIC:
        raise _core.InvalidArgumentError(f"'{name}' is not an rdmaflow tensor receiver")
    (n,) = struct.unpack_from("<I", value, 4)
    if 8 + n > len(value):
        raise _core.InvalidArgumentError(f"the header published as '{name}' is truncated")
    try:
        meta = json.loads(value[8 : 8 + n])
    except ValueError as e:
        raise _core.InvalidArgumentError(f"the header published as '{name}' is malformed: {e}") from None
    return meta, value[8 + n :]


def check_tensor(t, what: str = "tensor") -> None:
    if not isinstance(t, torch.Tensor):
        raise _core.InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise _core.InvalidArgumentError(
            f"{what} is on {t.device}; this build moves host tensors (GPU tensors need UCX with CUDA and GPUDirect)"
        )
    if not t.is_contiguous():
        raise _core.InvalidArgumentError(f"{what} is not contiguous; call .contiguous() first (that copies)")


class Word:
    """An 8-byte counter in registered memory, read with acquire semantics."""

    def __init__(self, tensor: torch.Tensor):
        self.t = tensor  # int64 view of one element
        self.address = tensor.data_ptr()

    def get(self) -> int:
        return int(self.t.item())

    def set(self, v: int) -> None:
        self.t.fill_(v)

    def wait_at_least(self, v: int, timeout: float | None) -> bool:
        return _core.wait_u64_at_least(self.address, v, timeout)


class Endpoint:
    """A local arena block plus the peer it talks to: what both sides of a pair hold."""

    def __init__(self, device: _core.Device, name: str, timeout: float):
        self.device = device
        self.name = name
        self.timeout = timeout
        self.arena: Arena = arena_of(device)
        self._lock = threading.Lock()
        self.closed = False

    def _deadline_left(self, deadline: float | None) -> float | None:
        return None if deadline is None else max(0.0, deadline - time.monotonic())


class SenderIntro:
    """What a sender writes into its receiver's control block, once, with one-sided WRITEs."""

    @staticmethod
    def encode(endpoint: str, arena_descriptor: bytes, ack_offset: int) -> bytes:
        body = json.dumps({"endpoint": endpoint, "ack": ack_offset, "arena": arena_descriptor.hex()}).encode()
        if 16 + len(body) > CTL_BYTES:
            raise _core.InvalidArgumentError("sender introduction does not fit the control block")
        return struct.pack("<QQ", 0, len(body)) + body

    @staticmethod
    def decode(raw: bytes) -> tuple[str, bytes, int]:
        (_, n) = struct.unpack_from("<QQ", raw, 0)
        if n == 0 or 16 + n > len(raw):
            raise _core.InvalidArgumentError("malformed sender introduction in the control block")
        try:
            d = json.loads(raw[16 : 16 + n])
            return str(d["endpoint"]), bytes.fromhex(d["arena"]), int(d["ack"])
        except (ValueError, KeyError) as e:
            raise _core.InvalidArgumentError(f"malformed sender introduction in the control block: {e}") from None
