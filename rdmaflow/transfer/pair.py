"""The two ends of a tensor transfer pair, shared by static and dynamic transfers.

A receiver publishes (through the device's side RPC) a header and its arena's descriptor,
once. Its sender looks that up, writes an introduction (its endpoint, its arena's descriptor
and where its ack word is) into the receiver's control block with one-sided WRITEs, once.
From then on every transfer is one-sided:

    sender                                      receiver
      wait until ack >= k - depth  (credits: never overwrite an unconsumed slot)
      WRITE payload of transfer k -> slot
      (ordered behind it: write_flagged)
      WRITE k -> flag of slot  ──────────────▶  waits until flag >= k, then reads the slot
                               ◀──────────────  WRITE k -> sender's ack word, once consumed

Either side's close() tells the other, behind everything it wrote before: a receiver writes
CLOSED + the transfers it received into the sender's ack word; a sender writes CLOSED + the
transfers it sent into the control block's closing word, so that a wait for a transfer it
never sent ends in PeerError. A receiver pairs with one sender for its life: its device hands
the published name to the first sender that claims it, and refuses every later one.
"""
from __future__ import annotations

import os
import threading
import weakref

import torch

from rdmaflow import (
    WRITE,
    DeviceClosedError,
    InvalidArgumentError,
    PeerError,
    RdmaflowError,
    RemoteRegion,
    TimeoutError,
)
from rdmaflow._cuda_ipc import gpu_ipc_info, map_gpu_ipc
from rdmaflow.deadline import ENDPOINT_TIMEOUT, Deadline, call_timeout, time_left
from rdmaflow.transfer.common import (
    CTL_BYTES,
    CTL_CLOSED,
    FLAG_STRIDE,
    Endpoint,
    SenderIntro,
    align,
    keep_until_device_closes,
    pack_header,
    unpack_header,
)
from rdmaflow.transfer.flag import (
    MISMATCH,
    OK,
    OTHER_SENDER,
    PEER_FAILED,
    WAIT_SLICE,
    Word,
    first_slice,
    peer_failed,
    wait_flag,
)

ACK_CELLS = 16
CLOSED = 1 << 62  # a closing receiver leaves CLOSED + the transfers it received in its sender's ack word;
#                   a closing sender leaves CLOSED + the transfers it sent in the receiver's closing word
MAX_DEPTH = 1 << 16  # slots of a pair, as a sender accepts from a header


def _unpublish(device, name: str, token: object) -> None:
    """Unpublishes ``name`` if the receiver of ``token`` still holds it (a receiver closed, or
    dropped without close: then its finalizer calls this)."""
    live = device.receivers
    held = live.get(name)
    if held is None or held[1] is not token:
        return
    del live[name]
    try:
        device.unpublish(name)
    except RdmaflowError:
        pass  # the device is closed: nothing is published any more


def _int_field(meta: dict, key: str, name: str, lo: int = 0, hi: int = 1 << 62) -> int:
    v = meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise InvalidArgumentError(
            f"the header published as '{name}' has a bad '{key}' field: {v!r} (want an integer in [{lo}, {hi}])"
        )
    return v


