"""A key-value store's values in one file: what ``KVStore.save(path)`` writes and what
``KVStore(..., init=path)`` reads back.

The file is a torch.save dict::

    {"format": "rdmaflow.kv", "version": 1,
     "dtype": "float32", "keys": [[key, shape], ...],   # the declaration, keys ascending
     "values": flat tensor}                              # every key's values, in that order

It holds the stored values only (not state a handler keeps of its own), by key, not by
shard, so a job of another shard or worker count may read it; the declaration (keys, shapes,
dtype) must be the reading job's. Written under a temporary name and renamed
(checkpoint.write_whole), so a file that exists is whole.
"""
from __future__ import annotations

import math

import torch

from rdmaflow import InvalidArgumentError
from rdmaflow.ps.checkpoint import read, write_whole
from rdmaflow.ps.kv_layout import DTYPES, describe_difference

FORMAT, VERSION = "rdmaflow.kv", 1


def save(path: str, decl: dict, values: torch.Tensor) -> None:
    """Writes ``values`` (every declared key's, flat, in the declaration's order, in host memory)
    to ``path``. A tensor of its own, as a pull returns it: torch.save writes a view's whole
    storage."""
    write_whole({"format": FORMAT, "version": VERSION, "dtype": decl["dtype"], "keys": decl["keys"],
                 "values": values}, path)


def load(path: str, decl: dict) -> list[torch.Tensor]:
    """The values ``path`` holds, one tensor per key in the declaration's order (keys ascending).
    InvalidArgumentError naming the path when it is missing, unreadable, not a snapshot, or of
    another declaration (naming the first difference)."""
    state = read(path, "snapshot")
    if state.get("format") != FORMAT or state.get("version") != VERSION:
        raise InvalidArgumentError(f"snapshot {path} is not a key-value snapshot of this rdmaflow "
                                   f"(format {state.get('format')!r}, version {state.get('version')!r})")
    theirs = {"dtype": state.get("dtype"), "keys": state.get("keys")}
    if theirs != decl:
        try:
            diff = describe_difference(decl, theirs).replace("on worker 0", "in the snapshot")
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"snapshot {path} is damaged: its declaration is unreadable") from None
        raise InvalidArgumentError(f"snapshot {path} was saved with another declaration: {diff}")
    values = state.get("values")
    shapes = [tuple(s) for _, s in decl["keys"]]
    sizes = [math.prod(s) for s in shapes]
    if (not isinstance(values, torch.Tensor) or values.dim() != 1 or values.numel() != sum(sizes)
            or values.dtype != DTYPES[decl["dtype"]]):
        raise InvalidArgumentError(f"snapshot {path} is damaged: its values are not {sum(sizes)} {decl['dtype']} "
                                   "numbers")
    return [t.view(s) for t, s in zip(values.split(sizes), shapes)]
