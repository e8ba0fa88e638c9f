"""The worker side: parameters and gradients in registered memory, push and pull per step."""
from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

from rdmaflow import _core
from rdmaflow.ps.layout import DTYPES, describe_difference, make_plan, spec_of
from rdmaflow.ps.optim import describe_optimizer
from rdmaflow.ps.protocol import ABORT, DONE, FLAG, ShardLayout, WorkerLayout
from rdmaflow.transfer.common import Word, pack_header, unpack_header

W = _core.Direction.WRITE
POLL = 0.05
MODES = ("sync", "async", "bounded")


class WorkerFailure(_core.RdmaflowError):
    pass


class Worker:
    """Wraps a model and its torch optimizer: ``step()`` pushes gradients and pulls weights."""

    def __init__(self, ctx, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, mode: str = "sync",
                 staleness: int = 0, policy: str = "block", block_bytes: int = 1 << 20,
                 log_every: int = 0, progress: bool | None = None):
        if mode not in MODES:
            raise _core.InvalidArgumentError(f"mode must be one of {MODES}, got {mode!r}")
        if mode == "bounded" and staleness < 0:
            raise _core.InvalidArgumentError(f"staleness must be >= 0, got {staleness}")
        self.ctx = ctx
        self.role = ctx.role
        self.id = ctx.role.index
        self.store = ctx.store
        self.dev = ctx.device
        self.model = model
        self.optimizer = optimizer
        self.mode = mode
        self.log_every = log_every
        self.progress = sys.stderr.isatty() if progress is None else progress
        self.step_count = 0
        self.timings = {"push": 0.0, "pull": 0.0, "compute": 0.0}
        self._last_step_end = None
        self._closed = False
        try:
            self._setup(staleness, policy, block_bytes)
        except Exception as e:
            self.store.abort(f"worker {self.id}: {e}")
            raise

    # -- setup --------------------------------------------------------------------------------
    def _setup(self, staleness: int, policy: str, block_bytes: int) -> None:
        store = self.store
        named = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        spec = spec_of(named)
        store.set(f"ep/worker/{self.id}", self.dev.endpoint)
        if self.id == 0:
            cfg = {"mode": self.mode, "staleness": staleness, "policy": policy, "block_bytes": block_bytes,
                   "optim": describe_optimizer(self.optimizer)}
            store.set("config", json.dumps(cfg))
            store.set("spec", json.dumps(spec))
        job_spec = json.loads(store.get("spec"))
        if spec != job_spec:
            raise WorkerFailure(f"worker {self.id}'s model differs from the job's: {describe_difference(spec, job_spec)}")
        cfg = json.loads(store.get("config"))
        if self.id != 0 and (cfg["mode"] != self.mode or cfg["policy"] != policy):
            raise WorkerFailure(f"worker {self.id} asks for mode={self.mode}, policy={policy}; the job runs "
                                f"mode={cfg['mode']}, policy={cfg['policy']}")
        self.plan = plan = make_plan(spec, self.role.num_shards, cfg["policy"], int(cfg["block_bytes"]))
        self.dtype = DTYPES[plan.dtype]
        isz = self.itemsize = plan.itemsize
        L = self.layout = WorkerLayout(plan.total, isz, self.role.num_shards)
        arena = self.dev.create_arena(L.total + (1 << 20))
        self.block = arena.allocate(L.total)
        self.base = self.block.offset
        self.region = arena.region
        raw = torch.frombuffer(self.block, dtype=torch.uint8, count=L.total)
        raw[L.reply :].zero_()
        self.flat_params = raw[L.params : L.params + plan.total * isz].view(self.dtype)
        self.flat_grads = raw[L.grads : L.grads + plan.total * isz].view(self.dtype)
        self.flat_grads.zero_()
        # The allocation-site decision of seed 000 §3.4, in PyTorch: parameters and gradients
        # live in registered memory, so backward writes straight into the send buffers and
        # new weights land straight in the parameters.
        self._params = []
        with torch.no_grad():
            for (name, p), info in zip(named, plan.params):
                view = self.flat_params[info.offset : info.offset + info.numel].view(info.shape)
                view.copy_(p.data)
                p.data = view
                p.grad = self.flat_grads[info.offset : info.offset + info.numel].view(info.shape)
                self._params.append((p, info))
        self.reply = [Word(raw[L.reply + FLAG * s : L.reply + FLAG * s + 8].view(torch.int64))
                      for s in range(self.role.num_shards)]
        self.push_src = [raw[L.push_src + FLAG * s : L.push_src + FLAG * s + 8].view(torch.int64)
                         for s in range(self.role.num_shards)]
        self.dev.publish("ps/worker", pack_header({"layout": L.to_dict(), "base": self.base}, arena.region.descriptor()))
        store.set(f"ready/worker/{self.id}", "1")
        self.shards = []
        for s in range(self.role.num_shards):
            ep = store.get(f"ep/shard/{s}")
            store.wait([f"ready/shard/{s}"])
            meta, desc = unpack_header(self.dev.lookup(ep, "ps/shard"), "ps/shard")
            sl = ShardLayout(meta["layout"]["numel"], meta["layout"]["itemsize"], meta["layout"]["workers"])
            self.shards.append({"ep": ep, "remote": _core.RemoteRegion.from_descriptor(desc), "base": int(meta["base"]),
                                "layout": sl, "channel": self.dev.channel(ep), "units": plan.units_of(s)})
        self.bytes_per_step = 2 * plan.total * isz
        self._wait_replies(1, "the initial weights")
        self._t0 = time.monotonic()

    # -- data path ----------------------------------------------------------------------------
    def _bind_grads(self) -> None:
        """Gradients a user set to None (zero_grad(set_to_none=True)) or replaced are copied back
        into registered memory and the views restored."""
        with torch.no_grad():
            for p, info in self._params:
                view = self.flat_grads[info.offset : info.offset + info.numel].view(info.shape)
                g = p.grad
                if g is None:
                    view.zero_()
                elif g.data_ptr() != view.data_ptr():
                    view.copy_(g)
                else:
                    continue
                p.grad = view

    def push(self, t: int) -> list:
        futs = []
        isz = self.itemsize
        for s, sh in enumerate(self.shards):
            ch, remote, sl, sbase = sh["channel"], sh["remote"], sh["layout"], sh["base"]
            slot = sbase + sl.gslots + self.id * sl.gstride
            for u in sh["units"]:
                ch.memcpy(self.region, self.base + self.layout.grads + u.offset * isz, remote,
                          slot + u.shard_offset * isz, u.numel * isz, W)
            ch.fence()
            self.push_src[s].fill_(t)
            futs.append(ch.memcpy(self.region, self.base + self.layout.push_src + FLAG * s, remote,
                                  sbase + sl.push + FLAG * self.id, 8, W))
        return futs

    def _wait_replies(self, version: int, what: str) -> None:
        deadline = time.monotonic() + self.ctx.step_timeout
        last_store = time.monotonic()
        for s, word in enumerate(self.reply):
            while not word.wait_at_least(version, POLL):
                sh = self.shards[s]
                if sh["channel"].failed:
                    # A shard that stopped because the job was aborted is not the cause: say what is.
                    reason = self.store.abort_reason()
                    if reason:
                        raise WorkerFailure(f"the job was aborted: {reason}")
                    msg = f"shard {s} at {sh['ep']} died while worker {self.id} waited for {what}"
                    self.store.abort(msg)
                    raise _core.PeerError(msg)
                now = time.monotonic()
                if now - last_store > 1.0:
                    last_store = now
                    reason = self.store.abort_reason()
                    if reason:
                        raise WorkerFailure(f"the job was aborted: {reason}")
                if now > deadline:
                    raise _core.TimeoutError(f"shard {s} did not deliver {what} within {self.ctx.step_timeout:.0f} s")
            if word.get() >= ABORT:
                raise WorkerFailure(f"the job was aborted: {self.store.aborted() or 'by a shard'}")

    def step(self) -> None:
        """Pushes this step's gradients to the shards and waits for the new weights."""
        if self._closed:
            raise _core.InvalidArgumentError("this parameter-server worker is closed")
        t0 = time.monotonic()
        if self._last_step_end is not None:
            self.timings["compute"] += t0 - self._last_step_end
        self._bind_grads()
        t = self.step_count + 1
        futs = self.push(t)
        t1 = time.monotonic()
        self._wait_replies(t + 1, f"the weights of step {t}")
        for f in futs:
            f.result(self.ctx.timeout)
        t2 = time.monotonic()
        self.timings["push"] += t1 - t0
        self.timings["pull"] += t2 - t1
        self.step_count = t
        self._last_step_end = t2
        self._report(t)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # The gradient buffers are the send buffers: zero them in place, never drop them.
        self.flat_grads.zero_()

    def _report(self, t: int) -> None:
        elapsed = max(time.monotonic() - self._t0, 1e-9)
        if self.progress and (t == 1 or t % 10 == 0):
            rate = t / elapsed
            sys.stderr.write(f"\r[rdmaflow ps] worker {self.id} step {t} | {rate:.1f} steps/s | "
                             f"{rate * self.bytes_per_step / 1e9:.2f} GB/s   ")
            sys.stderr.flush()
        if self.log_every and t % self.log_every == 0:
            n = self.log_every
            rec = {"event": "ps_step", "worker": self.id, "step": t,
                   "push_ms": 1e3 * self.timings["push"] / n, "pull_ms": 1e3 * self.timings["pull"] / n,
                   "compute_ms": 1e3 * self.timings["compute"] / n,
                   "steps_per_s": t / elapsed, "bytes_per_s": t * self.bytes_per_step / elapsed}
            # One write per line, so that lines of several workers sharing a pipe never interleave.
            sys.stdout.write(json.dumps(rec) + "\n")
            sys.stdout.flush()
            self.timings = {"push": 0.0, "pull": 0.0, "compute": 0.0}

    def close(self) -> None:
        """Tells the shards this worker is done (its last push is DONE)."""
        if self._closed:
            return
        self._closed = True
        if self.progress:
            sys.stderr.write("\n")
        futs = []
        for s, sh in enumerate(self.shards):
            if sh["channel"].failed:
                continue
            self.push_src[s].fill_(DONE)
            sh["channel"].fence()
            futs.append(sh["channel"].memcpy(self.region, self.base + self.layout.push_src + FLAG * s, sh["remote"],
                                             sh["base"] + sh["layout"].push + FLAG * self.id, 8, W))
        for f in futs:
            f.wait(5.0)
