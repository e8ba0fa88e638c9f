"""Where each parameter lives: the flat buffers on workers and the units spread over shards.

Two placement policies:

- ``"variable"``: whole variables, never cut (Xue et al. §5.2), in contiguous runs balanced by
  bytes: shard s holds the variables whose middle element falls in the s-th 1/S of the flat
  buffer. A shard's variables are then adjacent in the workers' buffers as in its own, so a
  step moves them in one WRITE per shard and chunk however many small tensors the model has
  (round-robin, the older placement, scattered them: one WRITE per variable).
- ``"block"``: the flat parameter space cut into fixed-size blocks spread evenly over the
  shards (iRDMA §IV-C); a block may span variables.

Both sides compute the same plan from the same spec, so no offsets are exchanged.
"""
from __future__ import annotations

import hashlib
import json
from bisect import bisect_left, bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from rdmaflow import InvalidArgumentError
from rdmaflow.transfer import FLOAT_DTYPES, dtype_name

POLICIES = ("variable", "block")
# Part of a checkpoint's fingerprint: where the units lie changed with it (2: "variable" went from
# round-robin to contiguous runs), so a checkpoint of another placement is refused, not misread.
PLACEMENT_VERSION = 2
# A unit this large is pushed on its own as soon as backward produces it; smaller ones wait in
# their shard's batch until it is this large, or until step(), and go as one WRITE per run.
BATCH_BYTES = 256 << 10
DEFAULT_BLOCK_BYTES = 1 << 20
# Weights are delivered in chunks, each followed by a fence and a progress flag: enough chunks
# that the next forward can start early, few enough that the fences stay cheap.
MAX_CHUNKS = 32
MIN_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str
    numel: int
    offset: int  # in elements, inside the worker's flat buffer


@dataclass(frozen=True)
class Unit:
    key: int
    shard: int
    offset: int        # elements, inside the worker's flat buffer
    numel: int
    shard_offset: int  # elements, inside the shard's weights
    name: str


def spec_of(named_params) -> list[dict]:
    """The model's parameter spec: names, shapes, dtypes, in registration order."""
    out = []
    for name, p in named_params:
        out.append({"name": name, "shape": list(p.shape), "dtype": dtype_name(p.dtype)})
    return out


