"""A sparse table's hash table as both sides see it: the layout of one shard's table region,
the hashes that place a key (on a shard, in three buckets), the entries' self-check, the
initializers, and the vectorized lookup. No I/O: the shard (sparse_server.py) writes a region,
a worker (sparse_client.py) reads a copy of it or maps it. The protocol is in sparse.py.

Region (one per shard and epoch; int64 words)::

    header   8 words: epoch, state (LIVE, or RETIRED once a larger region replaced it),
             the next region's epoch, buckets, slots per bucket, words per entry, rows, 0
    keys     [buckets, SLOTS, 2]: (key, 1) for an occupied slot, (0, 0) for a free one
    entries  [buckets * SLOTS, W]: version, key, check, the row's words, the handler's state

A key lives in one of its three buckets (bucketized hashing with three choices, no
displacement), in the slot the keys array names: a reader fetches the three buckets' keys, finds
its slot, then fetches the entry.
"""
from __future__ import annotations

import math

import torch

SLOTS = 8                      # slots per bucket: a bucket's keys are 128 bytes, two cache lines
CHOICES = 3                    # buckets a key may live in
HEADER_WORDS = 8
VER, KEY, CHECK, ROW = 0, 1, 2, 3  # word positions in an entry
LIVE, RETIRED = 1, 2

_M = (1 << 64) - 1


def _s64(c: int) -> int:
    """A 64-bit constant as the signed int64 torch holds."""
    c &= _M
    return c - (1 << 64) if c >> 63 else c


C1, C2 = _s64(0xBF58476D1CE4E5B9), _s64(0x94D049BB133111EB)
GOLDEN = _s64(0x9E3779B97F4A7C15)
SALT_SHARD, SALT_INIT, *SALT_B = (_s64(0x5EED0000 + i * 0x1F3D5B79) for i in range(2 + CHOICES))


def lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical shift right of int64 words (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 words (products wrap modulo 2**64, as torch's do)."""
    x = x ^ lsr(x, 30)
    x = x * C1
    x = x ^ lsr(x, 27)
    x = x * C2
    return x ^ lsr(x, 31)


def shard_of(keys: torch.Tensor, num_shards: int) -> torch.Tensor:
    """The shard of each key: a hash, so that keys of any pattern spread evenly."""
    return lsr(mix(keys ^ SALT_SHARD), 1) % num_shards


def buckets_of(keys: torch.Tensor, nbuckets: int) -> torch.Tensor:
    """[n, CHOICES]: each key's buckets (nbuckets a power of two; a choice may repeat another,
    which costs that key a choice, never correctness)."""
    return torch.stack([mix(keys ^ salt) & (nbuckets - 1) for salt in SALT_B], 1)


def check_of(words: torch.Tensor) -> torch.Tensor:
    """The check word of entries ``words`` [n, W'] (their version, key, and row words; the
    check word itself left out): a sum of each word mixed with its position, so that an entry
    copied in any order, part before a write and part after, matches its check only by chance
    (2**-64), whichever words came from which write."""
    pos = torch.arange(1, words.shape[1] + 1, dtype=torch.int64) * GOLDEN
    return mix(words + pos).sum(1)


def entry_check(entries: torch.Tensor, row_words: int) -> torch.Tensor:
    """The check word entries [n, W] should hold (from their version, key and row)."""
    return check_of(torch.cat([entries[:, VER:KEY + 1], entries[:, ROW:ROW + row_words]], 1))


class TableFormat:
    """Sizes of a table's entries: ``dim`` values of ``dtype`` per row, ``state`` float32 values
    of the handler's per row (Adagrad's accumulators)."""

    def __init__(self, dim: int, dtype: torch.dtype, state: int):
        self.dim, self.dtype, self.state = dim, dtype, state
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.row_bytes = dim * self.itemsize
        self.row_words = math.ceil(self.row_bytes / 8)
        self.state_words = math.ceil(state * 4 / 8)
        self.words = ROW + self.row_words + self.state_words
        self.entry_bytes = 8 * self.words

    def region_bytes(self, nbuckets: int) -> int:
        slots = nbuckets * SLOTS
        return 8 * HEADER_WORDS + 16 * slots + self.entry_bytes * slots

    def rows_of(self, entries: torch.Tensor) -> torch.Tensor:
        """The rows of entries [n, W] as [n, dim] values of the table's dtype (a view)."""
        return entries[:, ROW:ROW + self.row_words].view(self.dtype)[:, : self.dim]

    def state_of(self, entries: torch.Tensor) -> torch.Tensor:
        at = ROW + self.row_words
        return entries[:, at:at + self.state_words].view(torch.float32)[:, : self.state]


class TableView:
    """Tensors over one table region (its bytes ``raw``, uint8): header, keys, entries."""

    def __init__(self, raw: torch.Tensor, fmt: TableFormat, nbuckets: int):
        self.fmt, self.nbuckets = fmt, nbuckets
        slots = nbuckets * SLOTS
        words = raw[: fmt.region_bytes(nbuckets)].view(torch.int64)
        self.header = words[:HEADER_WORDS]
        self.keys = words[HEADER_WORDS : HEADER_WORDS + 2 * slots].view(nbuckets, SLOTS, 2)
        self.entries = words[HEADER_WORDS + 2 * slots :].view(slots, fmt.words)

    def find(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(found, slot) per key, from this view's keys array (a gather of its buckets)."""
        return find_in(self.keys, buckets_of(keys, self.nbuckets), keys)


def find_in(bucket_keys: torch.Tensor, buckets: torch.Tensor, keys: torch.Tensor):
    """(found [n] bool, slot [n] int64) of each key given its buckets' keys: ``bucket_keys``
    the whole keys array [nbuckets, SLOTS, 2] (gathered here: index_select, which is ~30x faster
    than advanced indexing here), or already [n, CHOICES, SLOTS, 2]."""
    n = len(keys)
    if bucket_keys.dim() == 3:
        flat = bucket_keys.view(bucket_keys.shape[0], 2 * SLOTS)
        cand = flat.index_select(0, buckets.reshape(-1)).view(n, CHOICES, SLOTS, 2)
    else:
        cand = bucket_keys
    match = ((cand[..., 0] == keys[:, None, None]) & (cand[..., 1] == 1)).reshape(n, CHOICES * SLOTS)
    found = match.any(1)
    at = match.to(torch.uint8).argmax(1)
    slot = buckets.gather(1, (at // SLOTS)[:, None])[:, 0] * SLOTS + at % SLOTS
    return found, slot


def place(fill: torch.Tensor, keys: torch.Tensor, nbuckets: int) -> torch.Tensor | None:
    """Slots for new ``keys`` (distinct, none in the table), each in the least full of its
    buckets; ``fill`` (occupied slots per bucket) is updated. None, with ``fill`` unchanged, when
    some key finds all its buckets full: the table must grow."""
    n = len(keys)
    b = buckets_of(keys, nbuckets)
    slot = torch.full((n,), -1, dtype=torch.int64)
    new_fill = fill.clone()
    # A batch's keys choose by the fill before the batch, so a large batch would choose as one
    # choice does: they go in parts of an eighth of the buckets, the fill updated after each.
    step = max(nbuckets // 8, 64)
    for start in range(0, n, step):
        if not _place_part(new_fill, b, slot, torch.arange(start, min(n, start + step))):
            return None
    fill.copy_(new_fill)
    return slot


def _place_part(new_fill: torch.Tensor, b: torch.Tensor, slot: torch.Tensor, pending: torch.Tensor) -> bool:
    while len(pending):
        bp = b[pending]
        f = new_fill[bp]
        if bool((f >= SLOTS).all(1).any()):
            return False
        cb = bp.gather(1, f.argmin(1, keepdim=True))[:, 0]
        # Keys that chose one bucket in this round take its next free slots in turn.
        order = torch.argsort(cb, stable=True)
        sorted_b = cb[order]
        _, counts = torch.unique_consecutive(sorted_b, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.empty_like(cb)
        rank[order] = torch.arange(len(cb)) - torch.repeat_interleave(starts, counts)
        pos = new_fill[cb] + rank
        ok = pos < SLOTS
        slot[pending[ok]] = cb[ok] * SLOTS + pos[ok]
        new_fill.index_add_(0, cb[ok], torch.ones(int(ok.sum()), dtype=torch.int64))
        pending = pending[~ok]
    return True


# -- initializers: a never-pushed row's value, a function of (seed, key) alone -----------------------

def _uniform01(keys: torch.Tensor, dim: int, seed: int, stream: int) -> torch.Tensor:
    """[n, dim] float64 in [0, 1) from a counter-based hash of (seed, stream, key, column)."""
    s = mix(torch.tensor([_s64(seed)], dtype=torch.int64) ^ SALT_INIT) + _s64(stream * GOLDEN)
    x = mix(mix(keys[:, None] ^ s) + torch.arange(dim, dtype=torch.int64) * GOLDEN)
    return lsr(x, 11).to(torch.float64) * (1.0 / (1 << 53))


class Initializer:
    """What a row that was never pushed holds. Subclasses: Zeros, Constant, Normal, Uniform."""

    def spec(self) -> dict:
        raise NotImplementedError

    def values(self, keys: torch.Tensor, dim: int, seed: int) -> torch.Tensor:
        raise NotImplementedError


class Zeros(Initializer):
    def spec(self) -> dict:
        return {"kind": "zeros"}

    def values(self, keys, dim, seed):
        return torch.zeros(len(keys), dim, dtype=torch.float64)


class Constant(Initializer):
    def __init__(self, value: float):
        self.value = float(value)

    def spec(self) -> dict:
        return {"kind": "constant", "value": self.value}

    def values(self, keys, dim, seed):
        return torch.full((len(keys), dim), self.value, dtype=torch.float64)


class Uniform(Initializer):
    def __init__(self, a: float = 0.0, b: float = 1.0):
        self.a, self.b = float(a), float(b)

    def spec(self) -> dict:
        return {"kind": "uniform", "a": self.a, "b": self.b}

    def values(self, keys, dim, seed):
        return self.a + (self.b - self.a) * _uniform01(keys, dim, seed, 0)


class Normal(Initializer):
    def __init__(self, mean: float = 0.0, std: float = 1.0):
        self.mean, self.std = float(mean), float(std)

    def spec(self) -> dict:
        return {"kind": "normal", "mean": self.mean, "std": self.std}

    def values(self, keys, dim, seed):  # Box-Muller on two independent streams
        u1 = 1.0 - _uniform01(keys, dim, seed, 1)   # (0, 1]: log is finite
        u2 = _uniform01(keys, dim, seed, 2)
        return self.mean + self.std * torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * math.pi * u2)


def initializer_from_spec(spec: dict) -> Initializer:
    kind = spec["kind"]
    if kind == "zeros":
        return Zeros()
    if kind == "constant":
        return Constant(spec["value"])
    if kind == "uniform":
        return Uniform(spec["a"], spec["b"])
    return Normal(spec["mean"], spec["std"])
