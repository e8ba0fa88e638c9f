"""The key-value store's declaration (keys, shapes, one dtype) and the layout both sides derive
from it: where each value and word lives in a shard's block (KVServerArea) and in a worker's
block (KVClientArea). The protocol that uses them is described in kv.py."""
from __future__ import annotations

import math

import torch

from rdmaflow import InvalidArgumentError
from rdmaflow._args import integer
from rdmaflow.ps.protocol import aligned
from rdmaflow.transfer.dtypes import FLOAT_DTYPES, dtype_name

U64 = 8
REASON = 512  # bytes of the message a failing shard leaves in each worker's block
# The dtypes a key-value store may hold: the floating ones, and the integers a counter needs.
DTYPES = dict(FLOAT_DTYPES, int32=torch.int32, int64=torch.int64)


def key_of(k, what: str = "key") -> int:
    """A key (an integer in [0, 2**63), as :func:`rdmaflow._args.integer` takes it), or
    InvalidArgumentError naming ``what``."""
    k = integer(k, what)
    if not 0 <= k < (1 << 63):
        raise InvalidArgumentError(f"{what} must be in [0, 2**63), got {k}")
    return k


def _shape(s, key: int) -> tuple[int, ...]:
    if isinstance(s, int) and not isinstance(s, bool):
        s = (s,)
    try:
        if isinstance(s, (str, bytes)):
            raise TypeError
        shape = tuple(integer(d, "a dimension") for d in s)  # True is no dimension
    except (TypeError, InvalidArgumentError):
        raise InvalidArgumentError(f"the shape of key {key} must be a tuple of integers, got {s!r}") from None
    if any(d <= 0 for d in shape):
        raise InvalidArgumentError(f"the shape of key {key} must have positive dimensions, got {list(shape)}")
    return shape


def declaration(keys, shapes, dtype) -> dict:
    """The canonical declaration (keys ascending) every process derives the layout from."""
    if isinstance(dtype, str):
        dtype = DTYPES.get(dtype.replace("torch.", ""), dtype)
    if dtype not in DTYPES.values():
        raise InvalidArgumentError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    try:
        keys, shapes = list(keys), list(shapes)
    except TypeError:
        raise InvalidArgumentError("keys and shapes must be sequences") from None
    if not keys:
        raise InvalidArgumentError("declare at least one key")
    if len(keys) != len(shapes):
        raise InvalidArgumentError(f"{len(keys)} keys but {len(shapes)} shapes")
    seen: dict[int, tuple] = {}
    for k, s in zip(keys, shapes):
        k = key_of(k)
        if k in seen:
            raise InvalidArgumentError(f"key {k} is declared twice")
        seen[k] = _shape(s, k)
    nbytes = sum(math.prod(s) for s in seen.values()) * dtype.itemsize
    if nbytes >= 1 << 62:  # past what the layout's 64-bit offsets hold
        raise InvalidArgumentError(f"the declared keys hold {nbytes} bytes of {dtype_name(dtype)} values: too many")
    return {"dtype": dtype_name(dtype), "keys": [[k, list(seen[k])] for k in sorted(seen)]}


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


