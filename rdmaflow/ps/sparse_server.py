"""The shard's end of sparse tables: SparseShard, a service whose ``run()`` serves every table of
the job until every worker closed them. Per table it keeps the hash table in a registered region
of its own (sparse_table.py), applies pushes with the table's handler, answers the pulls that
come as requests, and grows the table into a larger region while readers go on. The protocol is
described in sparse.py."""
from __future__ import annotations

import contextlib
import ctypes
import json
import time

import torch

from rdmaflow import WRITE, RdmaflowError, RemoteRegion
from rdmaflow.deadline import Deadline
from rdmaflow.ps.kv_layout import REASON, U64, RequestWords, words
from rdmaflow.ps.protocol import ABORT, DONE, LEFT_WITHOUT_CLOSE
from rdmaflow.ps.services import stop_others, stopping
from rdmaflow.ps.shard import ShardFailure
from rdmaflow.ps.sparse_handlers import Applier, state_size
from rdmaflow.ps.sparse_layout import FULL, HEAD, OP_ASSIGN, SparseClientArea, SparseShardArea
from rdmaflow.ps.sparse_table import (
    CHECK,
    HEADER_WORDS,
    KEY,
    LIVE,
    RETIRED,
    SLOTS,
    VER,
    TableFormat,
    TableView,
    entry_check,
    initializer_from_spec,
    place,
)
from rdmaflow.transfer.common import pack_header, unpack_header
from rdmaflow.transfer.dtypes import FLOAT_DTYPES

POLL = 0.05          # seconds between liveness checks of the workers while serving
STORE_CHECK = 0.05   # seconds between looks at the store for new tables and the job's abort