def spec_digest(spec: list[dict]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def describe_difference(mine: Sequence[tuple[object, str]], theirs: Sequence[tuple[object, str]], *,
                        item: str = "parameter", there: str = "in the job's model") -> str:
    """The first difference between two declarations, readable: each is a sequence of
    (name, description) in declaration order, e.g. ("0.weight", "float32[16, 8]"). Different
    lengths name the extra and missing names; else the first pair that differs is named.
    ``item`` is what one entry is, ``there`` where the other declaration comes from."""
    if len(mine) != len(theirs):
        names_m = {n for n, _ in mine}
        names_t = {n for n, _ in theirs}
        extra, missing = sorted(names_m - names_t), sorted(names_t - names_m)
        return (f"{len(mine)} {item}s here, {len(theirs)} {there}"
                + (f"; extra here: {extra[:5]}" if extra else "")
                + (f"; missing here: {missing[:5]}" if missing else ""))
    for (name_m, desc_m), (name_t, desc_t) in zip(mine, theirs):
        if (name_m, desc_m) != (name_t, desc_t):
            return f"{item} {name_m} {desc_m} here vs {name_t} {desc_t} {there}"
    return "no difference"


def spec_entries(spec: list[dict]) -> list[tuple[str, str]]:
    """A model spec as describe_difference takes it: ("0.weight", "float32[16, 8]") per parameter."""
    return [(p["name"], f"{p['dtype']}{p['shape']}") for p in spec]


@dataclass
class Plan:
    params: list[ParamInfo]
    units: list[Unit]
    num_shards: int
    policy: str
    block_bytes: int
    dtype: str
    total: int  # elements

    @property
    def itemsize(self) -> int:
        return FLOAT_DTYPES[self.dtype].itemsize

    def units_of(self, shard: int) -> list[Unit]:
        return [u for u in self.units if u.shard == shard]

    def chunks_of(self, shard: int, min_bytes: int = MIN_CHUNK_BYTES) -> list[list[Unit]]:
        """The shard's units, in flat-buffer (registration, so forward) order, cut into at most
        MAX_CHUNKS runs of at least ``min_bytes``: the steps of pipelined weight delivery."""
        units = sorted(self.units_of(shard), key=lambda u: u.offset)
        isz = self.itemsize
        target = max(int(min_bytes), 1, -(-sum(u.numel for u in units) * isz // MAX_CHUNKS))
        chunks: list[list[Unit]] = []
        cur: list[Unit] = []
        acc = 0
        for u in units:
            cur.append(u)
            acc += u.numel * isz
            if acc >= target:
                chunks.append(cur)
                cur, acc = [], 0
        if cur:
            chunks.append(cur)
        return chunks

    def shard_numel(self, shard: int) -> int:
        return sum(u.numel for u in self.units_of(shard))

    def to_json(self) -> str:
        return json.dumps({"params": [asdict(p) for p in self.params], "units": [asdict(u) for u in self.units],
                           "num_shards": self.num_shards, "policy": self.policy,
                           "block_bytes": self.block_bytes, "dtype": self.dtype, "total": self.total})


@dataclass(frozen=True)
class Run:
    """Units adjacent both in the worker's flat buffer and in their shard's weights: one WRITE."""
    offset: int        # elements, inside the worker's flat buffer
    shard_offset: int  # elements, inside the shard's weights
    numel: int


def runs_of(units: Sequence[Unit]) -> list[Run]:
    """Units of one shard merged into maximal runs, in worker-buffer order."""
    out: list[Run] = []
    for u in sorted(units, key=lambda u: u.offset):
        if u.numel == 0:
            continue
        last = out[-1] if out else None
        if last and last.offset + last.numel == u.offset and last.shard_offset + last.numel == u.shard_offset:
            out[-1] = Run(last.offset, last.shard_offset, last.numel + u.numel)
        else:
            out.append(Run(u.offset, u.shard_offset, u.numel))
    return out


def units_holding(starts: Sequence[int], lo: int, hi: int) -> range:
    """Indices of the units holding flat elements [lo, hi), given the units' sorted offsets."""
    return range(max(bisect_right(starts, lo) - 1, 0), bisect_left(starts, hi))


def covered_once(units: Sequence[Unit], ranges: Sequence[tuple[int, int]]) -> tuple[set[int], set[int]]:
    """Of ``units`` (sorted by offset), the indices of those that element ranges [lo, hi) cover
    whole and exactly once, and of those they touch at all."""
    starts = [u.offset for u in units]

    def within(lo: int, hi: int) -> range:
        return units_holding(starts, lo, hi)

    merged: list[list[int]] = []
    twice: set[int] = set()
    for lo, hi in sorted(r for r in ranges if r[0] < r[1]):
        if merged and lo < merged[-1][1]:
            twice.update(within(lo, min(hi, merged[-1][1])))  # sorted by start: only the last can overlap
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    once, touched = set(), set()
    for lo, hi in merged:
        for i in within(lo, hi):
            u = units[i]
            if u.offset + u.numel > lo and u.offset < hi:
                touched.add(i)
                if lo <= u.offset and u.offset + u.numel <= hi and i not in twice:
                    once.add(i)
    return once, touched


def make_plan(spec: list[dict], num_shards: int, policy: str = "block",
              block_bytes: int = DEFAULT_BLOCK_BYTES) -> Plan:
    if policy not in POLICIES:
        raise InvalidArgumentError(f"placement policy must be one of {POLICIES}, got {policy!r}")
    if num_shards < 1:
        raise InvalidArgumentError(f"need at least one shard, got {num_shards}")
    if not spec:
        raise InvalidArgumentError("the model has no parameters")
    dtypes = {p["dtype"] for p in spec}
    if len(dtypes) != 1 or next(iter(dtypes)) not in FLOAT_DTYPES:
        raise InvalidArgumentError(
            f"parameters must share one floating dtype ({', '.join(FLOAT_DTYPES)}); this model has {sorted(dtypes)}"
        )
    dtype = next(iter(dtypes))
    itemsize = FLOAT_DTYPES[dtype].itemsize
    params, off = [], 0
    for p in spec:
        numel = 1
        for s in p["shape"]:
            numel *= int(s)
        params.append(ParamInfo(p["name"], tuple(p["shape"]), dtype, numel, off))
        off += numel
    total = off
    units: list[Unit] = []
    shard_fill = [0] * num_shards
    if policy == "variable":
        for i, p in enumerate(params):
            s = min(num_shards - 1, (2 * p.offset + p.numel) * num_shards // (2 * total)) if total else 0
            units.append(Unit(i, s, p.offset, p.numel, shard_fill[s], p.name))
            shard_fill[s] += p.numel
    else:
        if block_bytes < itemsize or block_bytes % itemsize:
            raise InvalidArgumentError(f"block size {block_bytes} is not a positive multiple of the element size "
                                       f"{itemsize}")
        per = block_bytes // itemsize
        for k, start in enumerate(range(0, total, per)):
            n = min(per, total - start)
            s = k % num_shards
            units.append(Unit(k, s, start, n, shard_fill[s], f"block {k}"))
            shard_fill[s] += n
    return Plan(params, units, num_shards, policy, block_bytes, dtype, total)
