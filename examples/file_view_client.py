"""The file view's quick start (docs/file-view.md): a training loop that knows nothing of
rdmaflow, only the files of a mounted model. Run one per mount:

    python examples/file_view_client.py MOUNTPOINT [--steps N]

Linear regression y = x @ weight.T + bias on the model.json of the quick start (weight [3, 6],
bias [3]): each step reads the weights, computes the gradient of a batch of its own, writes
it into ``grad`` and pushes it with ``fsync``; the next read waits for the new weights. It
waits for the mount to appear (``model.json``) and prints the loss as it goes."""
import argparse
import json
import os
import sys
import time
import zlib

import numpy as np

ap = argparse.ArgumentParser()
ap.add_argument("mount")
ap.add_argument("--steps", type=int, default=100)
ap.add_argument("--wait", type=float, default=300.0, help="seconds to wait for the mount to appear")
a = ap.parse_args()

deadline = time.monotonic() + a.wait
while not os.path.exists(os.path.join(a.mount, "model.json")):  # the mount is serving once it exists
    if time.monotonic() > deadline:
        sys.exit(f"{a.mount}/model.json did not appear within {a.wait:.0f} s: is the mount running?")
    time.sleep(0.1)
with open(os.path.join(a.mount, "model.json")) as f:
    meta = json.load(f)
var = {v["name"]: v for v in meta["variables"]}
n_out, n_in = var["weight"]["shape"]
dt = np.dtype(meta["dtype"])
weights = os.open(os.path.join(a.mount, "weights"), os.O_RDONLY)
grad = os.open(os.path.join(a.mount, "grad"), os.O_WRONLY)

rng = np.random.default_rng(zlib.crc32(os.path.abspath(a.mount).encode()))  # each mount its own batches
w_true = np.random.default_rng(7).standard_normal((n_out, n_in))
for step in range(a.steps):
    flat = np.frombuffer(os.pread(weights, meta["total_bytes"], 0), dt).astype(np.float64)
    w = flat[: n_out * n_in].reshape(n_out, n_in)
    b = flat[n_out * n_in :]
    x = rng.standard_normal((32, n_in))
    err = x @ w.T + b - (x @ w_true.T + 0.5)      # the error of this batch
    g = np.concatenate([(2 / err.size * err.T @ x).ravel(), 2 / err.size * err.sum(0)])
    os.pwrite(grad, g.astype(dt).tobytes(), 0)   # adds into this step's gradient, on its way to the shards
    os.fsync(grad)                               # pushes the step; the next pread waits for its weights
    if step % 20 == 0 or step == a.steps - 1:
        print(f"{a.mount}: step {step}: loss {np.mean(err ** 2):.4f}", flush=True)
os.close(grad)
os.close(weights)
