"""Transfer with static placement (Xue et al. §3.2).

The receiver preallocates the destination tensor (shape and dtype known in advance) in its
registered arena and publishes where it is, once. The sender then writes the tensor straight
into it, then the slot's flag: the receiver sees the flag only after the data. The pair is
reused every iteration with no handshake.

The paper relies on RDMA writes landing in ascending address order with the flag byte last;
neither UCX nor current NICs promise that (adaptive routing, relaxed ordering), so the flag
WRITE is ordered behind the data WRITE by the core (``write_flagged``): put once the data's
flush has completed, right behind it on one tcp connection, or in the same active message
(docs/transfer.md, "The flag never lands before the data"). Flags carry the transfer's sequence number instead of a
set/cleared byte, so the receiver never has to clear one.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rdmaflow import Future, InvalidArgumentError, PeerError, TimeoutError
from rdmaflow._args import shape_of
from rdmaflow.deadline import ENDPOINT_TIMEOUT, Deadline, checked_timeout, time_left
from rdmaflow.transfer.common import FLAG_STRIDE, KIND_STATIC, check_tensor, stream_done
from rdmaflow.transfer.dtypes import CODE_DTYPE, describe, dtype_code
from rdmaflow.transfer.flag import OK, PEER_FAILED, RECEIVER_CLOSED, WAIT_SLICE, first_slice, peer_failed
from rdmaflow.transfer.pair import CLOSED, Receiver, Sender

MODES = ("auto", "zerocopy", "copy")


MAX_STATIC_RANK = 64  # the dimensions a header may carry (dynamic and bounded records hold 8)


class StaticReceiver(Receiver):
    """Receives tensors of one fixed shape and dtype into preallocated, registered memory.

    ``recv()`` returns a tensor viewing the slot the data was written to: no copy. The slot is
    handed back to the sender by ``release()``, or by the next ``recv()``; until then the
    sender cannot overwrite it. ``depth`` slots let the sender run that many transfers ahead.

    ``device`` ("cuda", "cuda:1"): the slots are GPU memory in the device's GPU arena and
    ``recv()`` returns CUDA tensors; the flags stay in host memory, where this CPU polls them
    (Xue et al. §3.5). A flag is put only once its data's WRITE has completed (UCX's copy has
    finished), so a received tensor is safe to use on any stream.
    """

    kind = KIND_STATIC
    header_bytes = 0  # bounded transfers: the actual shape, before the data in each slot

    def __init__(self, device, name: str, shape: Sequence[int] | int, dtype: torch.dtype,
                 depth: int = 1, timeout: float | None = 60.0, *, cuda=None):
        self.shape = shape_of(shape)
        if len(self.shape) > MAX_STATIC_RANK:  # no sender would accept its header
            raise InvalidArgumentError(f"a static receiver's rank is at most {MAX_STATIC_RANK}, got {len(self.shape)}")
        self.dtype = dtype
        dtype_code(dtype)
        self.itemsize = dtype.itemsize
        numel = 1
        for s in self.shape:
            numel *= s
        self.nbytes = numel * self.itemsize
        meta = {"shape": list(self.shape), "dtype": dtype_code(dtype), "nbytes": self.nbytes}
        if cuda is not None and self.header_bytes:
            raise InvalidArgumentError("bounded transfers keep their size records in the slots: host memory only")
        super().__init__(device, name, depth, self.header_bytes + self.nbytes, meta, timeout, cuda)
        raw, first = self._raw, self.data_off
        if self.data_block is not None:  # GPU slots: CUDA tensors holding the arena block
            raw, first = torch.as_tensor(self.data_block, device=device.gpu_arena(cuda).cuda_device), 0
        self._views = []
        for i in range(depth):
            start = first + i * self.slot_stride + self.header_bytes
            self._views.append(raw[start : start + self.nbytes].view(dtype).view(self.shape))

    def recv(self, timeout: float | None = ENDPOINT_TIMEOUT) -> torch.Tensor:
        """Waits for the next transfer and returns the tensor it landed in (no copy)."""
        # inline call_timeout: a function call is a measurable share of a small transfer
        timeout = self.timeout if timeout is ENDPOINT_TIMEOUT else checked_timeout(timeout)
        if self.closed:
            raise InvalidArgumentError(f"recv: receiver '{self.name}' is closed")
        k = self.seq + 1
        if self._sender is None:  # the first transfer: its sender introduces itself
            slot = self._wait_flag(k, Deadline(timeout))
        else:  # the previous tensor is consumed by now: its ack, then the wait, in one call
            slot = self._await(k, timeout, self.seq if self.acked < self.seq else 0)
        self.seq = k
        return self._landed(slot, k)

    def _landed(self, slot: int, k: int) -> torch.Tensor:
        """The tensor transfer ``k`` wrote into ``slot``."""
        return self._views[slot]


class StaticSender(Sender):
    """Writes tensors of the receiver's shape and dtype into its preallocated slots.

    ``mode``: ``"zerocopy"`` sends straight from a tensor that lives in the arena (allocate it
    with ``device.empty``) and refuses others; ``"copy"`` always copies into a registered
    staging buffer first (the paper's RDMA.cp); ``"auto"`` does the former when it can.
    """

    kind = KIND_STATIC
    header_bytes = 0
    header_record_bytes = 0  # how much of header_bytes a transfer writes (bounded: its size record)

    def __init__(self, device, remote_endpoint: str, name: str, shape: Sequence[int] | int | None = None,
                 dtype: torch.dtype | None = None, mode: str = "auto", qp_idx: int = 0,
                 timeout: float | None = 60.0):
        if mode not in MODES:
            raise InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self._declared = (None if shape is None else shape_of(shape), dtype)
        super().__init__(device, remote_endpoint, name, qp_idx, timeout)
        # Whether a tensor of the receiver's dtype can have its conjugate bit set (complex only):
        # only then does a send ask it. Its negative bit is asked always: any dtype can carry it
        # contiguously (torch._neg_view, a one-element x.conj().imag), and its memory then holds
        # the values before the negation.
        self._conj_bit = self.dtype.is_complex
        self._staging: list = [None] * self.depth
        self._gpu_staging: list = [None] * self.depth
        # Where each slot's data and flag are in the receiver's region, and this sender's ack word.
        self._slot_at = [self.r_base + self.r_data + i * self.r_stride for i in range(self.depth)]
        self._flag_at = [self.r_base + FLAG_STRIDE * i for i in range(self.depth)]
        self._flag_src = [self._off(self._flags_off + FLAG_STRIDE * i) for i in range(self.depth)]
        self._ack_addr = self.ack.address
        # Over UCX, host slots of a static pair (no size record to write after the credit): the
        # credit wait and the post in one call into the core (_send_slot).
        self._one_call = self._direct is None and self._gpu_map is None and not self.header_bytes and (
            self.data_remote is self.remote)
        # Its arguments but the transfer's number, source and rider, fixed once.
        self._slots = self.channel.slot_sender(self._ack_addr, CLOSED, self.arena.region, self.remote, self.nbytes,
                                               self._slot_at, self._flag_src, self._flag_at) if self._one_call else None

    @property
    def copies_from_any_memory(self) -> bool:
        """The receiver is on this host and this sender's mode is "auto": a send is one copy by the
        caller's thread from the tensor wherever it lives into the receiver's mapped slot, so a
        tensor in the arena saves no copy here."""
        return self._direct is not None and self.mode == "auto"

    def _validate(self, meta: dict) -> None:
        shape, code, nbytes = meta.get("shape"), meta.get("dtype"), meta.get("nbytes")
        if not isinstance(shape, list) or len(shape) > MAX_STATIC_RANK or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise InvalidArgumentError(f"the header published as '{self.name}' has a bad shape: {shape!r}")
        if not isinstance(code, int) or code not in CODE_DTYPE:
            raise InvalidArgumentError(f"the header published as '{self.name}' has an unknown dtype code {code!r}")
        self.shape, self.dtype = tuple(shape), CODE_DTYPE[code]
        numel = 1
        for s in self.shape:
            numel *= s
        want = numel * self.dtype.itemsize
        if nbytes != want or self.r_stride < self.header_bytes + want:
            raise InvalidArgumentError(
                f"the header published as '{self.name}' says {nbytes!r} bytes for {describe(self.shape, self.dtype)} "
                f"({want} bytes) in slots of {self.r_stride}"
            )
        self.nbytes = want
        d_shape, d_dtype = self._declared
        if d_shape is not None and d_shape != self.shape or d_dtype is not None and d_dtype != self.dtype:
            raise InvalidArgumentError(
                f"receiver '{self.name}' at {self.remote_endpoint} holds {describe(self.shape, self.dtype)}; "
                f"this sender declared {describe(d_shape or self.shape, d_dtype or self.dtype)}"
            )

    def send(self, tensor: torch.Tensor, timeout: float | None = ENDPOINT_TIMEOUT, release: Receiver | None = None) -> Future:
        """Writes ``tensor`` into the receiver's next slot, then its flag.

        Returns a future that completes when both are visible at the receiver. With zero copy
        the tensor is read in place: do not modify it before the future completes. On one
        host (the same-host path) the copy is made before ``send`` returns, and so is the future.

        ``release``: a receiver of this device whose last received tensor the caller is done
        with. Over UCX its ack leaves with this send, as by ``release.release()``: in this
        send's message when that receiver's sender is at the other end of this sender's channel
        and the message path carries it (a reply that hands the request's slot back, as in a
        ping-pong, costs one message, not two), else on its own right behind the send. On one
        host it is a store that the receiver's next ``recv()`` makes (call ``release()`` to make
        it now). Either way it goes first when this send has to wait for a credit. Blocks like
        ``send``; not thread-safe with ``release``'s own calls.
        """
        # inline call_timeout: a function call is a measurable share of a small transfer
        timeout = self.timeout if timeout is ENDPOINT_TIMEOUT else checked_timeout(timeout)
        if self.closed:
            raise InvalidArgumentError(f"send: the sender to '{self.name}' is closed")
        try:
            host = (isinstance(tensor, torch.Tensor) and tensor.shape == self.shape and tensor.dtype == self.dtype
                    and tensor.is_cpu and tensor.is_contiguous()
                    and not tensor.is_neg() and not (self._conj_bit and tensor.is_conj()))
        except RuntimeError:  # a sparse or nested tensor, which has no shape or strides to ask: _refuse says so
            host = False
        if not host:
            self._refuse(tensor)  # returns for a tensor that may be sent: a CUDA one
        if release is not None:
            self._check_release(release)
        with self._send_lock:
            if self._direct is not None:
                if not host:  # into host memory on this host: the copy to it is the transfer
                    tensor = self._stage(tensor, 0)
                return self._send_direct(tensor, timeout, release)
            if self._one_call and host:
                return self._send_slot(tensor, timeout, release)
            return self._send(tensor, timeout, release)

    def _refuse(self, tensor) -> None:
        """Raises InvalidArgumentError naming why ``tensor`` cannot be sent (returns if it can)."""
        check_tensor(tensor)
        if tuple(tensor.shape) != self.shape or tensor.dtype != self.dtype:
            raise InvalidArgumentError(
                f"tensor {describe(tuple(tensor.shape), tensor.dtype)} does not match receiver "
                f"'{self.name}' ({describe(self.shape, self.dtype)})"
            )

    def _send_slot(self, tensor: torch.Tensor, timeout: float | None, release: Receiver | None) -> Future:
        """Over UCX, a host tensor into host slots: the credit wait and the post of payload, fence
        and flag in one call into the core with the GIL released (``SlotSender.send``), one call
        per WAIT_SLICE while the credit does not come. ``release`` as in ``send``."""
        k = self.seq + 1
        slot, need = (k - 1) % self.depth, k - self.depth
        rider, release_after = (None, None) if release is None else self._hand_back(release, need, timeout)
        if self._pending[slot] is not None:
            self._slot_reusable(slot, timeout)
        keep, off = self._host_source(tensor, slot, self.nbytes)
        post, extra = (self._slots.send, ()) if rider is None else (self._slots.send_with_rider, rider)
        first = first_slice(timeout)
        code, f = post(k, off, first, *extra)
        if code != OK:
            posted = []

            def attempt(t: float) -> int:
                code, f = post(k, off, t, *extra)
                posted.append(f)
                return code

            self._send_waiting(code, need, attempt, Deadline(None if timeout is None else timeout - first))
            f = posted[-1]
        return self._sent(k, slot, f, keep, release, rider, release_after)

    def _hand_back(self, release: Receiver | None, need: int, timeout) -> tuple:
        """How a send over UCX hands ``release``'s last transfer back: (the rider for the send's
        post, or None; the receiver to release right behind the post, or None). A send that has
        to wait for its credit must not hold back an ack its peer may wait for: that ack goes
        first, here. Else it rides the send's message where there is one, or goes right behind
        the send's post (on the put path an ack before it would put a fence in front of the
        data, and a rider would land only behind the data's flush)."""
        if release is None:
            return None, None
        if self.ack.get() < need:
            release.release()
            return None, None
        if self.channel.flagged_by_message and self.nbytes <= self.channel.flagged_message_bytes:
            return release._rider_for(self.channel, timeout if isinstance(timeout, Deadline) else Deadline(timeout)), None
        return None, release

    def _slot_reusable(self, slot: int, timeout) -> None:
        """Waits until the last transfer from ``slot`` completed (raising its error, if it
        failed): its source (a staging buffer, or a tensor kept alive for it) may then be
        reused. Its flush completes on the next drive of the worker: where it has not, this
        thread drives it once instead of waking a parked progress thread."""
        prev = self._pending[slot]
        if prev is not None:
            if not prev[0].done():
                self.channel.progress_now()
            prev[0].result(time_left(timeout))

    def _host_source(self, tensor: torch.Tensor, slot: int, nbytes: int) -> tuple:
        """(what must stay alive, its arena offset) of a host tensor's ``nbytes``: the tensor
        itself where it lives in the arena (zero copy), else its copy in ``slot``'s staging."""
        if not nbytes:
            return tensor, 0
        off = self._arena_offset(tensor, nbytes)
        if off is not None:
            return tensor, off
        keep = self._stage(tensor, slot)
        return keep, self.arena.offset_of(keep)

    def _sent(self, k: int, slot: int, f, keep, release, rider, release_after) -> Future:
        """Transfer ``k`` from ``slot`` was posted as ``f``: its bookkeeping."""
        if rider is not None:
            release._rode(f)
        self._pending[slot] = (f, keep)
        self.seq = k
        if release_after is not None:
            release_after.release()
        return f

    def _send(self, tensor: torch.Tensor, timeout: float | None, release: Receiver | None = None) -> Future:
        """A send over UCX in a few calls: GPU data or slots, or a bounded transfer's size record,
        which may be written only once the credit is there."""
        deadline = Deadline(timeout)
        k = self.seq + 1
        rider, release_after = self._hand_back(release, k - self.depth, deadline)
        slot = self._wait_credit(k, deadline)
        self._slot_reusable(slot, deadline)
        keep, off, local = tensor, 0, None
        nbytes = tensor.numel() * tensor.element_size()
        if self._gpu_map is not None:  # GPU slots on this host: a copy kernel, then the flag alone
            keep = self._copy_to_mapped_slot(tensor, slot, nbytes)
            nbytes = 0
        elif tensor.is_cuda:
            keep, off, local = self._gpu_source(tensor, slot, nbytes)
        else:
            keep, off = self._host_source(tensor, slot, nbytes)
        self._write_size(slot, k, tensor)  # fenced behind, like the data, by the flag's post
        remote = None if self.data_remote is self.remote else self.data_remote
        f = self._post(k, slot, off, self.d_at + slot * self.r_stride + self.header_bytes, nbytes, rider, local,
                       remote)
        return self._sent(k, slot, f, keep, release, rider, release_after)

    def _copy_to_mapped_slot(self, tensor: torch.Tensor, slot: int, nbytes: int) -> torch.Tensor:
        """Copies ``tensor`` (host or CUDA) into the receiver's mapped GPU slot on the caller's
        current stream, behind the work that produced it, and waits for that stream: the flag,
        posted next, lands after the data. Returns what must stay alive until the flag's post
        completes. Mode "copy" stages a CUDA tensor first (the paper's RDMA.cp); "zerocopy"
        refuses one outside the GPU arena, as every path does."""
        if tensor.is_cuda and nbytes and self.mode == "copy":
            tensor = self._gpu_source(tensor, slot, nbytes)[0]
        elif tensor.is_cuda and nbytes and self.mode == "zerocopy":
            self._gpu_offset(self.device.gpu_arena(tensor.device), tensor)
        if nbytes:
            at = self.d_at + slot * self.r_stride + self.header_bytes
            dst = self._gpu_map[at : at + nbytes].view(tensor.dtype)
            dst.copy_(tensor.reshape(-1))
            stream_done(dst)
        return tensor

    def _gpu_source(self, tensor: torch.Tensor, slot: int, nbytes: int) -> tuple:
        """(what must stay alive, offset, region) of a CUDA tensor's bytes in the GPU arena: the
        tensor itself (zero copy), or a copy in GPU staging memory of ``slot`` (mode "copy", or
        "auto" with a tensor outside the arena). Then waits for the caller's stream, whose work
        produced the tensor (and the copy): UCX reads it on a stream of its own."""
        gpu = self.device.gpu_arena(tensor.device)
        off = None if self.mode == "copy" or not nbytes else self._gpu_offset(gpu, tensor)
        keep = tensor
        if off is None and nbytes:
            if self._gpu_staging[slot] is None:
                self._gpu_staging[slot] = gpu.empty(self.shape, self.dtype)
            keep = self._gpu_staging[slot].view(-1)[: tensor.numel()].view(tensor.shape)
            keep.copy_(tensor)
            off = gpu.offset_of(keep)
        stream_done(keep)
        return keep, off or 0, gpu.region

    def _stage(self, tensor: torch.Tensor, slot: int) -> torch.Tensor:
        """``tensor`` copied into registered staging memory of ``slot``."""
        if self._staging[slot] is None:  # at the maxima for a bounded transfer
            self._staging[slot] = self.arena.empty(self.shape, self.dtype)
        staging = self._staging[slot].view(-1)[: tensor.numel()].view(tensor.shape)
        staging.copy_(tensor)
        return staging

    def _write_size(self, slot: int, k: int, tensor: torch.Tensor) -> None:
        """Bounded transfers write the tensor's actual shape here; a static one has none to write."""

    def _send_direct(self, tensor: torch.Tensor, timeout: float | None, release: Receiver | None = None) -> Future:
        """Same host: the credit, the copy into the slot and the flag's release store, all on
        this thread in one call into the core. The copy is the transfer itself: a tensor
        outside the arena needs no staging (mode "copy" stages anyway: the paper's RDMA.cp)."""
        k = self.seq + 1
        slot = (k - 1) % self.depth
        nbytes, data, header = self.nbytes, self._slot_at[slot], ()
        if self.header_bytes:  # bounded: this transfer's size record, then its actual bytes
            nbytes = tensor.numel() * tensor.element_size()
            header = (data, self.arena.base + self._size_record(slot, k, tensor), self.header_record_bytes)
            data += self.header_bytes
        source = tensor.data_ptr()
        if self.mode != "auto" and nbytes:
            if self.mode == "copy":
                source = self._stage(tensor, 0).data_ptr()
            elif not self._arena_lo <= source <= self._arena_hi - nbytes:
                self._arena_offset(tensor, nbytes)  # refuses a tensor outside the arena, as on every path
        need, flag = k - self.depth, self._flag_at[slot]
        # On one host the ack is a store that the receiver's next recv() makes in its own call (a
        # store here, before or after the copy, measured slower: docs/benchmarks.md), unless this
        # send has no credit yet: then its peer may be waiting for that ack, which goes first.
        if release is not None and self.ack.get() < need:
            release.release()

        def attempt(t: float) -> int:
            return self._direct.send_slot(self._ack_addr, need, CLOSED, data, source, nbytes, flag, k, t, *header)

        first = first_slice(timeout)
        code = attempt(first)
        if code != OK:
            self._send_waiting(code, need, attempt, Deadline(None if timeout is None else timeout - first))
        self.seq = k
        return self._done

    def _send_waiting(self, code: int, need: int, attempt, deadline: Deadline) -> None:
        """The rest of a one-call send (direct, or over UCX) whose first call found no credit:
        ``attempt(seconds)`` once per WAIT_SLICE until it returns OK."""
        what = (f"waiting for '{self.name}' at {self.remote_endpoint} to consume transfer {need} "
                f"(a sender never overwrites a slot its receiver has not consumed)")
        while code != OK:
            if code == RECEIVER_CLOSED:
                raise PeerError(f"receiver '{self.name}' at {self.remote_endpoint} was closed")
            if code == PEER_FAILED:
                raise peer_failed(what, self.channel)
            if deadline.passed():
                raise TimeoutError(f"timed out {what}")
            code = attempt(deadline.slice(WAIT_SLICE))
