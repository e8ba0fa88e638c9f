"""A parameter-server shard: holds its units' weights and optimizer state, aggregates the
workers' gradients and runs the optimizer itself, then returns weights one-sidedly.

A shard runs on the CPU, or with ``shard_device="cuda"`` on a GPU: then its weights, aggregate,
gradient slots and optimizer state are GPU memory (its GPU arena), workers WRITE gradients
straight into it, and it WRITEs weights from it; its flags stay in host memory."""
from __future__ import annotations

import contextlib
import json
import os
import sys
import time

import torch

from rdmaflow import READ, WRITE, Arena, PeerError, RdmaflowError, RemoteRegion, wait_all
from rdmaflow.deadline import Deadline
from rdmaflow.job import env_int
from rdmaflow.ps import checkpoint
from rdmaflow.ps.context import profile_stream
from rdmaflow.ps.dense_replica import Backups, Mirror, MirrorLayout, primaries_of, source_bytes
from rdmaflow.ps.layout import MIN_CHUNK_BYTES, PLACEMENT_VERSION, make_plan, runs_of, spec_digest
from rdmaflow.ps.optim import hyper_fields
from rdmaflow.ps.protocol import (
    ABORT,
    DONE,
    FLAG,
    LEFT_WITHOUT_CLOSE,
    ShardLayout,
    WorkerLayout,
    progress,
    read_record,
    record_bytes,
    write_runs_then_flag,
)
from rdmaflow.ps.services import stop_others, stopping
from rdmaflow.ps.unit_optim import UnitOptimizers
from rdmaflow.transfer import FLOAT_DTYPES, Word, pack_header, unpack_header, wait_flag
from rdmaflow.transfer.common import stream_done

POLL = 0.05


class ShardFailure(RdmaflowError):
    pass


