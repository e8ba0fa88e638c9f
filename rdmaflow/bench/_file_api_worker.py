"""A process of the Python-API side of ``rdmaflow bench file``: the same model as the file
view, stepped through ``DistributedOptimizer`` (push and pull, no overlap). Shards serve inside
``ps.init()``; the worker prints one JSON line per step with its time."""
from __future__ import annotations

import argparse
import json
import time

from rdmaflow import ps
from rdmaflow.fileview import load_declaration


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, required=True)
    a = ap.parse_args()
    decl = load_declaration(a.model)
    ps.init()
    model, optimizer = decl.build()
    opt = ps.DistributedOptimizer(model, optimizer, overlap=False, progress=False)
    for _ in range(a.steps):
        t0 = time.perf_counter()
        opt.step()        # push the whole gradient, wait for the new weights
        opt.zero_grad()
        print(json.dumps({"step_s": time.perf_counter() - t0}), flush=True)
    opt.close()


if __name__ == "__main__":
    main()
