"""Sparse tables: rows keyed by any int64, never declared, for embedding tables of any size::

    import rdmaflow.ps as ps

    ctx = ps.init()                                   # shards serve here
    table = ps.SparseTable("emb", dim=16, initializer=ps.Normal(0, 0.01), handler=ps.SparseAdagrad(lr=0.1))
    rows = table.wait(table.pull(ids))                # [n, 16]; never-pushed ids read as the initializer's
    table.wait(table.push(ids, grads))                # the shards apply the handler
    table.save("emb.snapshot"); table.close()

Modules: sparse_table.py (the hash table's region, hashes, check words, initializers: no I/O),
sparse_layout.py (request areas and words), sparse_handlers.py (add, SparseAdagrad, users'),
sparse_server.py (SparseShard, the shard's service), sparse_client.py (SparseTable, the worker).
docs/parameter-server.md, "Sparse tables", draws the protocol: who writes what where.

Placement: key k lives on shard ``shard_of(k)`` (a hash), in one of its three buckets there
(bucketized hashing with three choices, 8 slots a bucket). A shard's table is one registered
region per epoch: header, keys array, entries ``[version, key, check, row, state]``.

Push (worker w to shard s, at most ``batch_rows`` rows per request, one in flight per shard)::

    wait ack[s] >= (n-1) << 1;  stage count, op, keys, rows;  WRITE -> push area[w];  fence;
    WRITE n -> push flag[w]                      shard: sums duplicate keys, inserts absent
                                                 keys (initializer's rows; grows the table if a
                                                 key's buckets are full), applies the handler,
                                                 writes each entry: version odd, row + check,
                                                 version even;  WRITE n << 1 | refused -> ack[s]

Pull, one-sided (the region mapped on one host, or READs over UCX): wait until this worker's
pushes to s are acked (read-your-writes); fetch its buckets' keys; find the slot; fetch the
entry (mapped: versions, entries, versions, three ordered loads; READ: the check word);
fetch the header: a region that is no longer LIVE, or of another epoch, means the table moved:
look up the epoch it names and read again. An entry that does not verify goes as a request;
a key in neither bucket reads as the initializer's value, computed here.

Pull by request: stage count, keys; WRITE -> pull area[w]; fence; WRITE m -> pull flag[w];
the shard gathers rows (initializer's for absent keys) into reply src[w], WRITEs them to
landing[s], fence, m -> reply[s].
"""
from __future__ import annotations

from rdmaflow.ps.sparse_client import SparseHandle, SparseTable, TableFullError
from rdmaflow.ps.sparse_handlers import SparseAdagrad, check_user_handlers
from rdmaflow.ps.sparse_server import SparseShard
from rdmaflow.ps.sparse_table import Constant, Initializer, Normal, Uniform, Zeros

__all__ = ["Constant", "Initializer", "Normal", "SparseAdagrad", "SparseHandle", "SparseShard", "SparseTable",
           "TableFullError", "Uniform", "Zeros", "check_user_handlers"]
