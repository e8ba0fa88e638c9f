"""The shard's end of the key-value API: KVShard holds the stored values of its keys, applies
pushes with the job's handler and answers pulls. The protocol is described in kv.py."""
from __future__ import annotations

import contextlib
import json
import sys
import time

import torch

from rdmaflow import READ, WRITE, Arena, InvalidArgumentError, RdmaflowError, RemoteRegion
from rdmaflow.deadline import Deadline
from rdmaflow.ps.kv_layout import REASON, U64, KVLayout, RequestWords, element_index, words
from rdmaflow.ps.kv_replica import candidates, drop, first_slot, owner, redo, replicate
from rdmaflow.ps.protocol import ABORT, DONE, LEFT_WITHOUT_CLOSE
from rdmaflow.ps.services import stop_others, stopping
from rdmaflow.ps.shard import ShardFailure
from rdmaflow.transfer.common import pack_header, unpack_header

POLL = 0.05          # seconds between liveness checks of the workers while serving
STORE_CHECK = 1.0    # seconds between checks of the store's abort key while serving


def sum_handler(key: int, stored: torch.Tensor, pushed: torch.Tensor) -> None:
    """The default server-side handler: ``stored += pushed`` (applied to a whole request at once
    as one ``index_add_``, never called per key)."""
    stored.add_(pushed)


def check_handlers(handler, batch_handler) -> None:
    for name, fn in (("kv_handler", handler), ("kv_batch_handler", batch_handler)):
        if fn is not None and not callable(fn):
            raise InvalidArgumentError(f"{name} must be callable, got {type(fn).__name__}")
    if handler is not None and batch_handler is not None:
        raise InvalidArgumentError("give kv_handler or kv_batch_handler, not both")


