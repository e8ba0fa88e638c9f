"""A ps-lite-style key-value API over the parameter server, for frameworks other than PyTorch's
``nn.Module`` training loops::

    import rdmaflow.ps as ps

    ctx = ps.init(kv_handler=None)         # shards serve here (default handler: stored += pushed)
    kv = ps.KVStore(keys=[0, 1, 7], shapes=[(4,), (2, 3), ()], dtype=torch.float32)
    h = kv.push([0, 7], [g0, g7])          # returns at once
    outs = kv.wait(kv.pull([0, 1, 7]))     # pulls see this worker's own pushes
    kv.barrier()                           # every worker's pushes before it are seen after it
    kv.close()

Keys are non-negative integers declared once, collectively, with a shape each and one dtype
for the job; key ``k`` lives on shard ``k % num_shards``. A shard applies every push with the
user's handler ``handler(key, stored, pushed)``, which updates ``stored`` in place (or returns
the new value).

The data path is one-sided, like the rest of the parameter server (see protocol.py): the
side RPC and the c10d store are used at setup only. Both sides compute the same layout from the
declaration, so only each block's base offset and arena descriptor are exchanged.

Shard s's block (its keys in ascending order, i = 0..n-1; arrays of u64 words are dense,
8 bytes apart, each word written by one peer only)::

    stored       n values, each 256-byte aligned
    push slots   one value per (worker, key): slot[w][i]
    push flags   u64[w][i]: the push sequence number worker w last wrote for key i
    pull flags   u64[w][i]: the pull sequence number worker w last requested for key i
    ack sources  u64[w][i]: values the shard WRITEs into worker w's ack word of key i
    reply sources u64[w][i]
    done         u64[w]: DONE once worker w closed
    barrier      u64[w]: the last barrier worker w entered (used on shard 0)
    barrier sources u64[w], then the abort source: u64 and the reason text

Worker w's block (every key of the job, ascending, j = 0..K-1)::

    staging      one value per key: the push source (unless the tensor lives in the arena)
    out          one value per key: where pulls land
    reply        u64[j]: the last pull sequence number the shard answered
    ack          u64[j]: the last push sequence number the shard applied
    push / pull sources u64[j]
    status       u64[s], then 512 bytes per shard: a shard that gives up WRITEs its reason,
                 fence, ABORT into its status word (the store may be gone with it)
    barrier      u64: the last barrier shard 0 released, then done / barrier sources

Push n of key j (one outstanding push per key and worker; a second waits for the first's ack)::

    worker w                                          shard s = key % S
      wait until ack[j] >= n - 1   (slot free)
      WRITE value -> slot[w][i]
      fence
      WRITE n -> push flag[w][i]  ───────────────▶    sees push flag > applied:
                                                      handler(key, stored[i], slot[w][i])
                                  ◀───────────────    WRITE n -> ack[j] of w

Pull m of key j::

      fence        (orders it behind this worker's earlier pushes)
      WRITE m -> pull flag[w][i]  ───────────────▶    sees pull flag > replied: reads the pull
                                                      flags, then the push flags of key i, and
                                                      applies every push it sees first
                                  ◀───────────────    WRITE stored[i] -> out[j] of w
                                                      fence
                                  ◀───────────────    WRITE m -> reply[j] of w
      waits until reply[j] >= m, copies out[j]

Because a shard reads a key's push flags after the pull request, a pull sees every push to that
key that was visible at the shard before the request was made: the worker's own (the fence puts
its push flag first: read-your-writes), and any other worker's whose ``wait()`` returned before.
A key whose reply WRITE is still reading ``stored`` takes no new push until it completes, so a
pull never sees a half-applied value. ``barrier()`` waits for this worker's pushes to be visible,
then WRITEs its barrier number to shard 0, which WRITEs it back to every worker once all live
workers entered it. ``close()`` WRITEs DONE (after a fence) into every shard's done word; a
shard applies what is left and exits when every worker is done.
"""
from __future__ import annotations

import json
import operator
import os
import time

import torch

from rdmaflow import _core
from rdmaflow.ps.context import PREFIX, dumps
from rdmaflow.ps.protocol import ABORT, DONE, aligned
from rdmaflow.ps.shard import ShardFailure
from rdmaflow.ps.worker import WorkerFailure
from rdmaflow.transfer.common import pack_header, unpack_header

