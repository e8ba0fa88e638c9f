"""The worker's end of the key-value API: KVStore (push, pull, wait, barrier, close) and the
handles it returns. The protocol is described in kv.py."""
from __future__ import annotations

import json

import torch

from rdmaflow import WRITE, InvalidArgumentError, PeerError, RdmaflowError, RemoteRegion, TimeoutError
from rdmaflow.deadline import Deadline
from rdmaflow.ps.context import dumps
from rdmaflow.ps.kv_job import leave
from rdmaflow.ps.kv_layout import DTYPES, REASON, U64, KVLayout, declaration, describe_difference, key_of, words
from rdmaflow.ps.protocol import DONE
from rdmaflow.ps.worker import WorkerFailure
from rdmaflow.transfer.common import pack_header, unpack_header
from rdmaflow.transfer.dtypes import dtype_name
from rdmaflow.transfer.flag import Word, wait_flag

ARENA_SLACK = 16 << 20  # room left in a worker's arena for tensors it pushes without a copy


def _arena(dev, nbytes: int):
    existing = getattr(dev, "_rdmaflow_arena", None)
    return existing if existing is not None else dev.create_arena(nbytes)


class KVHandle:
    """What ``push`` and ``pull`` return; pass it to ``KVStore.wait``."""

    __slots__ = ("_futs", "_items", "_keep", "_result", "done", "keys", "kind", "single")

    def __init__(self, kind: str, keys: list[int], single: bool = False):
        self.kind, self.keys, self.single = kind, keys, single
        self._futs: list = []
        self._items: list = []
        self._keep: list = []  # tensors sent without a copy, alive until the WRITEs completed
        self.done = False
        self._result = None

    def __repr__(self) -> str:
        return f"<KVHandle {self.kind} of {len(self.keys)} keys{' done' if self.done else ''}>"


class _Pull:
    __slots__ = ("done", "j", "out", "result", "seq")

    def __init__(self, j: int, seq: int, out):
        self.j, self.seq, self.out = j, seq, out
        self.result = None
        self.done = False


_ACTIVE: set[int] = set()  # ids of contexts that already hold a KVStore


