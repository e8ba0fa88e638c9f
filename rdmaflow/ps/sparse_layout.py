"""Where a sparse table's requests and words live: the shard's control block (SparseShardArea)
and a worker's block (SparseClientArea), both computed from the table's format, the request
capacity (``batch_rows`` rows per request) and the job's size. The table's rows are elsewhere,
in a region of their own (sparse_table.py). The protocol that uses them is in sparse.py."""
from __future__ import annotations

from rdmaflow.ps.kv_layout import REASON, U64, RequestAreas
from rdmaflow.ps.protocol import aligned
from rdmaflow.ps.sparse_table import CHOICES, SLOTS, TableFormat

HEAD = 2 * U64  # a request's header: count, op
OP_PUSH, OP_ASSIGN = 0, 1  # apply the handler; set rows and state as given (a snapshot's restore)
FULL = 1  # the low bit of an ack: the push was refused whole (the table would pass its bound)
COUNTERS = 4  # words a worker may READ: pull requests served, push requests, epoch, rows


def push_bytes(fmt: TableFormat, rows: int) -> int:
    """A push request of ``rows`` rows: header, keys, then rows and state (state: assign only)."""
    return HEAD + U64 * rows + rows * (fmt.row_bytes + 4 * fmt.state)


class SparseShardArea(RequestAreas):
    """One table's control block on a shard; w numbers the workers."""

    def __init__(self, fmt: TableFormat, batch_rows: int, nw: int):
        self.batch_rows = batch_rows
        self.counters = self._lay_out(0, nw, aligned(push_bytes(fmt, batch_rows)), aligned(HEAD + U64 * batch_rows),
                                      aligned(batch_rows * fmt.row_bytes), extra=U64 * COUNTERS)


class SparseClientArea:
    """One table's block on a worker; s numbers the shards."""

    def __init__(self, shard: SparseShardArea, ns: int, fmt: TableFormat, batch_rows: int):
        per = shard.push_stride + shard.pull_stride + shard.value_stride
        self.push_stage = [s * per for s in range(ns)]
        self.pull_stage = [s * per + shard.push_stride for s in range(ns)]
        self.landing = [s * per + shard.push_stride + shard.pull_stride for s in range(ns)]
        off = ns * per
        # Where one-sided READs of a shard's table land (the READ path): the buckets' keys, then
        # the entries, then the header, of up to batch_rows keys.
        self.read_keys = off
        self.read_entries = off + aligned(batch_rows * CHOICES * SLOTS * 16)  # every choice's bucket of keys
        self.read_header = self.read_entries + aligned(batch_rows * fmt.entry_bytes)
        off = self.read_header + aligned(64)
        words = aligned(U64 * ns)
        self.flags = off
        self.reply, self.ack, self.push_src, self.pull_src, self.status = (off + i * words for i in range(5))
        self.reason = off + 5 * words
        self.barrier = self.reason + aligned(REASON * ns)
        self.done_src = self.barrier + U64
        self.barrier_src = self.barrier + 2 * U64
        self.counters = self.barrier + aligned(3 * U64)  # a shard's counters READ here
        self.total = self.counters + aligned(U64 * COUNTERS * ns)