class Shard(UnitOptimizers):
    def __init__(self, ctx):
        self.ctx = ctx
        self.role = ctx.role
        self.id = ctx.role.index
        self.store = ctx.store
        self.dev = ctx.device
        self.stats = {"steps": 0, "max_gap": 0, "applied": [], "replies": 0, "reply_writes": 0}
        self.dead: set[int] = set()
        self.replicas, self.mirrors, self.backups = 1, [], None  # dense_replica.py, when R > 1

    # -- setup --------------------------------------------------------------------------------
    def setup(self) -> None:
        store, role = self.store, self.role
        torch.set_num_threads(shard_threads())
        store.set(f"ep/shard/{self.id}", self.dev.endpoint)
        self.config = json.loads(store.get("config", getattr(self.ctx, "declare_timeout", None)))
        self.spec = spec = json.loads(store.get("spec"))
        self.mode = self.config["mode"]
        self.staleness = int(self.config.get("staleness", 0))
        self.switching = bool(self.config.get("overlap")) and self.mode != "sync"
        self.min_workers = int(self.config.get("min_workers") or role.num_workers)
        self.ckpt_dir = self.config.get("checkpoint_dir")
        self.ckpt_every = int(self.config.get("checkpoint_every") or 0)
        if self.ckpt_every and self.mode != "sync":
            raise ShardFailure("checkpoints need mode='sync' (an asynchronous job has no common step to save)")
        if self.ckpt_dir and self.mode == "sync" and (reason := checkpoint.unwritable(self.ckpt_dir)):
            raise ShardFailure(f"checkpoint_dir {self.ckpt_dir} cannot be written here ({reason})")
        if self.ckpt_dir and self.mode != "sync" and self.id == 0:  # often set for every job (the variable)
            print(f"rdmaflow ps: checkpoint_dir {self.ckpt_dir} is set, but checkpoints are taken in mode='sync' "
                  f"only: this {self.mode} job writes none", file=sys.stderr, flush=True)
        self.plan = make_plan(spec, role.num_shards, self.config["policy"], int(self.config["block_bytes"]))
        self.units = self.plan.units_of(self.id)
        self.dtype = FLOAT_DTYPES[self.plan.dtype]
        self.itemsize = self.plan.itemsize
        n = self.plan.shard_numel(self.id)
        self.numel = n
        self.nw = role.num_workers
        self.hyper_fields = hyper_fields(self.config["optim"])
        self.layout = L = ShardLayout(n, self.itemsize, self.nw, 2 if self.switching else 1, len(self.hyper_fields),
                                      len(self.plan.params))
        # Replicas (dense_replica.py): this shard's backups, and its mirrors of the units of the
        # R - 1 shards before it, in the same arena (one per device).
        self.replicas = int(self.config.get("replicas") or 1)
        primaries = primaries_of(self.id, role.num_shards, self.replicas)
        extra_bytes = 0
        if self.replicas > 1:
            if self.mode != "sync" or self.config.get("shard_device", "cpu") == "cuda":
                raise ShardFailure("replicated shards of a DistributedOptimizer are built for mode='sync' on CPU "
                                   "shards only")
            extra_bytes = sum(MirrorLayout(self.plan.shard_numel(p), self.itemsize, L.hyper_count,
                                           L.param_count).total + 4096 for p in primaries)
            extra_bytes += source_bytes(L.hyper_count, L.param_count, self.replicas - 1) + 4096
        # A region of this service's own, not the device's one arena: a job's other services
        # (services.py) and a KVStore's arena tensors size theirs independently.
        arena = self.arena = Arena(self.dev.alloc_region(L.total + extra_bytes + (1 << 20)))
        self.block = arena.allocate(L.total)
        self.mirrors = [Mirror(self, p, arena) for p in primaries]
        self.backups = Backups(self, arena, self.replicas) if self.replicas > 1 else None
        self.base = self.block.offset
        raw = torch.frombuffer(self.block, dtype=torch.uint8, count=L.total)
        raw[L.push :].zero_()
        self.raw = raw
        # Weights, aggregate and grad slots: in the host block, or on a GPU shard at the same
        # offsets in a block of its GPU arena (the host block's part before L.push is then unused).
        self.on_gpu = self.config.get("shard_device", "cpu") == "cuda"
        data, self.data_region, self.data_base = raw, arena.region, self.base
        extra = {"mirrors": {str(m.p): m.block.offset for m in self.mirrors}} if self.mirrors else {}
        if self.on_gpu:
            gpu = self.dev.create_arena(L.push + (1 << 20), device="cuda")
            self.gpu_block = gpu.allocate(L.push)
            data = torch.as_tensor(self.gpu_block, device=gpu.cuda_device)
            self.data_region, self.data_base = gpu.region, self.gpu_block.offset
            extra["data"] = {"base": self.data_base, "descriptor": gpu.region.descriptor().hex()}

        def view(off: int) -> torch.Tensor:
            if not n:
                return torch.empty(0, dtype=self.dtype, device=data.device)
            return data[off : off + n * self.itemsize].view(self.dtype)

        self.weights = view(L.weights)
        self.aggregate = view(L.aggregate)
        self.gslots = [[view(L.gslot(w, k)) for k in range(L.slots)] for w in range(self.nw)]
        self.push = [Word.at(raw, L.push + FLAG * w) for w in range(self.nw)]
        self.pull = [Word.at(raw, L.pull + FLAG * w) for w in range(self.nw)]
        self.reply_src = [raw[L.reply_src_at(w, 0) : L.reply_src_at(w + 1, 0)].view(torch.int64)
                          for w in range(self.nw)]
        # Per worker and slot: its step record (marker, hyperparameters, which have a gradient).
        nrec = record_bytes(L.hyper_count, L.param_count)
        self.records = [[raw[L.record_at(w, k) : L.record_at(w, k) + nrec] for k in range(L.slots)]
                      for w in range(self.nw)]
        # Where this job starts: step 0, or the latest complete checkpoint when resuming.
        if self.id == 0:
            start = 0
            if checkpoint.resuming():
                if not self.ckpt_dir:
                    raise ShardFailure("--resume needs a checkpoint directory "
                                       "(DistributedOptimizer(checkpoint_dir=...))")
                found = checkpoint.latest(self.ckpt_dir, role.num_shards)
                if found is None:
                    print(f"rdmaflow ps: no complete checkpoint in {self.ckpt_dir}; starting at step 0",
                          file=sys.stderr, flush=True)
                else:
                    start = found
            store.set("start_step", str(start))
        self.start = int(store.get("start_step"))
        self.dev.publish("ps/shard", pack_header({"layout": L.to_dict(), "base": self.base, **extra},
                                                 arena.region.descriptor()))
        store.set(f"ready/shard/{self.id}", "1")

        # The workers: their endpoints, layouts and channels.
        self.workers = []
        for w in range(self.nw):
            ep = store.get(f"ep/worker/{w}")
            store.wait([f"ready/worker/{w}"])
            meta, desc = unpack_header(self.dev.lookup(ep, "ps/worker"), "ps/worker")
            self.workers.append({"ep": ep, "remote": RemoteRegion.from_descriptor(desc),
                                 "base": int(meta["base"]), "layout": WorkerLayout.from_dict(meta["layout"]),
                                 "channel": self.dev.channel(ep)})
        self.region = arena.region
        self.build_optimizers(self.id, int(self.config.get("chunk_bytes") or MIN_CHUNK_BYTES), self.config["optim"])
        if self.start:
            state = checkpoint.load(self.ckpt_dir, self.start, self.id, role.num_shards, self.fingerprint())
            with torch.no_grad():
                self.weights.copy_(state["weights"])
            self.load_optimizers(state["optimizer"], self.start, ShardFailure)
        else:
            # Initial weights: worker 0's parameters.
            w0 = self.workers[0]
            isz, src = self.itemsize, w0["base"] + w0["layout"].params_at(0)
            futs = [w0["channel"].memcpy(self.data_region, self.data_base + L.weights + u.shard_offset * isz,
                                         w0["remote"], src + u.offset * isz, u.numel * isz, READ)
                    for u in runs_of(self.units)]
            wait_all(futs, self.ctx.timeout)
        self.start_hyper(self.config["optim"])
        for m in self.mirrors:
            m.start(self.start, int(self.config.get("chunk_bytes") or MIN_CHUNK_BYTES))
        if self.backups is not None:
            self.backups.connect(unpack_header)
        self.applied = [self.start] * self.nw
        self.answered = [self.start] * self.nw
        self.done = [False] * self.nw
        self.saved = self.start
        self._reply_futs: list = [[] for _ in range(self.nw)]
        for w in range(self.nw):
            self._to_worker(w, self.reply, w, self.start + 1)

    def fingerprint(self) -> dict:
        return {"spec": spec_digest(self.spec), "policy": self.config["policy"],
                "block_bytes": int(self.config["block_bytes"]), "num_shards": self.role.num_shards,
                "optimizer": self.config["optim"]["name"], "placement": PLACEMENT_VERSION}

    def save(self, step: int) -> None:
        if not self.ckpt_dir or step <= self.saved:
            return
        checkpoint.save(self.ckpt_dir, step, self.id, self.role.num_shards, self.fingerprint(),
                        self.weights, [opt.state_dict() for _, opt in self.optimizers])
        self.saved = step

    # -- data path ----------------------------------------------------------------------------
    def reply(self, w: int, version: int) -> None:
        """WRITEs this shard's weights into worker w's parameters chunk by chunk, in forward
        order, each chunk followed by a fence and its progress flag. Asynchronous overlap
        alternates the worker's two parameter buffers (version v lands in buffer (v - 1) % 2)."""
        self._reply_begin(w)
        for k in range(1, len(self.chunks) + 1):
            self._reply_chunk(w, version, k)
        if not self.chunks:
            self._reply_chunk(w, version, 0)
        self.stats["replies"] += 1

    def _reply_begin(self, w: int) -> None:
        for f in self._reply_futs[w]:
            f.result(self.ctx.timeout)  # the previous reply's source reads are over
        self._reply_futs[w] = []

    def _reply_chunk(self, w: int, version: int, k: int) -> None:
        info = self.workers[w]
        ch, remote, wl = info["channel"], info["remote"], info["layout"]
        dst = info["base"] + wl.params_at(version - 1)
        isz = self.itemsize
        runs = self.chunk_runs[k - 1] if k else []
        self.stats["reply_writes"] += len(runs)
        if self.on_gpu:
            stream_done(self.weights)  # the optimizer's kernels are queued, maybe not done
        # The chunk's runs, then its reply flag; the last run travels with the flag.
        self._reply_futs[w].extend(write_runs_then_flag(
            ch, self.data_region, remote,
            [(self.data_base + self.layout.weights + u.shard_offset * isz, dst + u.offset * isz, u.numel * isz)
             for u in runs],
            self.base + self.layout.reply_src_at(w, k), progress(version, k),
            info["base"] + wl.reply + FLAG * self.id, self.region if self.on_gpu else None))

    def _worker_died(self, w: int) -> bool:
        """Whether worker w is gone. Survivors go on (iRDMA §IV-D) while at least min_workers
        remain; below that the job fails, naming the worker."""
        if w in self.dead:
            return True
        if not self.workers[w]["channel"].failed:
            return False
        if self.push[w].get() >= DONE:
            return False  # it finished and closed its device: not a failure
        # A worker that stopped because the job was aborted is not the cause: say what is.
        reason = self.store.abort_reason()
        if reason:
            raise ShardFailure(f"the job was aborted: {reason}")
        msg = (f"worker {w} at {self.workers[w]['ep']} died (shard {self.id} lost its connection)"
               f"{LEFT_WITHOUT_CLOSE}")
        self.dead.add(w)
        live = self.nw - len(self.dead)
        if live < self.min_workers:
            raise ShardFailure(f"{msg}; {live} of {self.nw} workers remain, fewer than min_workers={self.min_workers}")
        print(f"rdmaflow ps: {msg}; going on with the {live} remaining workers", file=sys.stderr, flush=True)
        self.store.declare_dead("worker", w)
        self.stats.setdefault("dead", []).append(w)
        return True

    def _to_worker(self, w: int, send, *args) -> bool:
        """Runs one part of a reply to worker w; False once w is dead. A worker can die between
        its push and the reply to it (the WRITE then raises PeerError on its failed channel):
        that worker is dropped like one found dead while waiting, so the survivors go on."""
        if w in self.dead:
            return False
        try:
            send(*args)
            return True
        except PeerError:
            if self._worker_died(w):
                return False
            raise

    def _wait_push(self, w: int, t: int) -> int | None:
        """The push flag of worker w once it reaches t; None if the worker died."""
        def too_late():
            raise ShardFailure(f"worker {w} pushed nothing for step {t} within {self.ctx.step_timeout:.0f} s")

        if wait_flag(self.push[w], t, Deadline(self.ctx.step_timeout), f"the push of worker {w} for step {t}",
                     give_up=lambda: self._stop_if_another_failed() or self._worker_died(w),
                     abort_reason=self.store.abort_reason,
                     aborted=ShardFailure, on_timeout=too_late, poll=POLL):
            return self.push[w].get()
        return None

    def record(self, w: int, t: int) -> tuple[list[float], torch.Tensor] | None:
        """Worker w's step record for its push t: (hyperparameters, which parameters have a
        gradient), or None if it wrote none (its push flag came after it)."""
        return read_record(self.records[w][t % self.layout.slots], self.layout.hyper_count, self.layout.param_count)

    def apply(self, grads: torch.Tensor, scale: float, skip=None) -> None:
        for k, (lo, hi) in enumerate(self.spans):
            g = grads[lo:hi]
            self.apply_chunk(k, g if scale == 1.0 else g * scale, () if skip is None else skip[k])
        self.stats["steps"] += 1

    def live(self) -> list[int]:
        return [w for w in range(self.nw) if w not in self.dead and not self.done[w]]

    def run_sync(self) -> None:
        t = self.start
        prof = self.stats.setdefault("profile", {"wait_push": 0.0, "update_and_send": 0.0})
        while True:
            t += 1
            flags = {}
            t0 = time.monotonic()
            for w in self.live():
                f = self._wait_push(w, t)
                if f is not None:
                    flags[w] = f
            t1 = time.monotonic()
            prof["wait_push"] += t1 - t0
            self._stop_if_another_failed()  # before any reply: none of step t goes out then
            if not flags:
                return  # every worker died or finished
            finished = [w for w, f in flags.items() if f >= DONE]
            if finished:
                if len(finished) == len(flags):
                    for w in finished:
                        self.done[w] = True
                    self.save(t - 1)
                    return
                raise ShardFailure("workers disagree on the number of steps: some finished, some pushed step "
                                   f"{t} (synchronous mode needs the same number of steps on every worker)")
            # The mean of the workers' gradients: what one process would get on the
            # concatenated batch (of the surviving workers, after a failure). Chunk by chunk:
            # chunk k's weights are on the wire while chunk k + 1 is computed (iRDMA §IV-C).
            ws = sorted(flags)
            records = [self.record(w, t) for w in ws]
            self.use_hyper(records[0])  # worker 0's, or the lowest live one's after a failure
            skip = self.skipped(records)  # a parameter some worker has a gradient for is stepped
            for w in ws:
                self.applied[w] = t
                self._to_worker(w, self._reply_begin, w)
            if self.backups is not None:
                self._step_replicated(t, ws, records, skip)
            for k, (lo, hi) in enumerate(self.spans if self.backups is None else ()):
                agg = self.aggregate[lo:hi]
                if len(ws) == 1:
                    # Applied from the slot itself, as async mode does: the worker writes it again
                    # only once this chunk's reply has landed, and optimizers never change a grad.
                    agg = self.gslots[ws[0]][0][lo:hi]
                elif len(ws) == 2:
                    # The mean of two in one pass over memory (not two: add, then scale).
                    torch.lerp(self.gslots[ws[0]][0][lo:hi], self.gslots[ws[1]][0][lo:hi], 0.5, out=agg)
                else:
                    torch.add(self.gslots[ws[0]][0][lo:hi], self.gslots[ws[1]][0][lo:hi], out=agg)
                    for w in ws[2:]:
                        agg.add_(self.gslots[w][0][lo:hi])
                    agg.mul_(1.0 / len(ws))
                self.apply_chunk(k, agg, () if skip is None else skip[k])
                for w in ws:
                    self._to_worker(w, self._reply_chunk, w, t + 1, k + 1)
            if not self.spans and self.backups is None:
                for w in ws:
                    self._to_worker(w, self._reply_chunk, w, t + 1, 0)
            self.stats["steps"] += 1
            self.stats["replies"] += len(ws)
            prof["update_and_send"] += time.monotonic() - t1
            if self.ckpt_every and t % self.ckpt_every == 0:
                self.save(t)  # while the workers compute the next step

    def _step_replicated(self, t: int, ws: list[int], records: list, skip) -> None:
        """Step t with backups: the mean gradient of every chunk first, then the step's record
        and mean gradient WRITEn to every backup; chunk 0's optimizer step runs while they travel,
        and no weights go to a worker before every live backup holds them (``Backups.wait``)."""
        aggs = []
        for lo, hi in self.spans:
            agg = self.aggregate[lo:hi]
            if len(ws) == 1:
                agg = self.gslots[ws[0]][0][lo:hi]
            elif len(ws) == 2:
                torch.lerp(self.gslots[ws[0]][0][lo:hi], self.gslots[ws[1]][0][lo:hi], 0.5, out=agg)
            else:
                torch.add(self.gslots[ws[0]][0][lo:hi], self.gslots[ws[1]][0][lo:hi], out=agg)
                for w in ws[2:]:
                    agg.add_(self.gslots[w][0][lo:hi])
                agg.mul_(1.0 / len(ws))
            aggs.append(agg)
        L = self.layout
        src = self.base + (L.gslot(ws[0], 0) if len(ws) == 1 else L.aggregate)
        values = records[0][0] if records[0] is not None else None  # the hyperparameters use_hyper took
        if any(r is None for r in records):
            has = [True] * L.param_count
        else:
            merged = records[0][1].clone()
            for r in records[1:]:
                merged |= r[1]
            has = merged.tolist()
        pending = self.backups.send(t, values, has, src)
        for k, agg in enumerate(aggs):
            self.apply_chunk(k, agg, () if skip is None else skip[k])
            if k == 0:
                self.backups.wait(pending)
            for w in ws:
                self._to_worker(w, self._reply_chunk, w, t + 1, k + 1)
        if not self.spans:
            self.backups.wait(pending)
            for w in ws:
                self._to_worker(w, self._reply_chunk, w, t + 1, 0)

    def run_async(self) -> None:
        """Applies each worker's gradient on arrival. With staleness s >= 0 (bounded staleness),
        a worker gets its new weights only while it is at most s steps ahead of the slowest.
        With overlap, a worker's pull flag says when it wants them (adaptive pulling)."""
        bounded = self.mode == "bounded"
        waiting: set[int] = set()
        idle_since = time.monotonic()
        last_check = time.monotonic()
        while self.live():
            self._stop_if_another_failed()
            progressed = False
            for w in self.live():
                f = self.push[w].get()
                if f >= DONE:
                    self.done[w] = True
                    waiting.discard(w)
                    progressed = True
                    continue
                while f > self.applied[w]:  # in order: with overlap two pushes may be waiting
                    k = self.applied[w] + 1
                    record = self.record(w, k)
                    self.use_hyper(record)
                    self.apply(self.gslots[w][k % self.layout.slots], 1.0, self.skipped([record]))
                    self.applied[w] = k
                    waiting.add(w)
                    progressed = True
            live = [self.applied[v] for v in self.live()]
            slowest = min(live) if live else 0
            for w in sorted(waiting):
                if self.switching:
                    r = self.pull[w].get()
                    if r <= self.answered[w] or self.applied[w] < r - 1:
                        continue
                else:
                    r = self.applied[w]
                # With overlap, the worker that gets pull r finishes step r on it: count that.
                gap = max(self.applied[w], r if self.switching else 0) - slowest
                if not bounded or gap <= self.staleness:
                    self.stats["max_gap"] = max(self.stats["max_gap"], gap)
                    self._to_worker(w, self.reply, w, r + 1)
                    self.answered[w] = r
                    waiting.discard(w)
                    progressed = True
            if self.switching:
                # A pull can come before any new push (the first one, or a fast worker's).
                for w in self.live():
                    if w not in waiting and self.pull[w].get() > self.answered[w]:
                        waiting.add(w)
            now = time.monotonic()
            if progressed:
                idle_since = now
                continue
            if now - last_check > POLL:
                last_check = now
                for w in self.live():
                    self._worker_died(w)
                reason = self.store.abort_reason()
                if reason:
                    raise ShardFailure(f"the job was aborted: {reason}")
                if now - idle_since > self.ctx.step_timeout:
                    raise ShardFailure(f"no worker pushed anything within {self.ctx.step_timeout:.0f} s")
            time.sleep(0.0002)

    def _stop_if_another_failed(self) -> bool:
        """Raises once another service of this shard process has failed (services.py)."""
        reason = stopping(self.ctx)
        if reason:
            raise ShardFailure(f"the job was aborted: {reason}")
        return False

    def run(self) -> dict:
        try:
            self.setup()
            if self.mode == "sync":
                self.run_sync()
            else:
                self.run_async()
            # One bound for every last reply: a worker that has left may never complete its flush.
            deadline = Deadline(5.0)
            for w in range(self.nw):
                if w in self.dead:
                    continue
                for f in self._reply_futs[w]:
                    f.wait(deadline.left())
            self.stats["applied"] = list(self.applied)
            for m in self.mirrors:
                m.stop(self.ctx.timeout)
            if self.replicas > 1:  # what tests compare: a mirror is its primary's state, bit for bit
                self.stats["digest"] = self.digest()
                self.stats["mirrors"] = {str(m.p): m.digest() for m in self.mirrors}
            if os.environ.get("RDMAFLOW_PS_PROFILE"):
                print(json.dumps({"event": "ps_profile", "shard": self.id, "steps": self.stats["steps"],
                                  **self.stats.get("profile", {})}), file=profile_stream(), flush=True)
            with contextlib.suppress(Exception):  # the store may have left with the workers already
                self.store.set(f"stats/shard/{self.id}", json.dumps(self.stats))
            return self.stats
        except (Exception, KeyboardInterrupt) as e:  # Ctrl-C too: the workers learn why the job stops
            reason = f"shard {self.id}: {'interrupted (SIGINT)' if isinstance(e, KeyboardInterrupt) else e}"
            stop_others(self.ctx, reason)
            self.store.abort(reason)
            self._abort_workers()
            if isinstance(e, (RdmaflowError, KeyboardInterrupt)):
                raise
            raise ShardFailure(reason) from e

    def _abort_workers(self) -> None:
        for w, info in enumerate(getattr(self, "workers", [])):
            if info["channel"].failed:
                continue
            # Best effort while failing (setup may have stopped half-way): nothing may hide the failure.
            with contextlib.suppress(Exception):
                self.reply_src[w].fill_(ABORT)
                info["channel"].memcpy(self.region, self.base + self.layout.reply_src_at(w, 0), info["remote"],
                                       info["base"] + info["layout"].reply + FLAG * self.id, 8, WRITE).wait(1.0)


def shard_threads() -> int:
    """Intra-op threads for a shard's aggregation and optimizer: RDMAFLOW_SHARD_THREADS, else
    the host's cores divided among the job's processes on it. Elementwise updates gain little
    from more threads, and OpenMP threads that spin between kernels take the cores the
    workers compute on."""
    if os.environ.get("RDMAFLOW_SHARD_THREADS"):
        return max(1, env_int("RDMAFLOW_SHARD_THREADS"))
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    local = env_int("LOCAL_WORLD_SIZE", 1)
    return max(1, cores // max(local, 1))