class KVStore:
    """The worker's end of the key-value API. Construct it on every worker with the same
    declaration (``keys``, ``shapes``, ``dtype``); ``init`` (worker 0 only, others ignore it)
    gives the initial values, else they are zeros. One KVStore per job; not thread-safe."""

    def __init__(self, keys, shapes, dtype: torch.dtype = torch.float32, *, init=None, ctx=None,
                 timeout: float | None = None):
        if ctx is None:
            from rdmaflow import ps

            ctx = ps._CTX
        if ctx is None:
            raise InvalidArgumentError("call rdmaflow.ps.init() first")
        if not ctx.is_worker:
            raise InvalidArgumentError("KVStore runs on workers; this process is a shard")
        if id(ctx) in _ACTIVE:
            raise InvalidArgumentError("this job already has a KVStore: declare every key in one KVStore")
        self.ctx = ctx
        self.role = ctx.role
        self.id = ctx.role.index
        self.store = ctx.store
        self.dev = ctx.device
        self.timeout = ctx.step_timeout if timeout is None else float(timeout)
        self._closed = False
        self.stats = {"pushes": 0, "pulls": 0, "barriers": 0, "zero_copy": 0}
        _ACTIVE.add(id(ctx))
        try:  # a bad declaration aborts the job too: the other processes would wait for this one
            try:
                keys = list(keys.tolist() if isinstance(keys, torch.Tensor) else keys)
            except TypeError:
                raise InvalidArgumentError(f"keys must be a sequence of integers, got {keys!r}") from None
            decl = declaration(keys, shapes, dtype)
            if init is not None and self.id == 0:
                init = self._check_init(decl, keys, init)
            self._setup(decl, init if self.id == 0 else None)
        except Exception as e:
            self.store.abort(f"worker {self.id}: {e}")
            leave(ctx, f"worker/{self.id}")
            _ACTIVE.discard(id(ctx))
            raise

    @staticmethod
    def _check_init(decl: dict, keys, init) -> list[torch.Tensor]:
        init = list(init) if isinstance(init, (list, tuple)) else None
        if init is None or len(init) != len(decl["keys"]):
            raise InvalidArgumentError("init must be a list with one tensor per declared key")
        order = {key_of(k): t for k, t in zip(keys, init)}
        dtype = DTYPES[decl["dtype"]]
        out = []
        for k, shape in decl["keys"]:
            t = order[k]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
                got = (f"{dtype_name(t.dtype)}{list(t.shape)}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise InvalidArgumentError(f"init of key {k} must be {decl['dtype']}{shape}, got {got}")
            out.append(t)
        return out

    # -- setup ------------------------------------------------------------------------------------
    def _setup(self, decl: dict, init) -> None:
        store, role = self.store, self.role
        store.set(f"ep/worker/{self.id}", self.dev.endpoint)
        if self.id == 0:
            store.set("kv/spec", dumps(dict(decl, init=init is not None)))
            store.set("config", dumps({"kind": "kv"}))
        cfg = json.loads(store.get("config"))
        if cfg.get("kind") != "kv":
            raise WorkerFailure(f"worker {self.id} made a KVStore, but worker 0 runs a DistributedOptimizer job: "
                                "every worker of a job must use the same API")
        job = json.loads(store.get("kv/spec"))
        job_decl = {"dtype": job["dtype"], "keys": job["keys"]}
        if job_decl != decl:
            raise InvalidArgumentError(
                f"worker {self.id}'s key declaration differs from worker 0's: {describe_difference(decl, job_decl)}")
        self.spec = spec = KVLayout(decl, role.num_shards, role.num_workers)
        self.dtype, self.keys = spec.dtype, spec.keys
        L = self.layout = spec.worker
        self.arena = _arena(self.dev, L.total + ARENA_SLACK)
        self.block = self.arena.allocate(L.total)
        self.base = self.block.offset
        self.region = self.arena.region
        raw = torch.frombuffer(self.block, dtype=torch.uint8, count=L.total)
        raw[L.flags :].zero_()

        def value(off: int, j: int) -> torch.Tensor:
            o = off + L.voff[j]
            return raw[o : o + spec.nbytes[j]].view(self.dtype).view(spec.shapes[j])

        self.staging = [value(L.stage, j) for j in range(L.k)]
        self.outs = [value(L.out, j) for j in range(L.k)]
        self.reply = words(raw, L.reply, L.k)
        self.ack = words(raw, L.ack, L.k)
        self.push_src = words(raw, L.push_src, L.k)
        self.pull_src = words(raw, L.pull_src, L.k)
        self.status = words(raw, L.status, role.num_shards)
        self.reasons = raw[L.reason : L.reason + REASON * role.num_shards].view(role.num_shards, REASON)
        self.barrier_word = words(raw, L.barrier, 1)
        self.done_src = words(raw, L.done_src, 1)
        self.barrier_src = words(raw, L.barrier_src, 1)
        if init is not None:
            for j, t in enumerate(init):
                self.staging[j].copy_(t)
        self.push_seq = [0] * L.k
        self.pull_seq = [0] * L.k
        self.barrier_seq = 0
        self._pending: list[_Pull | None] = [None] * L.k
        self._unflushed: list = []  # futures of push flags not yet known to be visible
        self._held: list = []  # (last flag future of a push, the arena tensors it sends from)
        self.dev.publish("ps/kv/worker", pack_header({"total": L.total, "base": self.base}, self.region.descriptor()))
        store.set(f"ready/worker/{self.id}", "1")
        self.shards = []
        for s in range(role.num_shards):
            ep = store.get(f"ep/shard/{s}")
            store.wait([f"ready/shard/{s}"])
            meta, desc = unpack_header(self.dev.lookup(ep, "ps/kv/shard", self.ctx.timeout), "ps/kv/shard")
            if int(meta["total"]) != spec.shards[s].total:
                raise WorkerFailure(f"shard {s} computed a layout of {meta['total']} bytes, this worker "
                                    f"{spec.shards[s].total}: are all processes running the same rdmaflow?")
            self.shards.append({"ep": ep, "remote": RemoteRegion.from_descriptor(desc),
                                "base": int(meta["base"]), "layout": spec.shards[s], "channel": self.dev.channel(ep)})
        # The shards are serving (and have read worker 0's initial values) once this returns.
        store.wait([f"kv/serving/{s}" for s in range(role.num_shards)])

    # -- checks -----------------------------------------------------------------------------------
    def _index(self, k, op: str) -> int:
        k = key_of(k)
        j = self.spec.index.get(k)
        if j is None:
            raise InvalidArgumentError(f"{op}: key {k} was not declared (declared: {_short(self.keys)})")
        return j

    def _prepare(self, keys, tensors, op: str, allow_none: bool = False):
        if self._closed:
            raise InvalidArgumentError(f"{op}: this KVStore is closed")
        if isinstance(keys, torch.Tensor) and keys.dim() == 1:
            keys = keys.tolist()
        single = not isinstance(keys, (list, tuple))
        keys = [keys] if single else list(keys)
        if tensors is None and allow_none:
            tensors = [None] * len(keys)
        elif single or isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        else:
            tensors = list(tensors)
        if len(keys) != len(tensors):
            raise InvalidArgumentError(f"{op}: {len(keys)} keys but {len(tensors)} tensors")
        idx = [self._index(k, op) for k in keys]
        if len(set(idx)) != len(idx):
            dup = next(self.keys[j] for j in idx if idx.count(j) > 1)
            raise InvalidArgumentError(f"{op}: key {dup} appears twice in one call")
        for j, t in zip(idx, tensors):
            if t is None and allow_none:
                continue
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"{op}: the tensor of key {self.keys[j]} must be a torch.Tensor, "
                                                 f"got {type(t).__name__}")
            want = self.spec.shapes[j]
            if t.dtype != self.dtype or tuple(t.shape) != want:
                raise InvalidArgumentError(
                    f"{op}: key {self.keys[j]} holds {dtype_name(self.dtype)}{list(want)}, got "
                    f"{dtype_name(t.dtype)}{list(t.shape)}")
            if t.device.type != "cpu":
                raise InvalidArgumentError(f"{op}: the tensor of key {self.keys[j]} is on {t.device}; "
                                                 "the key-value API moves host tensors")
        return idx, tensors, single

    # -- waiting ----------------------------------------------------------------------------------
    def _fail(self, msg: str, exc=PeerError):
        """The error for a shard that is gone; the job's abort reason instead if it has one (that
        shard may have left because of another failure)."""
        reason = self.store.abort_reason()
        leave(self.ctx, f"worker/{self.id}")
        if reason:
            return WorkerFailure(f"the job was aborted: {reason}")
        self.store.abort(msg)
        return exc(msg)

    def _shard_gave_up(self, s: int, what: str) -> bool:
        """A liveness check while waiting on shard s: raises if a shard left its reason in this
        worker's block (the store may be gone with it) or if shard s's channel failed."""
        if self.status.ne(0).any():
            bad = int(self.status.ne(0).nonzero()[0])
            reason = bytes(self.reasons[bad].numpy()).split(b"\0", 1)[0].decode("utf-8", "replace")
            leave(self.ctx, f"worker/{self.id}")
            raise WorkerFailure(f"shard {bad} gave up while worker {self.id} waited for {what}: "
                                f"{reason or self.store.aborted() or 'see its output'}")
        sh = self.shards[s]
        if sh["channel"].failed:
            raise self._fail(f"shard {s} at {sh['ep']} died while worker {self.id} waited for {what}")
        return False

    def _abort_reason(self) -> str | None:
        reason = self.store.aborted()
        if reason:
            leave(self.ctx, f"worker/{self.id}")
        return reason

    def _wait_word(self, words: torch.Tensor, j: int, value: int, s: int, what: str, deadline: Deadline) -> None:
        def timed_out():
            raise TimeoutError(f"shard {s} did not answer {what} within {self.timeout:g} s")

        wait_flag(Word(words[j : j + 1]), value, deadline, what, give_up=lambda: self._shard_gave_up(s, what),
                  abort_reason=self._abort_reason, aborted=WorkerFailure, on_timeout=timed_out)

    def _wait_futures(self, futs, deadline: Deadline, what: str) -> None:
        """Waits for (shard, future) pairs of WRITEs this worker posted."""
        for s, f in futs:
            try:
                f.result(deadline.left())
            except TimeoutError:
                raise TimeoutError(f"{what} did not reach shard {s} within {self.timeout:g} s") from None
            except PeerError as e:
                raise self._fail(f"shard {s} at {self.shards[s]['ep']} died while worker {self.id} waited "
                                 f"for {what}: {e}") from None

    def _write(self, s: int, local_off: int, remote_off: int, nbytes: int, what: str):
        """WRITEs nbytes at local_off of this worker's region to remote_off of shard s's block;
        returns the (shard, future) pair."""
        sh = self.shards[s]
        try:
            return s, sh["channel"].memcpy(self.region, local_off, sh["remote"], sh["base"] + remote_off, nbytes, WRITE)
        except PeerError as e:
            raise self._fail(f"shard {s} at {sh['ep']} is unreachable from worker {self.id} ({what}): {e}") from None

    # -- the API ----------------------------------------------------------------------------------
    def push(self, keys, tensors) -> KVHandle:
        """Sends ``tensors`` to their keys' shards, which apply the handler to each. Returns at
        once with a handle; the tensors may be reused when push returns, except ones that live
        in the device's arena (sent without a copy): keep those unchanged until ``wait``."""
        idx, tensors, _ = self._prepare(keys, tensors, "push")
        h = KVHandle("push", [self.keys[j] for j in idx])
        deadline = Deadline(self.timeout)
        by_shard: dict[int, list[int]] = {}
        L, spec = self.layout, self.spec
        for j in idx:
            # One push per key in flight: the slot (and the staging) are free once acked.
            self._wait_word(self.ack, j, self.push_seq[j], spec.shard_of[j], f"the push of key {self.keys[j]}",
                            deadline)
        for j, t in zip(idx, tensors):
            s = spec.shard_of[j]
            off = self.arena.offset_of(t) if t.is_contiguous() else None
            if off is None:
                self.staging[j].copy_(t)
                off = self.base + L.stage + L.voff[j]
            else:
                h._keep.append(t)
                self.stats["zero_copy"] += 1
            h._futs.append(self._write(s, off, spec.shards[s].slot(self.id, spec.local[j]), spec.nbytes[j], "push"))
            by_shard.setdefault(s, []).append(j)
        for s, js in by_shard.items():
            self.shards[s]["channel"].fence()  # the values land before their flags
            sl = spec.shards[s]
            for j in js:
                self.push_seq[j] += 1
                self.push_src[j] = self.push_seq[j]
                pair = self._write(s, self.base + L.push_src + U64 * j, sl.word(sl.push, self.id, spec.local[j]),
                                   U64, "push")
                h._futs.append(pair)
                self._unflushed.append(pair)
        self.stats["pushes"] += len(idx)
        if len(self._unflushed) > 4096:
            self._unflushed = [p for p in self._unflushed if not p[1].done()]
        # Tensors sent without a copy stay referenced until their WRITEs completed, even if the
        # handle is dropped: their arena memory must not be reused while a WRITE reads it.
        while self._held and self._held[0][0].done():
            self._held.pop(0)
        if h._keep:
            self._held.append((h._futs[-1][1], list(h._keep)))
        return h

    def pull(self, keys, outs=None) -> KVHandle:
        """Asks the keys' shards for their values; ``wait`` copies them into ``outs`` (or into
        new tensors when ``outs`` is None) and returns them. A pull sees this worker's earlier
        pushes, and every other worker's push whose ``wait`` returned before it."""
        idx, outs, single = self._prepare(keys, outs, "pull", allow_none=True)
        h = KVHandle("pull", [self.keys[j] for j in idx], single)
        deadline = Deadline(self.timeout)
        by_shard: dict[int, list[int]] = {}
        for j in idx:
            if self._pending[j] is not None:  # the out area is reused: finish the earlier pull first
                self._complete(self._pending[j], deadline)
            by_shard.setdefault(self.spec.shard_of[j], []).append(j)
        items = {}
        L, spec = self.layout, self.spec
        for s, js in by_shard.items():
            self.shards[s]["channel"].fence()  # behind this worker's pushes: read-your-writes
            sl = spec.shards[s]
            for j in js:
                self.pull_seq[j] += 1
                self.pull_src[j] = self.pull_seq[j]
                h._futs.append(self._write(s, self.base + L.pull_src + U64 * j,
                                           sl.word(sl.pull, self.id, spec.local[j]), U64, "pull"))
                items[j] = self._pending[j] = _Pull(j, self.pull_seq[j], None)
        for j, out in zip(idx, outs):
            items[j].out = out
            h._items.append(items[j])
        self.stats["pulls"] += len(idx)
        return h

    def _complete(self, item: _Pull, deadline: Deadline) -> None:
        if item.done:
            return
        j = item.j
        s = self.spec.shard_of[j]
        self._wait_word(self.reply, j, item.seq, s, f"the pull of key {self.keys[j]}", deadline)
        if item.out is not None:
            item.out.copy_(self.outs[j])
            item.result = item.out
        else:
            item.result = self.outs[j].clone()
        item.done = True
        if self._pending[j] is item:
            self._pending[j] = None

    def wait(self, handle: KVHandle, timeout: float | None = None):
        """Waits until ``handle`` completed. A push: its values are at the shards (visible to
        every later pull). A pull: returns the list of pulled tensors (a tensor if pull was
        given one key, not a list). Raises PeerError if a shard died, TimeoutError after
        ``timeout`` (default: the job's step timeout)."""
        if not isinstance(handle, KVHandle):
            raise InvalidArgumentError(
                f"wait() takes a handle from push() or pull(), got {type(handle).__name__}")
        if handle.done:
            return handle._result
        deadline = Deadline(self.timeout if timeout is None else float(timeout))
        what = f"{handle.kind} of keys {_short(handle.keys)}"
        self._wait_futures(handle._futs, deadline, what)
        if handle.kind == "pull":
            for item in handle._items:
                self._complete(item, deadline)
            handle._result = [item.result for item in handle._items]
            if handle.single:
                handle._result = handle._result[0]
        handle._keep.clear()
        handle._futs.clear()
        handle.done = True
        return handle._result

    def push_pull(self, keys, tensors, outs=None):
        """Pushes, then pulls the same keys (the pull sees the push); returns the pulled values."""
        self.push(keys, tensors)
        return self.wait(self.pull(keys, outs))

    def barrier(self, timeout: float | None = None) -> None:
        """Returns once every live worker entered this barrier; pushes any worker made before
        it are visible to pulls made after it. One-sided, through shard 0."""
        if self._closed:
            raise InvalidArgumentError("barrier: this KVStore is closed")
        deadline = Deadline(self.timeout if timeout is None else float(timeout))
        self._wait_futures(self._unflushed, deadline, f"worker {self.id}'s pushes")
        self._unflushed = []
        self.barrier_seq += 1
        self.barrier_src[0] = self.barrier_seq
        self._write(0, self.base + self.layout.barrier_src, self.spec.shards[0].barrier + U64 * self.id, U64,
                    "barrier")
        self._wait_word(self.barrier_word, 0, self.barrier_seq, 0, f"barrier {self.barrier_seq}", deadline)
        self.stats["barriers"] += 1

    @property
    def num_workers(self) -> int:
        return self.role.num_workers

    @property
    def rank(self) -> int:
        """This worker's index among the job's workers."""
        return self.id

    def close(self) -> None:
        """Finishes outstanding pulls and tells every shard this worker is done."""
        if self._closed:
            return
        self._closed = True
        _ACTIVE.discard(id(self.ctx))
        deadline = Deadline(min(self.timeout, 30.0))
        try:
            for item in self._pending:
                if item is not None:
                    self._complete(item, deadline)
            self._wait_futures(self._unflushed, deadline, f"worker {self.id}'s pushes")
        except RdmaflowError:
            pass  # the job is failing already; still tell the shards this worker is done
        self._unflushed = []
        self.done_src[0] = DONE
        futs = []
        for sh in getattr(self, "shards", []):
            if sh["channel"].failed:
                continue
            try:
                sh["channel"].fence()
                futs.append(sh["channel"].memcpy(self.region, self.base + self.layout.done_src, sh["remote"],
                                                 sh["base"] + sh["layout"].done + U64 * self.id, U64, WRITE))
            except RdmaflowError:
                pass
        deadline = Deadline(5.0)
        for f in futs:
            f.wait(deadline.left())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _short(keys) -> str:
    keys = list(keys)
    return str(keys) if len(keys) <= 8 else f"[{', '.join(map(str, keys[:8]))}, ... ({len(keys)} keys)]"


