"""The flat model a file view reads and writes: the worker's registered parameter and gradient
buffers, addressed by byte offset.

``DistributedOptimizer`` (zero copy) keeps every parameter and every gradient in one flat
buffer in registered memory, in declaration order. A gradient write adds straight into the
gradient buffer and WRITEs the elements it touched to their shards at once (a write-through
one returns when they have landed, as iRDMA's block requests complete at the server, so
asynchronous I/O keeps many on the wire); the step then sends only what those writes did not
cover exactly once, and the push flag. A
weight read copies out of the parameter buffer that the shards WRITE into, once the chunks
holding it have landed. Writes may have any size and alignment: the whole elements in a write
are added at once, and the bytes of an element cut by a write's edges wait in a small table
until the element is complete."""
from __future__ import annotations

import ctypes
import errno
import threading
import warnings

import torch

from rdmaflow import InvalidArgumentError, RdmaflowError

STRIPE = 1 << 20  # bytes covered by one accumulation lock: concurrent writes to disjoint stripes never wait

# torch.frombuffer warns about read-only buffers; the bytes FUSE hands over are only read.
warnings.filterwarnings("ignore", message="The given buffer is not writable")


def flat_view(tensors: list[torch.Tensor], numel: int, what: str) -> torch.Tensor:
    """One 1-D tensor over the consecutive ``tensors`` (views of one buffer, in order)."""
    first = tensors[0]
    flat = first.new_empty(0).set_(first.untyped_storage(), first.storage_offset(), (numel,), (1,))
    isz = first.element_size()
    at = flat.data_ptr()
    for t in tensors:
        if t.data_ptr() != at or not t.is_contiguous():
            raise InvalidArgumentError(f"the parameter server's {what} are not one flat buffer (zero_copy is off?)")
        at += t.numel() * isz
    return flat


