"""The model a file view serves: its declaration file, the module and optimizer built from it,
and the metadata document that describes the byte layout to clients.

A declaration is JSON::

    {"variables": [{"name": "linear.weight", "shape": [4, 8], "dtype": "float32", "init": 0.1},
                   {"name": "linear.bias", "shape": [4], "dtype": "float32", "init": [0, 0, 0, 0]}],
     "optimizer": {"name": "SGD", "lr": 0.1, "momentum": 0.9}}

``init`` is a number (every element) or a flat list (row-major), default 0; only worker 0's
values matter, as for ``DistributedOptimizer`` (the shards READ its initial weights). The flat
model is the variables in declaration order, so a variable's byte offset is the sum of the sizes
before it: the same flat space the placement plan cuts into blocks or variables.
"""
from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass

import torch

from rdmaflow import InvalidArgumentError
from rdmaflow.ps.layout import make_plan
from rdmaflow.ps.optim import describe_optimizer
from rdmaflow.transfer import FLOAT_DTYPES

NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
MAX_MODEL_BYTES = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # every process holds the model


@dataclass(frozen=True)
class Variable:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int   # bytes, in the flat model
    nbytes: int


class DeclaredModel(torch.nn.Module):
    """A module whose parameters are the declared variables, named and ordered as declared
    (``named_parameters`` is what the parameter server's spec is made of)."""

    def __init__(self, variables: list[Variable], inits: list[torch.Tensor]):
        super().__init__()
        self._names = [v.name for v in variables]
        for i, t in enumerate(inits):
            self.register_parameter(f"v{i}", torch.nn.Parameter(t))

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for i, name in enumerate(self._names):
            yield prefix + name, getattr(self, f"v{i}")


@dataclass
class Declaration:
    variables: list[Variable]
    dtype: str
    optimizer: dict
    inits: list[torch.Tensor]

    @property
    def total_bytes(self) -> int:
        return sum(v.nbytes for v in self.variables)

    def build(self) -> tuple[DeclaredModel, torch.optim.Optimizer]:
        model = DeclaredModel(self.variables, self.inits)
        name = self.optimizer.get("name", "SGD")
        cls = getattr(torch.optim, name, None) if isinstance(name, str) else None
        if not isinstance(cls, type) or not issubclass(cls, torch.optim.Optimizer):
            raise InvalidArgumentError(f"the declaration's optimizer {name!r} is not a torch.optim class")
        hyper = {k: v for k, v in self.optimizer.items() if k != "name"}
        try:
            opt = cls(model.parameters(), **hyper)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(f"the declaration's optimizer {name}({hyper}) is invalid: {e}") from None
        describe_optimizer(opt)  # one the shards run (checked here, before joining the job)
        return model, opt

    def metadata(self, num_shards: int, policy: str, block_bytes: int, mode: str) -> bytes:
        """The metadata file: every variable's name, shape, dtype and byte offset, and where the
        placement puts each block (or variable) of the flat model."""
        spec = [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype} for v in self.variables]
        plan = make_plan(spec, num_shards, policy, block_bytes)
        isz = plan.itemsize
        doc = {"dtype": self.dtype, "itemsize": isz, "total_bytes": self.total_bytes, "mode": mode,
               "files": {"grad": "grad", "weights": "weights", "variables": "vars/<name>.grad, vars/<name>.weights"},
               "variables": [{"name": v.name, "shape": list(v.shape), "dtype": v.dtype, "offset": v.offset,
                              "nbytes": v.nbytes} for v in self.variables],
               "placement": {"policy": policy, "num_shards": num_shards, "block_bytes": block_bytes,
                             "units": [{"name": u.name, "shard": u.shard, "offset": u.offset * isz,
                                        "nbytes": u.numel * isz} for u in plan.units]}}
        return (json.dumps(doc, indent=1) + "\n").encode()


