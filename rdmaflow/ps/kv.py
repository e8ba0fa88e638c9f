"""A ps-lite-style key-value API over the parameter server, for frameworks other than PyTorch's
``nn.Module`` training loops::

    import rdmaflow.ps as ps

    ctx = ps.init(kv_handler=None)         # shards serve here (default handler: stored += pushed)
    kv = ps.KVStore(keys=[0, 1, 7], shapes=[(4,), (2, 3), ()], dtype=torch.float32)
    h = kv.push([0, 7], [g0, g7])          # returns at once
    outs = kv.wait(kv.pull([0, 1, 7]))     # pulls see this worker's own pushes
    kv.barrier()                           # every worker's pushes before it are seen after it
    kv.close()

Keys are non-negative integers declared once, collectively, with a shape each and one dtype
for the job; key ``k`` lives on shard ``k % num_shards``. A shard applies every push with the
user's handler ``handler(key, stored, pushed)``, which updates ``stored`` in place (or returns
the new value).

The worker's end is kv_client.py, the shard's kv_server.py, the layout of both kv_layout.py.
The data path is one-sided, like the rest of the parameter server (see protocol.py): the
side RPC and the c10d store are used at setup only. Both sides compute the same layout from the
declaration, so only each block's base offset and arena descriptor are exchanged.

Shard s's block (its keys in ascending order, i = 0..n-1; arrays of u64 words are dense,
8 bytes apart, each word written by one peer only)::

    stored       n values, each 256-byte aligned
    push slots   one value per (worker, key): slot[w][i]
    push flags   u64[w][i]: the push sequence number worker w last wrote for key i
    pull flags   u64[w][i]: the pull sequence number worker w last requested for key i
    ack sources  u64[w][i]: values the shard WRITEs into worker w's ack word of key i
    reply sources u64[w][i]
    done         u64[w]: DONE once worker w closed
    barrier      u64[w]: the last barrier worker w entered (used on shard 0)
    barrier sources u64[w], then the abort source: u64 and the reason text

Worker w's block (every key of the job, ascending, j = 0..K-1)::

    staging      one value per key: the push source (unless the tensor lives in the arena)
    out          one value per key: where pulls land
    reply        u64[j]: the last pull sequence number the shard answered
    ack          u64[j]: the last push sequence number the shard applied
    push / pull sources u64[j]
    status       u64[s], then 512 bytes per shard: a shard that gives up WRITEs its reason,
                 fence, ABORT into its status word (the store may be gone with it)
    barrier      u64: the last barrier shard 0 released, then done / barrier sources

Push n of key j (one outstanding push per key and worker; a second waits for the first's ack)::

    worker w                                          shard s = key % S
      wait until ack[j] >= n - 1   (slot free)
      WRITE value -> slot[w][i]
      fence
      WRITE n -> push flag[w][i]  ───────────────▶    sees push flag > applied:
                                                      handler(key, stored[i], slot[w][i])
                                  ◀───────────────    WRITE n -> ack[j] of w

Pull m of key j::

      fence        (orders it behind this worker's earlier pushes)
      WRITE m -> pull flag[w][i]  ───────────────▶    sees pull flag > replied: reads the pull
                                                      flags, then the push flags of key i, and
                                                      applies every push it sees first
                                  ◀───────────────    WRITE stored[i] -> out[j] of w
                                                      fence
                                  ◀───────────────    WRITE m -> reply[j] of w
      waits until reply[j] >= m, copies out[j]

Because a shard reads a key's push flags after the pull request, a pull sees every push to that
key that was visible at the shard before the request was made: the worker's own (the fence puts
its push flag first: read-your-writes), and any other worker's whose ``wait()`` returned before.
A key whose reply WRITE is still reading ``stored`` takes no new push until it completes, so a
pull never sees a half-applied value. ``barrier()`` waits for this worker's pushes to be visible,
then WRITEs its barrier number to shard 0, which WRITEs it back to every worker once all live
workers entered it. ``close()`` WRITEs DONE (after a fence) into every shard's done word; a
shard applies what is left and exits when every worker is done.
"""
from __future__ import annotations

from rdmaflow.ps.kv_client import KVHandle, KVStore
from rdmaflow.ps.kv_job import job_kind
from rdmaflow.ps.kv_layout import KVClientArea, KVLayout, KVServerArea, declaration, describe_difference
from rdmaflow.ps.kv_server import KVShard, sum_handler

__all__ = ["KVClientArea", "KVHandle", "KVLayout", "KVServerArea", "KVShard", "KVStore", "declaration",
           "describe_difference", "job_kind", "sum_handler"]