class FlatModel:
    """Byte-addressed access to a worker's flat gradients and weights, and the step between them."""

    def __init__(self, optimizer, params: list[torch.nn.Parameter], timeout: float):
        self.opt = optimizer
        self.timeout = timeout  # seconds for a write's WRITEs to land
        self.params = params
        self.dtype = params[0].dtype
        self.itemsize = params[0].element_size()
        self.numel = sum(p.numel() for p in params)
        self.nbytes = self.numel * self.itemsize
        self._locks = [threading.Lock() for _ in range(max(1, -(-self.nbytes // STRIPE)))]
        self._partial_lock = threading.Lock()
        self._partials: dict[int, tuple[bytearray, int]] = {}  # element -> (its bytes, mask of those written)
        self._bind()

    def _bind(self) -> None:
        # zero_grad() switches the gradient buffer: the flat view follows it.
        self.grads = flat_view([p.grad for p in self.params], self.numel, "gradients")
        self.weights = flat_view([p.data for p in self.params], self.numel, "parameters")

    # -- gradients ---------------------------------------------------------------------------
    def _add(self, first: int, values: torch.Tensor) -> None:
        lo, hi = first * self.itemsize // STRIPE, ((first + values.numel()) * self.itemsize - 1) // STRIPE
        locks = self._locks[lo : hi + 1]
        for lk in locks:
            lk.acquire()
        try:
            self.grads[first : first + values.numel()].add_(values)
        finally:
            for lk in reversed(locks):
                lk.release()

    def _elements(self, offset: int, size: int) -> tuple[int, int]:
        """The elements that bytes [offset, offset + size) touch."""
        return offset // self.itemsize, -(-(offset + size) // self.itemsize)

    def write(self, offset: int, data, through: bool, give_up=None) -> None:
        """Adds ``data`` (a buffer of raw elements of the model's dtype) into this step's gradient
        at byte ``offset`` and WRITEs the touched elements to the shards; with ``through``
        returns once they are in the shards' memory, else once posted (the step completes them).
        ``give_up()`` ends the wait before anything is added (InterruptedError)."""
        lo, hi = self._elements(offset, len(data))
        self.opt.wait_range(lo, hi, give_up=give_up)  # the shards are done with the last step's gradient there
        self.add(offset, data)
        futs = self.opt.push_range(lo, hi)
        if through:
            for f in futs:
                f.result(self.timeout)

    def add(self, offset: int, data) -> None:
        """Adds ``data`` (a buffer of raw elements of the model's dtype) into this step's gradient at byte ``offset``."""
        data = memoryview(data).cast("B")
        isz = self.itemsize
        head = min((-offset) % isz, len(data))
        whole = (offset + head) // isz, (offset + head) // isz + (len(data) - head) // isz
        if self._partials:  # whole elements over bytes of one still incomplete: refused, as partial ones are
            with self._partial_lock:
                hit = next((e for e in self._partials if whole[0] <= e < whole[1]), None)
            if hit is not None:
                raise OSError(errno.EINVAL, f"bytes of element {hit} written twice before the element was complete")
        if head:
            self._add_partial(offset, data[:head])
        n = (len(data) - head) // isz
        if n:
            self._add((offset + head) // isz, torch.frombuffer(data, dtype=self.dtype, count=n, offset=head))
        tail = head + n * isz
        if tail < len(data):
            self._add_partial(offset + tail, data[tail:])

    def _add_partial(self, offset: int, chunk: memoryview) -> None:
        isz = self.itemsize
        elem, pos = divmod(offset, isz)
        bits = ((1 << len(chunk)) - 1) << pos
        with self._partial_lock:
            buf, mask = self._partials.get(elem, (bytearray(isz), 0))
            if mask & bits:
                raise OSError(errno.EINVAL, f"bytes of element {elem} written twice before the element was complete")
            buf[pos : pos + len(chunk)] = chunk
            mask |= bits
            if mask != (1 << isz) - 1:
                self._partials[elem] = (buf, mask)
                return
            self._partials.pop(elem, None)
        self._add(elem, torch.frombuffer(buf, dtype=self.dtype))

    def incomplete(self) -> list[int]:
        """Byte offsets of elements some of whose bytes were written this step, not all."""
        with self._partial_lock:
            return sorted(e * self.itemsize for e in self._partials)

    # -- reads -------------------------------------------------------------------------------
    def read_into(self, which: str, offset: int, size: int, dest: int, give_up=None) -> int:
        """Copies ``size`` bytes of the weights (once they have landed) or of this step's
        gradient at ``offset`` (clipped to the end) to address ``dest``; returns the count.
        ``give_up()`` ends the wait for the weights (InterruptedError)."""
        size = max(0, min(size, self.nbytes - offset))
        if not size:
            return 0
        if which == "weights":
            self.opt.wait_range(*self._elements(offset, size), give_up=give_up)
        t = self.weights if which == "weights" else self.grads
        ctypes.memmove(dest, t.data_ptr() + offset, size)  # a foreign call: the GIL is released
        return size

    def landed(self, timeout: float) -> bool:
        """Whether the newest weights (those of the last push) are all in, waiting up to ``timeout``."""
        try:
            self.opt.wait_range(0, self.numel, timeout)
        except RdmaflowError:
            return False
        return True

    # -- the step ----------------------------------------------------------------------------
    def discard(self) -> None:
        """Throws this step's gradient away (a write into it was refused after part of it may
        have been added): zero here, and zeros WRITten over every slot of the step. A slot
        that the step's writes WRITE as well is then covered twice, so the next push sends it
        whole, behind a fence, from this buffer: nothing of the discarded sum reaches a shard.
        Called with no write in flight (the step gate held)."""
        with self._partial_lock:
            self._partials.clear()
        self.grads.zero_()
        self.opt.wait_range(0, self.numel)
        self.opt.push_range(0, self.numel)

    def step(self, give_up=None) -> None:
        """Pushes what the writes did not, and the push flag; returns once that has landed
        (reads and the next step's writes wait for the new weights, chunk by chunk). The next
        step's gradient starts at zero. The gradient file is every variable's gradient, zeros
        where nothing was written: each is stepped, also in a push with no write. It first
        waits for the previous step's weights, which ``give_up()`` ends (InterruptedError,
        nothing pushed)."""
        self.opt.wait_range(0, self.numel, give_up=give_up)
        self.opt.mark_gradients()
        self.opt.step(wait=False)
        self.opt.zero_grad()
        with self._partial_lock:
            self._partials.clear()
        self._bind()