def region_bytes(region, nbytes: int) -> torch.Tensor:
    """The first ``nbytes`` of a registered host region as a uint8 tensor (the caller keeps the
    region alive as long as the tensor)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(region.address), dtype=torch.uint8)


def table_spec_format(spec: dict) -> TableFormat:
    return TableFormat(spec["dim"], FLOAT_DTYPES[spec["dtype"]], state_size(spec["handler"], spec["dim"]))


class _Table(RequestWords):
    """One table on this shard: its control block, its current region, its workers."""

    def __init__(self, shard: SparseShard, spec: dict):
        self.shard, self.spec, self.name = shard, spec, spec["name"]
        dev, store, sid = shard.dev, shard.store, shard.id
        self.nw = shard.role.num_workers
        fmt = self.fmt = table_spec_format(spec)
        self.dtype = fmt.dtype
        self.applier = Applier(spec["handler"], shard.handlers)
        self.init = initializer_from_spec(spec["initializer"])
        self.max_rows = int(spec["max_rows"])
        L = self.layout = SparseShardArea(fmt, spec["batch_rows"], self.nw)
        self.wl = SparseClientArea(L, shard.role.num_shards, fmt, spec["batch_rows"])
        self.region = dev.alloc_region(L.total)
        raw = self.raw = region_bytes(self.region, L.total)
        raw[L.flags:].zero_()
        self._view_words(raw, L)
        self.counters = words(raw, L.counters, 4)   # pull requests, push requests, epoch, rows
        self.replied = torch.zeros(self.nw, dtype=torch.int64)
        self.released = 0
        self.rows = 0
        self.regions: list = []  # every table region so far (readers may still hold the old ones)
        nb = 1
        while nb * SLOTS < spec["initial_rows"]:
            nb *= 2
        self.epoch = 0
        self._new_region(max(nb, 2))
        self._publish_table()
        self.stats = {"push_requests": 0, "pull_requests": 0, "pushed_rows": 0, "pulled_rows": 0, "resizes": 0,
                      "refused_full": 0}
        dev.publish(f"ps/sparse/{self.name}/shard", pack_header({"total": L.total}, self.region.descriptor()))
        store.set(f"sparse/{self.name}/ready/shard/{sid}", "1")
        self.workers = []
        for w in range(self.nw):
            ep = store.get(f"ep/worker/{w}")
            store.wait([f"sparse/{self.name}/ready/worker/{w}"])
            meta, desc = unpack_header(dev.lookup(ep, f"ps/sparse/{self.name}/worker", shard.ctx.timeout), "worker")
            if int(meta["total"]) != self.wl.total:
                raise ShardFailure(f"table {self.name!r}: worker {w} computed a block of {meta['total']} bytes, "
                                   f"shard {sid} {self.wl.total}: are all processes running the same rdmaflow?")
            self.workers.append({"ep": ep, "remote": RemoteRegion.from_descriptor(desc), "channel": dev.channel(ep)})
        store.set(f"sparse/{self.name}/serving/{sid}", "1")
        self.inflight: list = []

    # -- the table region ---------------------------------------------------------------------------
    def _new_region(self, nbuckets: int) -> None:
        """Makes a region of ``nbuckets`` buckets the table's (empty), for epoch self.epoch + 1."""
        nbytes = self.fmt.region_bytes(nbuckets)
        region = self.shard.dev.alloc_region(nbytes)
        raw = region_bytes(region, nbytes)
        raw.zero_()
        view = TableView(raw, self.fmt, nbuckets)
        self.epoch += 1
        view.header[:] = torch.tensor([self.epoch, LIVE, 0, nbuckets, SLOTS, self.fmt.words, self.rows, 0])
        self.view, self.nbuckets, self.table_region = view, nbuckets, region
        self.fill = torch.zeros(nbuckets, dtype=torch.int64)
        self.regions.append(region)

    def _publish_table(self) -> None:
        self.shard.dev.publish(f"ps/sparse/{self.name}/table/{self.epoch}",
                               pack_header({"epoch": self.epoch, "nbuckets": self.nbuckets},
                                           self.table_region.descriptor()))
        self.counters[2] = self.epoch

    def _grow(self, limit_rows: int) -> bool:
        """Rehashes every row into a region of twice the buckets (more if placement needs it);
        then retires the old region: its header names the new epoch, then says RETIRED, so that a
        reader holding it looks the new one up. False when that would pass the memory bound."""
        old, old_epoch = self.view, self.epoch
        occ = old.keys[..., 1].reshape(-1) == 1
        idx = torch.nonzero(occ).flatten()
        keys = old.keys[..., 0].reshape(-1)[idx]
        nb = self.nbuckets
        while True:
            nb *= 2
            if nb * SLOTS > 4 * limit_rows + 64 * SLOTS:
                return False
            fill = torch.zeros(nb, dtype=torch.int64)
            slots = place(fill, keys, nb)
            if slots is not None:
                break
        self._new_region(nb)
        self.fill = fill
        self.view.entries[slots] = old.entries[idx]
        self.view.keys.view(-1, 2)[slots] = torch.stack([keys, torch.ones_like(keys)], 1)
        self._publish_table()
        old.header[2] = self.epoch      # where readers of the old region go next ...
        old.header[1] = RETIRED         # ... once they see it retired (a store after the one before)
        self.stats["resizes"] += 1
        del old_epoch
        return True

    def _insert(self, keys: torch.Tensor) -> torch.Tensor:
        """Slots for ``keys`` (distinct, absent), their entries written with the initializer's
        rows, then the keys array names them; grows the table when a key's buckets are full."""
        while True:
            slots = place(self.fill, keys, self.nbuckets)
            if slots is not None:
                break
            if not self._grow(self.max_rows):
                raise ShardFailure(f"table {self.name!r}: shard {self.shard.id} cannot place {len(keys)} new rows "
                                   f"within its bound of {self.max_rows} rows")
        fmt = self.fmt
        e = torch.zeros(len(keys), fmt.words, dtype=torch.int64)
        e[:, KEY] = keys
        e[:, VER] = 2
        fmt.rows_of(e)[:] = self.init.values(keys, fmt.dim, self.spec["seed"]).to(fmt.dtype)
        if fmt.state:
            fmt.state_of(e)[:] = self.spec["handler"].get("initial", 0.0)
        e[:, CHECK] = entry_check(e, fmt.row_words)
        self.view.entries[slots] = e
        self.view.keys.view(-1, 2)[slots] = torch.stack([keys, torch.ones_like(keys)], 1)
        self.rows += len(keys)
        self.view.header[6] = self.rows
        self.counters[3] = self.rows
        return slots

    def _write_rows(self, slots: torch.Tensor, rows: torch.Tensor, state: torch.Tensor | None) -> None:
        """Writes entries in the order a reader's check relies on: the version made odd, the row
        (and state) and check, the version made even again (x86 keeps stores in program order;
        each step is one tensor operation)."""
        fmt, ent = self.fmt, self.view.entries
        ver = ent[slots, VER]
        ent[slots, VER] = ver + 1
        e = ent[slots]
        fmt.rows_of(e)[:] = rows.to(fmt.dtype)
        if state is not None and fmt.state:
            fmt.state_of(e)[:] = state
        e[:, VER] = ver + 2
        e[:, CHECK] = entry_check(e, fmt.row_words)
        ent[slots, KEY:] = e[:, KEY:]
        ent[slots, VER] = ver + 2

    # -- requests -----------------------------------------------------------------------------------
    def _request(self, area: int) -> tuple[int, int, torch.Tensor]:
        count, op = (int(x) for x in self.raw[area: area + HEAD].view(torch.int64))
        if not 0 <= count <= self.layout.batch_rows:
            raise ShardFailure(f"table {self.name!r}: a request names {count} rows; at most "
                               f"{self.layout.batch_rows}")
        return count, op, self.raw[area + HEAD: area + HEAD + U64 * count].view(torch.int64)

    def _apply(self, w: int) -> bool:
        """Applies worker w's push request whole; False when it was refused whole (full)."""
        fmt = self.fmt
        area = self.layout.push(w)
        count, op, keys = self._request(area)
        at = area + HEAD + U64 * count
        values = self.raw[at: at + count * fmt.row_bytes].view(fmt.dtype).view(count, fmt.dim)
        uk, inv = torch.unique(keys, return_inverse=True)
        if op == OP_ASSIGN:
            st_at = at + count * fmt.row_bytes
            state = self.raw[st_at: st_at + count * 4 * fmt.state].view(torch.float32).view(count, fmt.state)
            last = torch.zeros(len(uk), dtype=torch.int64).scatter_(0, inv, torch.arange(count))
            summed, state = values[last].to(torch.float32), state[last].clone()
        elif len(uk) == count:
            summed = torch.zeros(count, fmt.dim, dtype=torch.float32)
            summed[inv] = values.to(torch.float32)
        else:
            summed = torch.zeros(len(uk), fmt.dim, dtype=torch.float32).index_add_(0, inv, values.to(torch.float32))
        found, slots = self.view.find(uk)
        new = ~found
        n_new = int(new.sum())
        if n_new and self.rows + n_new > self.max_rows:
            self.stats["refused_full"] += 1
            return False
        if n_new:
            epoch = self.epoch
            placed = self._insert(uk[new])
            if self.epoch != epoch:  # the table grew: every key has moved
                _, slots = self.view.find(uk)
            else:
                slots = slots.clone()
                slots[new] = placed
        if op == OP_ASSIGN:
            self._write_rows(slots, summed, state)
        else:
            e = self.view.entries[slots]
            state = fmt.state_of(e).clone() if fmt.state else None
            try:
                rows = self.applier.apply(uk, fmt.rows_of(e).to(torch.float32), state, summed)
            except Exception as ex:
                raise ShardFailure(f"table {self.name!r}: the handler raised on a push of {len(uk)} rows from "
                                   f"worker {w}: {ex!r}") from ex
            self._write_rows(slots, rows, state)
        self.stats["push_requests"] += 1
        self.stats["pushed_rows"] += count
        self.counters[1] += 1
        return True

    def _reply(self, w: int, seq: int) -> None:
        """Answers worker w's pull request: rows in request order (the initializer's for absent
        keys), one WRITE, then behind a fence the reply flag."""
        fmt, L = self.fmt, self.layout
        count, _, keys = self._request(L.pull(w))
        found, slots = self.view.find(keys)
        out = self.raw[L.reply(w): L.reply(w) + count * fmt.row_bytes].view(fmt.dtype).view(count, fmt.dim)
        out[:] = fmt.rows_of(self.view.entries[slots])
        if not bool(found.all()):
            miss = ~found
            out[miss] = self.init.values(keys[miss], fmt.dim, self.spec["seed"]).to(fmt.dtype)
        self.counters[0] += 1
        self.stats["pull_requests"] += 1
        self.stats["pulled_rows"] += count
        s = self.shard.id
        self._post(w, L.reply(w), self.wl.landing[s], count * fmt.row_bytes)
        self.workers[w]["channel"].fence()
        self.reply_flag_src[w] = seq
        self._post(w, L.word(L.reply_flag_src, w), self.wl.reply + U64 * s, U64)

    def _post(self, w: int, local_off: int, remote_off: int, nbytes: int) -> None:
        info = self.workers[w]
        try:
            f = info["channel"].memcpy(self.region, local_off, info["remote"], remote_off, nbytes, WRITE)
        except RdmaflowError as e:
            if int(self.done[w]) >= DONE:
                return
            raise ShardFailure(f"worker {w} at {info['ep']} died (shard {self.shard.id} cannot reach it: {e})"
                               f"{LEFT_WITHOUT_CLOSE}") from None
        self.inflight.append(f)

    def round(self) -> bool:
        """Applies every push request seen, then answers the pull requests seen before them."""
        q = self.pull_flags.clone()
        p = self.push_flags.clone()
        pushes = torch.nonzero(p > self.applied).flatten().tolist()
        pulls = torch.nonzero(q > self.replied).flatten().tolist()
        s, L = self.shard.id, self.layout
        for w in pushes:
            seq = int(p[w])
            ok = self._apply(w)
            self.applied[w] = seq
            self.ack_src[w] = seq << 1 | (0 if ok else FULL)
            self._post(w, L.word(L.ack_src, w), self.wl.ack + U64 * s, U64)
        for w in pulls:
            seq = int(q[w])
            self.replied[w] = seq
            self._reply(w, seq)
        if self.shard.id == 0:
            self._barrier()
        if len(self.inflight) > 1024:
            self.inflight = [f for f in self.inflight if not f.done()]
        return bool(pushes or pulls)

    def _barrier(self) -> None:
        live = self.done < DONE
        if not bool(live.any()):
            return
        m = int(self.bflags[live].min())
        if m <= self.released:
            return
        self.released = m
        for w in torch.nonzero(live).flatten().tolist():
            self.barrier_src[w] = m
            self._post(w, self.layout.barrier_src + U64 * w, self.wl.barrier, U64)

    def finished(self) -> bool:
        return bool((self.done >= DONE).all())

    def check_workers(self) -> None:
        for w, info in enumerate(self.workers):
            if int(self.done[w]) < DONE and info["channel"].failed:
                reason = self.shard.store.abort_reason()
                if reason:
                    raise ShardFailure(f"the job was aborted: {reason}")
                self.shard.store.declare_dead("worker", w)
                raise ShardFailure(f"worker {w} at {info['ep']} died (shard {self.shard.id} lost its connection)"
                                   f"{LEFT_WITHOUT_CLOSE}")

    def abort_workers(self, reason: str) -> list:
        L = self.layout
        msg = reason.encode("utf-8", "replace")[: REASON - 1] + b"\0"
        self.raw[L.reason_src: L.reason_src + len(msg)] = torch.frombuffer(bytearray(msg), dtype=torch.uint8)
        self.abort_src[0] = ABORT
        futs = []
        for info in self.workers:
            if info["channel"].failed:
                continue
            with contextlib.suppress(Exception):
                ch = info["channel"]
                futs.append(ch.memcpy(self.region, L.reason_src, info["remote"],
                                      self.wl.reason + REASON * self.shard.id, len(msg), WRITE))
                ch.fence()
                futs.append(ch.memcpy(self.region, L.abort_src, info["remote"], self.wl.status + U64 * self.shard.id,
                                      U64, WRITE))
        return futs


