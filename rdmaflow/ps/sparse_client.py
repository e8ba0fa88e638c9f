"""The worker's end of sparse tables: SparseTable (push, pull, wait, barrier, save, stats, close).
Pulls read the shards' hash tables one-sided where they can (a mapped region on one host, or
READs), and fall back to a request to the shard for what they cannot verify. The protocol is
described in sparse.py."""
from __future__ import annotations

import ctypes
import json
import os
import threading

import torch

from rdmaflow import READ, WRITE, InvalidArgumentError, PeerError, RdmaflowError, RemoteRegion, TimeoutError
from rdmaflow._args import integer
from rdmaflow.deadline import Deadline, checked_timeout
from rdmaflow.ps.checkpoint import read as read_file
from rdmaflow.ps.checkpoint import write_whole
from rdmaflow.ps.context import dumps
from rdmaflow.ps.kv_layout import REASON, U64, words
from rdmaflow.ps.protocol import DONE
from rdmaflow.ps.sparse_handlers import handler_spec
from rdmaflow.ps.sparse_layout import COUNTERS, FULL, HEAD, OP_ASSIGN, OP_PUSH, SparseClientArea, SparseShardArea
from rdmaflow.ps.sparse_server import region_bytes, table_spec_format
from rdmaflow.ps.sparse_table import (
    CHECK,
    CHOICES,
    HEADER_WORDS,
    KEY,
    LIVE,
    ROW,
    SLOTS,
    VER,
    Initializer,
    TableView,
    Zeros,
    buckets_of,
    entry_check,
    find_in,
    initializer_from_spec,
    shard_of,
)
from rdmaflow.ps.worker import WorkerFailure
from rdmaflow.transfer.common import pack_header, unpack_header
from rdmaflow.transfer.dtypes import dtype_name
from rdmaflow.transfer.flag import Word, wait_flag

SPARSE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
READ_PATHS = ("auto", "read", "request")
MAX_ROWS_ENV = "RDMAFLOW_PS_SPARSE_MAX_ROWS"
DEFAULT_MAX_ROWS = 1 << 24
FORMAT, VERSION = "rdmaflow.sparse", 1


class TableFullError(RdmaflowError, MemoryError):
    """A push would put more rows on a shard than the table's ``max_rows_per_shard``."""


class SparseHandle:
    """What ``push`` and ``pull`` return; pass it to ``SparseTable.wait``."""

    __slots__ = ("_parts", "_pushes", "done", "kind", "result")

    def __init__(self, kind: str):
        self.kind = kind
        self._pushes: list[tuple[int, int]] = []   # (shard, push number)
        self._parts: list = []                      # (shard, pull number, positions) owed by a request
        self.done = False
        self.result = None

    def __repr__(self) -> str:
        return f"<SparseHandle {self.kind}{' done' if self.done else ''}>"


class _Shard:
    """What a worker knows of one shard: its channel, control block, and its table's current
    region (epoch, buckets, a mapped view when the region is shared memory on this host)."""

    def __init__(self, s: int, ep: str, channel, remote):
        self.s, self.ep, self.channel, self.remote = s, ep, channel, remote
        self.epoch, self.nbuckets, self.table, self.window, self.view = 0, 0, None, None, None


