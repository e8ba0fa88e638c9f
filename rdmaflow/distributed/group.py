"""``ProcessGroupRdmaflow``: the torch.distributed process group of the "rdmaflow" backend.

A Python subclass of ``torch.distributed.ProcessGroup``: ``init_process_group`` and
``new_group`` use it as the whole group. Ops run on the caller's thread, one at a time per
group: sends and collectives when called, receives at their Work's first wait (work.py).
Every op is bounded by the group's timeout.
"""
from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from rdmaflow import InvalidArgumentError, RdmaflowError
from rdmaflow.deadline import Deadline
from rdmaflow.distributed import collectives as coll
from rdmaflow.distributed.mailbox import Mailbox, check_host
from rdmaflow.distributed.rendezvous import agree_uid, exchange, process_device
from rdmaflow.distributed.work import Work

BACKEND = "rdmaflow"


class UnsupportedOpError(InvalidArgumentError):
    """An op of torch.distributed the rdmaflow process group does not implement."""


def _seconds(timeout) -> float | None:
    if isinstance(timeout, timedelta):
        timeout = timeout.total_seconds()
    return None if timeout is None or timeout <= 0 else float(timeout)


class ProcessGroupRdmaflow(dist.ProcessGroup):
    """One rank's end of a group: a pair to and from every other rank (mailbox.py)."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta | float | None, group_name: str = ""):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self.timeout = _seconds(timeout)
        self._lock = threading.RLock()
        self._pending: dict[tuple[int, int], list[Work]] = {}  # posted receives per (peer, tag), oldest first
        t = self.timeout or 300.0
        self.device = process_device(store, t)
        uid = f"{group_name}.{agree_uid(store)}" if group_name else agree_uid(store)
        self.mailbox = Mailbox(self.device, uid, rank, size, self.timeout)
        self.mailbox.connect(exchange(store, rank, size, self.device.endpoint, t))
        self.closed = False

    # -- identity ----------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND

    def __repr__(self) -> str:
        return f"ProcessGroupRdmaflow(rank={self._rank}, size={self._size})"

    def _deadline(self) -> Deadline:
        if self.closed:
            raise InvalidArgumentError("rdmaflow process group: the group was destroyed")
        return Deadline(self.timeout)

    def _run(self, what: str, tensors, fn, result=None) -> Work:
        """Runs ``fn(deadline)`` now, under the group's lock; its Work, complete, holds ``result``."""
        for i, t in enumerate(tensors):
            check_host(t, f"{what}'s tensor {i}")
        with self._lock:
            fn(self._deadline())
        return Work(result=result)

    # -- point to point ----------------------------------------------------------------------
    def send(self, tensors, dst: int, tag: int = 0) -> Work:
        def go(dl):
            for t in tensors:
                self.mailbox.send(dst, t, tag, dl)
        return self._run("send", tensors, go, list(tensors))

    def recv(self, tensors, src: int, tag: int = 0) -> Work:
        for i, t in enumerate(tensors):
            check_host(t, f"recv's tensor {i}")
        self.mailbox._check_peer(src, "receive from")
        key = (src, tag)
        work: Work

        def run(block: bool, timeout: float | None) -> bool:
            with self._lock:
                queue = self._pending.get(key, [])
                if work not in queue:
                    return True  # completed by a later receive's wait
                dl = self._deadline()
                if timeout is not None and (dl.left() is None or timeout < dl.left()):
                    dl = Deadline(timeout)
                for w in list(queue):
                    if not block and not self.mailbox.ready(src, tag):
                        return False
                    try:
                        for t in w._tensors:
                            self.mailbox.recv(src, tag, t, dl)
                    except Exception as e:
                        queue.remove(w)
                        if w is not work:  # the earlier receive failed: so does it
                            w._error, w._run = e, None
                            w._settle()
                        raise
                    queue.remove(w)
                    if w is not work:
                        w._complete(True)
                    else:
                        return True
                return True

        work = Work(result=list(tensors), run=run, source=src)
        work._tensors = tensors
        with self._lock:
            self._pending.setdefault(key, []).append(work)
        return work

    def recv_anysource(self, tensors, tag: int = 0) -> Work:
        for i, t in enumerate(tensors):
            check_host(t, f"recv's tensor {i}")
        if len(tensors) != 1:
            raise InvalidArgumentError("rdmaflow process group: recv from any source takes one tensor")
        work: Work

        def run(block: bool, timeout: float | None) -> bool:
            with self._lock:
                peers = [p for p in range(self._size) if p != self._rank]
                if not block and not any(self.mailbox.ready(p, tag) for p in peers):
                    return False
                dl = self._deadline()
                if timeout is not None and (dl.left() is None or timeout < dl.left()):
                    dl = Deadline(timeout)
                work._source = self.mailbox.recv_any(tag, tensors[0], dl)
                return True

        work = Work(result=list(tensors), run=run)
        return work

    # -- collectives ---------------------------------------------------------------------------
    def barrier(self, opts=None) -> Work:
        return self._run("barrier", [], lambda dl: coll.barrier(self.mailbox, dl))

    def broadcast(self, tensors, opts=None) -> Work:
        root = opts.rootRank if opts is not None else 0

        def go(dl):
            for t in tensors:
                coll.broadcast(self.mailbox, t, root, dl)
        return self._run("broadcast", tensors, go, list(tensors))

    def allreduce(self, tensors, opts=None) -> Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def go(dl):
            for t in tensors:
                coll.allreduce(self.mailbox, t, op, dl)
        return self._run("allreduce", tensors, go, list(tensors))

    def allreduce_coalesced(self, tensors, opts=None) -> Work:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None) -> Work:
        root = opts.rootRank if opts is not None else 0
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def go(dl):
            for t in tensors:
                coll.reduce(self.mailbox, t, root, op, dl)
        return self._run("reduce", tensors, go, list(tensors))

    def allgather(self, output_lists, inputs, opts=None) -> Work:
        def go(dl):
            for outs, t in zip(output_lists, inputs, strict=True):
                coll.allgather(self.mailbox, outs, t, dl)
        return self._run("allgather", list(inputs) + [o for outs in output_lists for o in outs], go, list(output_lists))

    def allgather_coalesced(self, output_lists, inputs, opts=None) -> Work:
        def go(dl):
            for outs, t in zip(output_lists, inputs, strict=True):
                coll.allgather(self.mailbox, outs, t, dl)
        return self._run("allgather_coalesced", list(inputs), go, list(output_lists))

    def all_gather_single(self, output, input, opts=None) -> Work:
        n = self._size
        if output.numel() != n * input.numel():
            raise InvalidArgumentError(f"rdmaflow process group: all_gather_into_tensor's output has {output.numel()} "
                                       f"elements, not {n} x the input's {input.numel()}")

        def go(dl):
            flat = output.view(-1) if output.is_contiguous() else torch.empty(output.numel(), dtype=output.dtype)
            coll.allgather(self.mailbox, list(flat.split(input.numel())) if input.numel() else
                           [flat[:0]] * n, input.reshape(-1), dl)
            if not output.is_contiguous():
                output.copy_(flat.view(output.shape))
        return self._run("all_gather_into_tensor", [output, input], go, [output])

    _allgather_base = all_gather_single

    def reduce_scatter(self, outputs, input_lists, opts=None) -> Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def go(dl):
            for out, ins in zip(outputs, input_lists, strict=True):
                coll.reduce_scatter(self.mailbox, out, ins, op, dl)
        return self._run("reduce_scatter", list(outputs) + [i for ins in input_lists for i in ins], go, list(outputs))

    def reduce_scatter_single(self, output, input, opts=None) -> Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        n = self._size
        if input.numel() != n * output.numel():
            raise InvalidArgumentError(f"rdmaflow process group: reduce_scatter_tensor's input has {input.numel()} "
                                       f"elements, not {n} x the output's {output.numel()}")

        def go(dl):
            flat = input.reshape(-1)
            chunks = list(flat.split(output.numel())) if output.numel() else [flat[:0]] * n
            coll.reduce_scatter(self.mailbox, output, chunks, op, dl)
        return self._run("reduce_scatter_tensor", [output, input], go, [output])

    _reduce_scatter_base = reduce_scatter_single

    def gather(self, output_lists, inputs, opts=None) -> Work:
        root = opts.rootRank if opts is not None else 0

        def go(dl):
            coll.gather(self.mailbox, output_lists[0] if output_lists else None, inputs[0], root, dl)
        return self._run("gather", list(inputs), go, list(output_lists))

    def scatter(self, outputs, input_lists, opts=None) -> Work:
        root = opts.rootRank if opts is not None else 0

        def go(dl):
            coll.scatter(self.mailbox, outputs[0], input_lists[0] if input_lists else None, root, dl)
        return self._run("scatter", list(outputs), go, list(outputs))

    def alltoall(self, outputs, inputs, opts=None) -> Work:
        return self._run("alltoall", list(outputs) + list(inputs),
                         lambda dl: coll.alltoall(self.mailbox, outputs, inputs, dl), list(outputs))

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None) -> Work:
        n = self._size

        def splits(t, sizes, what):
            if not sizes:
                if t.shape[0] % n if t.dim() else True:
                    raise InvalidArgumentError(f"rdmaflow process group: all_to_all_single's {what} has "
                                               f"{t.shape[0] if t.dim() else 'no'} rows, not divisible by {n} ranks")
                sizes = [t.shape[0] // n] * n
            if len(sizes) != n or sum(sizes) != t.shape[0]:
                raise InvalidArgumentError(f"rdmaflow process group: all_to_all_single's {what} split sizes {sizes} "
                                           f"do not split its {t.shape[0]} rows into {n} parts")
            return list(t.split(list(sizes)))

        def go(dl):
            coll.alltoall(self.mailbox, splits(output, output_split_sizes, "output"),
                          splits(input, input_split_sizes, "input"), dl)
        return self._run("all_to_all_single", [output, input], go, [output])

    alltoall_base = all_to_all_single

    # -- what is not supported -------------------------------------------------------------------
    def _unsupported(name):
        def refuse(self, *args, **kwargs):
            raise UnsupportedOpError(f"rdmaflow process group: {name} is not supported by the rdmaflow backend "
                                     "(docs/distributed.md, 'Not supported')")
        refuse.__name__ = name
        return refuse

    monitored_barrier = _unsupported("monitored_barrier")
    allgather_into_tensor_coalesced = _unsupported("allgather_into_tensor_coalesced")
    all_gather_single_coalesced = _unsupported("all_gather_single_coalesced")
    reduce_scatter_tensor_coalesced = _unsupported("reduce_scatter_tensor_coalesced")
    reduce_scatter_single_coalesced = _unsupported("reduce_scatter_single_coalesced")
    split_group = _unsupported("split_group")
    merge_remote_group = _unsupported("merge_remote_group")
    del _unsupported

    # -- the end -------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Closes the group's pairs (destroy_process_group calls it); the process's device
        stays for the process's other groups."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            try:
                self.mailbox.close()
            except RdmaflowError:
                pass

    def abort(self) -> None:
        self.shutdown()
