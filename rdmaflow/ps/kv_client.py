"""The worker's end of the key-value API: KVStore (push, pull, wait, barrier, save, close) and the
handles it returns. The protocol is described in kv.py."""
from __future__ import annotations

import contextlib
import functools
import json
import os
import threading

import torch

from rdmaflow import READ, WRITE, InvalidArgumentError, PeerError, RdmaflowError, RemoteRegion, TimeoutError
from rdmaflow.deadline import Deadline, checked_timeout
from rdmaflow.ps import kv_replica, kv_snapshot
from rdmaflow.ps.checkpoint import resuming
from rdmaflow.ps.context import dumps, replica_count
from rdmaflow.ps.kv_layout import DTYPES, REASON, U64, KVLayout, declaration, describe_difference, key_of, words
from rdmaflow.ps.kv_request import Request, short
from rdmaflow.ps.protocol import DONE
from rdmaflow.ps.services import declare as declare_service
from rdmaflow.ps.worker import WorkerFailure
from rdmaflow.transfer.common import pack_header, unpack_header
from rdmaflow.transfer.dtypes import dtype_name
from rdmaflow.transfer.flag import Word, wait_flag

ARENA_SLACK = 16 << 20  # room left in a worker's arena for tensors it pushes without a copy


class KVHandle:
    """What ``push`` and ``pull`` return; pass it to ``KVStore.wait``."""

    __slots__ = ("_acks", "_futs", "_keep", "_parts", "_request", "_result", "done", "keys", "kind")

    def __init__(self, kind: str, request: Request):
        self.kind, self.keys, self._request = kind, request.keys, request
        self._futs: list = []
        self._parts: list[_PullPart] = []
        self._acks: list[tuple[int, int]] = []  # with replicas: (range, push number) acknowledged at wait
        self._keep: list = []  # tensors sent without a copy, alive until the WRITEs completed
        self.done = False
        self._result = None

    def __repr__(self) -> str:
        return f"<KVHandle {self.kind} of {len(self.keys)} keys{' done' if self.done else ''}>"


class _PullPart:
    """What one shard owes a pull: its reply ``seq`` lands in this worker's landing area of shard
    ``s``; ``positions`` are the request positions of its keys (None: all of them)."""

    __slots__ = ("done", "positions", "s", "seq", "values")

    def __init__(self, s: int, seq: int, positions, values: torch.Tensor):
        self.s, self.seq, self.positions, self.values = s, seq, positions, values
        self.done = False


