"""The parameter server's memory layout and flag values, shared by shards and workers.

Shard i's block in its arena::

    weights       its units, concatenated (elements of the model's dtype)
    aggregate     the mean of the workers' gradients (synchronous mode)
    grad slots    ``slots`` per worker (2 with asynchronous overlap), laid out like ``weights``
    push flags    one u64 per worker, 64 bytes apart: the last step that worker pushed
    pull flags    one u64 per worker: the last step whose weights that worker asked for
                  (asynchronous overlap: adaptive pulling)
    reply sources per worker, one u64 per chunk: the values the shard WRITEs into that
                  worker's reply flag
    step records  per worker and grad slot: a u64 marker, the optimizer's numeric
                  hyperparameters (float64) the worker's push in that slot runs with (if they
                  are no longer the job's), and a byte per parameter, 1 if it has a gradient
                  in that push; written before the push flag, and only when it differs from
                  what that slot last got (an LR scheduler's change, a parameter without a
                  gradient)

Worker w's block in its arena::

    params        ``param_buffers`` flat parameter buffers (2 with asynchronous overlap: buffer
                  switching); every ``param.data`` is a view into the one in use
    grads         two flat gradient buffers, switched by ``zero_grad`` so that zeroing one never
                  waits for the push still reading the other (none on a CUDA worker: its
                  gradient buffers are in its GPU arena, and it pushes them from there)
    reply flags   one u64 per shard, 64 bytes apart: ``progress(version, chunk)``
    push sources  one u64 per shard
    pull sources  one u64 per shard
    record sources two step records, used in turn

Step t of worker w (t = 1, 2, ...), synchronous::

    worker w                                       shard s
      backward: as soon as every gradient of a unit
      of s is accumulated, WRITE it -> grad slot w
      fence
      WRITE t -> push flag w  ──────────────────▶  sees push flag w = t of every live
                                                   worker; for each chunk k = 1..n of its
                                                   units (the model's forward order): the
                                                   mean of the chunk's grad slots, the
                                                   chunk's optimizer step, then
                                ◀──────────────────  WRITE the chunk's weights -> params of w,
                                                   fence, WRITE progress(t + 1, k) -> reply
                                                   flag s
      forward of step t + 1: before a layer runs,
      waits until every reply flag covers the
      chunks holding that layer's weights

Version 1 is the initial weights. ``progress(v, k) = v << CHUNK_BITS | k`` grows with both, so
one word per shard tells a worker how much of which version has landed, and a fence before
each flag WRITE makes every earlier chunk visible first. A worker writes DONE into its push
flags when it finishes; a shard that gives up writes ABORT into the reply flags, with the
reason in the store.

A shard on a GPU (``shard_device="cuda"``) keeps weights, aggregate and grad slots at the same
offsets in its GPU arena (published as ``data`` next to the layout), and its flags and reply
sources in the host block: flags stay in host memory, where the CPU polls them.

Asynchronous mode with overlap (iRDMA §IV-B) gives the shard two grad slots per worker (push t
lands in slot t % 2) and the worker two parameter buffers: step t computes on buffer
(t - 1) % 2, and "pull r" (the shard's weights once it has applied the worker's push r - 1,
version r + 1) lands in buffer r % 2 when the worker's pull flag says r. The worker times that
request to land as its computation ends (adaptive pulling).

"""
from __future__ import annotations

import torch

from rdmaflow import WRITE
from rdmaflow.ps.layout import MAX_CHUNKS

FLAG = 64
DONE = 1 << 62
ABORT = (1 << 62) + 1
# Said after "worker w died": a process that ends normally without close() never writes DONE,
# so its shards cannot tell it from a crash.
LEFT_WITHOUT_CLOSE = "; if its process ended normally, it did not call close() (KVStore or DistributedOptimizer)"
ALIGN = 256
CHUNK_BITS = 16


def progress(version: int, chunk: int) -> int:
    """The reply-flag value once ``chunk`` chunks of weight ``version`` have landed."""
    return (version << CHUNK_BITS) | chunk


def write_runs_then_flag(channel, region, remote, runs: list[tuple[int, int, int]], word_local: int,
                         value: int, word_remote: int, word_region=None, word_remote_region=None) -> list:
    """WRITEs each run (local offset, remote offset, bytes) from ``region`` to ``remote``, then
    ``value`` into the flag word at ``word_remote`` (sourced from ``word_local``): the flag never
    lands before any run, nor before what the channel wrote earlier. The last run travels with
    the flag as one ``write_flagged`` (over tcp one message, docs/transfer.md "Flagged writes").
    Flags stay in host memory: where the data is GPU memory, ``word_region`` (local) and
    ``word_remote_region`` (remote) are the host regions of the word (default: the data's).
    Returns the futures."""
    futs = [channel.memcpy(region, lo, remote, ro, n, WRITE) for lo, ro, n in runs[:-1]]
    if word_region is None and word_remote_region is None:
        lo, ro, n = runs[-1] if runs else (0, 0, 0)
        futs.append(channel.write_flagged(region, lo, remote, ro, n, word_local, value, word_remote))
        return futs
    wl = region if word_region is None else word_region
    wr = remote if word_remote_region is None else word_remote_region
    if runs:
        lo, ro, n = runs[-1]
        futs.append(channel.write_flagged(region, lo, remote, ro, n, word_local, value, word_remote,
                                          word_local_region=wl, word_remote_region=wr))
    else:  # the word alone, behind what the channel wrote earlier
        futs.append(channel.write_flagged(wl, 0, wr, 0, 0, word_local, value, word_remote))
    return futs


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def record_bytes(hyper: int, params: int) -> int:
    """A step record: a u64 marker (the step it was written for; 0: none yet), a u64 that says
    whether hyperparameters follow (1) or the job's hold (0), ``hyper`` float64
    hyperparameters, then one byte per parameter: 1 if it has a gradient in that push."""
    return 8 * (2 + hyper) + (params + 7) // 8 * 8


