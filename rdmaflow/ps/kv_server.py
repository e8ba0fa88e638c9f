"""The shard's end of the key-value API: KVShard holds the stored values of its keys, applies
pushes with the job's handler and answers pulls. The protocol is described in kv.py."""
from __future__ import annotations

import json
import time

import torch

from rdmaflow import READ, WRITE, InvalidArgumentError, RdmaflowError, RemoteRegion
from rdmaflow.deadline import Deadline
from rdmaflow.ps.kv_job import leave, linger
from rdmaflow.ps.kv_layout import REASON, U64, KVLayout, words
from rdmaflow.ps.protocol import ABORT, DONE
from rdmaflow.ps.shard import ShardFailure
from rdmaflow.transfer.common import pack_header, unpack_header

POLL = 0.05          # seconds between liveness checks of the workers while serving
STORE_CHECK = 1.0    # seconds between checks of the store's abort key while serving


def sum_handler(key: int, stored: torch.Tensor, pushed: torch.Tensor) -> None:
    """The default server-side handler: ``stored += pushed``."""
    stored.add_(pushed)


class KVShard:
    """Holds the stored values of keys ``k % num_shards == id`` and applies pushes to them."""

    def __init__(self, ctx, handler=None):
        if handler is not None and not callable(handler):
            raise InvalidArgumentError(f"kv_handler must be callable, got {type(handler).__name__}")
        self.ctx = ctx
        self.role = ctx.role
        self.id = ctx.role.index
        self.store = ctx.store
        self.dev = ctx.device
        self.handler = handler or sum_handler
        self.stats = {"kind": "kv", "pushes": 0, "pulls": 0, "barriers": 0}
        self.workers: list[dict] = []

    def setup(self) -> None:
        store, role = self.store, self.role
        store.set(f"ep/shard/{self.id}", self.dev.endpoint)
        job = json.loads(store.get("kv/spec"))
        spec = self.spec = KVLayout({"dtype": job["dtype"], "keys": job["keys"]}, role.num_shards, role.num_workers)
        self.js = spec.shard_keys[self.id]      # i -> j
        self.n, self.nw = len(self.js), role.num_workers
        L = self.layout = spec.shards[self.id]
        arena = self.dev.create_arena(L.total + (1 << 20))
        self.block = arena.allocate(L.total)
        self.base = self.block.offset
        self.region = arena.region
        raw = torch.frombuffer(self.block, dtype=torch.uint8, count=L.total)
        raw[: L.slots].zero_()
        raw[L.flags :].zero_()
        self.raw = raw

        def value(off: int, i: int) -> torch.Tensor:
            j = self.js[i]
            return raw[off + L.voff[i] : off + L.voff[i] + spec.nbytes[j]].view(spec.dtype).view(spec.shapes[j])

        self.stored = [value(L.stored, i) for i in range(self.n)]
        self.slots = [[value(L.slots + w * L.slot_stride, i) for i in range(self.n)] for w in range(self.nw)]
        self.pflags = words(raw, L.push, self.nw * self.n).view(self.nw, self.n)
        self.qflags = words(raw, L.pull, self.nw * self.n).view(self.nw, self.n)
        self.ack_src = words(raw, L.ack_src, self.nw * self.n).view(self.nw, self.n)
        self.reply_src = words(raw, L.reply_src, self.nw * self.n).view(self.nw, self.n)
        self.done = words(raw, L.done, self.nw)
        self.bflags = words(raw, L.barrier, self.nw)
        self.barrier_src = words(raw, L.barrier_src, self.nw)
        self.abort_src = words(raw, L.abort_src, 1)
        self.applied = torch.zeros(self.nw, self.n, dtype=torch.int64)
        self.replied = torch.zeros(self.nw, self.n, dtype=torch.int64)
        self.released = 0
        self.busy: dict[int, list] = {}  # i -> reply WRITEs still reading stored[i]
        self.inflight: list = []
        self.dev.publish("ps/kv/shard", pack_header({"total": L.total, "base": self.base}, self.region.descriptor()))
        store.set(f"ready/shard/{self.id}", "1")
        for w in range(self.nw):
            ep = store.get(f"ep/worker/{w}")
            store.wait([f"ready/worker/{w}"])
            meta, desc = unpack_header(self.dev.lookup(ep, "ps/kv/worker", self.ctx.timeout), "ps/kv/worker")
            if int(meta["total"]) != spec.worker.total:
                raise ShardFailure(f"worker {w} computed a layout of {meta['total']} bytes, shard {self.id} "
                                   f"{spec.worker.total}: are all processes running the same rdmaflow?")
            self.workers.append({"ep": ep, "remote": RemoteRegion.from_descriptor(desc),
                                 "base": int(meta["base"]), "channel": self.dev.channel(ep)})
        if job.get("init") and self.n:
            w0, wl = self.workers[0], spec.worker
            futs = [w0["channel"].memcpy(self.region, self.base + L.stored + L.voff[i], w0["remote"],
                                         w0["base"] + wl.stage + wl.voff[j], spec.nbytes[j], READ)
                    for i, j in enumerate(self.js)]
            for f in futs:
                f.result(self.ctx.timeout)
        store.set(f"kv/serving/{self.id}", "1")

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
            raise ShardFailure(f"worker {w} at {info['ep']} died (shard {self.id} cannot reach it: {e})") from None

    def _apply(self, w: int, i: int, seq: int) -> None:
        key = self.spec.keys[self.js[i]]
        stored = self.stored[i]
        try:
            ret = self.handler(key, stored, self.slots[w][i])
        except Exception as e:
            raise ShardFailure(f"the kv handler raised on key {key} (push from worker {w}): {e!r}") from e
        if ret is not None and ret is not stored:
            if not isinstance(ret, torch.Tensor):
                raise ShardFailure(f"the kv handler returned {type(ret).__name__} for key {key}: "
                                   "update `stored` in place and return None, or return a tensor")
            try:
                stored.copy_(ret)
            except RuntimeError as e:
                raise ShardFailure(f"the kv handler returned a tensor that does not fit key {key}: {e}") from None
        self.applied[w, i] = seq
        self.stats["pushes"] += 1

    def _round(self) -> tuple[bool, bool]:
        """One pass over every flag: applies the pushes it sees, then answers the pulls it saw
        first. Returns (did something, a key is held back by a reply still in flight)."""
        q = self.qflags.clone()  # the pull requests first ...
        p = self.pflags.clone()  # ... then the pushes, which a request's fence put before it
        pushes, pulls = p > self.applied, q > self.replied
        if not (bool(pushes.any()) or bool(pulls.any())):
            return False, False
        held = False
        for i in list(self.busy):
            self.busy[i] = [f for f in self.busy[i] if not f.done()]
            if not self.busy[i]:
                del self.busy[i]
        if self.busy:  # a reply still reads stored[i]: nothing lands on key i before it completed
            cols = torch.tensor(sorted(self.busy))
            held = bool(pushes[:, cols].any()) or bool(pulls[:, cols].any())
            pushes[:, cols] = False
            pulls[:, cols] = False
        L, wl = self.layout, self.spec.worker
        for (w, i), seq in zip(torch.nonzero(pushes).tolist(), p[pushes].tolist()):
            self._apply(w, i, seq)
            self.ack_src[w, i] = seq
            f = self._post(w, self.base + L.word(L.ack_src, w, i), wl.ack + U64 * self.js[i], U64)
            if f is not None:
                self.inflight.append(f)
        replies: dict[int, list] = {}
        for (w, i), seq in zip(torch.nonzero(pulls).tolist(), q[pulls].tolist()):
            self.replied[w, i] = seq
            replies.setdefault(w, []).append((i, seq))
        if replies:
            self._reply(replies)
        return bool(pushes.any()) or bool(replies), held

    def _reply(self, replies: dict) -> None:
        L, wl, spec = self.layout, self.spec.worker, self.spec
        for w, items in replies.items():
            for i, _ in items:
                j = self.js[i]
                f = self._post(w, self.base + L.stored + L.voff[i], wl.out + wl.voff[j], spec.nbytes[j])
                if f is not None:
                    self.busy.setdefault(i, []).append(f)
            self.workers[w]["channel"].fence()
            for i, seq in items:
                self.reply_src[w, i] = seq
                f = self._post(w, self.base + L.word(L.reply_src, w, i), wl.reply + U64 * self.js[i], U64)
                if f is not None:
                    self.inflight.append(f)
                self.stats["pulls"] += 1

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

    def _check_workers(self) -> None:
        for w, info in enumerate(self.workers):
            if int(self.done[w]) < DONE and info["channel"].failed:
                reason = self.store.abort_reason()  # a worker that gave up says why before it leaves
                if reason:
                    raise ShardFailure(f"the job was aborted: {reason}")
                raise ShardFailure(f"worker {w} at {info['ep']} died (shard {self.id} lost its connection)")

    def serve(self) -> None:
        """Serves until every worker closed. Being idle is no error (workers may compute for
        long between pushes); a worker that dies or a job that is aborted ends it."""
        now = time.monotonic()
        last_progress = last_check = last_store = now
        while True:
            all_done = bool((self.done >= DONE).all())  # read before the flags: DONE came after them
            progressed, waiting = self._round() if self.n else (False, False)
            if self.id == 0 and self._barrier():
                progressed = True
            if len(self.inflight) > 1024:
                self.inflight = [f for f in self.inflight if not f.done()]
            if all_done and not progressed and not waiting:
                return
            now = time.monotonic()
            if now - last_check > POLL:
                last_check = now
                self._check_workers()
            if now - last_store > STORE_CHECK:
                last_store = now
                reason = self.store.abort_reason()  # (a store gone with shard 0 at the end is no error)
                if reason:
                    raise ShardFailure(f"the job was aborted: {reason}")
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
            for f in self.inflight + [f for b in self.busy.values() for f in b]:
                f.wait(deadline.left())
            self.stats["applied"] = self.applied.sum(0).tolist()
            try:
                self.store.set(f"stats/shard/{self.id}", json.dumps(self.stats))
            except Exception:  # noqa: BLE001 - the store may have left with shard 0 already
                pass
            return self.stats
        except Exception as e:
            reason = f"shard {self.id}: {e}"
            self.store.abort(reason)
            self._abort_workers(reason)
            leave(self.ctx, f"shard/{self.id}")
            linger(self.ctx)
            if isinstance(e, RdmaflowError):
                raise
            raise ShardFailure(reason) from e

    def _abort_workers(self, reason: str) -> None:
        """Leaves the reason, then ABORT, in every worker's block (the store may leave with us)."""
        if not hasattr(self, "abort_src"):
            return
        L, wl = self.layout, self.spec.worker
        msg = reason.encode("utf-8", "replace")[: REASON - 1] + b"\0"
        self.raw[L.reason_src : L.reason_src + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
        self.abort_src[0] = ABORT
        futs = []
        for w, info in enumerate(self.workers):
            if info["channel"].failed:
                continue
            try:
                ch = info["channel"]
                futs.append(ch.memcpy(self.region, self.base + L.reason_src, info["remote"],
                                      info["base"] + wl.reason + REASON * self.id, len(msg), WRITE))
                ch.fence()
                futs.append(ch.memcpy(self.region, self.base + L.abort_src, info["remote"],
                                      info["base"] + wl.status + U64 * self.id, U64, WRITE))
            except Exception:  # noqa: BLE001 - best effort while failing
                pass
        deadline = Deadline(1.0)
        for f in futs:
            f.wait(deadline.left())

