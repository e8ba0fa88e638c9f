"""Point to point between the ranks of one group, on the transfer layer's pairs.

Every ordered pair of ranks (a, b) holds two pairs from a to b, made once when the group is
made (docs/distributed.md, "Point to point"):

- the **frame pair**, a bounded pair of bytes (slots preallocated at ``INLINE_BYTES``): every
  message is one transfer on it, a 32-byte frame (tag, payload bytes, dtype code, where the
  payload is) followed, for a payload of at most ``INLINE_BYTES - FRAME.size`` bytes, by the
  payload itself: one WRITE of data and flag, no READ;
- the **bulk pair**, a dynamic pair: a larger payload is staged in a's arena and sent on it
  first (metadata record + flag; b READs the data), then its frame on the frame pair says so.

The receiver reads frames in the order they were sent, so c10d's ordering per (peer, tag)
holds; a message whose tag nobody waits for yet is kept aside (``_stash``) until a recv for that
tag takes it.

Collectives use the same pairs under a tag of their own (``COLLECTIVE_TAG``): every rank of a
group issues the group's collectives in the same order, so that per pair they match up.
"""
from __future__ import annotations

import struct
import time
from collections import deque

import torch

from rdmaflow import InvalidArgumentError, PeerError, RdmaflowError, TimeoutError
from rdmaflow.deadline import Deadline
from rdmaflow.transfer import BoundedReceiver, BoundedSender, DynamicReceiver, DynamicSender, wait_any

FRAME = struct.Struct("<qqII8x")  # tag, payload bytes, dtype code, bulk (1: the payload is on the bulk pair); 32 B
COLLECTIVE_TAG = -(1 << 62)  # c10d's tags are the user's; collectives take one they never use
DEPTH = 32  # messages a sender may run ahead of its receiver on one pair
INLINE_BYTES = 8192 + FRAME.size  # a frame pair's slot: a payload up to 8 KiB travels in the frame

