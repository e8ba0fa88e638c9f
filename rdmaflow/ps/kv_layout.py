"""The key-value store's declaration (keys, shapes, one dtype) and the layout both sides derive
from it: where each value and word lives in a shard's block (KVServerArea) and in a worker's
block (KVClientArea). The protocol that uses them is described in kv.py."""
from __future__ import annotations

import operator

import torch

from rdmaflow import InvalidArgumentError
from rdmaflow.ps.protocol import aligned
from rdmaflow.transfer.dtypes import FLOAT_DTYPES, dtype_name

U64 = 8
REASON = 512  # bytes of the message a failing shard leaves in each worker's block
# The dtypes a key-value store may hold: the floating ones, and the integers a counter needs.
DTYPES = dict(FLOAT_DTYPES, int32=torch.int32, int64=torch.int64)


def key_of(k, what: str = "key") -> int:
    if isinstance(k, bool):
        raise InvalidArgumentError(f"{what} must be an integer, got {k!r}")
    try:
        k = operator.index(k)
    except TypeError:
        if isinstance(k, torch.Tensor) and k.numel() == 1 and not k.is_floating_point():
            k = int(k.item())
        else:
            raise InvalidArgumentError(f"{what} must be an integer, got {k!r}") from None
    if not 0 <= k < (1 << 63):
        raise InvalidArgumentError(f"{what} must be in [0, 2**63), got {k}")
    return k


def _shape(s, key: int) -> tuple[int, ...]:
    if isinstance(s, int) and not isinstance(s, bool):
        s = (s,)
    try:
        shape = tuple(operator.index(d) for d in s)
    except TypeError:
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
        self.worker = KVClientArea(self.nbytes, num_shards)
        self.shards = [KVServerArea([self.nbytes[j] for j in js], num_workers) for js in self.shard_keys]


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


class KVServerArea:
    """Where things are in shard s's block (see kv.py's protocol)."""

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


class KVClientArea:
    """Where things are in a worker's block (see kv.py's protocol)."""

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


def words(raw: torch.Tensor, off: int, count: int) -> torch.Tensor:
    return raw[off : off + U64 * count].view(torch.int64)


def _arena(dev, nbytes: int):
    existing = getattr(dev, "_rdmaflow_arena", None)
    return existing if existing is not None else dev.create_arena(nbytes)