def _init_tensor(v: Variable, init, numel: int) -> torch.Tensor:
    dtype = FLOAT_DTYPES[v.dtype]
    if init is None:
        return torch.zeros(v.shape, dtype=dtype)
    try:
        if isinstance(init, (int, float)) and not isinstance(init, bool):
            return torch.full(v.shape, float(init), dtype=dtype)
        if isinstance(init, list) and len(init) == numel and all(isinstance(x, (int, float)) for x in init):
            return torch.tensor(init, dtype=dtype).reshape(v.shape)
    except (OverflowError, RuntimeError) as e:  # 10**400, or 1e10 in float16
        raise InvalidArgumentError(f"variable {v.name}: init {repr(init)[:40]} does not fit {v.dtype}: {e}") from None
    raise InvalidArgumentError(f"variable {v.name}: init must be a number or a flat list of {numel} numbers")


DECLARATION_KEYS = ("variables", "optimizer")
VARIABLE_KEYS = ("name", "shape", "dtype", "init")


def _check_keys(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    """A misspelled key ("optimiser", "intit") would silently fall back to a default: refused."""
    for key in obj:
        if key not in allowed:
            near = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise InvalidArgumentError(f"{where} has an unknown key {key!r}{hint}; the keys are {list(allowed)}")


def parse_declaration(doc: dict, source: str = "the declaration") -> Declaration:
    if not isinstance(doc, dict) or not isinstance(doc.get("variables"), list) or not doc["variables"]:
        raise InvalidArgumentError(f"{source} needs a non-empty list under \"variables\"")
    _check_keys(doc, DECLARATION_KEYS, source)
    variables, inits, seen, off = [], [], set(), 0
    for i, item in enumerate(doc["variables"]):
        if not isinstance(item, dict):
            raise InvalidArgumentError(f"{source}: variable {i} is not an object")
        _check_keys(item, VARIABLE_KEYS, f"{source}: variable {item.get('name', i)!s}")
        name, shape, dtype = item.get("name"), item.get("shape"), item.get("dtype", "float32")
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise InvalidArgumentError(f"{source}: variable {i} has no valid name (letters, digits, _ . -): {name!r}")
        if name in seen:
            raise InvalidArgumentError(f"{source}: variable {name} is declared twice")
        seen.add(name)
        if not isinstance(shape, list) or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                                  for s in shape):
            raise InvalidArgumentError(f"{source}: variable {name}'s shape must be a list of non-negative integers")
        if not isinstance(dtype, str) or dtype not in FLOAT_DTYPES:
            raise InvalidArgumentError(
                f"{source}: variable {name}'s dtype {dtype!r} is not one of {list(FLOAT_DTYPES)}")
        numel = 1
        for s in shape:
            numel *= s
        v = Variable(name, tuple(shape), dtype, off, numel * FLOAT_DTYPES[dtype].itemsize)
        if off + v.nbytes > MAX_MODEL_BYTES:
            raise InvalidArgumentError(f"{source}: the variables up to {name} take {off + v.nbytes} bytes, more than "
                                       f"this host's memory ({MAX_MODEL_BYTES})")
        variables.append(v)
        inits.append(_init_tensor(v, item.get("init"), numel))
        off += v.nbytes
    dtypes = {v.dtype for v in variables}
    if len(dtypes) != 1:
        raise InvalidArgumentError(f"{source}: every variable must have the same dtype, got {sorted(dtypes)}")
    optimizer = doc.get("optimizer", {"name": "SGD", "lr": 0.01})
    if not isinstance(optimizer, dict):
        raise InvalidArgumentError(f"{source}: \"optimizer\" must be an object like {{\"name\": \"SGD\", \"lr\": 0.1}}")
    return Declaration(variables, dtypes.pop(), optimizer, inits)


def load_declaration(path: str) -> Declaration:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise InvalidArgumentError(f"cannot read the model declaration {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise InvalidArgumentError(f"the model declaration {path} is not JSON: {e}") from None
    return parse_declaration(doc, path)
