"""A ps-lite-style key-value API over the parameter server, for frameworks other than PyTorch's
``nn.Module`` training loops::

    import rdmaflow.ps as ps

    ctx = ps.init(kv_handler=None)         # shards serve here (default handler: stored += pushed)
    kv = ps.KVStore(keys=[0, 1, 7], shapes=[(4,), (2, 3), ()], dtype=torch.float32)
    h = kv.push([0, 7], [g0, g7])          # returns at once
    outs = kv.wait(kv.pull([0, 1, 7]))     # pulls see this worker's own pushes
    kv.push(torch.tensor([0, 7]), flat)    # batched form: keys as a tensor, values concatenated
    kv.barrier()                           # every worker's pushes before it are seen after it
    kv.save("kv.snapshot")                 # collective: worker 0 writes every key's values
    kv.close()
    # a later job, of any size: ps.KVStore(keys, shapes, init="kv.snapshot")

Keys are non-negative integers declared once, collectively, with a shape each and one dtype
for the job; key ``k`` lives on shard ``k % num_shards``. A shard applies a push request as one
unit: the default handler as one vectorised ``index_add_`` over the request, a user's
``handler(key, stored, pushed)`` once per key (a Python call per key), or a user's
``batch_handler(keys, stored, pushed)`` once per request (ps.init's ``kv_batch_handler``).

Modules: kv_layout.py (the declaration; KVLayout, KVServerArea, KVClientArea: where everything
is), kv_request.py (a push or pull checked and cut by shard), kv_client.py (KVStore, the
worker), kv_server.py (KVShard),
kv_snapshot.py (the file ``save()`` writes and ``init=`` reads), kv_replica.py (replicated key
ranges and their failover).

The data path is one-sided, like the rest of the parameter server (see protocol.py): the
side RPC and the c10d store are used at setup only, and by ``save()``, whose worker 0 tells the
others through the store whether it wrote the file (kv_snapshot.py). Both sides compute the same layout from the
declaration, so only each block's base offset and arena descriptor are exchanged. A request is
"batched": all the keys of one push (or pull) that live on one shard travel as one request with
one flag, whatever their number.

Shard s's block (n keys, E elements; i numbers its keys ascending; w the workers; every u64
word is written by one peer only)::

    stored         E values, packed in key order (key i at element offset[i])
    push area[w]   count | local key indices i[count] | their values, packed in request order
    pull area[w]   count | local key indices i[count]
    reply src[w]   a pull's values gathered in request order (what the reply WRITE reads)
    push flag      u64[w]: the last push request worker w wrote
    pull flag      u64[w]: the last pull request worker w wrote
    ack / reply flag sources u64[w]; done u64[w]; barrier u64[w] (shard 0); barrier sources
    abort source   u64, then the reason text

Worker w's block (per shard s: a push staging area and a pull staging area laid out like the
shard's push and pull areas, and a landing area for its replies)::

    push stage[s] | pull stage[s] | landing[s]      for s = 0..S-1
    reply u64[s]   the last pull request shard s answered
    ack u64[s]     the last push request shard s applied
    push / pull sources u64[s]
    status u64[s], then 512 bytes per shard: a shard that gives up WRITEs its reason, fence,
                   ABORT into its status word (the store may be gone with it)
    barrier u64: the last barrier shard 0 released, then done / barrier sources, then where a
                 barrier that timed out READs shard 0's done and barrier words

Push number n from worker w to shard s (one push request in flight per worker and shard: the
next one waits for this one's ack before it touches the staging or the shard's area)::

      worker w                                             shard s
      wait until ack[s] >= n - 1
      stage count, indices, values (one copy)
      WRITE stage -> push area[w]   (arena tensors: one WRITE each, after the staged part)
      fence
      WRITE n -> push flag[w]  ──────────────────────▶    sees push flag[w] > applied[w]:
                                                          applies the whole request (one
                                                          index_add_, or the user's handler)
                               ◀──────────────────────    WRITE n -> ack[s] of w

Pull number m from worker w to shard s (one in flight per worker and shard: the next waits
until this one's reply was copied out of landing[s])::

      stage count, indices
      WRITE stage -> pull area[w]
      fence        (orders the flag behind the request and this worker's earlier push flags)
      WRITE m -> pull flag[w]  ──────────────────────▶    reads every pull flag, then every push
                                                          flag; applies the pushes it sees first;
                                                          gathers stored[request] -> reply src[w]
                               ◀──────────────────────    WRITE reply src[w] -> landing[s] of w
                                                          fence
                               ◀──────────────────────    WRITE m -> reply[s] of w
      waits until reply[s] >= m, copies landing[s] out

Guarantees. A shard is one thread that applies each push request whole before it looks at
anything else, and a reply is gathered into reply src (not read from stored by the WRITE), so a
pull never sees half of a request, and a later push never changes a reply in flight. Because
the shard reads the push flags after the pull flags, a pull sees every push whose flag was
visible before the pull's: the worker's own (its fence puts the push flag first:
read-your-writes) and any other worker's whose ``wait()`` returned before. One push request in
flight per worker and shard applies a worker's pushes in order. ``barrier()`` waits until this
worker's push flags were delivered, then WRITEs its barrier number to shard 0, which WRITEs it
back to every worker once all live workers entered it; one that times out READs shard 0's done
and barrier words to name the live workers that had not entered it. ``close()`` WRITEs DONE (after a fence)
into every shard's done word; a shard applies what is left and exits when every worker is done.

Replicas (``KVStore(..., replicas=R)``, kv_replica.py): shard process c holds the block of its own
key range and a mirror block of each of the R-1 ranges before it. The primary of a range
acknowledges a push, and answers a pull, only once it has WRITTEN the round's record and new
values into every live backup's mirror and the WRITEs completed; a worker's ``wait(push)``,
``barrier()`` and ``close()`` then wait for the acknowledgement. When a primary's channel fails,
the workers elect its successor in the job's store, ring it, and send it again their
unacknowledged push and pending pull of that range; it skips request numbers its copy applied.
With R = 1 none of this exists: the layout and the data path are the ones above.
"""
from __future__ import annotations

from rdmaflow.ps.kv_client import KVHandle, KVStore
from rdmaflow.ps.kv_layout import KVClientArea, KVLayout, KVServerArea, declaration, describe_difference
from rdmaflow.ps.kv_request import Request
from rdmaflow.ps.kv_server import KVShard, sum_handler

__all__ = ["KVClientArea", "KVHandle", "KVLayout", "KVServerArea", "KVShard", "KVStore", "Request", "declaration",
           "describe_difference", "sum_handler"]
