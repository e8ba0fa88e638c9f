"""The flat model a file view reads and writes: the worker's registered parameter and gradient
buffers, addressed by byte offset.

``DistributedOptimizer`` (zero copy) keeps every parameter and every gradient in one flat
buffer in registered memory, in declaration order. A gradient write adds straight into the
gradient buffer that the next push sends by one-sided WRITE; a weight read copies out of the
parameter buffer that the shards WRITE into. Writes may have any size and alignment: the
whole elements in a write are added at once, and the bytes of an element cut by a write's
edges wait in a small table until the element is complete."""
from __future__ import annotations

import ctypes
import errno
import threading
import warnings

import torch

from rdmaflow import InvalidArgumentError

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

    def __init__(self, optimizer, params: list[torch.nn.Parameter]):
        self.opt = optimizer
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

    def add(self, offset: int, data: bytes) -> None:
        """Adds ``data`` (raw elements of the model's dtype) into this step's gradient at byte ``offset``."""
        isz = self.itemsize
        head = min((-offset) % isz, len(data))
        if head:
            self._add_partial(offset, data[:head])
        n = (len(data) - head) // isz
        if n:
            self._add((offset + head) // isz, torch.frombuffer(data, dtype=self.dtype, count=n, offset=head))
        tail = head + n * isz
        if tail < len(data):
            self._add_partial(offset + tail, data[tail:])

    def _add_partial(self, offset: int, chunk: bytes) -> None:
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
    def read(self, which: str, offset: int, size: int) -> bytes:
        """A copy of ``size`` bytes of the weights or gradients at ``offset`` (clipped to the end)."""
        t = self.weights if which == "weights" else self.grads
        size = max(0, min(size, self.nbytes - offset))
        return ctypes.string_at(t.data_ptr() + offset, size) if size else b""

    # -- the step ----------------------------------------------------------------------------
    def step(self) -> None:
        """Pushes this step's gradient and waits for the weights the mode allows (the
        optimizer's push and pull), then starts the next step's gradient at zero."""
        self.opt.step()
        self.opt.zero_grad()
        with self._partial_lock:
            self._partials.clear()
        self._bind()