# Any dtype travels as bytes; the code only makes a mismatch's error readable.
_DTYPES: tuple[torch.dtype, ...] = tuple(
    d for d in (getattr(torch, n, None) for n in (
        "float32", "float64", "float16", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool",
        "complex64", "complex128", "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "complex32")) if isinstance(d, torch.dtype)
)
_CODE = {d: i + 1 for i, d in enumerate(_DTYPES)}


def _dtype_of(code: int) -> str:
    return str(_DTYPES[code - 1]).replace("torch.", "") if 1 <= code <= len(_DTYPES) else f"dtype code {code}"


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (every dtype, 0-dim and 0-element)."""
    flat = t.reshape(-1)
    return flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)


def check_host(t, what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"{what} is on {t.device}: the rdmaflow process group moves host (cpu) tensors")
    if t.is_sparse or t.layout != torch.strided:
        raise InvalidArgumentError(f"{what} has layout {t.layout}: the rdmaflow process group moves dense tensors")


class Mailbox:
    """The pairs of one rank to every other rank of a group, and the messages kept aside."""

    def __init__(self, device, group_id: str, rank: int, size: int, timeout: float | None):
        self.device, self.rank, self.size, self.timeout = device, rank, size, timeout
        self.group_id = group_id
        self.endpoints: list[str] = []
        self.receivers: dict[int, BoundedReceiver] = {}
        self.bulk_receivers: dict[int, DynamicReceiver] = {}
        self.senders: dict[int, BoundedSender] = {}
        self.bulk_senders: dict[int, DynamicSender] = {}
        self._stash: dict[tuple[int, int], deque] = {}
        self._frames: dict[int, torch.Tensor] = {}  # per peer: where a frame is built (the send copies it)
        for peer in range(size):
            if peer != rank:
                self.receivers[peer] = BoundedReceiver(device, self._name(peer, rank), (INLINE_BYTES,), torch.uint8,
                                                       depth=DEPTH, timeout=timeout)
                self.bulk_receivers[peer] = DynamicReceiver(device, self._name(peer, rank, "bulk"), depth=DEPTH,
                                                            timeout=timeout)

    def _name(self, src: int, dst: int, kind: str = "frame") -> str:
        return f"c10d/{self.group_id}/{src}>{dst}/{kind}"

    def connect(self, endpoints: list[str]) -> None:
        """Connects a sender to every peer's receiver (published before its endpoint was)."""
        self.endpoints = endpoints
        for peer in range(self.size):
            if peer != self.rank:
                try:
                    self.senders[peer] = BoundedSender(self.device, endpoints[peer], self._name(self.rank, peer),
                                                       (INLINE_BYTES,), torch.uint8, timeout=self.timeout)
                    self.bulk_senders[peer] = DynamicSender(self.device, endpoints[peer],
                                                            self._name(self.rank, peer, "bulk"), timeout=self.timeout)
                    self._frames[peer] = torch.empty(INLINE_BYTES, dtype=torch.uint8)
                except RdmaflowError as e:
                    raise type(e)(f"rdmaflow process group: connecting to rank {peer} at {endpoints[peer]}: {e}") \
                        from None

    # -- sending -----------------------------------------------------------------------------
    def send(self, peer: int, tensor: torch.Tensor, tag: int, deadline: Deadline) -> None:
        """Posts ``tensor`` to ``peer``: its frame (and a small payload) copied into the frame
        pair's slot, a larger payload staged in the arena for the bulk pair. Returns once posted
        (the receiver READs a bulk payload later; its staging block is held until it has)."""
        self._check_peer(peer, "send to")
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        payload = as_bytes(src)
        nbytes = payload.numel()
        bulk = FRAME.size + nbytes > INLINE_BYTES
        frame = self._frames[peer]
        frame[: FRAME.size] = torch.frombuffer(bytearray(FRAME.pack(tag, nbytes, _CODE.get(src.dtype, 0), int(bulk))),
                                               dtype=torch.uint8)
        try:
            if bulk:
                staged = self.device.arena.empty((nbytes,), torch.uint8)
                staged.copy_(payload)
                self._credit(peer, self.bulk_senders[peer], deadline)
                self.bulk_senders[peer].send(staged, timeout=deadline.left())
                self._credit(peer, self.senders[peer], deadline)
                self.senders[peer].send(frame[: FRAME.size], timeout=deadline.left())
            else:
                if nbytes:
                    frame[FRAME.size: FRAME.size + nbytes] = payload
                # the frame is copied (into the peer's slot on one host, into registered staging
                # over UCX) before send returns: the buffer is free for the next message
                self._credit(peer, self.senders[peer], deadline)
                self.senders[peer].send(frame[: FRAME.size + nbytes], timeout=deadline.left())
        except RdmaflowError as e:
            raise _about(e, peer, f"sending {nbytes} bytes (tag {tag}) to rank {peer}") from None

    def _credit(self, peer: int, sender, deadline: Deadline) -> None:
        """Returns once ``sender`` may send without waiting. Meanwhile it takes in what every
        peer sent (kept aside for the recvs that will ask for it): two ranks that each send
        more than a pair's credits before receiving would otherwise wait for each other until
        the timeout (gloo buffers such messages; so does this)."""
        if sender.has_credit():
            return
        naps = 0
        while not sender.has_credit():
            took = False
            for p, receiver in self.receivers.items():
                if receiver.poll():
                    tag, code, payload = self._next(p, deadline, f"receiving from rank {p}")
                    self._stash.setdefault((p, tag), deque()).append((code, payload))
                    took = True
            if took:
                continue
            if sender.channel.failed:
                raise PeerError(f"waiting to send to rank {peer}: its channel failed")
            if deadline.passed():
                raise TimeoutError(f"rank {peer} consumed none of the {DEPTH} messages in flight to it within "
                                   f"{deadline.timeout} s")
            naps += 1
            time.sleep(0 if naps < 100 else 1e-4)

    # -- receiving ---------------------------------------------------------------------------
    def _next(self, peer: int, deadline: Deadline, what: str) -> tuple[int, int, torch.Tensor]:
        """The next message from ``peer``: (tag, dtype code, payload bytes). A payload in the
        frame is copied out of the slot, which the next receive on the pair hands back."""
        try:
            msg = self.receivers[peer].recv(timeout=deadline.left())
            tag, nbytes, code, bulk = FRAME.unpack(bytes(msg[: FRAME.size].numpy()))
            if bulk:
                payload = self.bulk_receivers[peer].recv(timeout=deadline.left())
            else:
                payload = msg[FRAME.size: FRAME.size + nbytes].clone()
        except RdmaflowError as e:
            raise _about(e, peer, what) from None
        if payload.numel() != nbytes:
            raise RdmaflowError(f"rdmaflow process group: rank {peer}'s frame says {nbytes} bytes, its payload has "
                                f"{payload.numel()}")
        return tag, code, payload

    def _take(self, peer: int, tag: int, deadline: Deadline, what: str) -> tuple[int, torch.Tensor]:
        kept = self._stash.get((peer, tag))
        if kept:
            return kept.popleft()
        while True:
            got_tag, code, payload = self._next(peer, deadline, what)
            if got_tag == tag:
                return code, payload
            self._stash.setdefault((peer, got_tag), deque()).append((code, payload))

    def recv(self, peer: int, tag: int, out: torch.Tensor, deadline: Deadline) -> None:
        """Waits for the next message from ``peer`` under ``tag`` and copies it into ``out``."""
        self._check_peer(peer, "receive from")
        code, payload = self._take(peer, tag, deadline, f"receiving {_describe(out)} (tag {tag}) from rank {peer}")
        fill(out, code, payload, peer, tag)

    def ready(self, peer: int, tag: int) -> bool:
        """Whether a recv from ``peer`` under ``tag`` would find its message now. Never blocks."""
        if self._stash.get((peer, tag)):
            return True
        receiver = self.receivers[peer]
        try:
            while receiver.poll():
                got_tag, code, payload = self._next(peer, Deadline(self.timeout), f"receiving from rank {peer}")
                self._stash.setdefault((peer, got_tag), deque()).append((code, payload))
                if got_tag == tag:
                    return True
        except RdmaflowError as e:
            raise _about(e, peer, f"looking for a message (tag {tag}) from rank {peer}") from None
        return False

    def recv_any(self, tag: int, out: torch.Tensor, deadline: Deadline) -> int:
        """Waits for the first message under ``tag`` from any peer; returns the peer."""
        peers = [p for p in range(self.size) if p != self.rank]
        if not peers:
            raise InvalidArgumentError("recv from any source in a group of one rank would never end")
        while True:
            for p in peers:
                if self.ready(p, tag):
                    code, payload = self._stash[(p, tag)].popleft()
                    fill(out, code, payload, p, tag)
                    return p
            left = deadline.left()
            try:
                wait_any([self.receivers[p] for p in peers], timeout=None if left is None else max(left, 1e-3))
            except TimeoutError:
                raise TimeoutError(f"rdmaflow process group: no rank sent a message with tag {tag} within "
                                   f"{deadline.timeout} s (recv from any source)") from None
            except PeerError as e:
                raise PeerError(f"rdmaflow process group: recv from any source (tag {tag}): {e}") from None

    def _check_peer(self, peer: int, what: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self.size or peer == self.rank:
            raise InvalidArgumentError(f"cannot {what} rank {peer!r}: the group's ranks are 0..{self.size - 1} "
                                       f"and this one is {self.rank}")

    def close(self, drain: float = 10.0) -> None:
        """Closes the receivers (a peer waiting for them to consume its messages stops), then
        waits, at most ``drain`` seconds in all, until each peer has READ every message sent to it
        or closed its receiver: a message's data stays in this process until its receiver has read
        it, so a process that left at once would take messages with it that a peer is still to
        receive."""
        for r in self.receivers.values():
            r.close()
        self._stash.clear()
        deadline = Deadline(drain)
        for r in self.bulk_receivers.values():
            r.close()
        for s in self.bulk_senders.values():  # a bulk payload's frame is sent after it: this covers both
            try:
                s.wait_consumed(timeout=deadline.left())
            except RdmaflowError:
                pass  # the peer closed its receiver first, left, or is still not done: we are
        for s in [*self.senders.values(), *self.bulk_senders.values()]:
            s.close()


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"


def fill(out: torch.Tensor, code: int, payload: torch.Tensor, peer: int, tag: int) -> None:
    """Copies a message's bytes into ``out``; a message of another size raises."""
    want = out.numel() * out.element_size()
    if payload.numel() != want:
        raise InvalidArgumentError(
            f"rdmaflow process group: rank {peer} sent {payload.numel()} bytes ({_dtype_of(code)}, tag {tag}) "
            f"but the tensor received into is {_describe(out)}, {want} bytes: sizes must match")
    if not want:
        return
    if out.is_contiguous():
        as_bytes(out).copy_(payload)
    else:
        tmp = torch.empty(out.shape, dtype=out.dtype)
        as_bytes(tmp).copy_(payload)
        out.copy_(tmp)


def _about(e: RdmaflowError, peer: int, what: str) -> RdmaflowError:
    """``e`` re-raised naming the group rank it concerns."""
    kind = type(e)
    try:
        return kind(f"rdmaflow process group: {what}: rank {peer} "
                    f"{'failed or left' if isinstance(e, PeerError) else 'did not answer in time'}: {e}")
    except TypeError:
        return e
