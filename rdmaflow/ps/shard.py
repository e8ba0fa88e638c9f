"""A parameter-server shard: holds its units' weights and optimizer state, aggregates the
workers' gradients and runs the optimizer itself, then returns weights one-sidedly."""
from __future__ import annotations

import json
import time

import torch

from rdmaflow import _core
from rdmaflow.ps.layout import DTYPES, make_plan
from rdmaflow.ps.optim import build_optimizer
from rdmaflow.ps.protocol import ABORT, DONE, FLAG, ShardLayout, WorkerLayout
from rdmaflow.transfer.common import Word, pack_header, unpack_header

W = _core.Direction.WRITE
R = _core.Direction.READ
POLL = 0.05


class ShardFailure(_core.RdmaflowError):
    pass


class Shard:
    def __init__(self, ctx):
        self.ctx = ctx
        self.role = ctx.role
        self.id = ctx.role.index
        self.store = ctx.store
        self.dev = ctx.device
        self.stats = {"steps": 0, "max_gap": 0, "applied": [], "replies": 0}

    # -- setup --------------------------------------------------------------------------------
    def setup(self) -> None:
        store, role = self.store, self.role
        store.set(f"ep/shard/{self.id}", self.dev.endpoint)
        self.config = json.loads(store.get("config"))
        spec = json.loads(store.get("spec"))
        self.mode = self.config["mode"]
        self.staleness = int(self.config.get("staleness", 0))
        self.plan = make_plan(spec, role.num_shards, self.config["policy"], int(self.config["block_bytes"]))
        self.units = self.plan.units_of(self.id)
        self.dtype = DTYPES[self.plan.dtype]
        self.itemsize = self.plan.itemsize
        n = self.plan.shard_numel(self.id)
        self.numel = n
        self.nw = role.num_workers
        self.layout = L = ShardLayout(n, self.itemsize, self.nw)
        arena = self.dev.create_arena(L.total + (1 << 20))
        self.block = arena.allocate(L.total)
        self.base = self.block.offset
        raw = torch.frombuffer(self.block, dtype=torch.uint8, count=L.total)
        raw[L.push :].zero_()
        self.raw = raw

        def view(off: int) -> torch.Tensor:
            return raw[off : off + n * self.itemsize].view(self.dtype) if n else torch.empty(0, dtype=self.dtype)

        self.weights = view(L.weights)
        self.aggregate = view(L.aggregate)
        self.gslots = [view(L.gslots + w * L.gstride) for w in range(self.nw)]
        self.push = [Word(raw[L.push + FLAG * w : L.push + FLAG * w + 8].view(torch.int64)) for w in range(self.nw)]
        self.reply_src = [raw[L.reply_src + FLAG * w : L.reply_src + FLAG * w + 8].view(torch.int64) for w in range(self.nw)]
        self.dev.publish("ps/shard", pack_header({"layout": L.to_dict(), "base": self.base},
                                                 arena.region.descriptor()))
        store.set(f"ready/shard/{self.id}", "1")

        # The workers: their endpoints, layouts and channels.
        self.workers = []
        for w in range(self.nw):
            ep = store.get(f"ep/worker/{w}")
            store.wait([f"ready/worker/{w}"])
            meta, desc = unpack_header(self.dev.lookup(ep, "ps/worker"), "ps/worker")
            wl = WorkerLayout(**{"numel": meta["layout"]["numel"], "itemsize": meta["layout"]["itemsize"],
                                 "num_shards": meta["layout"]["shards"]})
            self.workers.append({"ep": ep, "remote": _core.RemoteRegion.from_descriptor(desc),
                                 "base": int(meta["base"]), "layout": wl, "channel": self.dev.channel(ep)})
        # Initial weights: worker 0's parameters (or a checkpoint's).
        w0 = self.workers[0]
        futs = [w0["channel"].memcpy(arena.region, self.base + L.weights + u.shard_offset * self.itemsize,
                                     w0["remote"], w0["base"] + w0["layout"].params + u.offset * self.itemsize,
                                     u.numel * self.itemsize, R) for u in self.units]
        _core_wait(futs, self.ctx.timeout)
        self.region = arena.region
        self.params = [self.weights[u.shard_offset : u.shard_offset + u.numel] for u in self.units]
        self.optimizer = build_optimizer(self.config["optim"], self.params)
        self.applied = [0] * self.nw
        self.done = [False] * self.nw
        self._reply_futs: list = [[] for _ in range(self.nw)]
        for w in range(self.nw):
            self.reply(w, 1)

    # -- data path ----------------------------------------------------------------------------
    def reply(self, w: int, version: int) -> None:
        """WRITEs this shard's weights into worker w's parameters, fence, then the version."""
        info = self.workers[w]
        ch, remote, wl = info["channel"], info["remote"], info["layout"]
        for f in self._reply_futs[w]:
            f.result(self.ctx.timeout)  # the previous reply's source reads are over
        futs = []
        for u in self.units:
            futs.append(ch.memcpy(self.region, self.base + self.layout.weights + u.shard_offset * self.itemsize,
                                  remote, info["base"] + wl.params + u.offset * self.itemsize,
                                  u.numel * self.itemsize, W))
        ch.fence()
        self.reply_src[w].fill_(version)
        futs.append(ch.memcpy(self.region, self.base + self.layout.reply_src + FLAG * w,
                              remote, info["base"] + wl.reply + FLAG * self.id, 8, W))
        self._reply_futs[w] = futs
        self.stats["replies"] += 1

    def _check_worker(self, w: int) -> None:
        ch = self.workers[w]["channel"]
        if ch.failed:
            # A worker that stopped because the job was aborted is not the cause: say what is.
            reason = self.store.abort_reason()
            if reason:
                raise ShardFailure(f"the job was aborted: {reason}")
            raise ShardFailure(f"worker {w} at {self.workers[w]['ep']} died (shard {self.id} lost its connection)")

    def _wait_push(self, w: int, t: int) -> int:
        deadline = time.monotonic() + self.ctx.step_timeout
        last_store_check = time.monotonic()
        while True:
            if self.push[w].wait_at_least(t, POLL):
                return self.push[w].get()
            self._check_worker(w)
            now = time.monotonic()
            if now - last_store_check > 1.0:
                last_store_check = now
                reason = self.store.abort_reason()
                if reason:
                    raise ShardFailure(f"the job was aborted: {reason}")
            if now > deadline:
                raise ShardFailure(f"worker {w} pushed nothing for step {t} within {self.ctx.step_timeout:.0f} s")

    def apply(self, grads: torch.Tensor, scale: float) -> None:
        for p, u in zip(self.params, self.units):
            g = grads[u.shard_offset : u.shard_offset + u.numel]
            p.grad = g if scale == 1.0 else g * scale
        self.optimizer.step()
        self.stats["steps"] += 1

    def run_sync(self) -> None:
        t = 0
        while True:
            t += 1
            flags = [self._wait_push(w, t) for w in range(self.nw)]
            if all(f >= DONE for f in flags):
                return
            if any(f >= DONE for f in flags):
                raise ShardFailure("workers disagree on the number of steps: some finished, some pushed step "
                                   f"{t} (synchronous mode needs the same number of steps on every worker)")
            # The mean of the workers' gradients: what one process would get on the concatenated batch.
            self.aggregate.copy_(self.gslots[0])
            for g in self.gslots[1:]:
                self.aggregate.add_(g)
            if self.nw > 1:
                self.aggregate.mul_(1.0 / self.nw)
            self.apply(self.aggregate, 1.0)
            for w in range(self.nw):
                self.applied[w] = t
                self.reply(w, t + 1)

    def run_async(self) -> None:
        """Applies each worker's gradient on arrival. With staleness s >= 0 (bounded staleness),
        a worker gets its new weights only while it is at most s steps ahead of the slowest."""
        bounded = self.mode == "bounded"
        waiting: set[int] = set()
        idle_since = time.monotonic()
        last_check = time.monotonic()
        while not all(self.done):
            progressed = False
            for w in range(self.nw):
                if self.done[w]:
                    continue
                f = self.push[w].get()
                if f >= DONE:
                    self.done[w] = True
                    waiting.discard(w)
                    progressed = True
                elif f > self.applied[w]:
                    self.apply(self.gslots[w], 1.0)
                    self.applied[w] = f
                    waiting.add(w)
                    progressed = True
            live = [self.applied[v] for v in range(self.nw) if not self.done[v]]
            slowest = min(live) if live else 0
            for w in sorted(waiting):
                gap = self.applied[w] - slowest
                if not bounded or gap <= self.staleness:
                    self.stats["max_gap"] = max(self.stats["max_gap"], gap)
                    self.reply(w, self.applied[w] + 1)
                    waiting.discard(w)
                    progressed = True
            now = time.monotonic()
            if progressed:
                idle_since = now
                continue
            if now - last_check > POLL:
                last_check = now
                for w in range(self.nw):
                    if not self.done[w]:
                        self._check_worker(w)
                if now - idle_since > self.ctx.step_timeout:
                    raise ShardFailure(f"no worker pushed anything within {self.ctx.step_timeout:.0f} s")
            time.sleep(0.0002)

    def run(self) -> dict:
        try:
            self.setup()
            if self.mode == "sync":
                self.run_sync()
            else:
                self.run_async()
            for w in range(self.nw):
                for f in self._reply_futs[w]:
                    f.wait(5.0)
            self.stats["applied"] = list(self.applied)
            self.store.set(f"stats/shard/{self.id}", json.dumps(self.stats))
            return self.stats
        except Exception as e:
            reason = f"shard {self.id}: {e}"
            self.store.abort(reason)
            self._abort_workers()
            if isinstance(e, _core.RdmaflowError):
                raise
            raise ShardFailure(reason) from e

    def _abort_workers(self) -> None:
        for w, info in enumerate(getattr(self, "workers", [])):
            if info["channel"].failed:
                continue
            try:
                self.reply_src[w].fill_(ABORT)
                info["channel"].memcpy(self.region, self.base + self.layout.reply_src + FLAG * w, info["remote"],
                                       info["base"] + info["layout"].reply + FLAG * self.id, 8, W).wait(1.0)
            except Exception:  # noqa: BLE001 - best effort while failing
                pass


def _core_wait(futs, timeout: float) -> None:
    for f in futs:
        f.result(timeout)
