"""The optimizers a shard runs on its units: the worker's torch optimizer, rebuilt server-side.

Only elementwise optimizers are allowed, so that running them on blocks of the flat parameter
space (which may cut variables) gives exactly what they give on whole variables. The numeric
hyperparameters (``hyper_fields``) may change during training, as an LR scheduler changes
``lr``: a worker sends them with its push when they changed; the others are fixed.
"""
from __future__ import annotations

import functools
import inspect

import torch

from rdmaflow import InvalidArgumentError

SUPPORTED = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


@functools.cache
def _constructor_keys(name: str) -> frozenset[str]:
    """The keyword arguments the optimizer class takes (describe_optimizer runs at every step)."""
    return frozenset(inspect.signature(SUPPORTED[name].__init__).parameters)


def describe_optimizer(opt: torch.optim.Optimizer) -> dict:
    name = type(opt).__name__
    if name not in SUPPORTED:
        raise InvalidArgumentError(
            f"the parameter server runs {sorted(SUPPORTED)} on its shards; {name} is not supported"
        )
    if len(opt.param_groups) != 1:
        raise InvalidArgumentError("the parameter server supports optimizers with one parameter group")
    hp = {}
    for k, v in opt.param_groups[0].items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            v = v.item()
        if isinstance(v, tuple):
            v = list(v)
        hp[k] = v
    # The foreach/fused kernels are an implementation detail: let each shard pick its own. Keys
    # the constructor does not take are a scheduler's bookkeeping (initial_lr, max_lr, ...).
    taken = _constructor_keys(name)
    for k in list(hp):
        if k in ("foreach", "fused", "capturable", "differentiable") or k not in taken:
            del hp[k]
    return {"name": name, "hyper": hp}


def build_optimizer(desc: dict, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    cls = SUPPORTED.get(desc["name"])
    if cls is None:
        raise InvalidArgumentError(f"unsupported optimizer {desc['name']!r}")
    hp = dict(desc["hyper"])
    for k in ("betas",):
        if k in hp and isinstance(hp[k], list):
            hp[k] = tuple(hp[k])
    if not params:
        params = [torch.zeros(0)]
    return cls(params, **hp)


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def hyper_fields(desc: dict) -> list[tuple[str, int | None]]:
    """The hyperparameters that may change during training, in a fixed order: each numeric one
    (key, None), and each number of a list of numbers (key, index), as ``betas``."""
    out: list[tuple[str, int | None]] = []
    for k in sorted(desc["hyper"]):
        v = desc["hyper"][k]
        if _number(v):
            out.append((k, None))
        elif isinstance(v, list) and v and all(_number(x) for x in v):
            out.extend((k, i) for i in range(len(v)))
    return out


def hyper_values(hyper: dict, fields) -> list[float]:
    """The values of ``fields`` in a description's ``hyper`` (``describe_optimizer``)."""
    return [float(hyper[k] if i is None else hyper[k][i]) for k, i in fields]


def fixed_changes(before: dict, now: dict, fields) -> list[str]:
    """The hyperparameters outside ``fields`` whose value differs between two descriptions."""
    numeric = {k for k, _ in fields}
    keys = (set(before["hyper"]) | set(now["hyper"])) - numeric
    return sorted(k for k in keys if before["hyper"].get(k) != now["hyper"].get(k))


def set_hyper(opt: torch.optim.Optimizer, fields, values) -> None:
    """Sets ``fields`` of the optimizer's parameter group to ``values``."""
    group = opt.param_groups[0]
    for (k, i), v in zip(fields, values):
        if i is None:
            if isinstance(group[k], torch.Tensor):
                group[k].fill_(v)
            else:
                group[k] = v
        else:
            parts = list(group[k])
            parts[i] = v
            group[k] = tuple(parts)