W = _core.Direction.WRITE
R = _core.Direction.READ
POLL = 0.05          # seconds between liveness checks while waiting
STORE_CHECK = 1.0    # seconds between checks of the store's abort key while waiting
U64 = 8
REASON = 512  # bytes of the message a failing shard leaves in each worker's block
ARENA_SLACK = 16 << 20  # room left in a worker's arena for tensors it pushes without a copy
LINGER = 5.0  # seconds a failing shard that serves the store waits for the others to read why

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int32": torch.int32, "int64": torch.int64}
NAMES = {v: k for k, v in DTYPES.items()}


def sum_handler(key: int, stored: torch.Tensor, pushed: torch.Tensor) -> None:
    """The default server-side handler: ``stored += pushed``."""
    stored.add_(pushed)


# -- the declaration ------------------------------------------------------------------------------
def _key(k, what: str = "key") -> int:
    if isinstance(k, bool):
        raise _core.InvalidArgumentError(f"{what} must be an integer, got {k!r}")
    try:
        k = operator.index(k)
    except TypeError:
        if isinstance(k, torch.Tensor) and k.numel() == 1 and not k.is_floating_point():
            k = int(k.item())
        else:
            raise _core.InvalidArgumentError(f"{what} must be an integer, got {k!r}") from None
    if not 0 <= k < (1 << 63):
        raise _core.InvalidArgumentError(f"{what} must be in [0, 2**63), got {k}")
    return k


def _shape(s, key: int) -> tuple[int, ...]:
    if isinstance(s, int) and not isinstance(s, bool):
        s = (s,)
    try:
        shape = tuple(operator.index(d) for d in s)
    except TypeError:
        raise _core.InvalidArgumentError(f"the shape of key {key} must be a tuple of integers, got {s!r}") from None
    if any(d <= 0 for d in shape):
        raise _core.InvalidArgumentError(f"the shape of key {key} must have positive dimensions, got {list(shape)}")
    return shape


def declaration(keys, shapes, dtype) -> dict:
    """The canonical declaration (keys ascending) every process derives the layout from."""
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.replace("torch.", ""), dtype)
    if dtype not in NAMES:
        raise _core.InvalidArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        keys, shapes = list(keys), list(shapes)
    except TypeError:
        raise _core.InvalidArgumentError("keys and shapes must be sequences") from None
    if not keys:
        raise _core.InvalidArgumentError("declare at least one key")
    if len(keys) != len(shapes):
        raise _core.InvalidArgumentError(f"{len(keys)} keys but {len(shapes)} shapes")
    seen: dict[int, tuple] = {}
    for k, s in zip(keys, shapes):
        k = _key(k)
        if k in seen:
            raise _core.InvalidArgumentError(f"key {k} is declared twice")
        seen[k] = _shape(s, k)
    return {"dtype": NAMES[dtype], "keys": [[k, list(seen[k])] for k in sorted(seen)]}


def describe_difference(mine: dict, theirs: dict) -> str:
    if mine["dtype"] != theirs["dtype"]:
        return f"dtype {mine['dtype']} here, {theirs['dtype']} on worker 0"
    a = {k: s for k, s in mine["keys"]}
    b = {k: s for k, s in theirs["keys"]}
    extra, missing = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if extra or missing:
        parts = []
        if extra:
            parts.append(f"keys {extra[:8]} are declared here only")
        if missing:
            parts.append(f"keys {missing[:8]} are declared on worker 0 only")
        return "; ".join(parts)
    for k in sorted(a):
        if a[k] != b[k]:
            return f"key {k} has shape {a[k]} here, {b[k]} on worker 0"
    return "no difference"