class KVLayout:
    """The layout of both sides, computed from the declaration and the job's size. Index j
    numbers the declared keys ascending; key j lives on shard ``shard_of[j]`` as that shard's
    key ``local[j]``; a shard packs its keys' values densely in key order (``offset``)."""

    def __init__(self, decl: dict, num_shards: int, num_workers: int, replicas: int = 1):
        self.decl = decl
        self.replicas = replicas
        self.dtype = DTYPES[decl["dtype"]]
        self.itemsize = torch.empty((), dtype=self.dtype).element_size()
        self.keys = [int(k) for k, _ in decl["keys"]]
        self.shapes = [tuple(int(d) for d in s) for _, s in decl["keys"]]
        self.numel = [math.prod(s) for s in self.shapes]
        self.ns, self.nw = num_shards, num_workers
        self.key_tensor = torch.tensor(self.keys, dtype=torch.int64)
        # Keys that are not too sparse get a table key -> j (-1: not declared): a request's keys
        # are then looked up with one gather instead of a binary search each.
        self.max_key = self.keys[-1]
        self.key_table = None
        if self.max_key < 4 * len(self.keys) + (1 << 16):
            self.key_table = torch.full((self.max_key + 1,), -1, dtype=torch.int64)
            self.key_table[self.key_tensor] = torch.arange(len(self.keys))
        self.numel_tensor = torch.tensor(self.numel, dtype=torch.int64)
        self.shard_tensor = self.key_tensor % num_shards
        self.local_tensor = torch.empty_like(self.key_tensor)
        self.shard_keys: list[list[int]] = [[] for _ in range(num_shards)]  # s -> [j]
        for s in range(num_shards):
            js = torch.nonzero(self.shard_tensor == s).flatten()
            self.local_tensor[js] = torch.arange(len(js))
            self.shard_keys[s] = js.tolist()
        # Every key has the same number of elements (scalars, rows of a table): requests then
        # index values as rows of that width instead of through per-element index lists.
        self.width = self.numel[0] if len(set(self.numel)) == 1 else None
        self.shards = [KVServerArea([self.numel[j] for j in js], num_workers, self.itemsize, replicas, num_shards)
                       for js in self.shard_keys]
        self.worker = KVClientArea(self.shards, replicas)

    def holders(self, r: int) -> list[int]:
        """The shard processes that hold key range r (the keys of shard r): its first primary,
        then its backups in the order they succeed it (kv_replica.py)."""
        return [(r + i) % self.ns for i in range(self.replicas)]

    def held_by(self, c: int) -> list[int]:
        """The key ranges shard process c holds a copy of: its own first, then those it backs up."""
        return [(c - i) % self.ns for i in range(self.replicas)]


def element_index(offsets: torch.Tensor, numels: torch.Tensor, rows: torch.Tensor, width: int | None) -> torch.Tensor:
    """The positions, in a flat array of values, of the elements of the values ``rows`` (in that
    order), where value r starts at ``offsets[r]`` and has ``numels[r]`` elements."""
    if width == 1:
        return rows
    if width is not None:
        return (rows[:, None] * width + torch.arange(width)).reshape(-1)
    lens = numels.index_select(0, rows)
    if int(lens.sum()) == len(rows):  # scalars only: one element each
        return offsets.index_select(0, rows)
    starts = offsets.index_select(0, rows) - (torch.cumsum(lens, 0) - lens)
    return torch.repeat_interleave(starts, lens) + torch.arange(int(lens.sum()))


def request_bytes(count: int, elements: int, itemsize: int) -> int:
    """The size of a push request: its header word, ``count`` key indices, then the values."""
    return U64 * (1 + count) + elements * itemsize


class RequestAreas:
    """A shard block's request areas and per-worker words, as every key-value-style shard lays
    them out (kv.py's protocol; a sparse table's shard, sparse.py, follows it): from ``start``,
    per worker a push area, a pull area and a reply source; from ``flags`` on (zeroed at setup)
    seven words per worker; ``extra`` bytes of the service's own; the abort word and its reason.
    w numbers the workers."""

    def _lay_out(self, start: int, nw: int, push_stride: int, pull_stride: int, value_stride: int,
                 extra: int = 0) -> int:
        self.nw = nw
        self.push_stride, self.pull_stride, self.value_stride = push_stride, pull_stride, value_stride
        self.push_area = start
        self.pull_area = self.push_area + nw * push_stride
        self.reply_src = self.pull_area + nw * pull_stride
        words = aligned(U64 * nw)
        off = self.flags = self.reply_src + nw * value_stride  # everything from here on starts zeroed
        (self.push_flag, self.pull_flag, self.ack_src, self.reply_flag_src, self.done, self.barrier,
         self.barrier_src) = (off + i * words for i in range(7))
        self.abort_src = off + 7 * words + aligned(extra)
        self.reason_src = self.abort_src + U64
        self.total = self.abort_src + aligned(U64 + REASON)
        return off + 7 * words  # where the extra bytes are

    def push(self, w: int) -> int:
        return self.push_area + w * self.push_stride

    def pull(self, w: int) -> int:
        return self.pull_area + w * self.pull_stride

    def reply(self, w: int) -> int:
        return self.reply_src + w * self.value_stride

    def word(self, array: int, w: int) -> int:
        return array + U64 * w


