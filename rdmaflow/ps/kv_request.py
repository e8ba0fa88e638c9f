"""One push or pull of the key-value API as the worker checks it and cuts it by shard, before
any byte moves. Two forms:

- per key: ``keys`` a list or any collection (or one key) and one tensor per key, of the key's
  declared shape;
- batched: ``keys`` a 1-D integer tensor and one flat tensor holding the keys' values
  concatenated in that order (ps-lite's ``keys``/``vals`` arrays); a pull then returns one
  flat tensor. Checking it costs a few tensor operations whatever the number of keys.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch

from rdmaflow import InvalidArgumentError
from rdmaflow.ps.kv_layout import KVLayout, element_index, key_of
from rdmaflow.transfer.dtypes import describe


def short(keys) -> str:
    """At most eight keys of a request, as messages name them."""
    head = keys[:8].tolist() if isinstance(keys, torch.Tensor) else list(keys)[:8]
    n = len(keys)
    return str(head) if n <= 8 else f"[{', '.join(map(str, head))}, ... ({n} keys)]"


class Request:
    """The declared indices ``j`` of a request's keys (request order), their values (``flat``,
    or ``tensors`` per key), and where each key's elements start in the request (``offsets``)."""

    def __init__(self, spec: KVLayout, keys, values, op: str, *, values_optional: bool = False):
        self.spec, self.op = spec, op
        self.batched = isinstance(keys, torch.Tensor) and keys.dim() == 1 and \
            (values is None or isinstance(values, torch.Tensor))
        if self.batched:
            self.single = False
            self.keys = self._check_key_tensor(keys)
        else:
            if isinstance(keys, torch.Tensor) and keys.dim() == 1:
                keys = keys.tolist()
            # One key, or any collection of them (a range, a numpy array), as the declaration takes
            self.single = isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable) or (
                getattr(keys, "ndim", 1) == 0)
            keys = [keys] if self.single else list(keys)
            self.keys = torch.tensor([key_of(k) for k in keys], dtype=torch.int64)
        self.j = self._index()
        self.numels = spec.numel_tensor.index_select(0, self.j)
        self.offsets = torch.cumsum(self.numels, 0) - self.numels
        self.elements = int(self.numels.sum()) if len(self.j) else 0
        self.flat: torch.Tensor | None = None
        self.tensors: list | None = None
        if self.batched:
            self._check_flat(values, values_optional)
        else:
            self._check_tensors(values, values_optional)

    def __len__(self) -> int:
        return len(self.j)

    def _check_key_tensor(self, keys: torch.Tensor) -> torch.Tensor:
        if keys.dtype.is_floating_point or keys.dtype.is_complex or keys.dtype == torch.bool:
            raise InvalidArgumentError(f"{self.op}: keys must be integers, got a {keys.dtype} tensor")
        keys = keys.to(torch.int64)
        if len(keys) and int(keys.min()) < 0:
            raise InvalidArgumentError(f"{self.op}: key must be in [0, 2**63), got {int(keys.min())}")
        return keys

    def _index(self) -> torch.Tensor:
        spec = self.spec
        if spec.key_table is not None:
            pos = spec.key_table.index_select(0, self.keys.clamp(max=spec.max_key))
            unknown = (pos < 0) | (self.keys > spec.max_key)
        else:
            pos = torch.searchsorted(spec.key_tensor, self.keys).clamp(max=len(spec.keys) - 1)
            unknown = spec.key_tensor.index_select(0, pos) != self.keys
        if bool(unknown.any()):
            k = int(self.keys[unknown][0])
            raise InvalidArgumentError(f"{self.op}: key {k} was not declared (declared: {short(spec.key_tensor)})")
        # Keys in ascending order (the usual request) cannot repeat; others are sorted to check.
        if len(pos) > 1 and not bool((pos[1:] > pos[:-1]).all()) and len(torch.unique(pos)) != len(pos):
            ordered, _ = torch.sort(self.keys)
            dup = int(ordered[1:][ordered[1:] == ordered[:-1]][0])
            raise InvalidArgumentError(f"{self.op}: key {dup} appears twice in one call")
        return pos

    def _check_flat(self, flat, optional: bool) -> None:
        if flat is None and optional:
            return
        want = (self.elements,)
        if not isinstance(flat, torch.Tensor):
            raise InvalidArgumentError(f"{self.op}: the values of {len(self)} keys are one "
                                       f"{describe(want, self.spec.dtype)} tensor, got {type(flat).__name__}")
        if flat.dtype != self.spec.dtype or tuple(flat.shape) != want:
            expected = describe(want, self.spec.dtype)
            raise InvalidArgumentError(f"{self.op}: the values of {len(self)} keys are one {expected} tensor, "
                                       f"got {describe(flat.shape, flat.dtype)}")
        self._check_device(flat, "the values")
        self.flat = flat

    def _check_tensors(self, tensors, optional: bool) -> None:
        if tensors is None and optional:
            self.tensors = [None] * len(self.j)
            return
        if tensors is None or not (self.single or isinstance(tensors, (torch.Tensor, list, tuple))):
            raise InvalidArgumentError(f"{self.op}: the values of keys {short(self.keys)} are one tensor per key "
                                       f"(a list), got {type(tensors).__name__}")
        tensors = [tensors] if self.single or isinstance(tensors, torch.Tensor) else list(tensors)
        if len(tensors) != len(self.j):
            raise InvalidArgumentError(f"{self.op}: {len(self.j)} keys but {len(tensors)} tensors")
        spec = self.spec
        for j, t in zip(self.j.tolist(), tensors):
            key = spec.keys[j]
            if t is None and optional:
                continue
            if not isinstance(t, torch.Tensor):
                raise InvalidArgumentError(f"{self.op}: the tensor of key {key} must be a torch.Tensor, "
                                           f"got {type(t).__name__}")
            if t.dtype != spec.dtype or tuple(t.shape) != spec.shapes[j]:
                raise InvalidArgumentError(f"{self.op}: key {key} holds {describe(spec.shapes[j], spec.dtype)}, "
                                           f"got {describe(t.shape, t.dtype)}")
            self._check_device(t, f"the tensor of key {key}")
        self.tensors = tensors

    def _check_device(self, t: torch.Tensor, what: str) -> None:
        if t.device.type != "cpu":
            raise InvalidArgumentError(f"{self.op}: {what} is on {t.device}; the key-value API moves host tensors")

    def by_shard(self) -> list[tuple[int, torch.Tensor | None]]:
        """(shard, the request positions of its keys) for every shard the request names; None
        for positions when the request's keys all go to that one shard."""
        if not len(self.j):
            return []
        shards = self.spec.shard_tensor.index_select(0, self.j)
        if self.spec.ns == 1 or bool((shards == shards[0]).all()):
            return [(int(shards[0]), None)]
        return [(s, torch.nonzero(shards == s).flatten()) for s in range(self.spec.ns) if bool((shards == s).any())]

    def element_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """Where the elements of the keys at request ``positions`` are in the request's values."""
        return element_index(self.offsets, self.numels, positions, self.spec.width)