class Spec:
    """The layout of both sides, computed from the declaration and the job's size."""

    def __init__(self, decl: dict, num_shards: int, num_workers: int):
        self.decl = decl
        self.dtype = DTYPES[decl["dtype"]]
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.keys = [int(k) for k, _ in decl["keys"]]
        self.shapes = [tuple(int(d) for d in s) for _, s in decl["keys"]]
        self.numel = [_numel(s) for s in self.shapes]
        self.nbytes = [n * self.itemsize for n in self.numel]
        self.index = {k: j for j, k in enumerate(self.keys)}
        self.ns, self.nw = num_shards, num_workers
        self.shard_of = [k % num_shards for k in self.keys]
        self.local = []  # j -> index of key j among its shard's keys
        self.shard_keys: list[list[int]] = [[] for _ in range(num_shards)]  # s -> [j]
        for j, s in enumerate(self.shard_of):
            self.local.append(len(self.shard_keys[s]))
            self.shard_keys[s].append(j)
        self.worker = WorkerLayout(self.nbytes, num_shards)
        self.shards = [ShardLayout([self.nbytes[j] for j in js], num_workers) for js in self.shard_keys]


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _values(sizes: list[int]) -> tuple[list[int], int]:
    offs, off = [], 0
    for b in sizes:
        offs.append(off)
        off += aligned(b)
    return offs, off


class ShardLayout:
    def __init__(self, sizes: list[int], nw: int):
        n = self.n = len(sizes)
        self.nw = nw
        self.voff, vbytes = _values(sizes)
        self.stored = 0
        self.slots = vbytes
        self.slot_stride = vbytes
        off = vbytes * (1 + nw)
        words = aligned(U64 * nw * n)
        self.push = off
        self.pull = off + words
        self.ack_src = off + 2 * words
        self.reply_src = off + 3 * words
        off += 4 * words
        self.done = off
        self.barrier = off + aligned(U64 * nw)
        self.barrier_src = off + 2 * aligned(U64 * nw)
        self.abort_src = off + 3 * aligned(U64 * nw)
        self.reason_src = self.abort_src + U64
        self.flags = self.push            # everything from here on starts zeroed
        self.total = self.abort_src + aligned(U64 + REASON)

    def slot(self, w: int, i: int) -> int:
        return self.slots + w * self.slot_stride + self.voff[i]

    def word(self, array: int, w: int, i: int) -> int:
        return array + U64 * (w * self.n + i)


class WorkerLayout:
    def __init__(self, sizes: list[int], ns: int):
        k = self.k = len(sizes)
        self.voff, vbytes = _values(sizes)
        self.stage = 0
        self.out = vbytes
        off = 2 * vbytes
        words = aligned(U64 * k)
        self.reply = off
        self.ack = off + words
        self.push_src = off + 2 * words
        self.pull_src = off + 3 * words
        off += 4 * words
        self.status = off
        self.reason = off + aligned(U64 * ns)
        self.barrier = self.reason + aligned(REASON * ns)
        self.done_src = self.barrier + U64
        self.barrier_src = self.barrier + 2 * U64
        self.flags = self.reply
        self.total = self.barrier + aligned(4 * U64)


def _words(raw: torch.Tensor, off: int, count: int) -> torch.Tensor:
    return raw[off : off + U64 * count].view(torch.int64)


def _arena(dev, nbytes: int):
    existing = getattr(dev, "_rdmaflow_arena", None)
    return existing if existing is not None else dev.create_arena(nbytes)


def _leave(ctx, who: str) -> None:
    """Tells a failing store host that this process has read why the job failed."""
    try:
        ctx.store.set(f"kv/left/{who}", "1")
    except Exception:  # noqa: BLE001 - the store may be gone already
        pass


def _linger(ctx) -> None:
    """A failing process that serves the job's store (rank 0 outside torchrun) keeps it up until
    every other process has read the abort reason from it, for at most LINGER seconds."""
    if ctx.role.rank != 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return
    me = f"{ctx.role.kind}/{ctx.role.index}"
    others = [f"kv/left/{k}/{i}" for k, n in (("worker", ctx.role.num_workers), ("shard", ctx.role.num_shards))
              for i in range(n) if f"{k}/{i}" != me]
    deadline = time.monotonic() + LINGER
    try:
        while others and time.monotonic() < deadline:
            others = [k for k in others if not ctx.store.check(k)]
            time.sleep(0.05)
    except Exception:  # noqa: BLE001
        pass


def _abort_reason(store) -> str | None:
    """The reason the job was aborted, None if it was not (or the store cannot say)."""
    try:
        return store.store.get(PREFIX + "abort").decode() if store.check("abort") else None
    except Exception:  # noqa: BLE001
        return None