class SparseTable:
    """Rows of ``dim`` values of ``dtype`` keyed by any int64, spread over the shards by a hash
    of the key; see sparse.py for the protocol and docs/parameter-server.md, "Sparse tables".
    Every worker makes the same tables, with the same arguments, in the same order."""

    def __init__(self, name: str, dim: int, dtype: torch.dtype = torch.float32, *, initializer="zeros",
                 seed: int = 0, handler="add", max_rows_per_shard: int | None = None, init=None,
                 batch_rows: int = 8192, initial_rows: int = 4096, read_path: str = "auto",
                 timeout: float | None = None, ctx=None):
        if ctx is None:
            from rdmaflow import ps

            ctx = ps._CTX
        if ctx is None:
            raise InvalidArgumentError("call rdmaflow.ps.init() first")
        if not ctx.is_worker:
            raise InvalidArgumentError("SparseTable runs on workers; this process is a shard")
        self.ctx, self.role, self.id = ctx, ctx.role, ctx.role.index
        self.store, self.dev = ctx.store, ctx.device
        self.timeout = ctx.step_timeout if timeout is None else checked_timeout(timeout)
        self.spec = self._declaration(name, dim, dtype, initializer, seed, handler, max_rows_per_shard,
                                      batch_rows, initial_rows)
        if read_path not in READ_PATHS:
            raise InvalidArgumentError(f"read_path must be one of {', '.join(READ_PATHS)}, got {read_path!r}")
        if name in ctx.sparse_names:
            raise InvalidArgumentError(f"this job already has a sparse table named {name!r}")
        self.name, self.read_path = name, read_path
        self.fmt = table_spec_format(self.spec)
        self.dim, self.dtype = self.fmt.dim, self.fmt.dtype
        self.init_values = initializer_from_spec(self.spec["initializer"])
        self._lock = threading.RLock()
        self._closed = False
        self.counts = {"one_sided_rows": 0, "request_rows": 0, "initialized_rows": 0, "torn": 0, "stale": 0}
        index = len(ctx.sparse_names)
        ctx.sparse_names.append(name)
        try:
            snapshot = None
            if init is not None and self.id == 0:
                snapshot = load(os.fspath(init), self.spec)
            self._setup(index)
            if self.id == 0:
                if snapshot is not None:
                    self._restore(*snapshot)
                self.store.set(f"sparse/{name}/loaded", "1")
            self.store.wait([f"sparse/{name}/loaded"], self.timeout)
        except Exception as e:
            reason = self.store.fail_with(f"worker {self.id}: {e}")
            self.store.count_out()
            if reason and isinstance(e, PeerError):
                raise WorkerFailure(f"the job was aborted: {reason}") from e
            raise

    # -- declaration and setup ----------------------------------------------------------------------
    def _declaration(self, name, dim, dtype, initializer, seed, handler, max_rows, batch_rows, initial_rows) -> dict:
        if not isinstance(name, str) or not name or "/" in name:
            raise InvalidArgumentError(f"a sparse table's name is a non-empty string without '/', got {name!r}")
        dim = integer(dim, "dim")
        if dim <= 0:
            raise InvalidArgumentError(f"dim must be positive, got {dim}")
        if dtype not in SPARSE_DTYPES:
            raise InvalidArgumentError(f"a sparse table holds float32, float16 or bfloat16, got {dtype!r}")
        if initializer == "zeros":
            initializer = Zeros()
        if not isinstance(initializer, Initializer):
            raise InvalidArgumentError(f"initializer must be 'zeros', ps.Constant, ps.Normal or ps.Uniform, got "
                                       f"{initializer!r}")
        seed = integer(seed, "seed")
        hspec = handler_spec(handler)
        if hspec["kind"] == "user" and hspec["name"] not in self.ctx.sparse_handlers:
            raise InvalidArgumentError(f"handler {hspec['name']!r} was not given to ps.init(sparse_handlers=...) "
                                       f"(it has {sorted(self.ctx.sparse_handlers)})")
        if max_rows is None:
            max_rows = integer(os.environ.get(MAX_ROWS_ENV, DEFAULT_MAX_ROWS), f"${MAX_ROWS_ENV}")
        max_rows = integer(max_rows, "max_rows_per_shard")
        batch_rows = integer(batch_rows, "batch_rows")
        initial_rows = integer(initial_rows, "initial_rows")
        for what, v in (("max_rows_per_shard", max_rows), ("batch_rows", batch_rows), ("initial_rows", initial_rows)):
            if v <= 0:
                raise InvalidArgumentError(f"{what} must be positive, got {v}")
        return {"name": name, "dim": dim, "dtype": dtype_name(dtype), "initializer": initializer.spec(),
                "seed": seed, "handler": hspec, "max_rows": max_rows, "batch_rows": batch_rows,
                "initial_rows": initial_rows}

    def _setup(self, index: int) -> None:
        store, name, ns = self.store, self.name, self.role.num_shards
        store.set(f"ep/worker/{self.id}", self.dev.endpoint)
        if self.id == 0:
            if not store.check("config"):
                store.set("config", dumps({"kind": "sparse"}))
            store.set(f"sparse/table/{index}", dumps(self.spec))
        job = json.loads(store.get(f"sparse/table/{index}", self.ctx.timeout))
        if job != self.spec:
            diff = next(k for k in self.spec if self.spec.get(k) != job.get(k))
            raise InvalidArgumentError(f"worker {self.id}'s sparse table #{index} differs from worker 0's: {diff} is "
                                       f"{self.spec.get(diff)!r} here, {job.get(diff)!r} on worker 0")
        fmt = self.fmt
        sl = self.shard_layout = SparseShardArea(fmt, self.spec["batch_rows"], self.role.num_workers)
        L = self.layout = SparseClientArea(sl, ns, fmt, self.spec["batch_rows"])
        self.region = self.dev.alloc_region(L.total)
        raw = self.raw = region_bytes(self.region, L.total)
        raw[L.flags:].zero_()
        self.reply = words(raw, L.reply, ns)
        self.ack = words(raw, L.ack, ns)
        self.push_src = words(raw, L.push_src, ns)
        self.pull_src = words(raw, L.pull_src, ns)
        self.status = words(raw, L.status, ns)
        self.reasons = raw[L.reason: L.reason + REASON * ns].view(ns, REASON)
        self.barrier_word = words(raw, L.barrier, 1)
        self.done_src = words(raw, L.done_src, 1)
        self.barrier_src = words(raw, L.barrier_src, 1)
        self.push_seq, self.pull_seq = [0] * ns, [0] * ns
        self.refused: set[tuple[int, int]] = set()
        self._pending: list = [None] * ns   # the pull request whose reply lands in landing[s]
        self.barrier_seq = self.save_seq = 0
        self.dev.publish(f"ps/sparse/{name}/worker", pack_header({"total": L.total}, self.region.descriptor()))
        store.set(f"sparse/{name}/ready/worker/{self.id}", "1")
        self.shards: list[_Shard] = []
        for s in range(ns):
            ep = store.get(f"ep/shard/{s}", self.ctx.timeout)
            store.wait([f"sparse/{name}/ready/shard/{s}"], self.ctx.timeout)
            meta, desc = unpack_header(self.dev.lookup(ep, f"ps/sparse/{name}/shard", self.ctx.timeout), "shard")
            if int(meta["total"]) != sl.total:
                raise WorkerFailure(f"table {name!r}: shard {s} computed a block of {meta['total']} bytes, this "
                                    f"worker {sl.total}: are all processes running the same rdmaflow?")
            sh = _Shard(s, ep, self.dev.channel(ep), RemoteRegion.from_descriptor(desc))
            self._look_up_table(sh, 1)
            self.shards.append(sh)
        store.wait([f"sparse/{name}/serving/{s}" for s in range(ns)], self.ctx.timeout)

    def _look_up_table(self, sh: _Shard, epoch: int) -> None:
        """Fetches the descriptor of shard sh's table region of ``epoch`` and maps it when it is
        shared memory on this host (and the read path is not "request")."""
        meta, desc = unpack_header(self.dev.lookup(sh.ep, f"ps/sparse/{self.name}/table/{epoch}", self.ctx.timeout),
                                   "table")
        sh.epoch, sh.nbuckets = int(meta["epoch"]), int(meta["nbuckets"])
        sh.table = RemoteRegion.from_descriptor(desc)
        sh.window = sh.view = None
        if self.read_path != "request":
            window = sh.channel.direct_window(sh.table)
            if window is not None:
                nbytes = self.fmt.region_bytes(sh.nbuckets)
                raw = torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(window.address), dtype=torch.uint8)
                sh.window, sh.view = window, TableView(raw, self.fmt, sh.nbuckets)

    def _refresh(self, sh: _Shard) -> None:
        """Follows retired regions to shard sh's current one: each names the next epoch."""
        for _ in range(64):
            header = self._header(sh)
            if int(header[1]) == LIVE and int(header[0]) == sh.epoch:
                return
            self.counts["stale"] += 1
            self._look_up_table(sh, int(header[2]))
        raise WorkerFailure(f"table {self.name!r}: shard {sh.s}'s table kept moving")

    def _header(self, sh: _Shard) -> torch.Tensor:
        if sh.view is not None:
            return sh.view.header.clone()
        at = self.layout.read_header
        self._read(sh, sh.table, 0, at, 8 * HEADER_WORDS).result(self.timeout)
        return self.raw[at: at + 8 * HEADER_WORDS].view(torch.int64).clone()

    # -- input --------------------------------------------------------------------------------------
    def _keys(self, keys, op: str) -> torch.Tensor:
        if self._closed:
            raise InvalidArgumentError(f"{op}: table {self.name!r} is closed")
        if not isinstance(keys, torch.Tensor):
            raise InvalidArgumentError(f"{op}: keys must be a 1-D int64 tensor, got {type(keys).__name__}")
        if keys.dtype != torch.int64 or keys.dim() != 1:
            raise InvalidArgumentError(f"{op}: keys must be a 1-D int64 tensor, got a {dtype_name(keys.dtype)} tensor "
                                       f"of shape {list(keys.shape)}")
        if keys.device.type != "cpu":
            raise InvalidArgumentError(f"{op}: keys are on {keys.device}; a sparse table takes host tensors")
        return keys.contiguous()

    def _values(self, values, n: int) -> torch.Tensor:
        want = f"[{n}, {self.dim}] {dtype_name(self.dtype)}"
        if not isinstance(values, torch.Tensor):
            raise InvalidArgumentError(f"push: values must be a {want} tensor, got {type(values).__name__}")
        if values.dtype != self.dtype or tuple(values.shape) != (n, self.dim) or values.device.type != "cpu":
            raise InvalidArgumentError(f"push: values must be a {want} host tensor (rows of the table's shape), got "
                                       f"{list(values.shape)} {dtype_name(values.dtype)} on {values.device}")
        return values.detach().contiguous()

    def _by_shard(self, keys: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        ns = self.role.num_shards
        if ns == 1:
            return [(0, torch.arange(len(keys)))] if len(keys) else []
        of = shard_of(keys, ns)
        return [(s, pos) for s in range(ns) if len(pos := torch.nonzero(of == s).flatten())]

    # -- waiting ------------------------------------------------------------------------------------
    def _shard_gave_up(self, s: int, what: str) -> bool:
        if bool(self.status.ne(0).any()):
            bad = int(self.status.ne(0).nonzero()[0])
            reason = bytes(self.reasons[bad].numpy()).split(b"\0", 1)[0].decode("utf-8", "replace")
            self.store.count_out()
            raise WorkerFailure(f"shard {bad} gave up while worker {self.id} waited for {what}: "
                                f"{reason or self.store.aborted() or 'see its output'}")
        sh = self.shards[s]
        if sh.channel.failed:
            self.store.fail_with(f"shard {s} died", ("shard", s))
            self.store.count_out()
            raise PeerError(f"shard {s} at {sh.ep} died while worker {self.id} waited for {what}")
        return False

    def _abort_reason(self):
        reason = self.store.aborted()
        if reason:
            self.store.count_out()
        return reason

    def _wait_word(self, w: torch.Tensor, j: int, value: int, s: int, what: str, deadline: Deadline) -> None:
        def timed_out():
            raise TimeoutError(f"worker {self.id} waited {deadline.timeout:g} s for {what} (shard {s}) in vain")

        wait_flag(Word(w[j: j + 1]), value, deadline, what, give_up=lambda: self._shard_gave_up(s, what),
                  abort_reason=self._abort_reason, aborted=WorkerFailure, on_timeout=timed_out)

    def _write(self, sh: _Shard, local_off: int, remote_off: int, nbytes: int):
        try:
            return sh.channel.memcpy(self.region, local_off, sh.remote, remote_off, nbytes, WRITE)
        except PeerError as e:
            raise PeerError(f"shard {sh.s} at {sh.ep} is unreachable from worker {self.id}: {e}") from None

    def _read(self, sh: _Shard, remote, remote_off: int, local_off: int, nbytes: int):
        return sh.channel.memcpy(self.region, local_off, remote, remote_off, nbytes, READ)

    def _acked(self, s: int, seq: int, deadline: Deadline) -> None:
        """Waits until shard s applied this worker's push ``seq`` (or refused it: recorded)."""
        if seq == 0:
            return
        self._wait_word(self.ack, s, seq << 1, s, f"shard {s}'s ack of push {seq}", deadline)
        a = int(self.ack[s])
        if a >> 1 == seq and a & FULL:
            self.refused.add((s, seq))

    # -- push ---------------------------------------------------------------------------------------
    def push(self, keys: torch.Tensor, values: torch.Tensor) -> SparseHandle:
        """Sends ``values`` [n, dim] to be applied to the rows of ``keys`` (1-D int64, any values,
        duplicates summed) by each shard's handler: one request per shard (per ``batch_rows``
        rows). Returns once the requests are posted (the values are copied: reuse them at once)."""
        with self._lock:
            keys = self._keys(keys, "push")
            values = self._values(values, len(keys))
            h = SparseHandle("push")
            deadline = Deadline(self.timeout)
            for s, pos in self._by_shard(keys):
                for chunk in pos.split(self.spec["batch_rows"]):
                    self._post_push(s, OP_PUSH, keys[chunk], values[chunk], None, h, deadline)
            return h

    def _post_push(self, s: int, op: int, keys, values, state, h: SparseHandle, deadline: Deadline) -> None:
        sh, L, fmt = self.shards[s], self.layout, self.fmt
        self._acked(s, self.push_seq[s], deadline)  # the stage and the shard's area are free
        n, at = len(keys), L.push_stage[s]
        head = self.raw[at: at + HEAD + U64 * n].view(torch.int64)
        head[0], head[1] = n, op
        head[2:] = keys
        vat = at + HEAD + U64 * n
        self.raw[vat: vat + n * fmt.row_bytes].view(self.dtype).view(n, self.dim).copy_(values)
        nbytes = HEAD + U64 * n + n * fmt.row_bytes
        if state is not None:
            self.raw[at + nbytes: at + nbytes + n * 4 * fmt.state].view(torch.float32).view(n, fmt.state).copy_(state)
            nbytes += n * 4 * fmt.state
        sl = self.shard_layout
        self._write(sh, at, sl.push(self.id), nbytes)
        sh.channel.fence()  # the request lands before its flag
        self.push_seq[s] += 1
        self.push_src[s] = self.push_seq[s]
        self._write(sh, L.push_src + U64 * s, sl.word(sl.push_flag, self.id), U64)
        h._pushes.append((s, self.push_seq[s]))

    # -- pull ---------------------------------------------------------------------------------------
    def pull(self, keys: torch.Tensor) -> SparseHandle:
        """The rows of ``keys`` (1-D int64); ``wait`` returns them as [n, dim]. A key never pushed
        reads as the initializer's value. One-sided where the read path allows (see sparse.py):
        what is read and verified, and absent keys, need no request; the rest goes as one
        request per shard. Sees this worker's earlier pushes (it waits until they are applied)
        and any push whose ``wait`` returned before."""
        with self._lock:
            keys = self._keys(keys, "pull")
            h = SparseHandle("pull")
            out = torch.empty(len(keys), self.dim, dtype=self.dtype)
            deadline = Deadline(self.timeout)
            for s, pos in self._by_shard(keys):
                sh = self.shards[s]
                rest = pos
                if self.read_path != "request" and (sh.view is not None or self.read_path == "read"):
                    self._acked(s, self.push_seq[s], deadline)  # read-your-writes
                    rest = self._one_sided(sh, keys, pos, out)
                for chunk in rest.split(self.spec["batch_rows"]) if len(rest) else ():
                    self._post_pull(s, keys[chunk], chunk, h, out, deadline)
            h.result = out
            return h

    def _one_sided(self, sh: _Shard, keys: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Reads keys[pos] from shard sh's table without its CPU; returns the positions it could
        not verify (torn, or read from a region that was replaced), for a request."""
        for attempt in range(2):
            k = keys[pos]
            if sh.view is not None:
                ok, found, rows, fresh = self._gather_mapped(sh, k)
            else:
                ok, found, rows, fresh = self._gather_read(sh, k)
            if fresh:
                break
            self._refresh(sh)
        else:
            return pos
        got = ok & found
        miss = ok & ~found
        if bool(got.all()):  # the usual pull: every row present and whole
            out.index_copy_(0, pos, rows)
            self.counts["one_sided_rows"] += len(pos)
            return pos[:0]
        if bool(got.any()):
            out[pos[got]] = rows[got]
        if bool(miss.any()):
            out[pos[miss]] = self.init_values.values(k[miss], self.dim, self.spec["seed"]).to(self.dtype)
        self.counts["one_sided_rows"] += int(got.sum())
        self.counts["initialized_rows"] += int(miss.sum())
        self.counts["torn"] += int((~ok).sum())
        return pos[~ok]

    def _verify(self, k, found, ent, v_before=None, v_after=None):
        """Which reads are whole: an even, non-zero version (and, read in place, the same version
        before and after the copy), the key, and the check word over version, key and row."""
        ver = ent[:, VER]
        ok = (ver > 0) & (ver & 1 == 0) & (ent[:, KEY] == k)
        if v_before is not None:
            ok &= (v_before == v_after) & (v_before == ver)
        else:
            ok &= ent[:, CHECK] == entry_check(ent, self.fmt.row_words)
        return ok | ~found  # an absent key: nothing to verify (its buckets' keys never change)

    def _gather_mapped(self, sh: _Shard, k: torch.Tensor):
        """The table mapped here: the gathers are the READs. Three loads in order (x86 keeps
        loads in program order; each is one tensor operation): versions, entries, versions."""
        view = sh.view
        found, slot = view.find(k)
        ent_all = view.entries
        v_before = ent_all[slot, VER]
        ent = ent_all[:, : ROW + self.fmt.row_words].index_select(0, slot)
        v_after = ent_all[slot, VER]
        fresh = int(view.header[1]) == LIVE and int(view.header[0]) == sh.epoch
        ok = self._verify(k, found, ent, v_before, v_after)
        return ok, found, self.fmt.rows_of(ent), fresh

    def _gather_read(self, sh: _Shard, k: torch.Tensor):
        """Over UCX: READs of the buckets' keys, then of the entries found, then of the header;
        an entry is copied in no particular order, so its check word verifies it."""
        L, fmt, n = self.layout, self.fmt, len(k)
        if n > self.spec["batch_rows"]:
            parts = [self._gather_read(sh, c) for c in k.split(self.spec["batch_rows"])]
            return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                    torch.cat([p[2] for p in parts]), all(p[3] for p in parts))
        b = buckets_of(k, sh.nbuckets)
        keys_at = 8 * HEADER_WORDS
        bucket_bytes = SLOTS * 16
        futs = [self._read(sh, sh.table, keys_at + bucket_bytes * bb, L.read_keys + bucket_bytes * i, bucket_bytes)
                for i, bb in enumerate(b.reshape(-1).tolist())]
        for f in futs:
            f.result(self.timeout)
        cand = self.raw[L.read_keys: L.read_keys + n * CHOICES * bucket_bytes].view(torch.int64)
        cand = cand.view(n, CHOICES, SLOTS, 2)
        found, slot = find_in(cand, b, k)
        ent_at = keys_at + sh.nbuckets * SLOTS * 16
        idx = torch.nonzero(found).flatten().tolist()
        slots = slot.tolist()
        futs = [self._read(sh, sh.table, ent_at + fmt.entry_bytes * slots[i], L.read_entries + fmt.entry_bytes * j,
                           fmt.entry_bytes) for j, i in enumerate(idx)]
        for f in futs:
            f.result(self.timeout)
        ent = torch.zeros(n, fmt.words, dtype=torch.int64)
        if idx:
            got = self.raw[L.read_entries: L.read_entries + len(idx) * fmt.entry_bytes].view(torch.int64)
            ent[found] = got.view(len(idx), fmt.words)
        header = self._header(sh)
        fresh = int(header[1]) == LIVE and int(header[0]) == sh.epoch
        ok = self._verify(k, found, ent)
        return ok, found, fmt.rows_of(ent), fresh

    def _post_pull(self, s: int, keys, positions, h: SparseHandle, out: torch.Tensor, deadline: Deadline) -> None:
        sh, L, sl = self.shards[s], self.layout, self.shard_layout
        if self._pending[s] is not None:
            self._complete(self._pending[s], deadline)
        n, at = len(keys), L.pull_stage[s]
        head = self.raw[at: at + HEAD + U64 * n].view(torch.int64)
        head[0], head[1] = n, 0
        head[2:] = keys
        self._write(sh, at, sl.pull(self.id), HEAD + U64 * n)
        sh.channel.fence()  # behind the request, and this worker's pushes: read-your-writes
        self.pull_seq[s] += 1
        self.pull_src[s] = self.pull_seq[s]
        self._write(sh, L.pull_src + U64 * s, sl.word(sl.pull_flag, self.id), U64)
        part = [s, self.pull_seq[s], positions, out, False]
        self._pending[s] = part
        h._parts.append(part)
        self.counts["request_rows"] += n

    def _complete(self, part: list, deadline: Deadline) -> None:
        s, seq, positions, out, done = part
        if done:
            return
        self._wait_word(self.reply, s, seq, s, f"shard {s}'s reply to a pull", deadline)
        at = self.layout.landing[s]
        n = len(positions)
        out[positions] = self.raw[at: at + n * self.fmt.row_bytes].view(self.dtype).view(n, self.dim)
        part[4] = True
        if self._pending[s] is part:
            self._pending[s] = None

    def wait(self, handle: SparseHandle, timeout: float | None = None):
        """A push: returns once the shards applied it (TableFullError if one refused it whole).
        A pull: returns the rows [n, dim]."""
        if not isinstance(handle, SparseHandle):
            raise InvalidArgumentError(f"wait() takes a handle from push() or pull(), got {type(handle).__name__}")
        with self._lock:
            if handle.done:
                return handle.result
            deadline = Deadline(self.timeout if timeout is None else checked_timeout(timeout))
            for s, seq in handle._pushes:
                if int(self.ack[s]) < seq << 1:
                    self._acked(s, seq, deadline)
                if (s, seq) in self.refused:
                    handle.done = True
                    raise TableFullError(f"table {self.name!r}: shard {s} holds too many rows to take this push "
                                         f"(max_rows_per_shard={self.spec['max_rows']}); nothing of its request "
                                         "to that shard was applied")
            for part in handle._parts:
                self._complete(part, deadline)
            handle.done = True
            return handle.result

    # -- barrier, stats, save, close ----------------------------------------------------------------
    def barrier(self, timeout: float | None = None) -> None:
        """Returns once every worker entered it; every push made before it is then applied."""
        with self._lock:
            deadline = Deadline(self.timeout if timeout is None else checked_timeout(timeout))
            for s in range(len(self.shards)):
                self._acked(s, self.push_seq[s], deadline)
            self.barrier_seq += 1
            self.barrier_src[0] = self.barrier_seq
            sl = self.shard_layout
            self._write(self.shards[0], self.layout.barrier_src, sl.word(sl.barrier, self.id), U64)
            self._wait_word(self.barrier_word, 0, self.barrier_seq, 0, f"barrier {self.barrier_seq}", deadline)

    def stats(self) -> dict:
        """This worker's counts (rows read one-sided, by request, computed as initial values;
        reads found torn; regions found replaced) and each shard's own counters, READ from it:
        ``requests`` (pull requests it served), ``push_requests``, ``epoch``, ``rows``."""
        with self._lock:
            per = []
            for sh in self.shards:
                at = self.layout.counters + U64 * COUNTERS * sh.s
                self._read(sh, sh.remote, self.shard_layout.counters, at, U64 * COUNTERS).result(self.timeout)
                c = self.raw[at: at + U64 * COUNTERS].view(torch.int64).tolist()
                per.append({"requests": c[0], "push_requests": c[1], "epoch": c[2], "rows": c[3]})
            return dict(self.counts, shards=per, requests=sum(p["requests"] for p in per))

    def save(self, path, timeout: float | None = None) -> None:
        """Collective: every worker calls it. After a barrier, worker 0 reads every shard's whole
        table and writes its rows (and the handler's state) by key to ``path``, for a later
        ``SparseTable(..., init=path)`` of any shard or worker count; every worker returns once
        the file is written (InvalidArgumentError on each if worker 0 could not)."""
        try:
            path = os.fspath(path)
        except TypeError:
            raise InvalidArgumentError(f"save: path must be a file name, got {type(path).__name__}") from None
        deadline = Deadline(self.timeout if timeout is None else checked_timeout(timeout))
        self.barrier(deadline.left())
        with self._lock:
            self.save_seq += 1
            outcome = f"sparse/{self.name}/save/{self.save_seq}"
            if self.id != 0:
                said = self.store.get(outcome, deadline.left())
                if said != "ok":
                    raise InvalidArgumentError(f"save: worker 0 could not write the snapshot: {said}")
                return
            try:
                keys, rows, state = self._dump()
                write_whole({"format": FORMAT, "version": VERSION, "table": _compared(self.spec), "keys": keys,
                             "rows": rows, "state": state}, path)
            except OSError as e:
                why = f"{path}: {type(e).__name__}: {e.strerror or e}"
                self.store.set(outcome, why)
                raise InvalidArgumentError(f"save: cannot write the snapshot {why}") from None
            except BaseException as e:
                self.store.set(outcome, f"{type(e).__name__}: {e}")
                raise
            self.store.set(outcome, "ok")

    def _dump(self):
        """Every row of every shard (no push is in flight: after a barrier, inside save)."""
        ks, rs, ss = [], [], []
        for sh in self.shards:
            self._refresh(sh)
            nbytes = self.fmt.region_bytes(sh.nbuckets)
            if sh.view is not None:
                keys, entries = sh.view.keys.clone(), sh.view.entries.clone()
            else:
                tmp = self.dev.alloc_region(nbytes)
                try:
                    sh.channel.memcpy(tmp, 0, sh.table, 0, nbytes, READ).result(self.timeout)
                    copy = TableView(region_bytes(tmp, nbytes).clone(), self.fmt, sh.nbuckets)
                finally:
                    tmp.free()
                keys, entries = copy.keys, copy.entries
            occ = keys[..., 1].reshape(-1) == 1
            e = entries[occ]
            ks.append(e[:, KEY].clone())
            rs.append(self.fmt.rows_of(e).clone())
            ss.append(self.fmt.state_of(e).clone())
        return torch.cat(ks), torch.cat(rs), torch.cat(ss)

    def _restore(self, keys, rows, state) -> None:
        """Worker 0, at setup: sets every row (and state) of a snapshot on its shard."""
        h = SparseHandle("push")
        deadline = Deadline(self.timeout)
        for s, pos in self._by_shard(keys):
            for chunk in pos.split(self.spec["batch_rows"]):
                self._post_push(s, OP_ASSIGN, keys[chunk], rows[chunk], state[chunk], h, deadline)
        self.wait(h)

    def close(self) -> None:
        """Tells every shard this worker is done with the table; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            deadline = Deadline(min(self.timeout, 30.0))
            try:
                for part in self._pending:
                    if part is not None:
                        self._complete(part, deadline)
                for s in range(len(self.shards)):
                    self._acked(s, self.push_seq[s], deadline)
            except RdmaflowError:
                pass
            self.done_src[0] = DONE
            futs = []
            sl = self.shard_layout
            for sh in getattr(self, "shards", []):
                if sh.channel.failed:
                    continue
                try:
                    sh.channel.fence()
                    futs.append(self._write(sh, self.layout.done_src, sl.word(sl.done, self.id), U64))
                except RdmaflowError:
                    pass
            d = Deadline(5.0)
            for f in futs:
                f.wait(d.left())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _compared(spec: dict) -> dict:
    """What a snapshot must share with the table that reads it (not its sizes or bound)."""
    return {k: spec[k] for k in ("dim", "dtype", "handler")}


def load(path: str, spec: dict):
    """(keys, rows, state) of a snapshot ``save()`` wrote; InvalidArgumentError naming the path
    when it is missing, unreadable, not a sparse snapshot, or of another row shape or handler."""
    state = read_file(path, "snapshot")
    if state.get("format") != FORMAT or state.get("version") != VERSION:
        raise InvalidArgumentError(f"snapshot {path} is not a sparse-table snapshot of this rdmaflow "
                                   f"(format {state.get('format')!r}, version {state.get('version')!r})")
    mine, theirs = _compared(spec), state.get("table") or {}
    for k in mine:
        if mine[k] != theirs.get(k):
            raise InvalidArgumentError(f"snapshot {path} was saved from another table: its {k} is {theirs.get(k)!r}, "
                                       f"this table's {mine[k]!r}")
    keys, rows, st = state.get("keys"), state.get("rows"), state.get("state")
    fmt = table_spec_format(spec)
    if (not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or not isinstance(rows, torch.Tensor)
            or tuple(rows.shape) != (len(keys), fmt.dim) or not isinstance(st, torch.Tensor)
            or tuple(st.shape) != (len(keys), fmt.state)):
        raise InvalidArgumentError(f"snapshot {path} is damaged: its keys, rows and state do not match")
    return keys, rows.to(fmt.dtype), st.to(torch.float32)