class RequestWords:
    """The tensors over a block's per-worker words (RequestAreas), as the shard's loop reads and
    writes them; for the shard-side objects of kv_server.py and sparse_server.py."""

    def _view_words(self, raw: torch.Tensor, L: RequestAreas) -> None:
        nw = L.nw
        self.push_flags = words(raw, L.push_flag, nw)
        self.pull_flags = words(raw, L.pull_flag, nw)
        self.ack_src = words(raw, L.ack_src, nw)
        self.reply_flag_src = words(raw, L.reply_flag_src, nw)
        self.done = words(raw, L.done, nw)
        self.bflags = words(raw, L.barrier, nw)
        self.barrier_src = words(raw, L.barrier_src, nw)
        self.abort_src = words(raw, L.abort_src, 1)
        self.applied = torch.zeros(nw, dtype=torch.int64)


class KVServerArea(RequestAreas):
    """Where things are in one shard's block (see kv.py's protocol); w numbers the workers."""

    def __init__(self, numels: list[int], nw: int, itemsize: int, replicas: int = 1, ns: int = 1):
        n = self.n = len(numels)
        self.itemsize = itemsize
        self.numels = torch.tensor(numels, dtype=torch.int64)
        self.offsets = torch.cumsum(self.numels, 0) - self.numels  # element offset of key i
        self.elements = int(self.numels.sum())
        vbytes = aligned(self.elements * itemsize)
        self.stored = 0
        self._lay_out(vbytes, nw, aligned(request_bytes(n, self.elements, itemsize)), aligned(U64 * (1 + n)), vbytes)
        words = aligned(U64 * nw)
        if replicas > 1:  # a replica's words (kv_replica.py); none with one copy: today's layout
            # Two slots for the record of a replication round, round | count | applied[nw] |
            # rows[n] | values, used in turn: a record never overwrites the last committed one.
            self.rec0 = self.total
            self.rec_size = aligned(U64 * (2 + nw + n)) + vbytes
            off = self.rec0 + 2 * self.rec_size
            (self.commit, self.mround, self.mround_src, self.peek) = (off + i * U64 for i in range(4))
            self.commit_src = off + 4 * U64  # u64[ns]: the commit word for each backup (its slot differs)
            self.mapplied = self.commit_src + aligned(U64 * ns)
            self.takeover = self.mapplied + words
            self.total = self.takeover + words

    def rec(self, slot: int) -> int:
        return self.rec0 + slot * self.rec_size

    def rec_rows(self, slot: int) -> int:
        return self.rec(slot) + U64 * (2 + self.nw)

    def rec_values(self, slot: int) -> int:
        return self.rec(slot) + aligned(U64 * (2 + self.nw + self.n))



class KVClientArea:
    """Where things are in a worker's block (see kv.py's protocol); s numbers the shards."""

    def __init__(self, shards: list[KVServerArea], replicas: int = 1):
        ns = len(shards)
        off, self.push_stage, self.pull_stage, self.landing = 0, [], [], []
        for sh in shards:  # per shard: where requests are staged, where its replies land
            self.push_stage.append(off)
            self.pull_stage.append(off + sh.push_stride)
            self.landing.append(off + sh.push_stride + sh.pull_stride)
            off += sh.push_stride + sh.pull_stride + sh.value_stride
        words = aligned(U64 * ns)
        self.flags = off
        self.reply, self.ack, self.push_src, self.pull_src, self.status = (off + i * words for i in range(5))
        self.reason = off + 5 * words
        self.barrier = self.reason + aligned(REASON * ns)
        self.done_src = self.barrier + U64
        self.barrier_src = self.barrier + 2 * U64
        # Where a barrier that timed out READs shard 0's done and barrier words (they are adjacent).
        sh0 = shards[0]
        self.peek = self.barrier + aligned(4 * U64)
        self.total = self.peek + sh0.barrier - sh0.done + aligned(U64 * sh0.nw)
        if replicas > 1:  # the epoch this worker rings a successor's takeover word with, per range
            self.takeover_src = self.total
            self.total += words


def words(raw: torch.Tensor, off: int, count: int) -> torch.Tensor:
    return raw[off : off + U64 * count].view(torch.int64)