def job_kind(ctx) -> str:
    """What worker 0 declared the job to be: "kv" (a KVStore) or "model" (a DistributedOptimizer)."""
    try:
        cfg = json.loads(ctx.store.get("config"))
    except Exception as e:
        ctx.store.abort(f"shard {ctx.role.index}: {e}")
        raise
    return cfg.get("kind", "model")


# -- the worker side ------------------------------------------------------------------------------
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
            raise _core.InvalidArgumentError("call rdmaflow.ps.init() first")
        if not ctx.is_worker:
            raise _core.InvalidArgumentError("KVStore runs on workers; this process is a shard")
        if id(ctx) in _ACTIVE:
            raise _core.InvalidArgumentError("this job already has a KVStore: declare every key in one KVStore")
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
                raise _core.InvalidArgumentError(f"keys must be a sequence of integers, got {keys!r}") from None
            decl = declaration(keys, shapes, dtype)
            if init is not None and self.id == 0:
                init = self._check_init(decl, keys, init)
            self._setup(decl, init if self.id == 0 else None)
        except Exception as e:
            self.store.abort(f"worker {self.id}: {e}")
            _leave(ctx, f"worker/{self.id}")
            _ACTIVE.discard(id(ctx))
            raise

    @staticmethod
    def _check_init(decl: dict, keys, init) -> list[torch.Tensor]:
        init = list(init) if isinstance(init, (list, tuple)) else None
        if init is None or len(init) != len(decl["keys"]):
            raise _core.InvalidArgumentError("init must be a list with one tensor per declared key")
        order = {_key(k): t for k, t in zip(keys, init)}
        dtype = DTYPES[decl["dtype"]]
        out = []
        for k, shape in decl["keys"]:
            t = order[k]
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or tuple(t.shape) != tuple(shape):
                got = (f"{NAMES.get(t.dtype, t.dtype)}{list(t.shape)}" if isinstance(t, torch.Tensor)
                       else type(t).__name__)
                raise _core.InvalidArgumentError(f"init of key {k} must be {decl['dtype']}{shape}, got {got}")
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
            raise _core.InvalidArgumentError(
                f"worker {self.id}'s key declaration differs from worker 0's: {describe_difference(decl, job_decl)}")
        self.spec = spec = Spec(decl, role.num_shards, role.num_workers)
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
        self.reply = _words(raw, L.reply, L.k)
        self.ack = _words(raw, L.ack, L.k)
        self.push_src = _words(raw, L.push_src, L.k)
        self.pull_src = _words(raw, L.pull_src, L.k)
        self.status = _words(raw, L.status, role.num_shards)
        self.reasons = raw[L.reason : L.reason + REASON * role.num_shards].view(role.num_shards, REASON)
        self.barrier_word = _words(raw, L.barrier, 1)
        self.done_src = _words(raw, L.done_src, 1)
        self.barrier_src = _words(raw, L.barrier_src, 1)
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
            self.shards.append({"ep": ep, "remote": _core.RemoteRegion.from_descriptor(desc),
                                "base": int(meta["base"]), "layout": spec.shards[s], "channel": self.dev.channel(ep)})
        # The shards are serving (and have read worker 0's initial values) once this returns.
        store.wait([f"kv/serving/{s}" for s in range(role.num_shards)])

    # -- checks -----------------------------------------------------------------------------------
    def _index(self, k, op: str) -> int:
        k = _key(k)
        j = self.spec.index.get(k)
        if j is None:
            raise _core.InvalidArgumentError(f"{op}: key {k} was not declared (declared: {_short(self.keys)})")
        return j

    def _prepare(self, keys, tensors, op: str, allow_none: bool = False):
        if self._closed:
            raise _core.InvalidArgumentError(f"{op}: this KVStore is closed")
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
            raise _core.InvalidArgumentError(f"{op}: {len(keys)} keys but {len(tensors)} tensors")
        idx = [self._index(k, op) for k in keys]
        if len(set(idx)) != len(idx):
            dup = next(self.keys[j] for j in idx if idx.count(j) > 1)
            raise _core.InvalidArgumentError(f"{op}: key {dup} appears twice in one call")
        for j, t in zip(idx, tensors):
            if t is None and allow_none:
                continue
            if not isinstance(t, torch.Tensor):
                raise _core.InvalidArgumentError(f"{op}: the tensor of key {self.keys[j]} must be a torch.Tensor, "
                                                 f"got {type(t).__name__}")
            want = self.spec.shapes[j]
            if t.dtype != self.dtype or tuple(t.shape) != want:
                raise _core.InvalidArgumentError(
                    f"{op}: key {self.keys[j]} holds {NAMES[self.dtype]}{list(want)}, got "
                    f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}")
            if t.device.type != "cpu":
                raise _core.InvalidArgumentError(f"{op}: the tensor of key {self.keys[j]} is on {t.device}; "
                                                 "the key-value API moves host tensors")
        return idx, tensors, single

    # -- waiting ----------------------------------------------------------------------------------
    def _fail(self, msg: str, exc=_core.PeerError):
        """The error for a shard that is gone; the job's abort reason instead if it has one (that
        shard may have left because of another failure)."""
        reason = _abort_reason(self.store)
        _leave(self.ctx, f"worker/{self.id}")
        if reason:
            return WorkerFailure(f"the job was aborted: {reason}")
        self.store.abort(msg)
        return exc(msg)

    def _check(self, s: int, what: str, last_store: list) -> None:
        sh = self.shards[s]
        if self.status.ne(0).any():
            bad = int(self.status.ne(0).nonzero()[0])
            reason = bytes(self.reasons[bad].numpy()).split(b"\0", 1)[0].decode("utf-8", "replace")
            _leave(self.ctx, f"worker/{self.id}")
            raise WorkerFailure(f"shard {bad} gave up while worker {self.id} waited for {what}: "
                                f"{reason or self.store.aborted() or 'see its output'}")
        if sh["channel"].failed:
            raise self._fail(f"shard {s} at {sh['ep']} died while worker {self.id} waited for {what}")
        now = time.monotonic()
        if now - last_store[0] > STORE_CHECK:
            last_store[0] = now
            reason = self.store.aborted()
            if reason:
                _leave(self.ctx, f"worker/{self.id}")
                raise WorkerFailure(f"the job was aborted: {reason}")

    def _wait_word(self, words: torch.Tensor, j: int, value: int, s: int, what: str, deadline: float) -> None:
        addr = words.data_ptr() + U64 * j
        last_store = [time.monotonic()]
        while not _core.wait_u64_at_least(addr, value, min(POLL, max(0.0, deadline - time.monotonic()))):
            self._check(s, what, last_store)
            if time.monotonic() >= deadline:
                raise _core.TimeoutError(f"shard {s} did not answer {what} within {self.timeout:g} s")

    def _wait_futures(self, futs, deadline: float, what: str) -> None:
        """Waits for (shard, future) pairs of WRITEs this worker posted."""
        for s, f in futs:
            try:
                f.result(max(0.0, deadline - time.monotonic()))
            except _core.TimeoutError:
                raise _core.TimeoutError(f"{what} did not reach shard {s} within {self.timeout:g} s") from None
            except _core.PeerError as e:
                raise self._fail(f"shard {s} at {self.shards[s]['ep']} died while worker {self.id} waited "
                                 f"for {what}: {e}") from None

    def _write(self, s: int, local_off: int, remote_off: int, nbytes: int, what: str):
        """WRITEs nbytes at local_off of this worker's region to remote_off of shard s's block;
        returns the (shard, future) pair."""
        sh = self.shards[s]
        try:
            return s, sh["channel"].memcpy(self.region, local_off, sh["remote"], sh["base"] + remote_off, nbytes, W)
        except _core.PeerError as e:
            raise self._fail(f"shard {s} at {sh['ep']} is unreachable from worker {self.id} ({what}): {e}") from None

    # -- the API ----------------------------------------------------------------------------------
    def push(self, keys, tensors) -> KVHandle:
        """Sends ``tensors`` to their keys' shards, which apply the handler to each. Returns at
        once with a handle; the tensors may be reused when push returns, except ones that live
        in the device's arena (sent without a copy): keep those unchanged until ``wait``."""
        idx, tensors, _ = self._prepare(keys, tensors, "push")
        h = KVHandle("push", [self.keys[j] for j in idx])
        deadline = time.monotonic() + self.timeout
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
        deadline = time.monotonic() + self.timeout
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

    def _complete(self, item: _Pull, deadline: float) -> None:
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
            raise _core.InvalidArgumentError(
                f"wait() takes a handle from push() or pull(), got {type(handle).__name__}")
        if handle.done:
            return handle._result
        deadline = time.monotonic() + (self.timeout if timeout is None else float(timeout))
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
            raise _core.InvalidArgumentError("barrier: this KVStore is closed")
        deadline = time.monotonic() + (self.timeout if timeout is None else float(timeout))
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
        deadline = time.monotonic() + min(self.timeout, 30.0)
        try:
            for item in self._pending:
                if item is not None:
                    self._complete(item, deadline)
            self._wait_futures(self._unflushed, deadline, f"worker {self.id}'s pushes")
        except _core.RdmaflowError:
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
                                                 sh["base"] + sh["layout"].done + U64 * self.id, U64, W))
            except _core.RdmaflowError:
                pass
        deadline = time.monotonic() + 5.0
        for f in futs:
            f.wait(max(0.0, deadline - time.monotonic()))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _short(keys) -> str:
    keys = list(keys)
    return str(keys) if len(keys) <= 8 else f"[{', '.join(map(str, keys[:8]))}, ... ({len(keys)} keys)]"


