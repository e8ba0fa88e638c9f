"""The optimizers a shard runs on its units: the worker's torch optimizer, rebuilt server-side.

Only elementwise optimizers are allowed, so that running them on blocks of the flat parameter
space (which may cut variables) gives exactly what they give on whole variables.
"""
from __future__ import annotations

import torch

from rdmaflow import InvalidArgumentError

SUPPORTED = {"SGD": torch.optim.SGD, "Adam": torch.optim.Adam, "AdamW": torch.optim.AdamW}


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
    # The foreach/fused kernels are an implementation detail: let each shard pick its own.
    for k in ("foreach", "fused", "capturable", "differentiable"):
        hp.pop(k, None)
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