class Receiver(Endpoint):
    """Preallocated slots, flags and a control block in the arena, published under ``name``."""

    kind = ""

    def __init__(self, device, name: str, depth: int, slot_bytes: int, meta: dict, timeout: float | None,
                 cuda=None):
        super().__init__(device, name, timeout)
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= MAX_DEPTH:
            raise InvalidArgumentError(f"depth must be an integer in [1, {MAX_DEPTH}], got {depth!r}")
        if not isinstance(name, str):
            raise InvalidArgumentError(f"a receiver's name must be a str, got {type(name).__name__}")
        held = device.receivers.get(name)
        other = held[0]() if held is not None else None
        if other is not None and not other.closed:
            raise InvalidArgumentError(f"a receiver named '{name}' already lives on this device: close it first, "
                                       "or name this one otherwise")
        self.depth = depth
        self.slot_stride = align(max(slot_bytes, 1))
        self.ctl_off = FLAG_STRIDE * depth
        self.data_off = self.ctl_off + CTL_BYTES
        # Slots in GPU memory (cuda given): in the device's GPU arena, named in the header; flags
        # and the control block stay here, in host memory, where this CPU polls them (§3.5).
        self.data_block = None
        total = self.data_off + self.slot_stride * depth
        if cuda is not None:
            gpu = device.gpu_arena(cuda)
            self.data_block = gpu.allocate(self.slot_stride * depth)
            meta = dict(meta, data_region=gpu.region.descriptor().hex(), data_base=self.data_block.offset,
                        data_ipc=gpu_ipc_info(gpu.base, gpu.nbytes, gpu.cuda_device))
            total = self.data_off
            keep_until_device_closes(device, self.data_block)
        self.block = self.arena.allocate(total)
        keep_until_device_closes(device, self.block)  # a sender may write into it until it learns
        self.base = self.block.offset
        raw = torch.frombuffer(self.block, dtype=torch.uint8, count=total)
        raw[: self.data_off].zero_()
        self._raw = raw
        self.flags = [Word.at(raw, FLAG_STRIDE * i) for i in range(depth)]
        self._flag_addrs = [w.address for w in self.flags]
        self.ctl_ready = Word.at(raw, self.ctl_off)
        self._ctl_addr = self.ctl_ready.address
        self.ctl_closed = Word.at(raw, self.ctl_off + CTL_CLOSED)
        # Registered sources for ack WRITEs; a cell is reused only after its WRITE completed.
        self._ack_block = self.arena.allocate(8 * ACK_CELLS)
        keep_until_device_closes(device, self._ack_block)  # the source of ack WRITEs in flight
        self._ack_futures: list = [None] * ACK_CELLS
        self._ack_next = 0
        self.seq = 0      # transfers delivered to the user
        self.acked = 0    # transfers acknowledged to the sender
        self._sender = None  # (channel, sender arena RemoteRegion, ack offset)
        self._ack_window = None  # the sender's arena written directly (same host), or None
        header = dict(meta, kind=self.kind, depth=depth, base=self.base, ctl=self.ctl_off,
                      data=self.data_off, stride=self.slot_stride)
        device.publish(name, pack_header(header, self.arena.region.descriptor()))
        self._token = token = object()
        device.receivers[name] = (weakref.ref(self), token)
        weakref.finalize(self, _unpublish, device, name, token).atexit = False  # dropped without close()

    # -- the sender's side of the link -------------------------------------------------------
    def _connect_sender(self, deadline: Deadline):
        if self._sender is not None:
            return self._sender
        wait_flag(self.ctl_ready, 1, deadline, f"waiting for a sender to introduce itself to '{self.name}'")
        self._generation = self.ctl_ready.get()
        raw = bytes(self._raw[self.ctl_off + 8 : self.ctl_off + CTL_CLOSED].numpy())
        endpoint, desc, ack_off = SenderIntro.decode(raw)
        remote = RemoteRegion.from_descriptor(desc)
        if ack_off < 0 or ack_off + 8 > remote.nbytes:
            raise InvalidArgumentError(f"sender introduction names an ack word outside its arena ({ack_off})")
        channel = self.device.channel(endpoint)
        self._ack_window = channel.direct_window(remote)
        # Everything a receive passes to the core but the transfer's number and its ack, fixed now.
        self._slots_rx = channel.slot_receiver(self._ack_window, self.arena.region, remote, ack_off,
                                               self._flag_addrs, self._ctl_addr, self._generation)
        self._sender = (channel, remote, ack_off)
        return self._sender

    @property
    def sender_channel(self):
        return None if self._sender is None else self._sender[0]

    def _ack(self, k: int, deadline: Deadline) -> None:
        channel, remote, ack_off = self._connect_sender(deadline)
        if self._ack_window is not None:  # same host: a release store, in order by construction
            self._ack_window.store_word(ack_off, k)
            self.acked = k
            return
        off = self._ack_cell(deadline)
        # Acks must land in order (a late smaller one would take credits back for good):
        # write_flagged orders the word behind what the channel posted before (tcp: one message
        # each, applied in order).
        self._acked(k, channel.write_flagged(self.arena.region, off, remote, ack_off, 0, off, k, ack_off))

    def _ack_cell(self, timeout: float | Deadline | None) -> int:
        """The arena offset of the next ack's source word, once the write that last used it
        completed, waiting at most ``timeout`` (over UCX an ack is a write_flagged, or a rider of
        one, from its own cell)."""
        prev = self._ack_futures[self._ack_next]
        if prev is not None:
            prev.result(time_left(timeout))
        return self._ack_block.offset + 8 * self._ack_next

    def _acked(self, k: int, future) -> None:
        """Ack ``k`` was posted from the next cell as (part of) ``future``."""
        self._ack_futures[self._ack_next] = future
        self._ack_next = (self._ack_next + 1) % ACK_CELLS
        self.acked = k

    def release(self) -> None:
        """Tells the sender the last received transfer is consumed; its slot may be rewritten."""
        if self.acked < self.seq:
            self._ack(self.seq, Deadline(self.timeout))

    def _rider_for(self, channel, deadline: Deadline) -> tuple | None:
        """Hands the last received transfer back with a send on ``channel`` (``send(...,
        release=self)``): the ack as that send's rider when its sender is at the other end of
        that very channel, whose posting order keeps the acks in order, as write_flagged's last
        four arguments (rider_remote_region, rider_offset, rider_value, rider_remote_offset;
        passed by position, which pybind11 takes faster than keywords); otherwise (same host,
        another channel, nothing owed) the ack is made here, on its own, and None is returned. The caller posts the send, then ``_rode``."""
        if self.acked >= self.seq:
            return None
        sender = self._connect_sender(deadline)
        if self._ack_window is not None or sender[0] is not channel:
            self._ack(self.seq, deadline)
            return None
        return sender[1], self._ack_cell(deadline), self.seq, sender[2]

    def _rode(self, future) -> None:
        """The send that carried ``_rider_for``'s ack was posted as ``future``."""
        self._acked(self.seq, future)

    def _sender_if_known(self):
        """The channel to the sender once it has introduced itself, connecting on first sight,
        so that a wait notices the sender's death."""
        if self._sender is None and self.ctl_ready.get() >= 1:
            self._connect_sender(Deadline(None))
        elif self._sender is not None and self.ctl_ready.get() != self._generation:
            raise RdmaflowError(
                f"a second sender introduced itself to '{self.name}': a receiver pairs with one sender"
            )
        return self.sender_channel

    def _await(self, k: int, timeout: float | Deadline | None, ack: int = 0) -> int:
        """Waits for transfer ``k`` from the connected sender, first handing back transfer
        ``ack`` (0: none) when that is owed; one call into the core per WAIT_SLICE. Returns
        the slot."""
        slot = (k - 1) % self.depth
        if isinstance(timeout, Deadline):
            deadline, first = timeout, timeout.slice(WAIT_SLICE)
        else:
            first = first_slice(timeout)
            deadline = None
        if ack and self._ack_window is None:  # over UCX: the ack's post and the wait in one call
            code, f = self._slots_rx.recv(k, ack, self._ack_cell(timeout), first)
            self._acked(ack, f)
        else:  # the ack, if any, a store through the window (same host)
            code = self._slots_rx.recv(k, ack, 0, first)[0]
            if ack:
                self.acked = ack
        if code == OK:
            return slot
        if deadline is None:
            deadline = Deadline(None if timeout is None else timeout - first)
        while True:
            if code == PEER_FAILED:
                raise peer_failed(f"waiting for transfer {k} on '{self.name}'", self._sender[0])
            if code == OTHER_SENDER or self.ctl_ready.get() != self._generation:
                raise RdmaflowError(
                    f"a second sender introduced itself to '{self.name}': a receiver pairs with one sender"
                )
            if code == MISMATCH:
                v = self.flags[slot].get()
                raise RdmaflowError(f"'{self.name}': slot {slot} holds transfer {v}, expected {k}: protocol violated")
            self._check_sender_open(k)
            if deadline.passed():
                raise TimeoutError(f"timed out waiting for transfer {k} on '{self.name}'")
            code = self._slots_rx.recv(k, 0, 0, deadline.slice(WAIT_SLICE))[0]
            if code == OK:
                return slot

    def _wait_flag(self, k: int, deadline: Deadline) -> int:
        if self._sender is not None:
            return self._await(k, deadline)
        slot = (k - 1) % self.depth
        wait_flag(self.flags[slot], k, deadline, f"waiting for transfer {k} on '{self.name}'",
                  peer=self._sender_if_known, give_up=lambda: self._check_sender_open(k))
        # The sender that wrote this transfer introduced itself before it: latch it now.
        self._sender_if_known()
        v = self.flags[slot].get()
        if v != k:
            raise RdmaflowError(f"'{self.name}': slot {slot} holds transfer {v}, expected {k}: protocol violated")
        return slot

    def _check_sender_open(self, k: int) -> bool:
        """Raises PeerError when transfer ``k`` will never come: its sender was closed after
        sending fewer. Its closing word lands behind its last flag, and a flag that is set counts
        whatever the word says. Returns False (``wait_flag``'s ``give_up``: keep waiting).
        Raises DeviceClosedError once this receiver's device is closed: nothing can land then."""
        if self.device.closed:
            raise DeviceClosedError(f"'{self.name}' waits for transfer {k}, but its device is closed")
        word = self.ctl_closed.get()
        if word >= CLOSED and word - CLOSED < k and self.flags[(k - 1) % self.depth].get() < k:
            raise PeerError(f"the sender of '{self.name}' was closed after sending {word - CLOSED} transfers: "
                            f"transfer {k} will not come")
        return False

    def poll(self) -> bool:
        """Whether the next transfer has landed (its flag is set, so ``recv()`` returns at once).
        Never blocks and consumes nothing; raises PeerError when it has not landed and the
        sender's channel failed or the sender was closed before sending it, InvalidArgumentError
        once this receiver is closed (``wait_any`` would wait for it in vain).

        Over UCX, a poll that finds nothing progresses the sender's channel's worker once, as
        ``recv()``'s wait does: over tcp a write is applied by this side's progress, and a caller
        polling in a loop may hold the core the progress thread would need."""
        if self.closed:
            raise InvalidArgumentError(f"poll: receiver '{self.name}' is closed")
        k = self.seq + 1
        flag = self.flags[(k - 1) % self.depth]
        if flag.get() >= k:
            return True
        channel = self._sender_if_known()
        if channel is not None:
            if channel.failed:
                raise peer_failed(f"'{self.name}' waits for transfer {k}", channel)
            if self._ack_window is None and channel.progress_now() and flag.get() >= k:
                return True
        return self._check_sender_open(k)

    def close(self) -> None:
        """Unpublishes, tells a connected sender that the receiver is gone, and keeps the
        slots allocated until the device closes, so that a write still in flight lands in
        memory nobody reuses."""
        if self.closed:
            return
        self.closed = True
        _unpublish(self.device, self.name, self._token)
        if self._sender is not None and not self._sender[0].failed:
            try:
                self._ack(CLOSED + self.seq, Deadline(1.0))  # done with all it received
            except RdmaflowError:
                pass
        for f in self._ack_futures:
            if f is not None:
                f.wait(1.0)


