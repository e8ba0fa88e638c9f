"""The parameter server's memory layout and flag values, shared by shards and workers.

Shard i's block in its arena::

    weights       its units, concatenated (elements of the model's dtype)
    aggregate     the sum of the workers' gradients (synchronous mode)
    grad slots    one per worker, laid out like ``weights``
    push flags    one u64 per worker, 64 bytes apart: the last step that worker pushed
    reply sources one u64 per worker: the value the shard WRITEs into that worker's reply flag

Worker w's block in its arena::

    params        the flat parameter buffer; every ``param.data`` is a view into it
    grads         the flat gradient buffer; every ``param.grad`` is a view into it
    reply flags   one u64 per shard, 64 bytes apart: the weight version that shard delivered
    push sources  one u64 per shard

Step t of worker w (t = 1, 2, ...)::

    worker w                                       shard s
      WRITE grads of s's units -> grad slot w
      fence
      WRITE t -> push flag w  ──────────────────▶  sees push flag w = t
                                                   (sync: of every worker) aggregates,
                                                   runs the optimizer on its units
                                ◀──────────────────  WRITE weights of its units -> params of w
                                                   fence
                                ◀──────────────────  WRITE t + 1 -> reply flag s of w
      waits until every reply flag >= t + 1

Version 1 is the initial weights. A worker writes DONE into its push flags when it finishes;
a shard that gives up writes ABORT into the reply flags, with the reason in the store.
"""
from __future__ import annotations

FLAG = 64
DONE = 1 << 62
ABORT = (1 << 62) + 1
ALIGN = 256


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class ShardLayout:
    def __init__(self, numel: int, itemsize: int, num_workers: int):
        self.numel, self.itemsize, self.num_workers = numel, itemsize, num_workers
        nbytes = max(numel * itemsize, 1)
        self.weights = 0
        self.aggregate = aligned(nbytes)
        self.gslots = 2 * aligned(nbytes)
        self.gstride = aligned(nbytes)
        self.push = self.gslots + num_workers * self.gstride
        self.reply_src = self.push + FLAG * num_workers
        self.total = self.reply_src + FLAG * num_workers

    def to_dict(self) -> dict:
        return {"numel": self.numel, "itemsize": self.itemsize, "workers": self.num_workers}


class WorkerLayout:
    def __init__(self, numel: int, itemsize: int, num_shards: int):
        self.numel, self.itemsize, self.num_shards = numel, itemsize, num_shards
        nbytes = max(numel * itemsize, 1)
        self.params = 0
        self.grads = aligned(nbytes)
        self.reply = 2 * aligned(nbytes)
        self.push_src = self.reply + FLAG * num_shards
        self.total = self.push_src + FLAG * num_shards

    def to_dict(self) -> dict:
        return {"numel": self.numel, "itemsize": self.itemsize, "shards": self.num_shards}