def _serialized(method):
    """Runs ``method`` holding the store's lock: calls from several threads take turns."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked


class KVStore:
    """The worker's end of the key-value API. Construct it on every worker with the same
    declaration (``keys``, ``shapes``, ``dtype``); ``init`` (worker 0 only, others ignore it)
    gives the initial values, else they are zeros: one tensor per key, in ``keys``' order, or the
    path of a snapshot ``save()`` wrote (of this declaration; a job of any shard and worker
    count may read it). One KVStore per job.

    Thread-safe: every method may be called from several threads. push, pull and barrier hold
    the store while they post, save and close for their whole duration, so they take turns and a
    push's sequence numbers and staging area are never shared by two calls at once. Their
    waits for a shard (a push for its acknowledgement of the last push, a pull for the reply to
    the last pull, a barrier for shard 0 to release it), and ``wait``, block without holding it:
    one thread waiting for a slow shard does not hold back another's pushes and pulls."""

    def __init__(self, keys, shapes, dtype: torch.dtype = torch.float32, *, init=None, ctx=None,
                 timeout: float | None = None, replicas: int | None = None):
        if ctx is None:
            from rdmaflow import ps

            ctx = ps._CTX
        if ctx is None:
            raise InvalidArgumentError("call rdmaflow.ps.init() first")
        if not ctx.is_worker:
            raise InvalidArgumentError("KVStore runs on workers; this process is a shard")
        if ctx.kv_state == "open":
            raise InvalidArgumentError("this job already has a KVStore: declare every key in one KVStore")
        if ctx.kv_state == "closed":
            raise InvalidArgumentError("this job's KVStore was closed, and its shards finished with it: "
                                       "a job has one KVStore")
        self.ctx, self.role, self.id = ctx, ctx.role, ctx.role.index
        self.store, self.dev = ctx.store, ctx.device
        self.timeout = ctx.step_timeout if timeout is None else checked_timeout(timeout)
        self._closed = False
        self._lock = threading.RLock()
        self.stats = {"pushes": 0, "pulls": 0, "barriers": 0, "zero_copy": 0}
        ctx.kv_state = "open"
        try:  # a bad declaration aborts the job too: the other processes would wait for this one
            try:
                keys = list(keys.tolist() if isinstance(keys, torch.Tensor) else keys)
            except TypeError:
                raise InvalidArgumentError(f"keys must be a sequence of integers, got {keys!r}") from None
            snapshot = isinstance(init, (str, os.PathLike))
            # Restarting from zeros (or a list of tensors) would lose what the job had stored;
            # worker 0's init alone decides the values.
            if resuming() and self.id == 0 and not snapshot:
                raise InvalidArgumentError(
                    "rdmaflow launch --resume (RDMAFLOW_RESUME=1) restarts a KVStore job from a snapshot: give "
                    "KVStore init= the path its save() wrote. A KVStore job takes no checkpoints of its own; "
                    "without a snapshot, start it without --resume")
            decl = declaration(keys, shapes, dtype)
            if init is not None and self.id == 0:
                init = kv_snapshot.load(os.fspath(init), decl) if snapshot else self._check_init(decl, keys, init)
            if self.id == 0:  # worker 0's setting is the job's (context.replica_count)
                replicas = replica_count(ctx.shard_replicas if replicas is None else replicas, self.role.num_shards)
            self._setup(decl, init if self.id == 0 else None, replicas)
        except Exception as e:
            # A peer lost during setup (a shard that closed its device) is most likely a
            # consequence of the job's abort: then that is what to report.
            reason = self.store.fail_with(f"worker {self.id}: {e}")
            self.store.count_out()
            ctx.kv_state = None
            if reason and isinstance(e, PeerError):
                raise WorkerFailure(f"the job was aborted: {reason}") from e
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
    def _setup(self, decl: dict, init, replicas: int | None) -> None:
        store, role = self.store, self.role
        declare_service(self.ctx, "kv")  # the job's shards serve a KVStore (services.py)
        store.set(f"ep/worker/{self.id}", self.dev.endpoint)
        if self.id == 0:
            store.set_large("kv/spec", dumps(dict(decl, init=init is not None, replicas=replicas)))  # ~15 bytes a key
        job = json.loads(store.get_large("kv/spec"))
        job_decl = {"dtype": job["dtype"], "keys": job["keys"]}
        if job_decl != decl:
            raise InvalidArgumentError(
                f"worker {self.id}'s key declaration differs from worker 0's: {describe_difference(decl, job_decl)}")
        self.replicas = int(job.get("replicas", 1))
        self.spec = spec = KVLayout(decl, role.num_shards, role.num_workers, self.replicas)
        self.dtype, self.keys = spec.dtype, spec.keys
        L = self.layout = spec.worker
        self.arena = self.dev.ensure_arena(L.total + ARENA_SLACK)
        self.block = self.arena.allocate(L.total)
        self.base = self.block.offset
        self.region = self.arena.region
        raw = self.raw = torch.frombuffer(self.block, dtype=torch.uint8, count=L.total)
        raw[L.flags :].zero_()
        ns = role.num_shards
        self.reply = words(raw, L.reply, ns)
        self.ack = words(raw, L.ack, ns)
        self.push_src = words(raw, L.push_src, ns)
        self.pull_src = words(raw, L.pull_src, ns)
        self.status = words(raw, L.status, ns)
        self.reasons = raw[L.reason : L.reason + REASON * ns].view(ns, REASON)
        self.barrier_word = words(raw, L.barrier, 1)
        self.done_src = words(raw, L.done_src, 1)
        self.barrier_src = words(raw, L.barrier_src, 1)
        if init is not None:  # staged as a request of every key of the shard, which READs it
            for s, js in enumerate(spec.shard_keys):
                if js:
                    staged = self._stage_values(s, len(js), spec.shards[s].elements)
                    with torch.no_grad():  # init may be the model's parameters
                        torch.cat([init[j].reshape(-1) for j in js], out=staged)
        self.push_seq = [0] * ns
        self.pull_seq = [0] * ns
        self.barrier_seq = 0
        self.save_seq = 0
        self._saving: int | None = None  # a save() past its barrier whose outcome this worker has not seen
        self._in_barrier = False
        self._pending: list[_PullPart | None] = [None] * ns
        self._unflushed: list = []  # futures of push flags not yet known to be visible
        self._held: list = []  # (the futures of a push's WRITEs, the arena tensors it sends from)
        # The last push (staged bytes, arena parts (offset, bytes), their tensors) and pull (bytes)
        # staged for each range: what a failover sends the range's successor again.
        self._staged: list[tuple | None] = [None] * ns
        self._pull_bytes = [0] * ns
        self.dev.publish("ps/kv/worker", pack_header({"total": L.total, "base": self.base}, self.region.descriptor()))
        store.set(f"kv/ready/worker/{self.id}", "1")
        # copies[r][c]: where shard process c holds key range r; shards[r]: the copy that serves it
        self.copies: list[dict[int, dict]] = [{} for _ in range(ns)]
        for c in range(ns):
            ep = store.get(f"ep/shard/{c}")
            store.wait([f"kv/ready/shard/{c}"])
            meta, desc = unpack_header(self.dev.lookup(ep, "ps/kv/shard", self.ctx.timeout), "ps/kv/shard")
            remote, channel = RemoteRegion.from_descriptor(desc), self.dev.channel(ep)
            for r, (base, total) in meta["ranges"].items():
                r = int(r)
                if int(total) != spec.shards[r].total:
                    raise WorkerFailure(f"shard {c} computed a layout of {total} bytes for key range {r}, this "
                                        f"worker {spec.shards[r].total}: are all processes running the same rdmaflow?")
                self.copies[r][c] = {"proc": c, "ep": ep, "remote": remote, "base": int(base),
                                     "layout": spec.shards[r], "channel": channel}
        self.shards = [self.copies[r][r] for r in range(ns)]
        # The shards are serving (and have read worker 0's initial values) once this returns.
        store.wait([f"kv/serving/{s}" for s in range(ns)])

    def _stage_values(self, s: int, count: int, elements: int) -> torch.Tensor:
        """The values part of the push request staged for shard s, after its ``count`` indices."""
        at = self.layout.push_stage[s] + U64 * (1 + count)
        return self.raw[at : at + elements * self.spec.itemsize].view(self.dtype)

    def _stage_indices(self, area: int, rows: torch.Tensor) -> int:
        """Writes a request's header (its key count) and key indices at ``area``; returns their bytes."""
        head = self.raw[area : area + U64 * (1 + len(rows))].view(torch.int64)
        head[0] = len(rows)
        head[1:] = rows
        return U64 * (1 + len(rows))

    # -- waiting ----------------------------------------------------------------------------------
    def _fail(self, msg: str, exc=PeerError, dead_shard: int | None = None):
        """The error for a shard that is gone; the job's abort reason instead if it has one (that
        shard may have left because of another failure). Without one, ``dead_shard`` (the shard
        whose channel failed) is declared dead in the store."""
        reason = self.store.fail_with(msg, None if dead_shard is None else ("shard", dead_shard))
        self.store.count_out()
        if reason:
            return WorkerFailure(f"the job was aborted: {reason}")
        return exc(msg)

    def _shard_gave_up(self, s: int, what: str) -> bool:
        """A liveness check while waiting on shard s: raises if a shard left its reason in this
        worker's block (the store may be gone with it) or if shard s's channel failed."""
        if self.status.ne(0).any():
            bad = int(self.status.ne(0).nonzero()[0])
            reason = bytes(self.reasons[bad].numpy()).split(b"\0", 1)[0].decode("utf-8", "replace")
            self.store.count_out()
            raise WorkerFailure(f"shard {bad} gave up while worker {self.id} waited for {what}: "
                                f"{reason or self.store.aborted() or 'see its output'}")
        sh = self.shards[s]
        if sh["channel"].failed:
            if self.replicas > 1:
                self._failover(s)
                return False
            raise self._fail(f"shard {s} at {sh['ep']} died while worker {self.id} waited for {what}", dead_shard=s)
        return False

    def _abort_reason(self) -> str | None:
        reason = self.store.aborted()
        if reason:
            self.store.count_out()
        return reason

    def _wait_word(self, words: torch.Tensor, j: int, value: int, s: int, what: str, deadline: Deadline,
                   watch=None, why=None, op: str | None = None) -> None:
        """Waits for shard s to write ``value`` into ``words[j]``; the channels of the shards in
        ``watch`` (default: s) are checked while waiting. ``why()``, on a timeout, says why.
        With ``op``, a store another thread closes meanwhile ends the wait: InvalidArgumentError."""
        def timed_out():
            raise TimeoutError(f"worker {self.id} waited {deadline.timeout:g} s for {what} (shard {s}) in vain"
                               + (why() if why is not None else ""))

        def closed() -> bool:
            if op is not None and self._closed:
                raise InvalidArgumentError(f"{op}: this KVStore was closed while it waited for {what}")
            return False

        watched = [s] if watch is None else list(watch)
        wait_flag(Word(words[j : j + 1]), value, deadline, what,
                  give_up=lambda: closed() or any(self._shard_gave_up(w, what) for w in watched),
                  abort_reason=self._abort_reason, aborted=WorkerFailure, on_timeout=timed_out)

    def _wait_futures(self, futs, deadline: Deadline, what: str) -> None:
        """Waits for (shard, future) pairs of WRITEs this worker posted."""
        for s, f in futs:
            try:
                f.result(deadline.left())
            except TimeoutError:
                raise TimeoutError(f"{what} did not reach shard {s} within {deadline.timeout:g} s") from None
            except PeerError as e:
                if self.replicas > 1:  # what the dead primary owed goes to its successor
                    self._failover(s)
                    continue
                raise self._fail(f"shard {s} at {self.shards[s]['ep']} died while worker {self.id} waited "
                                 f"for {what}: {e}", dead_shard=s) from None

    def _wait_acks(self, deadline: Deadline) -> None:
        """With replicas: waits until every range acknowledged this worker's last push to it (every
        live copy holds it); a barrier covers such pushes only, since a failover may redo others."""
        if self.replicas > 1:
            for s, seq in enumerate(self.push_seq):
                self._wait_word(self.ack, s, seq, s, f"shard {s}'s acknowledgement of a push", deadline)

    def _failover(self, r: int) -> None:
        """Range r's primary is gone (its channel failed): agrees with the others, through the
        job's store, on its successor (the first holder of the range, in succession order, that
        is neither declared dead nor dropped), rings it, and sends it again what the dead one may
        not have answered (kv_replica.py). WorkerFailure, and the job aborted, when no copy of the
        range is left. Another thread that did it already leaves nothing to do."""
        with self._lock:
            store, spec = self.store, self.spec
            deadline = Deadline(self.timeout)
            while self.shards[r]["channel"].failed:
                if deadline.passed():
                    raise TimeoutError(f"worker {self.id} could not agree on a successor for key range {r} within "
                                       f"{deadline.timeout:g} s")
                gone = self.shards[r]["proc"]
                store.declare_dead("shard", gone)
                epoch, c, text = kv_replica.owner(store, r)
                while c != gone and (self.copies[r][c]["channel"].failed or kv_replica.dead(store, c)):
                    store.declare_dead("shard", c)  # its successor died too: elect among the rest
                    gone = c
                if c == gone:
                    live = [x for x in kv_replica.candidates(store, spec, r) if not self.copies[r][x]["channel"].failed]
                    if not live:
                        reason = kv_replica.lost_message(spec, r)
                        recorded = store.abort(reason)
                        store.count_out()
                        raise WorkerFailure(reason if recorded in (None, reason) else f"the job was aborted: {recorded}")
                    won = store.compare_set(kv_replica.owner_key(r), text, f"{epoch + 1}:{live[0]}")
                    epoch, c = map(int, won.split(":"))  # this worker's choice, or another's that came first
                    if c == gone or self.copies[r][c]["channel"].failed:
                        continue
                reason = self._abort_reason()
                if reason:
                    raise WorkerFailure(f"the job was aborted: {reason}")
                self.shards[r] = self.copies[r][c]
                try:
                    self._resend(r, epoch)
                except PeerError:
                    continue  # the successor died meanwhile: its channel failed, elect again
                self.stats["failovers"] = self.stats.get("failovers", 0) + 1

    def _resend(self, r: int, epoch: int) -> None:
        """Sends range r's new primary what this worker's last push and pull to it were, unless
        answered (it skips a push its copy applied already: request numbers), the barrier this
        worker last entered (range 0 relays barriers), then rings its takeover word."""
        L, sl, t = self.layout, self.spec.shards[r], self.shards[r]
        ch, futs = t["channel"], []

        def post(local: int, remote: int, nbytes: int) -> None:
            futs.append((r, ch.memcpy(self.region, local, t["remote"], t["base"] + remote, nbytes, WRITE)))

        if self.push_seq[r] > int(self.ack[r]) and self._staged[r] is not None:
            nbytes, direct, _ = self._staged[r]
            post(self.base + L.push_stage[r], sl.push(self.id), nbytes)
            at = sl.push(self.id) + nbytes
            for off, n in direct:
                post(off, at, n)
                at += n
            ch.fence()
            post(self.base + L.push_src + U64 * r, sl.word(sl.push_flag, self.id), U64)
        part = self._pending[r]
        if part is not None and not part.done and int(self.reply[r]) < part.seq:
            post(self.base + L.pull_stage[r], sl.pull(self.id), self._pull_bytes[r])
            ch.fence()
            post(self.base + L.pull_src + U64 * r, sl.word(sl.pull_flag, self.id), U64)
        if r == 0 and self.barrier_seq:
            post(self.base + L.barrier_src, sl.word(sl.barrier, self.id), U64)
        words(self.raw, L.takeover_src, len(self.shards))[r] = epoch
        ch.fence()
        post(self.base + L.takeover_src + U64 * r, sl.takeover + U64 * self.id, U64)
        self._unflushed.extend(futs)

    @contextlib.contextmanager
    def _locked_when(self, op: str | None, due, deadline: Deadline):
        """Holds the store's lock once every word ``due()`` names has reached its value: ``due``,
        called under the lock, lists (words, shard, value, what). Each is waited for without
        the lock, so that other threads' calls go on meanwhile; then the lock is taken again and
        the list read anew (another thread may have used what came). With ``op``,
        InvalidArgumentError once the store is closed, also while waiting."""
        while True:
            self._lock.acquire()
            if op is not None and self._closed:
                self._lock.release()
                raise InvalidArgumentError(f"{op}: this KVStore is closed")
            missing = next(((w, s, v, what) for w, s, v, what in due() if int(w[s]) < v), None)
            if missing is None:
                break
            self._lock.release()
            w, s, v, what = missing
            self._wait_word(w, s, v, s, what, deadline, op=op)
        try:
            yield
        finally:
            self._lock.release()

    def _replies(self, parts) -> list:
        """For ``_locked_when``: the reply words of the pull parts (None skipped) not yet copied out."""
        return [(self.reply, p.s, p.seq, f"shard {p.s}'s reply to a pull") for p in parts
                if p is not None and not p.done]

    def _write(self, s: int, local_off: int, remote_off: int, nbytes: int, what: str):
        """WRITEs nbytes at local_off of this worker's region to remote_off of shard s's block;
        returns the (shard, future) pair."""
        sh = self.shards[s]
        try:
            return s, sh["channel"].memcpy(self.region, local_off, sh["remote"], sh["base"] + remote_off, nbytes, WRITE)
        except PeerError as e:
            if self.replicas > 1 and sh["channel"].failed:
                self._failover(s)
                return self._write(s, local_off, remote_off, nbytes, what)
            raise self._fail(f"shard {s} at {sh['ep']} is unreachable from worker {self.id} ({what}): {e}") from None

    # -- the API ----------------------------------------------------------------------------------
    def _request(self, keys, values, op: str, **kw) -> Request:
        if self._closed:
            raise InvalidArgumentError(f"{op}: this KVStore is closed")
        return Request(self.spec, keys, values, op, **kw)

    def push(self, keys, tensors) -> KVHandle:
        """Sends ``tensors`` to their keys' shards, which apply the handler to them: one request
        per shard, applied there as one unit. Returns with a handle once each of those shards
        has acknowledged this worker's last push to it (waiting for that without holding the
        store); the tensors may be reused when push returns, except ones that live in the
        device's arena (sent without a copy): keep those unchanged until ``wait``. ``keys`` a
        1-D integer tensor and ``tensors`` one flat tensor of their values concatenated: the
        batched form (see kv_request.py)."""
        req = self._request(keys, tensors, "push")
        h = KVHandle("push", req)
        deadline = Deadline(self.timeout)
        parts = list(req.by_shard())
        # One push request per shard in flight: the staging and the shard's area are free once
        # acked. Every shard's ack first, so that a push that times out has sent nothing.
        acked = lambda: [(self.ack, s, self.push_seq[s], f"shard {s}'s acknowledgement of the last push")
                         for s, _ in parts]
        with self._locked_when("push", acked, deadline):
            for s, positions in parts:
                self._push_to(s, req, positions, h)
            self.stats["pushes"] += len(req)
            if len(self._unflushed) > 4096:
                self._unflushed = [p for p in self._unflushed if not p[1].done()]
            # Tensors sent without a copy stay referenced until every WRITE of the push completed,
            # even if the handle is dropped: their arena memory must not be reused while a WRITE
            # reads it. WRITEs to different shards complete in any order.
            self._held = [(futs, keep) for futs, keep in self._held if not all(f.done() for f in futs)]
            if h._keep:
                self._held.append(([f for _, f in h._futs], list(h._keep)))
        return h

    def _push_to(self, s: int, req: Request, positions, h: KVHandle) -> None:
        """Stages the part of ``req`` for shard s (header, key indices, values copied in request
        order; arena tensors last, sent from where they are) and WRITEs it, then its flag. Shard
        s has acknowledged this worker's last push."""
        spec, L = self.spec, self.layout
        sel = positions if positions is not None else torch.arange(len(req))
        direct: list[tuple[int, int]] = []  # (request position, arena offset) of tensors sent in place
        if req.flat is not None:
            order = sel
            values = req.flat if positions is None else req.flat.index_select(0, req.element_positions(positions))
        else:
            copied = []
            for p in sel.tolist():
                t = req.tensors[p]
                off = self.arena.offset_of(t) if t.is_contiguous() else None
                if off is None:
                    copied.append(p)
                else:
                    direct.append((p, off))
                    h._keep.append(t)
            self.stats["zero_copy"] += len(direct)
            order = torch.tensor(copied + [p for p, _ in direct], dtype=torch.int64)
            values = None
        rows = spec.local_tensor.index_select(0, req.j.index_select(0, order))
        numels = req.numels.index_select(0, order)
        n_copied = len(order) - len(direct)
        copied_elements = int(numels[:n_copied].sum()) if n_copied else 0
        stage = L.push_stage[s]
        head = self._stage_indices(stage, rows)
        out = self._stage_values(s, len(rows), copied_elements)
        with torch.no_grad():  # the values, whether or not the tensors require grad
            if values is not None:
                out.copy_(values)
            elif n_copied:
                torch.cat([req.tensors[p].reshape(-1) for p in order[:n_copied].tolist()], out=out)
        remote = spec.shards[s].push(self.id)
        nbytes = head + copied_elements * spec.itemsize
        if self.replicas > 1:
            self._staged[s] = (nbytes, [(off, numel * spec.itemsize) for (_, off), numel in
                                        zip(direct, numels[n_copied:].tolist())], [req.tensors[p] for p, _ in direct])
        h._futs.append(self._write(s, self.base + stage, remote, nbytes, "push"))
        at = remote + nbytes
        for (_, off), numel in zip(direct, numels[n_copied:].tolist()):
            h._futs.append(self._write(s, off, at, numel * spec.itemsize, "push"))
            at += numel * spec.itemsize
        self.shards[s]["channel"].fence()  # the request lands before its flag
        self.push_seq[s] += 1
        self.push_src[s] = self.push_seq[s]
        sl = spec.shards[s]
        pair = self._write(s, self.base + L.push_src + U64 * s, sl.word(sl.push_flag, self.id), U64, "push")
        h._futs.append(pair)
        self._unflushed.append(pair)
        if self.replicas > 1:
            h._acks.append((s, self.push_seq[s]))

    def pull(self, keys, outs=None) -> KVHandle:
        """Asks the keys' shards for their values, one request per shard; ``wait`` copies them into
        ``outs`` (or into new tensors when ``outs`` is None) and returns them. A pull sees this
        worker's earlier pushes, and every other worker's push whose ``wait`` returned before it.
        The batched form (``keys`` a 1-D integer tensor) returns one flat tensor. Returns once
        the replies to this worker's last pull from each of those shards have landed (waiting
        for them without holding the store): their landing areas are reused."""
        req = self._request(keys, outs, "pull", values_optional=True)
        h = KVHandle("pull", req)
        deadline = Deadline(self.timeout)
        h._result = req.flat if req.flat is not None else torch.empty(req.elements, dtype=self.dtype)
        parts = list(req.by_shard())
        with self._locked_when("pull", lambda: self._replies(self._pending[s] for s, _ in parts), deadline):
            self._pull_from(req, parts, h, deadline)
        return h

    def _pull_from(self, req: Request, parts: list, h: KVHandle, deadline: Deadline) -> None:
        """Sends ``req``'s part for each shard of ``parts``, whose last pull's reply has landed
        (copied out first: its landing area is reused)."""
        spec, L = self.spec, self.layout
        for s, _ in parts:
            if self._pending[s] is not None:
                self._complete(self._pending[s], deadline)
        for s, positions in parts:
            sel = positions if positions is not None else torch.arange(len(req))
            stage = L.pull_stage[s]
            nbytes = self._pull_bytes[s] = self._stage_indices(
                stage, spec.local_tensor.index_select(0, req.j.index_select(0, sel)))
            sl = spec.shards[s]
            h._futs.append(self._write(s, self.base + stage, sl.pull(self.id), nbytes, "pull"))
            self.shards[s]["channel"].fence()  # behind the request, and this worker's pushes: read-your-writes
            self.pull_seq[s] += 1
            self.pull_src[s] = self.pull_seq[s]
            h._futs.append(self._write(s, self.base + L.pull_src + U64 * s, sl.word(sl.pull_flag, self.id), U64,
                                       "pull"))
            elements = None if positions is None else req.element_positions(positions)
            part = self._pending[s] = _PullPart(s, self.pull_seq[s], elements, h._result)
            h._parts.append(part)
        self.stats["pulls"] += len(req)

    def _complete(self, part: _PullPart, deadline: Deadline) -> None:
        """Waits for shard s's reply to a pull and copies it out of the landing area."""
        if part.done:
            return
        s = part.s
        self._wait_word(self.reply, s, part.seq, s, f"shard {s}'s reply to a pull", deadline)
        landing = self.layout.landing[s]
        n = part.values.numel() if part.positions is None else len(part.positions)
        got = self.raw[landing : landing + n * self.spec.itemsize].view(self.dtype)
        part.done = True
        if self._pending[s] is part:
            self._pending[s] = None
        with torch.no_grad():  # into tensors that may require grad (parameters): values, not autograd ops
            if part.positions is None:
                part.values.copy_(got)
            else:
                part.values.index_copy_(0, part.positions, got)

    def wait(self, handle: KVHandle, timeout: float | None = None):
        """Waits until ``handle`` completed. A push: its values are at the shards (visible to
        every later pull). A pull: returns the list of pulled tensors (a tensor if pull was
        given one key, not a list; one flat tensor in the batched form). Raises PeerError if a
        shard died, TimeoutError after ``timeout`` (default: the job's step timeout).

        Blocks without holding the store: other threads' calls go on while this one waits
        (several threads may wait at once, on one handle too). Only the copy of a pull's reply
        out of its landing area takes turns with them, as the other calls do."""
        if not isinstance(handle, KVHandle):
            raise InvalidArgumentError(
                f"wait() takes a handle from push() or pull(), got {type(handle).__name__}")
        if handle.done:
            return handle._result
        deadline = Deadline(self.timeout if timeout is None else timeout)
        what = f"{handle.kind} of keys {short(handle.keys)}"
        self._wait_futures(list(handle._futs), deadline, what)
        for s, seq in handle._acks:  # with replicas: a push is done once every copy of its range holds it
            self._wait_word(self.ack, s, seq, s, f"shard {s}'s acknowledgement of a push", deadline)
        # A pull's replies, then their copy out of the landing areas, unless a pull made
        # meanwhile copied them out already (part.done); after close() too, which copies them.
        with self._locked_when(None, lambda: self._replies(handle._parts), deadline):
            if not handle.done:
                if handle.kind == "pull":
                    for part in handle._parts:
                        self._complete(part, deadline)
                    handle._result = self._pulled(handle._request, handle._result)
                handle._keep.clear()
                handle._futs.clear()
                handle.done = True
            return handle._result

    def _pulled(self, req: Request, flat: torch.Tensor):
        """A pull's result in the request's form: the flat tensor, or one tensor per key."""
        if req.batched:
            return flat
        spec, out = self.spec, []
        with torch.no_grad():
            for j, off, numel, given in zip(req.j.tolist(), req.offsets.tolist(), req.numels.tolist(), req.tensors):
                value = flat[off : off + numel].view(spec.shapes[j])
                out.append(value if given is None else given.copy_(value))
        return out[0] if req.single else out

    def push_pull(self, keys, tensors, outs=None):
        """Pushes, then pulls the same keys (the pull sees the push, and whatever other threads
        pushed between the two); returns the pulled values. Blocks; its waits for the shards
        hold the store no more than push, pull and wait do."""
        self.push(keys, tensors)
        return self.wait(self.pull(keys, outs))

    def barrier(self, timeout: float | None = None) -> None:
        """Returns once every live worker entered this barrier; pushes any worker made before
        it are visible to pulls made after it. One-sided, through shard 0. Blocks; it waits for
        the other workers without holding the store, so other threads' calls go on meanwhile
        (a push made after the barrier began is not one it covers), and threads of this worker
        that call it while it is under way take part in the same barrier; a ``close()`` meanwhile
        ends it with InvalidArgumentError. After a TimeoutError this worker is still in the
        barrier: the next call waits for that one again."""
        deadline = Deadline(self.timeout if timeout is None else timeout)
        with self._lock:
            if self._closed:
                raise InvalidArgumentError("barrier: this KVStore is closed")
            if not self._in_barrier:
                self._wait_futures(self._unflushed, deadline, f"worker {self.id}'s pushes")
                self._unflushed = []
                self._wait_acks(deadline)
                self.barrier_seq += 1
                self.barrier_src[0] = self.barrier_seq
                shard0 = self.spec.shards[0]
                self._write(0, self.base + self.layout.barrier_src, shard0.word(shard0.barrier, self.id), U64,
                            "barrier")
                self._in_barrier = True  # entered: a call after a TimeoutError waits for this one again
            seq = self.barrier_seq
        # Shard 0 relays the barrier, but every shard's pushes must reach it: all are watched.
        # Only shard 0 writes the word, and only upwards, so no other thread can take what came.
        # A worker that closed takes no part in barriers: a close meanwhile ends the wait.
        self._wait_word(self.barrier_word, 0, seq, 0, f"barrier {seq}", deadline,
                        watch=range(len(self.shards)), why=self._barrier_stragglers, op="barrier")
        with self._lock:
            if self._in_barrier and self.barrier_seq == seq:  # the first of its callers to return
                self._in_barrier = False
                self.stats["barriers"] += 1

    @_serialized
    def save(self, path, timeout: float | None = None) -> None:
        """Writes every key's values to the file ``path`` (kv_snapshot.py), for a later job's
        ``KVStore(..., init=path)``. Collective: every worker calls it, and it blocks until worker
        0 has written the whole file (under a temporary name, then renamed). The values are those
        of a barrier: every push any worker made before its save() is in the file, none made after
        its save() returned. Worker 0 writes ``path`` on its own host; the others' ``path`` is
        unused. A file worker 0 cannot write raises InvalidArgumentError with the reason on every
        worker; TimeoutError after ``timeout`` (default: the job's step timeout) for all of it.
        After a TimeoutError on a worker other than 0, that save is still under way there: the
        next call waits for its outcome instead of starting another (as ``barrier`` does)."""
        if self._closed:
            raise InvalidArgumentError("save: this KVStore is closed")
        try:
            path = os.fspath(path)
        except TypeError:
            raise InvalidArgumentError(f"save: path must be a file name, got {type(path).__name__}") from None
        deadline = Deadline(self.timeout if timeout is None else timeout)
        if self._saving is None:
            self.barrier(deadline.left())  # after a TimeoutError, barrier() itself waits for it again
            self.save_seq += 1
            self._saving = self.save_seq
        # Worker 0 reads the values the barrier left and tells the others through the job's store
        # how it went; until then no worker returns, so none pushes into the snapshot.
        outcome = f"kv/save/{self._saving}"
        if self.id != 0:
            said = self.store.get(outcome, deadline.left())
            self._saving = None
            if said != "ok":
                raise InvalidArgumentError(f"save: worker 0 could not write the snapshot: {said}")
            return
        self._saving = None  # worker 0 settles the outcome below, whatever happens
        try:
            flat = self.wait(self.pull(torch.tensor(self.keys, dtype=torch.int64)), deadline.left())
            kv_snapshot.save(path, self.spec.decl, flat)
        except OSError as e:
            why = f"{path}: {type(e).__name__}: {e.strerror or e}"
            self.store.set(outcome, why)
            raise InvalidArgumentError(f"save: cannot write the snapshot {why}") from None
        except BaseException as e:
            self.store.set(outcome, f"{type(e).__name__}: {e}")
            raise
        self.store.set(outcome, "ok")

    @_serialized  # the READ lands in the peek words, which every barrier that times out uses
    def _barrier_stragglers(self) -> str:
        """For a barrier that timed out: the live workers that had not entered it, as shard 0
        sees them (one READ of its done and barrier words); empty if that READ fails."""
        sh, L = self.shards[0], self.spec.shards[0]
        n = L.barrier - L.done + U64 * L.nw
        try:
            sh["channel"].memcpy(self.region, self.base + self.layout.peek, sh["remote"], sh["base"] + L.done,
                                 n, READ).result(2.0)
        except RdmaflowError:
            return ""
        done = words(self.raw, self.layout.peek, L.nw)
        entered = words(self.raw, self.layout.peek + L.barrier - L.done, L.nw)
        late = [w for w in range(L.nw) if int(done[w]) < DONE and int(entered[w]) < self.barrier_seq]
        if not late:
            return ": every live worker entered it, shard 0 has not released it yet"
        return f": worker{'s' if len(late) > 1 else ''} {', '.join(map(str, late))} had not entered it"

    @property
    def num_workers(self) -> int:
        return self.role.num_workers

    @property
    def rank(self) -> int:
        """This worker's index among the job's workers."""
        return self.id

    @_serialized
    def close(self) -> None:
        """Finishes outstanding pulls and tells every shard this worker is done."""
        if self._closed:
            return
        self._closed = True
        self.ctx.kv_state = "closed"
        deadline = Deadline(30.0 if self.timeout is None else min(self.timeout, 30.0))
        try:
            for part in self._pending:
                if part is not None:
                    self._complete(part, deadline)
            self._wait_futures(self._unflushed, deadline, f"worker {self.id}'s pushes")
            self._wait_acks(deadline)
        except RdmaflowError:
            pass  # the job is failing already; still tell the shards this worker is done
        self._unflushed = []
        self.done_src[0] = DONE
        futs = []
        # DONE into every copy of every range: a backup that takes over later knows who left
        for sh in (c for copies in getattr(self, "copies", []) for c in copies.values()):
            if sh["channel"].failed:
                continue
            try:
                sh["channel"].fence()
                done_word = sh["base"] + sh["layout"].word(sh["layout"].done, self.id)
                futs.append(sh["channel"].memcpy(self.region, self.base + self.layout.done_src, sh["remote"],
                                                 done_word, U64, WRITE))
            except RdmaflowError:
                pass
        deadline = Deadline(5.0)
        for f in futs:
            f.wait(deadline.left())

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