class SparseShard:
    """The sparse tables' service on one shard: ``run()`` serves every table the job declares
    (worker 0 names them in the store, in order) until every worker closed every one of them,
    and returns the statistics. ``handlers``: ps.init's ``sparse_handlers``."""

    def __init__(self, ctx, handlers: dict | None = None):
        self.ctx, self.role, self.id = ctx, ctx.role, ctx.role.index
        self.store, self.dev = ctx.store, ctx.device
        self.handlers = handlers or {}
        self.tables: list[_Table] = []
        self.stats: dict = {"kind": "sparse", "tables": {}}

    def _discover(self) -> bool:
        """Sets up the tables worker 0 declared since the last look; whether there were any."""
        found = False
        while self.store.check(f"sparse/table/{len(self.tables)}"):
            spec = json.loads(self.store.get(f"sparse/table/{len(self.tables)}"))
            self.tables.append(_Table(self, spec))
            found = True
        return found

    def serve(self) -> None:
        self.store.set(f"ep/shard/{self.id}", self.dev.endpoint)
        now = time.monotonic()
        last_progress = last_check = last_store = now
        # Bounded like any service's wait for its declaration (services.py): a job that declared
        # "sparse" and whose workers make no table would otherwise keep this shard forever.
        first_by = now + (getattr(self.ctx, "declare_timeout", None) or self.ctx.timeout)
        while True:
            reason = stopping(self.ctx)  # another service of this process failed
            if reason:
                raise ShardFailure(f"the job was aborted: {reason}")
            if not self.tables and time.monotonic() > first_by:
                raise ShardFailure(f"no SparseTable was made within {first_by - now:.0f} s, though the job runs "
                                   "the 'sparse' service: every worker makes its tables soon after ps.init()")
            all_done = bool(self.tables) and all(t.finished() for t in self.tables)
            progressed = False
            for t in self.tables:  # every table's round, whatever the others did
                progressed |= t.round()
            now = time.monotonic()
            if now - last_store > STORE_CHECK:  # new tables, and the job's abort
                last_store = now
                if self._discover():
                    continue
                reason = self.store.abort_reason()
                if reason:
                    raise ShardFailure(f"the job was aborted: {reason}")
            if all_done and not progressed and not self._discover():
                return
            if now - last_check > POLL:
                last_check = now
                for t in self.tables:
                    t.check_workers()
            if progressed:
                last_progress = now
                continue
            time.sleep(0.0001 if now - last_progress < 0.01 else 0.001)

    def run(self) -> dict:
        try:
            self.serve()
            deadline = Deadline(5.0)
            for t in self.tables:
                for f in t.inflight:
                    f.wait(deadline.left())
                self.stats["tables"][t.name] = dict(t.stats, rows=t.rows, epoch=t.epoch)
            with contextlib.suppress(Exception):
                self.store.set(f"stats/shard/{self.id}", json.dumps(self.stats))
            return self.stats
        except (Exception, KeyboardInterrupt) as e:
            reason = f"shard {self.id}: {'interrupted (SIGINT)' if isinstance(e, KeyboardInterrupt) else e}"
            stop_others(self.ctx, reason)
            self.store.abort(reason)
            futs = []
            for t in self.tables:
                futs.extend(t.abort_workers(reason))
            deadline = Deadline(1.0)
            for f in futs:
                f.wait(deadline.left())
            if isinstance(e, (RdmaflowError, KeyboardInterrupt)):
                raise
            raise ShardFailure(reason) from e


__all__ = ["HEADER_WORDS", "SparseShard"]
