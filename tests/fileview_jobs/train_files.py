"""A training loop that talks to the parameter server only through a mounted file view:
plain os.pread/os.pwrite/os.fsync from a thread pool, no rdmaflow import (tests/test_fileview.py).

Linear regression, y = x @ W.T + b, mean squared error. Each step: read the weights, compute the
gradient of this worker's batch, write it in two halves (each half once, so the writes add
up to the gradient): one half through /grad in pieces cut at odd byte offsets by a thread
pool, the other through the per-variable files; then fsync pushes the step."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

PIECE = 10  # bytes: pieces cut float32 elements, so the mount assembles elements from two writes


def batch(seed: int, worker: int, step: int, n_in: int, n_out: int, size: int = 16):
    rng = np.random.default_rng([seed, worker, step])
    x = rng.standard_normal((size, n_in))
    w_true = np.random.default_rng(seed).standard_normal((n_out, n_in))
    return x, x @ w_true.T + 0.5


def gradient(w: np.ndarray, b: np.ndarray, x: np.ndarray, y: np.ndarray):
    err = x @ w.T + b - y
    scale = 2.0 / err.size
    return scale * err.T @ x, scale * err.sum(0)


def wait_for(path: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > end:
            sys.exit(f"{path} did not appear within {timeout:.0f} s")
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mount", required=True)
    ap.add_argument("--worker", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    wait_for(os.path.join(a.mount, "model.json"), 120)
    with open(os.path.join(a.mount, "model.json")) as f:
        meta = json.load(f)
    var = {v["name"]: v for v in meta["variables"]}
    n_out, n_in = var["weight"]["shape"]
    dt = np.dtype(meta["dtype"])
    weights = os.open(os.path.join(a.mount, "weights"), os.O_RDONLY)
    grad = os.open(os.path.join(a.mount, "grad"), os.O_WRONLY)
    per_var = {n: os.open(os.path.join(a.mount, "vars", f"{n}.grad"), os.O_WRONLY) for n in var}
    pool = ThreadPoolExecutor(8)
    for step in range(a.steps):
        flat = np.frombuffer(os.pread(weights, meta["total_bytes"], 0), dt)
        w = flat[: n_out * n_in].reshape(n_out, n_in).astype(np.float64)
        b = flat[n_out * n_in :].astype(np.float64)
        gw, gb = gradient(w, b, *batch(a.seed, a.worker, step, n_in, n_out))
        half = (np.concatenate([gw.ravel(), gb]) / 2).astype(dt).tobytes()
        # The first half through /grad, in pieces written concurrently at odd byte offsets.
        list(pool.map(lambda at, half=half: os.pwrite(grad, half[at : at + PIECE], at), range(0, len(half), PIECE)))
        # The second half through the per-variable files.
        for n in var:
            lo, hi = var[n]["offset"], var[n]["offset"] + var[n]["nbytes"]
            assert os.pwrite(per_var[n], half[lo:hi], 0) == hi - lo
        os.fsync(grad)
    final = np.frombuffer(os.pread(weights, meta["total_bytes"], 0), dt)
    np.save(a.out, final)
    loaded = sorted(m for m in sys.modules if m == "rdmaflow" or m.startswith("rdmaflow."))
    print(json.dumps({"worker": a.worker, "steps": a.steps, "rdmaflow_modules": loaded}), flush=True)


if __name__ == "__main__":
    main()