def write_record(buf, step: int, values: list[float] | None, has: list[bool], hyper: int) -> None:
    """Encodes a step record into ``buf`` (uint8, ``record_bytes`` long); ``values`` None: the
    job's hyperparameters hold."""
    k = 8 * (2 + hyper)
    head = buf[:16].view(torch.int64)
    head[0], head[1] = step, values is not None
    if values is not None:
        buf[16:k].view(torch.float64).copy_(torch.tensor(values, dtype=torch.float64))
    buf[k : k + len(has)].copy_(torch.tensor(has, dtype=torch.uint8))


def read_record(buf, hyper: int, params: int):
    """Decodes a step record: (hyperparameters, or None where the job's hold; a bool tensor of
    which parameters have a gradient), or None where none was written."""
    head = buf[:16].view(torch.int64)
    if not int(head[0]):
        return None
    k = 8 * (2 + hyper)
    return (buf[16:k].view(torch.float64).tolist() if int(head[1]) else None), buf[k : k + params].bool()


class ShardLayout:
    def __init__(self, numel: int, itemsize: int, num_workers: int, slots: int = 1, hyper: int = 0, params: int = 0):
        self.numel, self.itemsize, self.num_workers, self.slots = numel, itemsize, num_workers, slots
        self.hyper_count, self.param_count = hyper, params
        nbytes = max(numel * itemsize, 1)
        self.weights = 0
        self.aggregate = aligned(nbytes)
        self.gslots = 2 * aligned(nbytes)
        self.gstride = aligned(nbytes)
        self.push = self.gslots + num_workers * slots * self.gstride
        self.pull = self.push + FLAG * num_workers
        self.reply_src = self.pull + FLAG * num_workers
        self.records = self.reply_src + self.SRC_STRIDE * num_workers
        self.record_stride = aligned(record_bytes(hyper, params))
        self.total = self.records + num_workers * slots * self.record_stride

    # Per worker, a source word for each chunk flag of a reply (a WRITE may read its source
    # after the next flag's value is set, so they cannot share one).
    SRC_STRIDE = aligned(8 * (MAX_CHUNKS + 1))

    def reply_src_at(self, worker: int, chunk: int) -> int:
        return self.reply_src + worker * self.SRC_STRIDE + 8 * chunk

    def gslot(self, worker: int, step: int) -> int:
        return self.gslots + (worker * self.slots + step % self.slots) * self.gstride

    def record_at(self, worker: int, step: int) -> int:
        """Worker ``worker``'s step record for its push ``step`` (slot as its gradients)."""
        return self.records + (worker * self.slots + step % self.slots) * self.record_stride

    def to_dict(self) -> dict:
        return {"numel": self.numel, "itemsize": self.itemsize, "workers": self.num_workers, "slots": self.slots,
                "hyper": self.hyper_count, "params": self.param_count}

    @classmethod
    def from_dict(cls, d: dict) -> ShardLayout:
        return cls(int(d["numel"]), int(d["itemsize"]), int(d["workers"]), int(d.get("slots", 1)),
                   int(d.get("hyper", 0)), int(d.get("params", 0)))


class WorkerLayout:
    def __init__(self, numel: int, itemsize: int, num_shards: int, param_buffers: int = 1, grad_buffers: int = 2,
                 hyper: int = 0, params: int = 0):
        self.numel, self.itemsize, self.num_shards, self.param_buffers = numel, itemsize, num_shards, param_buffers
        self.hyper_count, self.param_count = hyper, params
        self.grad_buffers = grad_buffers  # 0: the gradients are elsewhere (a CUDA worker's GPU arena)
        nbytes = max(numel * itemsize, 1)
        self.stride = aligned(nbytes)
        self.params = 0
        self.grads = param_buffers * self.stride
        self.reply = self.grads + grad_buffers * self.stride
        self.push_src = self.reply + FLAG * num_shards
        self.pull_src = self.push_src + FLAG * num_shards
        self.record_src = self.pull_src + FLAG * num_shards  # two step records, used in turn
        self.record_stride = aligned(record_bytes(hyper, params))
        self.total = self.record_src + 2 * self.record_stride

    def params_at(self, buffer: int) -> int:
        return self.params + (buffer % self.param_buffers) * self.stride

    def grads_at(self, buffer: int) -> int:
        return self.grads + (buffer % 2) * self.stride

    def to_dict(self) -> dict:
        return {"numel": self.numel, "itemsize": self.itemsize, "shards": self.num_shards,
                "param_buffers": self.param_buffers, "grad_buffers": self.grad_buffers, "hyper": self.hyper_count,
                "params": self.param_count}

    @classmethod
    def from_dict(cls, d: dict) -> WorkerLayout:
        return cls(int(d["numel"]), int(d["itemsize"]), int(d["shards"]), int(d.get("param_buffers", 1)),
                   int(d.get("grad_buffers", 2)), int(d.get("hyper", 0)), int(d.get("params", 0)))
