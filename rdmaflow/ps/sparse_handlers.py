"""What a sparse table's shard applies to the rows a push names: the default sum, the built-in
``SparseAdagrad`` (per-row accumulators kept in the entry beside the row), or a user's function
given to ``ps.init(sparse_handlers={name: fn})`` and named by the table. A push's duplicate
keys are summed first, so a handler sees each key once per request."""
from __future__ import annotations

import math

import torch

from rdmaflow import InvalidArgumentError


class SparseAdagrad:
    """Adagrad per row (Duchi et al.): ``acc += g * g; row -= lr * g / (sqrt(acc) + eps)``, with
    ``acc`` (float32, one per element, starting at ``initial_accumulator_value``) kept on the
    shard beside the row. The pushed values are the gradient."""

    def __init__(self, lr: float = 0.01, eps: float = 1e-10, initial_accumulator_value: float = 0.0):
        for name, v in (("lr", lr), ("eps", eps), ("initial_accumulator_value", initial_accumulator_value)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
                raise InvalidArgumentError(f"SparseAdagrad: {name} must be a non-negative number, got {v!r}")
        self.lr, self.eps, self.initial = float(lr), float(eps), float(initial_accumulator_value)

    def spec(self) -> dict:
        return {"kind": "adagrad", "lr": self.lr, "eps": self.eps, "initial": self.initial}

    def __repr__(self) -> str:
        return f"SparseAdagrad(lr={self.lr}, eps={self.eps}, initial_accumulator_value={self.initial})"


def handler_spec(handler) -> dict:
    """The table's handler as its declaration holds it (InvalidArgumentError for anything else)."""
    if handler == "add":
        return {"kind": "add"}
    if isinstance(handler, SparseAdagrad):
        return handler.spec()
    if isinstance(handler, str) and handler:
        return {"kind": "user", "name": handler}
    raise InvalidArgumentError(f"handler must be 'add', a ps.SparseAdagrad, or the name of a handler given to "
                               f"ps.init(sparse_handlers=...), got {handler!r}")


def state_size(spec: dict, dim: int) -> int:
    """float32 values of per-row state the handler keeps."""
    return dim if spec["kind"] == "adagrad" else 0


def check_user_handlers(handlers) -> dict:
    if handlers is None:
        return {}
    if not isinstance(handlers, dict):
        raise InvalidArgumentError(f"sparse_handlers must be a dict of name -> function, got {type(handlers).__name__}")
    for name, fn in handlers.items():
        if not isinstance(name, str) or not name or name == "add":
            raise InvalidArgumentError(f"sparse_handlers: a handler's name must be a non-empty string other than "
                                       f"'add', got {name!r}")
        if not callable(fn):
            raise InvalidArgumentError(f"sparse_handlers[{name!r}] must be callable, got {type(fn).__name__}")
    return dict(handlers)


class Applier:
    """The shard's end of a handler: ``apply(keys, rows, state, pushed)`` returns the new rows
    (float32 or the table's dtype) and updates ``state`` in place. Raises what the user's
    function raised, or ValueError for a result of the wrong shape."""

    def __init__(self, spec: dict, user: dict):
        self.spec = spec
        self.fn = None
        if spec["kind"] == "user":
            if spec["name"] not in user:
                raise InvalidArgumentError(f"the table's handler {spec['name']!r} was not given to this shard's "
                                           f"ps.init(sparse_handlers=...) (it has {sorted(user)})")
            self.fn = user[spec["name"]]

    def apply(self, keys: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, pushed: torch.Tensor):
        kind = self.spec["kind"]
        if kind == "add":
            return rows + pushed
        if kind == "adagrad":
            g = pushed.to(torch.float32)
            state.add_(g * g)
            new = rows.to(torch.float32) - self.spec["lr"] * g / (state.sqrt() + self.spec["eps"])
            return new
        ret = self.fn(keys, rows, pushed)
        if ret is None:
            return rows
        if not isinstance(ret, torch.Tensor) or ret.shape != rows.shape:
            raise ValueError(f"the sparse handler returned {getattr(ret, 'shape', type(ret).__name__)} for rows of "
                             f"shape {list(rows.shape)}")
        return ret
