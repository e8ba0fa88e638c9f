"""What static and dynamic transfers share: the published header, the control block through
which a sender introduces itself, and the checks of what may be sent.

Memory layout of a receiver's block in its arena (offsets in bytes):

    [0, 64*depth)          flag of slot i at 64*i: the sequence number last delivered there
    [ctl, ctl+CTL_BYTES)   control block: sender's ready word, then its introduction; its last
                           64 bytes the word a closing sender leaves (CTL_CLOSED)
    [data, ...)            static: depth data slots; bounded: depth (size record, data slot at the
                           maxima); dynamic: depth metadata records

A sender's block in its own arena:

    [0, 8)                 ack word: the receiver writes the number of transfers it consumed
    [8, 16)                source of the word its close() leaves in the receiver's control block
    [64, 64+64*depth)      flag sources: the 8-byte values the sender writes into the flags
    [.., +CTL_BYTES)       staging for its introduction
"""
from __future__ import annotations

import json
import struct
import threading

import torch

from rdmaflow import Device, InvalidArgumentError
from rdmaflow.arena import Arena
from rdmaflow.deadline import checked_timeout
from rdmaflow.device import check_dense

MAGIC = b"RFX1"
CTL_BYTES = 4096
CTL_CLOSED = CTL_BYTES - 64  # in the control block: CLOSED + the transfers a closed sender sent
FLAG_STRIDE = 64
KIND_STATIC = "static"
KIND_DYNAMIC = "dynamic"
KIND_BOUNDED = "bounded"


def align(n: int, a: int = 64) -> int:
    return (n + a - 1) // a * a


def pack_header(meta: dict, descriptor: bytes) -> bytes:
    """What a receiver publishes under its name: its JSON metadata, then a region descriptor."""
    body = json.dumps(meta, sort_keys=True).encode()
    return MAGIC + struct.pack("<I", len(body)) + body + descriptor


def unpack_header(value: bytes, name: str) -> tuple[dict, bytes]:
    """(metadata, descriptor) of a header published as ``name``; InvalidArgumentError if it is none."""
    if len(value) < 8 or value[:4] != MAGIC:
        raise InvalidArgumentError(f"'{name}' is not an rdmaflow tensor receiver")
    (n,) = struct.unpack_from("<I", value, 4)
    if 8 + n > len(value):
        raise InvalidArgumentError(f"the header published as '{name}' is truncated")
    try:
        meta = json.loads(value[8 : 8 + n])
    except ValueError as e:
        raise InvalidArgumentError(f"the header published as '{name}' is malformed: {e}") from None
    return meta, value[8 + n :]


def check_tensor(t, what: str = "tensor") -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"{what} is on {t.device}; rdmaflow moves host and CUDA tensors")
    check_dense(t, what)
    if not t.is_contiguous():
        raise InvalidArgumentError(f"{what} is not contiguous; call .contiguous() first (that copies)")
    if t.is_conj() or t.is_neg():  # its memory holds the values before the lazy conjugation or negation
        raise InvalidArgumentError(f"{what} has its {'conjugate' if t.is_conj() else 'negative'} bit set: "
                                   "call .resolve_conj() / .resolve_neg() first (that copies)")


def stream_done(t: torch.Tensor) -> None:
    """Waits until the work queued on the caller's current stream of ``t``'s CUDA device has
    finished: before UCX reads a CUDA tensor that work produced (on a stream of its own), and
    before a flag or an ack says that a copy queued there has landed."""
    torch.cuda.current_stream(t.device).synchronize()


class Endpoint:
    """A local arena block plus the peer it talks to: what both sides of a pair hold."""

    def __init__(self, device: Device, name: str, timeout: float | None):
        self.device = device
        self.name = name
        self.timeout = checked_timeout(timeout)
        self.arena: Arena = device.arena
        self._lock = threading.Lock()
        self.closed = False


def keep_until_device_closes(device: Device, obj) -> None:
    """Keeps ``obj`` (arena memory a peer may still write or read: a receiver's slots, a sender's
    ack word, buffers a receiver will READ) alive until ``device`` closes, so that no transfer
    in flight, nor one of a peer that never learnt the endpoint went away, lands in memory the
    arena gave to someone else."""
    device.keep_until_closed(obj)


class SenderIntro:
    """What a sender writes into its receiver's control block, once, with one-sided WRITEs."""

    @staticmethod
    def encode(endpoint: str, arena_descriptor: bytes, ack_offset: int) -> bytes:
        body = json.dumps({"endpoint": endpoint, "ack": ack_offset, "arena": arena_descriptor.hex()}).encode()
        if 8 + 16 + len(body) > CTL_CLOSED:  # written after the ready word, before the closing word
            raise InvalidArgumentError("sender introduction does not fit the control block")
        return struct.pack("<QQ", 0, len(body)) + body

    @staticmethod
    def decode(raw: bytes) -> tuple[str, bytes, int]:
        (_, n) = struct.unpack_from("<QQ", raw, 0)
        if n == 0 or 16 + n > len(raw):
            raise InvalidArgumentError("malformed sender introduction in the control block")
        try:
            d = json.loads(raw[16 : 16 + n])
            return str(d["endpoint"]), bytes.fromhex(d["arena"]), int(d["ack"])
        except (ValueError, KeyError) as e:
            raise InvalidArgumentError(f"malformed sender introduction in the control block: {e}") from None