# -- the shard side -------------------------------------------------------------------------------
class KVShard:
    """Holds the stored values of keys ``k % num_shards == id`` and applies pushes to them."""

    def __init__(self, ctx, handler=None):
        if handler is not None and not callable(handler):
            raise _core.InvalidArgumentError(f"kv_handler must be callable, got {type(handler).__name__}")
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
        spec = self.spec = Spec({"dtype": job["dtype"], "keys": job["keys"]}, role.num_shards, role.num_workers)
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
        self.pflags = _words(raw, L.push, self.nw * self.n).view(self.nw, self.n)
        self.qflags = _words(raw, L.pull, self.nw * self.n).view(self.nw, self.n)
        self.ack_src = _words(raw, L.ack_src, self.nw * self.n).view(self.nw, self.n)
        self.reply_src = _words(raw, L.reply_src, self.nw * self.n).view(self.nw, self.n)
        self.done = _words(raw, L.done, self.nw)
        self.bflags = _words(raw, L.barrier, self.nw)
        self.barrier_src = _words(raw, L.barrier_src, self.nw)
        self.abort_src = _words(raw, L.abort_src, 1)
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
            self.workers.append({"ep": ep, "remote": _core.RemoteRegion.from_descriptor(desc),
                                 "base": int(meta["base"]), "channel": self.dev.channel(ep)})
        if job.get("init") and self.n:
            w0, wl = self.workers[0], spec.worker
            futs = [w0["channel"].memcpy(self.region, self.base + L.stored + L.voff[i], w0["remote"],
                                         w0["base"] + wl.stage + wl.voff[j], spec.nbytes[j], R)
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
                                          nbytes, W)
        except _core.RdmaflowError as e:
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
                reason = _abort_reason(self.store)  # a worker that gave up says why before it leaves
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
                reason = _abort_reason(self.store)  # (a store gone with shard 0 at the end is no error)
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
            deadline = time.monotonic() + 5.0
            for f in self.inflight + [f for b in self.busy.values() for f in b]:
                f.wait(max(0.0, deadline - time.monotonic()))
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
            _leave(self.ctx, f"shard/{self.id}")
            _linger(self.ctx)
            if isinstance(e, _core.RdmaflowError):
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
                                      info["base"] + wl.reason + REASON * self.id, len(msg), W))
                ch.fence()
                futs.append(ch.memcpy(self.region, self.base + L.abort_src, info["remote"],
                                      info["base"] + wl.status + U64 * self.id, U64, W))
            except Exception:  # noqa: BLE001 - best effort while failing
                pass
        deadline = time.monotonic() + 1.0
        for f in futs:
            f.wait(max(0.0, deadline - time.monotonic()))