class KVShard:
    """A shard process of a key-value job: holds the stored values of keys ``k % num_shards ==
    id`` (its key range), and with replicas (kv_replica.py) a mirror of the ranges it backs up,
    each in a block of its own (KVRange); serves the ranges it is the primary of.

    ``handler(key, stored, pushed)`` is called once per key of a request (a Python call and two
    tensor views per key, so a request of many small keys costs microseconds per key);
    ``batch_handler(keys, stored, pushed)`` once per request with the request's keys (int64) and
    their stored and pushed values flattened and concatenated in the same order; it updates
    ``stored`` in place or returns the new values. Neither: the vectorised sum."""

    def __init__(self, ctx, handler=None, batch_handler=None):
        check_handlers(handler, batch_handler)
        self.ctx = ctx
        self.role = ctx.role
        self.id = ctx.role.index
        self.store = ctx.store
        self.dev = ctx.device
        self.handler = None if handler is sum_handler else handler
        self.batch_handler = batch_handler
        self.stats = {"kind": "kv", "pushes": 0, "pulls": 0, "barriers": 0, "requests": 0}
        self.workers: list[dict] = []
        self.ranges: list[KVRange] = []
        self.inflight: list = []

    def setup(self) -> None:
        store, role = self.store, self.role
        store.set(f"ep/shard/{self.id}", self.dev.endpoint)
        job = json.loads(store.get_large("kv/spec", getattr(self.ctx, "declare_timeout", None)))
        self.replicas = int(job.get("replicas", 1))
        spec = self.spec = KVLayout({"dtype": job["dtype"], "keys": job["keys"]}, role.num_shards, role.num_workers,
                                    self.replicas)
        self.nw = role.num_workers
        held = spec.held_by(self.id)
        # A region of this service's own, not the device's one arena: a job's other services
        # (services.py) and a KVStore's arena tensors size theirs independently.
        arena = self.arena = Arena(self.dev.alloc_region(sum(spec.shards[r].total for r in held) + (1 << 20)))
        self.region = arena.region
        self.ranges = [KVRange(self, r, arena.allocate(spec.shards[r].total)) for r in held]
        self.own = self.ranges[0]
        self.dev.publish("ps/kv/shard", pack_header(
            {"total": self.own.layout.total, "base": self.own.base,
             "ranges": {str(g.r): [g.base, g.layout.total] for g in self.ranges}}, self.region.descriptor()))
        store.set(f"kv/ready/shard/{self.id}", "1")
        for w in range(self.nw):
            ep = store.get(f"ep/worker/{w}")
            store.wait([f"kv/ready/worker/{w}"])
            meta, desc = unpack_header(self.dev.lookup(ep, "ps/kv/worker", self.ctx.timeout), "ps/kv/worker")
            if int(meta["total"]) != spec.worker.total:
                raise ShardFailure(f"worker {w} computed a layout of {meta['total']} bytes, shard {self.id} "
                                   f"{spec.worker.total}: are all processes running the same rdmaflow?")
            self.workers.append({"ep": ep, "remote": RemoteRegion.from_descriptor(desc),
                                 "base": int(meta["base"]), "channel": self.dev.channel(ep)})
        if job.get("init"):  # worker 0 staged its initial values as a request of every key of each range
            w0 = self.workers[0]
            for g in self.ranges:
                if g.n:
                    at = spec.worker.push_stage[g.r] + U64 * (1 + g.n)
                    w0["channel"].memcpy(self.region, g.base, w0["remote"], w0["base"] + at,
                                         g.layout.elements * g.layout.itemsize, READ).result(self.ctx.timeout)
        if self.replicas > 1:  # the other holders of every range held here: where their copies are
            self.peers = {}
            for c in sorted({c for g in self.ranges for c in spec.holders(g.r)} - {self.id}):
                ep = store.get(f"ep/shard/{c}")
                store.wait([f"kv/ready/shard/{c}"])
                meta, desc = unpack_header(self.dev.lookup(ep, "ps/kv/shard", self.ctx.timeout), "ps/kv/shard")
                self.peers[c] = {"proc": c, "ep": ep, "remote": RemoteRegion.from_descriptor(desc),
                                 "ranges": {int(r): int(b) for r, (b, _) in meta["ranges"].items()},
                                 "channel": self.dev.channel(ep)}
            self.own.backups = [self.copy_of(self.own.r, c) for c in spec.holders(self.own.r)[1:]]
        store.set(f"kv/serving/{self.id}", "1")

    def copy_of(self, r: int, c: int) -> dict:
        """Where shard process c holds its copy of range r (a backup target)."""
        p = self.peers[c]
        return {"proc": c, "ep": p["ep"], "remote": p["remote"], "base": p["ranges"][r], "channel": p["channel"],
                "slot": 0}

    def _check_workers(self) -> None:
        for w, info in enumerate(self.workers):
            if int(self.own.done[w]) < DONE and info["channel"].failed:
                reason = self.store.abort_reason()  # a worker that gave up says why before it leaves
                if reason:
                    raise ShardFailure(f"the job was aborted: {reason}")
                # Declared dead, so that the process serving the store does not wait at exit for it
                self.store.declare_dead("worker", w)
                raise ShardFailure(f"worker {w} at {info['ep']} died (shard {self.id} lost its connection)"
                                   f"{LEFT_WITHOUT_CLOSE}")

    def _check_owners(self) -> None:
        """With replicas: takes over each range the job's store names this process the primary of
        (at a later epoch), and stops if another process took over its own (it was thought dead)."""
        for g in self.ranges:
            epoch, c, _ = owner(self.store, g.r)
            if c == self.id and epoch > g.epoch and not g.primary:
                g.promote(epoch)
            elif g.primary and c != self.id and epoch > g.epoch:
                raise ShardFailure(f"shard {c} took over key range {g.r} at epoch {epoch}: shard {self.id} was "
                                   "thought dead")

    def serve(self) -> None:
        """Serves until every worker closed. Being idle is no error (workers may compute for
        long between pushes); a worker that dies or a job that is aborted ends it."""
        now = time.monotonic()
        last_progress = last_check = last_store = now
        replicated = self.replicas > 1
        while True:
            # read before the flags: DONE came after them (a closing worker WRITEs it into every copy)
            all_done = all(bool((g.done >= DONE).all()) for g in self.ranges)
            reason = stopping(self.ctx)  # another service of this process failed
            if reason:
                raise ShardFailure(f"the job was aborted: {reason}")
            progressed = False
            for g in self.ranges:
                if g.primary:
                    progressed = g._round() or progressed
                    if g.r == 0 and g._barrier():
                        progressed = True
            if len(self.inflight) > 1024:
                self.inflight = [f for f in self.inflight if not f.done()]
            if all_done and not progressed:
                return
            now = time.monotonic()
            if now - last_check > POLL:
                last_check = now
                self._check_workers()
                # a backup's takeover words, rung by the workers that elected it (every 50 ms: a
                # backup does nothing per request)
                rung = [g for g in self.ranges if replicated and not g.primary and g.rung()]  # each looked at
                if rung:
                    self._check_owners()
            if now - last_store > STORE_CHECK:
                last_store = now
                reason = self.store.abort_reason()  # (a store gone with shard 0 at the end is no error)
                if reason:
                    raise ShardFailure(f"the job was aborted: {reason}")
                if replicated:
                    self._check_owners()
            if progressed:
                last_progress = now
                continue
            # Spin briefly after activity, then back off so an idle shard costs little CPU.
            time.sleep(0.0001 if now - last_progress < 0.01 else 0.001)

    def run(self) -> dict:
        try:
            self.setup()
            self.serve()
            deadline = Deadline(5.0)
            for f in self.inflight:
                f.wait(deadline.left())
            self.stats["applied"] = self.own.applied.tolist()
            with contextlib.suppress(Exception):  # the store may have left with shard 0 already
                self.store.set(f"stats/shard/{self.id}", json.dumps(self.stats))
            return self.stats
        except (Exception, KeyboardInterrupt) as e:  # Ctrl-C too: the workers learn why the job stops
            reason = f"shard {self.id}: {'interrupted (SIGINT)' if isinstance(e, KeyboardInterrupt) else e}"
            stop_others(self.ctx, reason)
            self.store.abort(reason)
            self._abort_workers(reason)
            # ps.init then leaves the store (JobStore.leave): if this process serves it, it stays
            # until the others have read the reason.
            if isinstance(e, (RdmaflowError, KeyboardInterrupt)):
                raise
            raise ShardFailure(reason) from e

    def _abort_workers(self, reason: str) -> None:
        """Leaves the reason, then ABORT, in every worker's block (the store may leave with us)."""
        if not self.ranges or not hasattr(self.own, "abort_src"):
            return
        g = self.own
        L, wl = g.layout, self.spec.worker
        msg = reason.encode("utf-8", "replace")[: REASON - 1] + b"\0"
        g.raw[L.reason_src : L.reason_src + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
        g.abort_src[0] = ABORT
        futs = []
        for info in self.workers:
            if info["channel"].failed:
                continue
            with contextlib.suppress(Exception):  # best effort while failing
                ch = info["channel"]
                futs.append(ch.memcpy(self.region, g.base + L.reason_src, info["remote"],
                                      info["base"] + wl.reason + REASON * self.id, len(msg), WRITE))
                ch.fence()
                futs.append(ch.memcpy(self.region, g.base + L.abort_src, info["remote"],
                                      info["base"] + wl.status + U64 * self.id, U64, WRITE))
        deadline = Deadline(1.0)
        for f in futs:
            f.wait(deadline.left())



class KVRange(RequestWords):
    """One key range's block in a shard process (kv.py's "shard s's block", plus a replica's
    words with replicas): its stored values, the workers' request areas and flags. The primary
    of the range serves it (``_round``); a backup's is a mirror its primary WRITEs into."""

    def __init__(self, shard: KVShard, r: int, block):
        self.shard, self.r, self.proc = shard, r, shard.id
        self.ctx, self.store, self.spec = shard.ctx, shard.store, shard.spec
        self.handler, self.batch_handler = shard.handler, shard.batch_handler
        self.stats, self.workers, self.inflight = shard.stats, shard.workers, shard.inflight
        spec = self.spec
        self.js = spec.shard_keys[r]      # i -> j
        self.n, self.nw = len(self.js), shard.nw
        L = self.layout = spec.shards[r]
        self.block = block
        self.base = block.offset
        self.region = shard.region
        raw = torch.frombuffer(block, dtype=torch.uint8, count=L.total)
        raw[: L.push_area].zero_()
        raw[L.flags :].zero_()
        self.raw = raw
        self.stored = raw[: L.elements * L.itemsize].view(spec.dtype)  # every value, packed in key order
        self.key_tensor = spec.key_tensor[self.js] if self.n else spec.key_tensor[:0]
        self.offsets = L.offsets.tolist()  # for the per-key handler and _where
        self.numels = L.numels.tolist()
        self._view_words(raw, L)
        self.replied = torch.zeros(self.nw, dtype=torch.int64)
        self.released = 0
        self.primary = r == shard.id
        self.replicated = spec.replicas > 1
        self.backups: list[dict] = []
        self.epoch = self.round = 0
        self.tagged = 0
        if self.replicated:
            self.takeover = words(raw, L.takeover, self.nw)

    def rung(self) -> bool:
        """Whether a worker rang this backup's takeover word with an epoch it has not acted on."""
        m = int(self.takeover.max())
        if m > self.tagged:
            self.tagged = m
            return True
        return False

    def promote(self, epoch: int) -> None:
        """Becomes the range's primary at ``epoch`` (the job's store names this process): the
        mirror made whole, every live holder brought to it, every worker's applied number
        acknowledged; then it serves the range like any primary."""
        self.applied = redo(self)
        self.replied.zero_()
        self.released = 0
        self.epoch, self.round = epoch, 0
        sh = self.shard
        self.backups = []
        for c in candidates(self.store, self.spec, self.r):
            if c != self.proc:
                b = sh.copy_of(self.r, c)
                try:
                    b["slot"] = first_slot(self, b, self.ctx.timeout)
                except RdmaflowError as e:
                    self.backups.append(b)
                    drop(self, b, e)
                    continue
                self.backups.append(b)
        self.primary = True
        replicate(self, None, self.ctx.step_timeout)  # the other copies may hold a record this one lacks
        wl = self.spec.worker
        self.ack_src.copy_(self.applied)
        for w in range(self.nw):
            if int(self.done[w]) < DONE:
                f = self._post(w, self.base + self.layout.word(self.layout.ack_src, w), wl.ack + U64 * self.r, U64)
                if f is not None:
                    self.inflight.append(f)
        self.stats["takeovers"] = self.stats.get("takeovers", 0) + 1
        self.stats["took_over_at"] = time.monotonic()  # (the tests compare it with when they killed)
        print(f"rdmaflow ps: shard {self.proc} took over key range {self.r} (epoch {epoch})", file=sys.stderr,
              flush=True)

    # -- data path --------------------------------------------------------------------------------
    def _post(self, w: int, local_off: int, remote_off: int, nbytes: int):
        """WRITEs nbytes at local_off of this shard's region to remote_off of worker w's block."""
        info = self.workers[w]
        try:
            return info["channel"].memcpy(self.region, local_off, info["remote"], info["base"] + remote_off,
                                          nbytes, WRITE)
        except RdmaflowError as e:
            if int(self.done[w]) >= DONE:
                return None  # that worker closed and left: nothing it waits for any more
            if info["channel"].failed and not self.store.abort_reason():  # as _check_workers: the
                self.store.declare_dead("worker", w)  # process serving the store need not wait for it
            raise ShardFailure(f"worker {w} at {info['ep']} died (shard {self.proc} cannot reach it: {e})"
                               f"{LEFT_WITHOUT_CLOSE}") from None

    def _request(self, area: int) -> torch.Tensor:
        """The local key indices of the request in the area at byte ``area``."""
        count = int(self.raw[area : area + U64].view(torch.int64))
        if not 0 <= count <= self.n:
            raise ShardFailure(f"a request names {count} keys; shard {self.proc} holds {self.n}")
        return self.raw[area + U64 : area + U64 * (1 + count)].view(torch.int64)

    def _where(self, rows: torch.Tensor) -> slice | torch.Tensor:
        """Where the values of ``rows`` (in that order) lie in ``stored``: a slice when the rows
        are consecutive (one key, every key, a dense range: no index to build or scatter), else
        the positions of their elements."""
        n = len(rows)
        if n == 0:
            return slice(0, 0)
        first, last = int(rows[0]), int(rows[-1])
        if last - first == n - 1 and (n <= 2 or bool((rows[1:] - rows[:-1] == 1).all())):
            return slice(self.offsets[first], self.offsets[last] + self.numels[last])
        L = self.layout
        return element_index(L.offsets, L.numels, rows, self.spec.width)

    @staticmethod
    def _count(where: slice | torch.Tensor) -> int:
        return where.stop - where.start if isinstance(where, slice) else len(where)

    def _apply(self, w: int) -> torch.Tensor:
        """Applies worker w's push request, every key of it, before anything else happens;
        returns the local indices of its keys."""
        L = self.layout
        rows = self._request(L.push(w))
        at = L.push(w) + U64 * (1 + len(rows))
        where = self._where(rows)
        pushed = self.raw[at : at + self._count(where) * L.itemsize].view(self.spec.dtype)
        if self.handler is not None:
            self._apply_per_key(w, rows, pushed)
        elif self.batch_handler is not None:
            self._apply_batch(w, rows, where, pushed)
        elif isinstance(where, slice):
            self.stored[where].add_(pushed)
        else:
            self.stored.index_add_(0, where, pushed)
        self.stats["pushes"] += len(rows)
        self.stats["requests"] += 1
        return rows

    def _apply_per_key(self, w: int, rows: torch.Tensor, pushed: torch.Tensor) -> None:
        spec = self.spec
        at = 0
        for i in rows.tolist():
            j = self.js[i]
            key, numel, shape = spec.keys[j], spec.numel[j], spec.shapes[j]
            off = self.offsets[i]
            stored = self.stored[off : off + numel].view(shape)
            try:
                ret = self.handler(key, stored, pushed[at : at + numel].view(shape))
            except Exception as e:
                raise ShardFailure(f"the kv handler raised on key {key} (push from worker {w}): {e!r}") from e
            at += numel
            self._store_returned(ret, stored, f"key {key}")

    def _apply_batch(self, w: int, rows: torch.Tensor, where, pushed: torch.Tensor) -> None:
        stored = self.stored[where] if isinstance(where, slice) else self.stored.index_select(0, where)
        try:
            ret = self.batch_handler(self.key_tensor.index_select(0, rows), stored, pushed)
        except Exception as e:
            raise ShardFailure(f"the kv batch handler raised on a request of {len(rows)} keys from worker {w}: "
                               f"{e!r}") from e
        self._store_returned(ret, stored, f"a request of {len(rows)} keys")
        if not isinstance(where, slice):
            self.stored.index_copy_(0, where, stored)

    @staticmethod
    def _store_returned(ret, stored: torch.Tensor, what: str) -> None:
        if ret is None or ret is stored:
            return
        if not isinstance(ret, torch.Tensor):
            raise ShardFailure(f"the kv handler returned {type(ret).__name__} for {what}: "
                               "update `stored` in place and return None, or return a tensor")
        if ret.shape != stored.shape:  # copy_ would broadcast a smaller one over every value
            raise ShardFailure(f"the kv handler returned a tensor of shape {list(ret.shape)} for {what}, whose "
                               f"values are of shape {list(stored.shape)}")
        try:
            stored.copy_(ret)
        except RuntimeError as e:
            raise ShardFailure(f"the kv handler returned a tensor that does not fit {what}: {e}") from None

    def _reply(self, w: int, seq: int) -> None:
        """Answers worker w's pull request: its values, gathered in request order, in one WRITE;
        then, behind a fence, the reply flag."""
        L, wl = self.layout, self.spec.worker
        rows = self._request(L.pull(w))
        src = self.raw[L.reply(w) : L.reply(w) + L.value_stride].view(self.spec.dtype)
        where = self._where(rows)
        count = self._count(where)
        if isinstance(where, slice):
            src[:count].copy_(self.stored[where])
        else:
            torch.index_select(self.stored, 0, where, out=src[:count])
        futs = [self._post(w, self.base + L.reply(w), wl.landing[self.r], count * L.itemsize)]
        self.workers[w]["channel"].fence()
        self.reply_flag_src[w] = seq
        futs.append(self._post(w, self.base + L.word(L.reply_flag_src, w), wl.reply + U64 * self.r, U64))
        self.inflight.extend(f for f in futs if f is not None)
        self.stats["pulls"] += len(rows)

    def _round(self) -> bool:
        """One pass over the flags: applies every push request it sees, then answers the pull
        requests it saw first. Returns whether it did something."""
        q = self.pull_flags.clone()  # the pull requests first ...
        p = self.push_flags.clone()  # ... then the pushes, which a request's fence put before it
        pushes = torch.nonzero(p > self.applied).flatten().tolist()
        pulls = torch.nonzero(q > self.replied).flatten().tolist()
        wl = self.spec.worker
        touched = []
        for w in pushes:
            seq = int(p[w])
            rows = self._apply(w)
            self.applied[w] = seq
            if self.backups:  # acknowledged below, once every backup holds it
                touched.append(rows.clone())
                continue
            self.ack_src[w] = seq
            f = self._post(w, self.base + self.layout.word(self.layout.ack_src, w), wl.ack + U64 * self.r, U64)
            if f is not None:
                self.inflight.append(f)
        if pushes and self.backups:
            replicate(self, torch.cat(touched), self.ctx.step_timeout)
            for w in pushes:
                self.ack_src[w] = self.applied[w]
                f = self._post(w, self.base + self.layout.word(self.layout.ack_src, w), wl.ack + U64 * self.r, U64)
                if f is not None:
                    self.inflight.append(f)
        for w in pulls:
            seq = int(q[w])
            self.replied[w] = seq
            self._reply(w, seq)
        return bool(pushes or pulls)

    def _barrier(self) -> bool:
        live = self.done < DONE
        if not bool(live.any()):
            return False
        m = int(self.bflags[live].min())
        if m <= self.released:
            return False
        self.released = m
        for w in torch.nonzero(live).flatten().tolist():
            self.barrier_src[w] = m
            f = self._post(w, self.base + self.layout.barrier_src + U64 * w, self.spec.worker.barrier, U64)
            if f is not None:
                self.inflight.append(f)
        self.stats["barriers"] += 1
        return True


KVShard._store_returned = KVRange._store_returned
