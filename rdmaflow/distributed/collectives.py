"""Collectives of the rdmaflow process group, built from the group's pairs (mailbox.py).

Every message is one transfer on a pair (a one-sided WRITE of its metadata record and flag,
then the receiver's one-sided READ of the data), under ``COLLECTIVE_TAG``. Each rank issues a
group's collectives in the same order, and each collective sends a fixed number of messages
per pair, so messages match up by their order on the pair.

Which algorithm (docs/distributed.md, "Collectives"):

- at most ``SMALL_BYTES`` per rank (or fewer elements than ranks): direct. Every rank sends
  its part to every rank that needs it in one round, and each rank reduces what it receives in
  rank order, so that every rank computes the same bytes.
- larger: ring. Reduce-scatter in n - 1 steps (at step s rank r sends chunk r - s - 1 to
  r + 1 and adds chunk r - s - 2 from r - 1 into its own), then allgather in n - 1 steps (rank
  r sends chunk r - s, receives chunk r - s - 1). Every rank's bytes of a chunk come from the
  one rank that reduced it.
- broadcast: a binomial tree (log2 n rounds); barrier: dissemination (log2 n rounds of empty
  messages).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from rdmaflow import InvalidArgumentError
from rdmaflow.deadline import Deadline
from rdmaflow.distributed.mailbox import COLLECTIVE_TAG as TAG
from rdmaflow.distributed.mailbox import Mailbox

SMALL_BYTES = 64 * 1024  # per rank: direct exchange up to this, ring above
_EMPTY = torch.empty(0, dtype=torch.uint8)

RO = dist.ReduceOp
_BITWISE = {RO.BAND: "bitwise_and_", RO.BOR: "bitwise_or_", RO.BXOR: "bitwise_xor_"}


def op_name(op) -> str:
    return str(getattr(op, "op", op)).replace("RedOpType.", "")


def combiner(op, dtype: torch.dtype, what: str) -> Callable[[torch.Tensor, torch.Tensor], None]:
    """``acc <- acc (op) x``, in place; raises InvalidArgumentError for an op this backend or
    this dtype does not have."""
    kind = getattr(op, "op", op)
    if kind in (RO.SUM, RO.AVG):
        if kind == RO.AVG and not (dtype.is_floating_point or dtype.is_complex):
            raise InvalidArgumentError(f"rdmaflow process group: {what} with ReduceOp.AVG needs a floating or complex "
                                       f"tensor, got {dtype}")
        return lambda a, x: a.add_(x)
    if kind == RO.PRODUCT:
        return lambda a, x: a.mul_(x)
    if kind in (RO.MIN, RO.MAX):
        if dtype.is_complex:
            raise InvalidArgumentError(f"rdmaflow process group: {what} with ReduceOp.{op_name(op)} on {dtype}: complex "
                                       "numbers have no order")
        f = torch.minimum if kind == RO.MIN else torch.maximum
        return lambda a, x: f(a, x, out=a)
    if kind in _BITWISE:
        if dtype.is_floating_point or dtype.is_complex:
            raise InvalidArgumentError(f"rdmaflow process group: {what} with ReduceOp.{op_name(op)} needs an integer or "
                                       f"bool tensor, got {dtype}")
        name = _BITWISE[kind]
        return lambda a, x: getattr(a, name)(x)
    raise InvalidArgumentError(f"rdmaflow process group: {what} with ReduceOp.{op_name(op)} is not supported "
                               "(SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR are)")


def _finish_avg(op, t: torch.Tensor, n: int) -> None:
    if getattr(op, "op", op) == RO.AVG:
        t.div_(n)


def _direct(n: int, nbytes: int, numel: int) -> bool:
    return nbytes <= SMALL_BYTES or numel < n


def barrier(mb: Mailbox, dl: Deadline) -> None:
    n, r, k = mb.size, mb.rank, 1
    while k < n:
        mb.send((r + k) % n, _EMPTY, TAG, dl)
        mb.recv((r - k) % n, TAG, _EMPTY, dl)
        k <<= 1


def broadcast(mb: Mailbox, t: torch.Tensor, root: int, dl: Deadline) -> None:
    n, r = mb.size, mb.rank
    vr, mask = (r - root) % n, 1
    while mask < n:
        if vr & mask:
            mb.recv((vr - mask + root) % n, TAG, t, dl)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            mb.send((vr + mask + root) % n, t, TAG, dl)
        mask >>= 1


def _ring_reduce_scatter(mb: Mailbox, chunks: Sequence[torch.Tensor], combine, dl: Deadline) -> None:
    """Leaves chunk r of rank r reduced over every rank (``chunks``: this rank's, reduced into)."""
    n, r = mb.size, mb.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        mb.send(nxt, chunks[(r - s - 1) % n], TAG, dl)
        mine = chunks[(r - s - 2) % n]
        got = torch.empty_like(mine)
        mb.recv(prv, TAG, got, dl)
        combine(mine, got)


def _ring_allgather(mb: Mailbox, chunks: Sequence[torch.Tensor], dl: Deadline) -> None:
    """Fills every chunk from the rank that holds it: rank r starts with chunk r."""
    n, r = mb.size, mb.rank
    nxt, prv = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        mb.send(nxt, chunks[(r - s) % n], TAG, dl)
        mb.recv(prv, TAG, chunks[(r - s - 1) % n], dl)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A flat view of ``t`` (a contiguous copy where it is not contiguous: written back by
    the caller)."""
    return t.view(-1) if t.is_contiguous() else t.contiguous().view(-1)


def allreduce(mb: Mailbox, t: torch.Tensor, op, dl: Deadline) -> None:
    n, r = mb.size, mb.rank
    combine = combiner(op, t.dtype, "allreduce")
    if n > 1:
        flat = _flat(t)
        if _direct(n, flat.numel() * flat.element_size(), flat.numel()):
            for k in range(1, n):
                mb.send((r + k) % n, flat, TAG, dl)
            parts = {r: flat}
            for k in range(1, n):
                p = (r - k) % n
                parts[p] = torch.empty_like(flat)
                mb.recv(p, TAG, parts[p], dl)
            acc = parts[0].clone()
            for p in range(1, n):
                combine(acc, parts[p])
            flat.copy_(acc)
        else:
            chunks = torch.tensor_split(flat, n)
            _ring_reduce_scatter(mb, chunks, combine, dl)
            _ring_allgather(mb, chunks, dl)
        if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
            t.copy_(flat.view(t.shape))
    _finish_avg(op, t, n)


def reduce(mb: Mailbox, t: torch.Tensor, root: int, op, dl: Deadline) -> None:
    n, r = mb.size, mb.rank
    combine = combiner(op, t.dtype, "reduce")
    if n == 1:
        _finish_avg(op, t, n)
        return
    flat = _flat(t)
    if _direct(n, flat.numel() * flat.element_size(), flat.numel()):
        if r != root:
            mb.send(root, flat, TAG, dl)
            return
        acc = None
        for p in range(n):
            if p == r:
                part = flat
            else:
                part = torch.empty_like(flat)
                mb.recv(p, TAG, part, dl)
            if acc is None:
                acc = part.clone()
            else:
                combine(acc, part)
        flat.copy_(acc)
    else:  # reduce-scatter over a copy (a non-root's tensor is left as it was), then gather at the root
        work = flat.clone() if r != root else flat
        chunks = torch.tensor_split(work, n)
        _ring_reduce_scatter(mb, chunks, combine, dl)
        if r != root:
            mb.send(root, chunks[r], TAG, dl)
            return
        for p in range(n):
            if p != r:
                mb.recv(p, TAG, chunks[p], dl)
    if flat.data_ptr() != t.data_ptr() or not t.is_contiguous():
        t.copy_(flat.view(t.shape))
    _finish_avg(op, t, n)


def allgather(mb: Mailbox, outputs: Sequence[torch.Tensor], mine: torch.Tensor, dl: Deadline) -> None:
    """``outputs[p]`` <- rank p's ``mine``, on every rank."""
    n, r = mb.size, mb.rank
    if len(outputs) != n:
        raise InvalidArgumentError(f"rdmaflow process group: allgather needs {n} output tensors (one per rank), "
                                   f"got {len(outputs)}")
    if outputs[r] is not mine:
        outputs[r].copy_(mine.view(outputs[r].shape) if mine.numel() == outputs[r].numel() else mine)
    nbytes = mine.numel() * mine.element_size()
    if n == 1:
        return
    if _direct(n, nbytes, n):
        for k in range(1, n):
            mb.send((r + k) % n, mine, TAG, dl)
        for k in range(1, n):
            p = (r - k) % n
            mb.recv(p, TAG, outputs[p], dl)
    else:
        _ring_allgather(mb, outputs, dl)


def reduce_scatter(mb: Mailbox, out: torch.Tensor, inputs: Sequence[torch.Tensor], op, dl: Deadline) -> None:
    """``out`` <- the reduction over ranks of their ``inputs[r]``."""
    n, r = mb.size, mb.rank
    if len(inputs) != n:
        raise InvalidArgumentError(f"rdmaflow process group: reduce_scatter needs {n} input tensors (one per rank), "
                                   f"got {len(inputs)}")
    combine = combiner(op, out.dtype, "reduce_scatter")
    if any(x.numel() != out.numel() for x in inputs):
        raise InvalidArgumentError(f"rdmaflow process group: reduce_scatter's inputs must each have the output's "
                                   f"{out.numel()} elements, got {[x.numel() for x in inputs]}")
    if n == 1:
        out.copy_(inputs[0].view(out.shape))
        _finish_avg(op, out, n)
        return
    if _direct(n, out.numel() * out.element_size(), out.numel()):
        for k in range(1, n):
            p = (r + k) % n
            mb.send(p, inputs[p], TAG, dl)
        acc = None
        for p in range(n):
            if p == r:
                part = inputs[r].reshape(-1)
            else:
                part = torch.empty(out.numel(), dtype=out.dtype)
                mb.recv(p, TAG, part, dl)
            if acc is None:
                acc = part.clone()
            else:
                combine(acc, part)
        out.copy_(acc.view(out.shape))
    else:
        chunks = [x.reshape(-1).clone() for x in inputs]
        _ring_reduce_scatter(mb, chunks, combine, dl)
        out.copy_(chunks[r].view(out.shape))
    _finish_avg(op, out, n)


def gather(mb: Mailbox, outputs: Sequence[torch.Tensor] | None, mine: torch.Tensor, root: int, dl: Deadline) -> None:
    n, r = mb.size, mb.rank
    if r != root:
        mb.send(root, mine, TAG, dl)
        return
    if outputs is None or len(outputs) != n:
        raise InvalidArgumentError(f"rdmaflow process group: gather's root needs {n} output tensors (one per rank)")
    for p in range(n):
        if p == r:
            outputs[p].copy_(mine.view(outputs[p].shape))
        else:
            mb.recv(p, TAG, outputs[p], dl)


def scatter(mb: Mailbox, out: torch.Tensor, inputs: Sequence[torch.Tensor] | None, root: int, dl: Deadline) -> None:
    n, r = mb.size, mb.rank
    if r != root:
        mb.recv(root, TAG, out, dl)
        return
    if inputs is None or len(inputs) != n:
        raise InvalidArgumentError(f"rdmaflow process group: scatter's root needs {n} input tensors (one per rank)")
    for p in range(n):
        if p != r:
            mb.send(p, inputs[p], TAG, dl)
    out.copy_(inputs[r].view(out.shape))


def alltoall(mb: Mailbox, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], dl: Deadline) -> None:
    """``outputs[p]`` <- rank p's ``inputs[r]``: every pair in one round."""
    n, r = mb.size, mb.rank
    if len(outputs) != n or len(inputs) != n:
        raise InvalidArgumentError(f"rdmaflow process group: alltoall needs {n} input and {n} output tensors, got "
                                   f"{len(inputs)} and {len(outputs)}")
    for k in range(1, n):
        p = (r + k) % n
        mb.send(p, inputs[p], TAG, dl)
    outputs[r].copy_(inputs[r].view(outputs[r].shape))
    for k in range(1, n):
        p = (r - k) % n
        mb.recv(p, TAG, outputs[p], dl)
