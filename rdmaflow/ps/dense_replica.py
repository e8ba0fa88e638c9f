"""Replicated units of a DistributedOptimizer job in mode="sync" (R = the job's replica count):
shard s's units have backups on shard processes s+1, ..., s+R-1 (mod S), each holding a
*mirror* of them (weights and optimizer state) in its registered memory. After FaRM
(Dragojević et al., "No compromises: distributed transactions with consistency, availability,
and performance", SOSP '15), as the key-value store's replicas (kv_replica.py): the primary
WRITEs one-sidedly into each backup's block what it needs, and WRITEs step t's weights to any
worker only once every live backup holds it. docs/parameter-server.md, "Replicated shards",
draws the protocol.

What goes to a backup is the step's *input*, not its result: the aggregated (mean) gradient
of the primary's units and a step record (step number, the hyperparameters it ran with, which
parameters had a gradient). A backup's CPU runs the same optimizer code (unit_optim.py) on the
same bytes, so its mirror stays bit-identical to the primary's units; it does so while the
workers compute the next step, off the step's critical path. The new state instead would be
the weights plus the optimizer state (2x the gradient's bytes for SGD with momentum, 3x for
Adam), and, to survive a primary dying half-way through it, written twice (a record, then in
place) or into one of two mirrors.

- ``Backups``: the primary's side. ``send(t, ...)`` WRITEs the record and the gradient into the
  backup's slot t % 2, fence, t into its ``commit`` word; ``wait`` waits for the WRITEs'
  completion (visible at the backup) before the primary's first reply of the step. Slot t % 2
  is free once the backup applied step t - 2: the primary READs its ``applied`` word when what
  it last read does not show that (at most every other step).
- ``Mirror``: the backup's side, a thread that applies step applied + 1 from its slot once
  ``commit`` covers it, then sets ``applied``.

Failover (a backup taking over a dead primary's units) is not built: a primary's death still
aborts the job (the workers' error says so).
"""
from __future__ import annotations

import sys
import threading
import time

import torch

from rdmaflow import READ, WRITE, RdmaflowError, RemoteRegion, wait_all
from rdmaflow.deadline import Deadline
from rdmaflow.ps import checkpoint
from rdmaflow.ps.layout import runs_of
from rdmaflow.ps.protocol import FLAG, aligned, read_record, record_bytes, write_record
from rdmaflow.ps.unit_optim import UnitOptimizers
from rdmaflow.transfer import FLOAT_DTYPES, Word

POLL = 0.0005


def backups_of(shard: int, num_shards: int, replicas: int) -> list[int]:
    """The shard processes holding a mirror of ``shard``'s units, in succession order."""
    return [(shard + i) % num_shards for i in range(1, replicas)]


def primaries_of(shard: int, num_shards: int, replicas: int) -> list[int]:
    """The shards whose units ``shard`` mirrors."""
    return [(shard - i) % num_shards for i in range(1, replicas)]


def out_key(p: int, b: int) -> str:
    """Set once backup b's mirror of shard p's units may be stale (its primary dropped it)."""
    return f"dense/out/{p}/{b}"


class MirrorLayout:
    """A mirror's block on a backup: the units' weights, two slots (a step record, then the
    step's mean gradient, laid out like the weights), ``commit`` (the last step whose slot
    landed whole; written by the primary) and ``applied`` (the last step the mirror applied;
    written by the backup, READ by the primary)."""

    def __init__(self, numel: int, itemsize: int, hyper: int, params: int):
        self.nbytes = numel * itemsize
        self.record_bytes = record_bytes(hyper, params)
        self.gbytes = aligned(max(self.nbytes, 1))
        self.rec_stride = aligned(self.record_bytes)
        self.weights = 0
        self.slots = self.gbytes
        self.commit = self.slots + 2 * (self.rec_stride + self.gbytes)
        self.applied = self.commit + FLAG
        self.total = self.applied + FLAG

    def record(self, step: int) -> int:
        return self.slots + (step % 2) * (self.rec_stride + self.gbytes)

    def grad(self, step: int) -> int:
        return self.record(step) + self.rec_stride


def source_bytes(hyper: int, params: int, backups: int) -> int:
    """The primary's sources: the record, then a commit word and a READ's landing per backup."""
    return aligned(record_bytes(hyper, params)) + 2 * FLAG * backups


