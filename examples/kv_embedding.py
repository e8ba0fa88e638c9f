"""A sparse embedding table in the key-value store, ps-lite style, saved at the end and resumed
from its snapshot:

    rdmaflow launch --nproc-per-node 2 --shards-per-node 2 examples/kv_embedding.py [SNAPSHOT]
    rdmaflow launch --nproc-per-node 3 --shards-per-node 1 --resume examples/kv_embedding.py [SNAPSHOT]

Each row of the table is a key. A step pulls the rows its batch uses, computes their gradient
(here: toward a fixed target vector per row), and pushes the update back; the shards add it
(the default handler). The second command starts from the first one's values, with another
number of workers and shards, and its loss starts where the first one's ended. The snapshot
goes to SNAPSHOT, by default ``rdmaflow-kv_embedding.snapshot`` in the temporary directory
(``$TMPDIR``, else /tmp), never into the directory the job starts in.
"""
import os
import sys
import tempfile

import torch

from rdmaflow import ps

ROWS, DIM, STEPS, BATCH, LR = 1000, 16, 100, 64, 0.5
SNAPSHOT = os.path.abspath(sys.argv[1] if len(sys.argv) > 1
                           else os.path.join(tempfile.gettempdir(), "rdmaflow-kv_embedding.snapshot"))

ctx = ps.init()  # shards serve inside init() and exit when the job ends
w = ctx.role.index
resume = os.environ.get("RDMAFLOW_RESUME") == "1"
kv = ps.KVStore(range(ROWS), [(DIM,)] * ROWS, torch.float32, init=SNAPSHOT if resume else None)
target = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(7))  # what each row should learn
g = torch.Generator().manual_seed(100 + w)  # each worker its own batches
for step in range(STEPS):
    ids = torch.randint(0, ROWS, (BATCH,), generator=g).unique()
    rows = kv.wait(kv.pull(ids)).view(-1, DIM)  # batched form: one flat tensor back
    diff = rows - target[ids]
    loss = 0.5 * diff.pow(2).sum(1).mean()
    if step == 0:
        print(f"worker {w}: first loss {loss.item():.4f}", flush=True)
    kv.push(ids, (-LR * diff).reshape(-1))  # the shards add it; returns at once
kv.save(SNAPSHOT)  # every worker calls it; worker 0 writes the file
print(f"worker {w}: last loss {loss.item():.4f}; snapshot {SNAPSHOT}", flush=True)
kv.close()