class Sender(Endpoint):
    """Looks up a receiver, introduces itself once, then writes payload + flag per transfer."""

    kind = ""

    def __init__(self, device, remote_endpoint: str, name: str, qp_idx: int, timeout: float | None):
        super().__init__(device, name, timeout)
        if not isinstance(qp_idx, int) or isinstance(qp_idx, bool) or not 0 <= qp_idx < device.qps_per_peer:
            raise InvalidArgumentError(f"qp_idx must be an integer in [0, {device.qps_per_peer}) (the device's "
                                       f"qps_per_peer), got {qp_idx!r}")
        deadline = Deadline(timeout)
        value = device.lookup(remote_endpoint, name, -1.0 if timeout is None else timeout)
        meta, desc = unpack_header(value, name)
        if meta.get("kind") != self.kind:
            raise InvalidArgumentError(
                f"'{name}' at {remote_endpoint} is a {meta.get('kind')} receiver, not a {self.kind} one"
            )
        self.meta = meta
        self.remote = RemoteRegion.from_descriptor(desc)
        self.remote_endpoint = remote_endpoint
        self.depth = _int_field(meta, "depth", name, 1, MAX_DEPTH)
        self.r_base = _int_field(meta, "base", name)
        self.r_ctl = _int_field(meta, "ctl", name)
        self.r_data = _int_field(meta, "data", name)
        self.r_stride = _int_field(meta, "stride", name, 1)
        # Where the slots are: after the control block, or in the receiver's GPU arena.
        self.data_remote, self.d_at = self.remote, self.r_base + self.r_data
        if "data_region" in meta:
            try:
                self.data_remote = RemoteRegion.from_descriptor(bytes.fromhex(str(meta["data_region"])))
            except (ValueError, RdmaflowError) as e:
                raise InvalidArgumentError(f"the header published as '{name}' has a bad data_region: {e}") from None
            self.d_at = _int_field(meta, "data_base", name)
        # GPU slots of a receiver on this host: mapped, and written by a copy kernel (arena.py).
        if (self.r_ctl < FLAG_STRIDE * self.depth or self.r_data < self.r_ctl + CTL_BYTES
                or self.r_base + self.r_data > self.remote.nbytes
                or self.d_at + self.r_stride * self.depth > self.data_remote.nbytes):
            raise InvalidArgumentError(
                f"the header published as '{name}' lays out its slots outside its region"
            )
        # GPU slots of a receiver on this host: mapped, and written by a copy kernel (arena.py).
        self._gpu_map = (map_gpu_ipc(meta.get("data_ipc"), self.data_remote.nbytes) if "data_region" in meta
                         else None)
        # Everything the subclass needs from the header is checked before the receiver is
        # touched: a rejected sender must leave no trace there.
        self._validate(meta)
        self.channel = device.channel(remote_endpoint, qp_idx)
        self._send_lock = threading.Lock()
        # [ack][pad][flag sources][one][introduction staging]
        self._flags_off = 64
        self._one_off = self._flags_off + FLAG_STRIDE * self.depth
        self._intro_off = self._one_off + 64
        total = self._intro_off + CTL_BYTES
        self.block = self.arena.allocate(total)
        self._arena_lo, self._arena_hi = self.arena.base, self.arena.base + self.arena.nbytes
        raw = torch.frombuffer(self.block, dtype=torch.uint8, count=total)
        raw.zero_()
        self._raw = raw
        self.ack = Word.at(raw, 0)
        self.seq = 0
        self._pending: list = [None] * self.depth  # per slot: (future, what must stay alive)
        # Only now, with everything checked and allocated, claim the receiver (the header checked
        # above, not one published anew since): its device hands it to one sender for its life,
        # so a second one is refused here, before it writes a byte.
        left = deadline.left()
        try:
            device.lookup(remote_endpoint, name, -1.0 if left is None else left, value)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(f"connecting a sender to '{name}': {e}") from None
        keep_until_device_closes(device, self.block)  # its ack word: the receiver writes it until it learns
        self._introduce(deadline)
        # Same host: the receiver's region written by this thread (DirectWindow), no progress
        # thread; sends on it are complete when they return, so they all share one done future.
        self._direct = self.channel.direct_window(self.remote) if self.data_remote is self.remote else None
        self._done = self.channel.memcpy(self.arena.region, 0, self.remote, 0, 0, WRITE)

    def _validate(self, meta: dict) -> None:
        """Checks the subclass's fields of the receiver's header; raises InvalidArgumentError."""

    def _off(self, local: int) -> int:
        return self.block.offset + local

    def _introduce(self, deadline: Deadline) -> None:
        intro = SenderIntro.encode(self.device.endpoint, self.arena.region.descriptor(), self._off(0))
        intro_bytes = torch.frombuffer(bytearray(intro), dtype=torch.uint8)
        self._raw[self._intro_off : self._intro_off + len(intro)] = intro_bytes
        # A fresh generation number, so that the receiver notices if another sender takes over.
        generation = int.from_bytes(os.urandom(7), "little") | 1
        self._raw[self._one_off : self._one_off + 8].view(torch.int64).fill_(generation)
        region = self.arena.region
        self.channel.memcpy(region, self._off(self._intro_off), self.remote, self.r_base + self.r_ctl + 8, len(intro),
                            WRITE)
        self.channel.fence()
        f = self.channel.memcpy(region, self._off(self._one_off), self.remote, self.r_base + self.r_ctl, 8, WRITE)
        f.result(deadline.left())

    def _wait_credit(self, k: int, deadline: Deadline) -> int:
        if self.ack.get() >= CLOSED:
            raise self._closed_receiver()
        need = k - self.depth
        if need > 0 and self.ack.get() < need:  # (the message is built only for a wait)
            wait_flag(self.ack, need, deadline,
                      f"waiting for '{self.name}' at {self.remote_endpoint} to consume transfer {need} "
                      f"(a sender never overwrites a slot its receiver has not consumed)", peer=self.channel,
                      drive=True)
            if self.ack.get() >= CLOSED:
                raise self._closed_receiver()
        return (k - 1) % self.depth

    def _arena_offset(self, tensor: torch.Tensor, nbytes: int) -> int | None:
        """Where ``tensor``'s ``nbytes`` (> 0) live in the arena, or None when they must be staged
        (mode "copy", or "auto" with a tensor outside the arena); mode "zerocopy" refuses such a
        tensor. Every send has checked that the tensor is contiguous and on the host, so this is
        a bounds check against the arena's span (it runs per send: arena.offset_of's own checks
        cost a ping-pong about 1 µs)."""
        off = None
        if self.mode != "copy":
            ptr = tensor.data_ptr()
            if self._arena_lo <= ptr and ptr + nbytes <= self._arena_hi:
                off = ptr - self._arena_lo
        if off is None and self.mode == "zerocopy":
            raise InvalidArgumentError(
                "zero-copy send needs a tensor that lives in the registered arena: allocate it "
                "with device.empty(shape, dtype), or use mode='copy'"
            )
        return off

    def _gpu_offset(self, gpu, tensor: torch.Tensor) -> int | None:
        """Where a CUDA tensor lives in the GPU arena ``gpu``, or None when it must be staged;
        mode "zerocopy" refuses one outside it."""
        off = gpu.offset_of(tensor)
        if off is None and self.mode == "zerocopy":
            raise InvalidArgumentError(
                "zero-copy send needs a CUDA tensor that lives in the registered GPU arena: allocate it "
                "with device.empty(shape, dtype, device='cuda'), or use mode='copy'"
            )
        return off

    def _post(self, k: int, slot: int, local_off: int = 0, data_off: int = 0, nbytes: int = 0,
              rider: tuple | None = None, local=None, remote=None):
        """One command: WRITE ``nbytes`` from the arena at ``local_off`` to the receiver's region
        at ``data_off``, then WRITE k into the flag of ``slot`` (``write_flagged``): the flag never
        lands before the payload. ``rider``: a receiver's ack to the same peer, in the same message (stored
        just before the flag), else as a word of its own right behind it (``Receiver._rider_for``).
        ``local``/``remote``: the data's regions when they are not the two arenas (GPU memory);
        the flag stays in the host arenas, put once the data's flush has completed."""
        if local is None and remote is None:
            return self.channel.write_flagged(self.arena.region, local_off, self.remote, data_off, nbytes,
                                              self._off(self._flags_off + FLAG_STRIDE * slot), k,
                                              self.r_base + FLAG_STRIDE * slot, None, *(rider or ()))
        return self.channel.write_flagged(local or self.arena.region, local_off, remote or self.remote, data_off,
                                          nbytes, self._off(self._flags_off + FLAG_STRIDE * slot), k,
                                          self.r_base + FLAG_STRIDE * slot, None, *(rider or (None, 0, 0, 0)),
                                          self.arena.region, self.remote)

    def _check_release(self, release) -> None:
        """``send(..., release=...)`` takes a receiver of this device, or None."""
        if release is not None and not (isinstance(release, Receiver) and release.device is self.device):
            raise InvalidArgumentError(
                f"release= takes a receiver of this sender's device (whose last transfer the send "
                f"hands back), got {type(release).__name__}"
            )

    def _closed_receiver(self) -> PeerError:
        return PeerError(f"receiver '{self.name}' at {self.remote_endpoint} was closed")

    @property
    def receiver_closed(self) -> bool:
        """Whether the receiver was closed (it consumes nothing more), as far as its closing word
        has landed here: over UCX that is some time after its close() returned. Never blocks."""
        return self.ack.get() >= CLOSED

    def consumed(self) -> int:
        """How many transfers the receiver has consumed; once it was closed, how many it had
        received by then (it is done with those). Never blocks."""
        v = self.ack.get()
        return v - CLOSED if v >= CLOSED else v

    def has_credit(self) -> bool:
        """Whether the next send() finds its slot free without waiting: the receiver has consumed
        the transfer that last used it (or was closed). Never blocks. Where acks come over UCX,
        a look that finds no credit drives the channel's worker once and looks again, as
        ``Receiver.poll()`` does: over tcp an ack lands only by this side's progress."""
        need = self.seq + 1 - self.depth
        if self.ack.get() >= need:  # (CLOSED + n is above any need)
            return True
        return self._direct is None and self.channel.progress_now() and self.ack.get() >= need

    def wait_consumed(self, k: int | None = None, timeout: float | None = ENDPOINT_TIMEOUT) -> None:
        """Waits until the receiver has consumed transfer ``k`` (default: every transfer sent),
        at most ``timeout`` seconds (default: the sender's; None: no limit). Raises PeerError
        when the receiver was closed before receiving ``k``: it never will."""
        k = self.seq if k is None else k
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= self.seq:
            raise InvalidArgumentError(f"wait_consumed: transfer {k!r} of '{self.name}' was not sent "
                                       f"({self.seq} were)")
        deadline = Deadline(call_timeout(timeout, self.timeout))
        wait_flag(self.ack, k, deadline, f"waiting for '{self.name}' to consume transfer {k}", peer=self.channel)
        if self.consumed() < k:  # the word is CLOSED + what the receiver took before it closed
            raise PeerError(f"receiver '{self.name}' at {self.remote_endpoint} was closed after receiving "
                            f"{self.consumed()} transfers: transfer {k} will not be consumed")

    def close(self) -> None:
        """Waits (up to a second each) for the transfers in flight, then leaves the receiver
        CLOSED + the number sent in its control block's closing word, behind them: its waits for
        a transfer never sent end in PeerError. Never blocks for longer than about two seconds."""
        if self.closed:
            return
        self.closed = True
        for p in self._pending:
            if p is not None:
                p[0].wait(1.0)
        if self.ack.get() >= CLOSED or self.channel.failed:
            return  # nobody is there to tell
        at, value = self.r_base + self.r_ctl + CTL_CLOSED, CLOSED + self.seq
        try:
            if self._direct is not None:  # same host: a release store, after the flags' own
                self._direct.store_word(at, value)
            else:  # a word alone lands behind everything the channel posted before it
                src = self._off(8)
                self.channel.write_flagged(self.arena.region, src, self.remote, at, 0, src, value, at).wait(1.0)
        except RdmaflowError:
            pass  # the receiver's device is gone: nobody is there to tell
