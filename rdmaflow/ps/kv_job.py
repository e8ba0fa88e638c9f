"""What a key-value job's processes do around a failure: say why through the store, and keep
a store this process serves up until the others have read why."""
from __future__ import annotations

import contextlib
import json
import os
import time

LINGER = 5.0  # seconds a failing shard that serves the store waits for the others to read why


def leave(ctx, who: str) -> None:
    """Tells a failing store host that this process has read why the job failed."""
    with contextlib.suppress(Exception):  # the store may be gone already
        ctx.store.set(f"kv/left/{who}", "1")


def linger(ctx) -> None:
    """A failing process that serves the job's store (rank 0 outside torchrun) keeps it up until
    every other process has read the abort reason from it or was declared dead
    (``Store.declare_dead``), for at most LINGER seconds."""
    if ctx.role.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    me = f"{ctx.role.kind}/{ctx.role.index}"
    others = [f"{k}/{i}" for k, n in (("worker", ctx.role.num_workers), ("shard", ctx.role.num_shards))
              for i in range(n) if f"{k}/{i}" != me]
    deadline = time.monotonic() + LINGER
    with contextlib.suppress(Exception):  # the store may be gone already
        while others and time.monotonic() < deadline:
            others = [o for o in others if not (ctx.store.check(f"kv/left/{o}") or ctx.store.check(f"dead/{o}"))]
            time.sleep(0.05)


def job_kind(ctx) -> str:
    """What worker 0 declared the job to be: "kv" (a KVStore) or "model" (a DistributedOptimizer)."""
    try:
        cfg = json.loads(ctx.store.get("config"))
    except Exception as e:
        ctx.store.abort(f"shard {ctx.role.index}: {e}")
        raise
    return cfg.get("kind", "model")