class Mirror(UnitOptimizers):
    """Backup ``shard``'s mirror of primary ``p``'s units, in ``arena``."""

    def __init__(self, shard, p: int, arena):
        self.shard, self.p = shard, p
        self.plan, self.hyper_fields = shard.plan, shard.hyper_fields
        n = self.plan.shard_numel(p)
        self.counts = (shard.layout.hyper_count, shard.layout.param_count)  # a step record's
        self.layout = L = MirrorLayout(n, shard.itemsize, *self.counts)
        self.block = arena.allocate(L.total)
        self.raw = raw = torch.frombuffer(self.block, dtype=torch.uint8, count=L.total)
        raw.zero_()
        dtype = FLOAT_DTYPES[self.plan.dtype]
        self.weights = raw[: L.nbytes].view(dtype) if n else torch.empty(0, dtype=dtype)
        self.grads = [raw[L.grad(k) : L.grad(k) + L.nbytes].view(dtype) if n else torch.empty(0, dtype=dtype)
                      for k in range(2)]
        self.commit, self.applied = Word.at(raw, L.commit), Word.at(raw, L.applied)
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, start: int, chunk_bytes: int) -> None:
        """Loads the units' state where the job starts (a checkpoint of shard p, else worker 0's
        parameters, as the primary does) and starts applying steps."""
        sh = self.shard
        self.build_optimizers(self.p, chunk_bytes, sh.config["optim"])
        if start:
            state = checkpoint.load(sh.ckpt_dir, start, self.p, sh.role.num_shards, sh.fingerprint())
            with torch.no_grad():
                self.weights.copy_(state["weights"])
            self.load_optimizers(state["optimizer"], start)
        else:
            w0 = sh.workers[0]
            isz, src = sh.itemsize, w0["base"] + w0["layout"].params_at(0)
            futs = [w0["channel"].memcpy(sh.region, self.block.offset + u.shard_offset * isz, w0["remote"],
                                         src + u.offset * isz, u.numel * isz, READ)
                    for u in runs_of(self.plan.units_of(self.p))]
            wait_all(futs, sh.ctx.timeout)
        self.start_hyper(sh.config["optim"])
        self.applied.set(start)
        self._thread = threading.Thread(target=self._run, name=f"rdmaflow-mirror-{self.p}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                stopping = self._stop.is_set()  # read before commit: a stop then drains what landed
                while self.applied.get() < self.commit.get():
                    self._step(self.applied.get() + 1)
                if stopping:
                    return
                time.sleep(POLL)
        except BaseException as e:  # noqa: BLE001 - said by stop(), on the shard's thread
            self.error = e

    def _step(self, t: int) -> None:
        L = self.layout
        rec_buf = self.raw[L.record(t) : L.record(t) + L.record_bytes]
        marker = int(rec_buf[:8].view(torch.int64)[0])
        if marker != t:
            raise RdmaflowError(f"mirror of shard {self.p}: slot {t % 2} holds step {marker}, not {t}")
        record = read_record(rec_buf, self.counts[0], self.counts[1])
        self.use_hyper(record)
        skip = self.skipped([record])
        grads = self.grads[t % 2]
        for k, (lo, hi) in enumerate(self.spans):
            self.apply_chunk(k, grads[lo:hi], () if skip is None else skip[k])
        self.applied.set(t)

    def stop(self, timeout: float) -> None:
        """Applies every step that landed, then stops; raises what the thread failed with."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise RdmaflowError(f"the mirror of shard {self.p} did not stop within {timeout:.0f} s")
        if self.error is not None:
            raise RdmaflowError(f"the mirror of shard {self.p} failed: {self.error}") from self.error


class Backups:
    """Primary ``shard``'s backups; its sources in ``arena``."""

    def __init__(self, shard, arena, replicas: int):
        self.shard = shard
        S = shard.role.num_shards
        self.ids = backups_of(shard.id, S, replicas)
        L = shard.layout
        self.nrec = record_bytes(L.hyper_count, L.param_count)
        nbytes = source_bytes(L.hyper_count, L.param_count, len(self.ids))
        self.block = arena.allocate(nbytes)
        self.raw = torch.frombuffer(self.block, dtype=torch.uint8, count=nbytes)
        self.raw.zero_()
        self.rec_src = self.raw[: self.nrec]
        self.word0 = aligned(self.nrec)
        self.live: list[dict] = []
        self.stats = shard.stats.setdefault("replication", {"steps": 0, "applied_reads": 0, "dropped": []})

    def connect(self, unpack_header) -> None:
        """Finds each backup's mirror of this shard's units (its ``ps/shard`` header)."""
        sh = self.shard
        for i, b in enumerate(self.ids):
            ep = sh.store.get(f"ep/shard/{b}")
            sh.store.wait([f"ready/shard/{b}"])
            meta, desc = unpack_header(sh.dev.lookup(ep, "ps/shard"), "ps/shard")
            self.live.append({"id": b, "ep": ep, "channel": sh.dev.channel(ep),
                              "remote": RemoteRegion.from_descriptor(desc),
                              "base": int(meta["mirrors"][str(sh.id)]), "known": sh.start,
                              "commit_src": self.word0 + 2 * FLAG * i, "peek": self.word0 + 2 * FLAG * i + FLAG})
        self.layout = MirrorLayout(sh.numel, sh.itemsize, sh.layout.hyper_count, sh.layout.param_count)

    def send(self, t: int, values, has, src: int) -> list:
        """Posts step t's record and mean gradient (at ``src``, an offset in the shard's region)
        to every live backup, then its commit word; returns what ``wait`` takes."""
        sh, ML = self.shard, self.layout
        write_record(self.rec_src, t, values, has, sh.layout.hyper_count)
        pending = []
        for b in list(self.live):
            try:
                self._free(b, t)
                ch, remote, base = b["channel"], b["remote"], b["base"]
                futs = [ch.memcpy(sh.region, self.block.offset, remote, base + ML.record(t), self.nrec, WRITE)]
                if ML.nbytes:
                    futs.append(ch.memcpy(sh.region, src, remote, base + ML.grad(t), ML.nbytes, WRITE))
                ch.fence()  # the slot lands whole before its commit word
                self.raw[b["commit_src"] : b["commit_src"] + 8].view(torch.int64)[0] = t
                futs.append(ch.memcpy(sh.region, self.block.offset + b["commit_src"], remote, base + ML.commit, 8,
                                      WRITE))
            except RdmaflowError as e:
                self._drop(b, e)
                continue
            pending.append((b, futs))
        return pending

    def wait(self, pending: list) -> None:
        """Returns once every WRITE of ``pending`` is complete (visible at its backup); a backup
        whose WRITEs fail or take longer than the step timeout is dropped."""
        deadline = Deadline(self.shard.ctx.step_timeout)
        for b, futs in pending:
            try:
                for f in futs:
                    f.result(deadline.left())
            except RdmaflowError as e:
                self._drop(b, e)
        self.stats["steps"] += 1

    def _free(self, b: dict, t: int) -> None:
        """Waits (bounded) until backup b applied step t - 2: slot t % 2 is then free."""
        if b["known"] >= t - 2:
            return
        sh = self.shard
        deadline = Deadline(sh.ctx.step_timeout)
        peek = self.raw[b["peek"] : b["peek"] + 8].view(torch.int64)
        while True:
            b["channel"].memcpy(sh.region, self.block.offset + b["peek"], b["remote"], b["base"] + self.layout.applied,
                                8, READ).result(deadline.left())
            self.stats["applied_reads"] += 1
            b["known"] = int(peek[0])
            if b["known"] >= t - 2:
                return
            if deadline.passed():
                raise RdmaflowError(f"backup shard {b['id']} applied no step past {b['known']} within "
                                    f"{sh.ctx.step_timeout:.0f} s")
            time.sleep(POLL)

    def _drop(self, b: dict, why) -> None:
        """Takes backup b out for good, recorded in the store before anything more is replied."""
        self.live.remove(b)
        sh = self.shard
        sh.store.set(out_key(sh.id, b["id"]), f"dropped by shard {sh.id}: {why}")
        self.stats["dropped"].append(b["id"])
        print(f"rdmaflow ps: shard {sh.id} dropped its backup shard {b['id']} ({why}); going on with "
              f"{len(self.live)} backup(s)", file=sys.stderr, flush=True)
