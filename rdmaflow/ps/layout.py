"""Where each parameter lives: the flat buffers on workers and the units spread over shards.

Two placement policies:

- ``"variable"``: whole variables round-robin over the shards (seed 000 §5.2).
- ``"block"``: the flat parameter space cut into fixed-size blocks spread evenly over the
  shards (iRDMA §IV-C); a block may span variables.

Both sides compute the same plan from the same spec, so no offsets are exchanged.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from rdmaflow import _core

POLICIES = ("variable", "block")
DEFAULT_BLOCK_BYTES = 1 << 20
# Weights are delivered in chunks, each followed by a fence and a progress flag: enough chunks
# that the next forward can start early, few enough that the fences stay cheap.
MAX_CHUNKS = 32
MIN_CHUNK_BYTES = 1 << 20

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16}


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
        out.append({"name": name, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")})
    return out


def spec_digest(spec: list[dict]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def describe_difference(mine: list[dict], theirs: list[dict]) -> str:
    """A readable first difference between two specs."""
    if len(mine) != len(theirs):
        names_m = {p["name"] for p in mine}
        names_t = {p["name"] for p in theirs}
        extra, missing = sorted(names_m - names_t), sorted(names_t - names_m)
        return (f"{len(mine)} parameters here, {len(theirs)} in the job's model"
                + (f"; extra here: {extra[:5]}" if extra else "")
                + (f"; missing here: {missing[:5]}" if missing else ""))
    for a, b in zip(mine, theirs):
        if a != b:
            return f"parameter {a['name']} {a['dtype']}{a['shape']} here vs {b['name']} {b['dtype']}{b['shape']} in the job's model"
    return "no difference"


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
        return torch.empty((), dtype=DTYPES[self.dtype]).element_size()

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


def make_plan(spec: list[dict], num_shards: int, policy: str = "block",
              block_bytes: int = DEFAULT_BLOCK_BYTES) -> Plan:
    if policy not in POLICIES:
        raise _core.InvalidArgumentError(f"placement policy must be one of {POLICIES}, got {policy!r}")
    if num_shards < 1:
        raise _core.InvalidArgumentError(f"need at least one shard, got {num_shards}")
    if not spec:
        raise _core.InvalidArgumentError("the model has no parameters")
    dtypes = {p["dtype"] for p in spec}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise _core.InvalidArgumentError(
            f"parameters must share one floating dtype ({', '.join(DTYPES)}); this model has {sorted(dtypes)}"
        )
    dtype = next(iter(dtypes))
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
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
            s = i % num_shards
            units.append(Unit(i, s, p.offset, p.numel, shard_fill[s], p.name))
            shard_fill[s] += p.numel
    else:
        if block_bytes < itemsize or block_bytes % itemsize:
            raise _core.InvalidArgumentError(f"block size {block_bytes} is not a multiple of the element size {itemsize}")
        per = block_bytes // itemsize
        k = 0
        for start in range(0, total, per):
            n = min(per, total - start)
            s = k % num_shards
            units.append(Unit(k, s, start, n, shard_fill[s], f"block {k}"))
            shard_fill[s] += n
            k += 1
    return Plan(params, units, num_shards, policy, block_bytes, dtype, total)
