"""Capture a model with torch.export and partition it into pipeline stages.

Split points follow torch.distributed.pipelining: ``pipe_split()`` calls inside ``forward``,
or a ``split_spec`` of ``{module_fqn: SplitPoint.BEGINNING | SplitPoint.END}``, which wraps
the named module's forward with a ``pipe_split()`` before or after it while exporting. Every
node goes to the stage numbered by the split points that precede it in program order;
``torch.fx.passes.split_module`` cuts the graph there and records what crosses. A trained
parameter stays with the one stage that uses it; a constant buffer or a frozen parameter used by
several stages is held by each of them.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import operator
import traceback
import warnings
from dataclasses import dataclass, field

import torch
from torch.distributed.pipelining import SplitPoint, pipe_split
from torch.fx.node import map_aggregate
from torch.fx.passes.split_module import split_module
from torch.overrides import TorchFunctionMode, resolve_name

import rdmaflow

PIPE_SPLIT = torch.ops.pippy._pipe_split.default


class CaptureError(rdmaflow.InvalidArgumentError):
    """The model cannot be captured or partitioned; the message names the op or the node."""


@dataclass(frozen=True)
class Ref:
    """Where a stage argument or a model output comes from.

    kind ``"input"``: model input ``index`` (held by stage 0); ``"value"``: output ``index``
    of stage ``stage``; ``"param"``: the parameter or buffer named ``name``."""

    kind: str
    stage: int = 0
    index: int = 0
    name: str = ""


@dataclass
class StageGraph:
    """One stage: its graph module, where each of its arguments comes from, its outputs."""

    index: int
    module: torch.fx.GraphModule
    args: list[Ref]
    outputs: list[torch.fx.Node]          # the nodes it returns, in order (their meta["val"])
    tuple_output: bool                    # the module returns a tuple rather than one value
    params: dict[str, torch.Tensor] = field(default_factory=dict)  # fqn -> Parameter or buffer


class _FailedOp(TorchFunctionMode):
    """Remembers the innermost torch function that raised while the model was traced."""

    def __init__(self):
        super().__init__()
        self.failed = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        try:
            return func(*args, **(kwargs or {}))
        except Exception:
            if self.failed is None:
                self.failed = func
            raise


def _user_frame(exc: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if "site-packages" not in f.filename and "/torch/" not in f.filename
              and "rdmaflow/graph" not in f.filename and f.filename != "<string>"]
    if not frames:
        return ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} `{(f.line or '').strip()}`"


def _op_name(func) -> str:
    try:
        return resolve_name(func) or getattr(func, "__name__", repr(func))
    except Exception:  # noqa: BLE001 - naming is best effort
        return getattr(func, "__name__", repr(func))


@contextlib.contextmanager
def _split_points(model: torch.nn.Module, split_spec: dict | None):
    """Wraps the forward of each module named in ``split_spec`` with a pipe_split() before
    (BEGINNING) or after (END) it, for the duration of the export. A module whose forward never
    ran put no split point in: refused, or the pipeline had a stage fewer than the user split."""
    patched, ran = [], dict.fromkeys(split_spec or {}, 0)
    try:
        for fqn, where in (split_spec or {}).items():
            try:
                mod = model.get_submodule(fqn)
            except AttributeError:
                raise CaptureError(f"split_spec names '{fqn}', which is not a submodule of the model") from None
            if where not in (SplitPoint.BEGINNING, SplitPoint.END):
                raise CaptureError(f"split_spec['{fqn}'] must be SplitPoint.BEGINNING or SplitPoint.END, got {where!r}")
            original = mod.forward

            def wrapped(*a, _orig=original, _where=where, _fqn=fqn, **kw):
                ran[_fqn] += 1
                if _where == SplitPoint.BEGINNING:
                    pipe_split()
                out = _orig(*a, **kw)
                if _where == SplitPoint.END:
                    pipe_split()
                return out

            mod.forward = wrapped
            patched.append(mod)
        yield
        never = [fqn for fqn, n in ran.items() if n == 0]
        if never:
            raise CaptureError(
                f"split_spec['{never[0]}'] put no split point in the model: its forward never ran during capture "
                "(a ModuleList or ModuleDict is iterated, not called: name one of its children, e.g. "
                f"'{never[0]}.1')")
    finally:
        for mod in patched:
            del mod.forward  # back to the class's forward


def export(model: torch.nn.Module, mb_args: tuple, split_spec: dict | None = None,
           dynamic_shapes=None, mb_kwargs: dict | None = None) -> torch.export.ExportedProgram:
    """torch.export.export with the split points in place; a failure names the op."""
    _check_arguments(model, mb_args, mb_kwargs, split_spec, dynamic_shapes)
    mode = _FailedOp()
    try:
        with _split_points(model, split_spec), mode:
            return torch.export.export(model, tuple(mb_args), kwargs=mb_kwargs, dynamic_shapes=dynamic_shapes)
    except CaptureError:
        raise
    except Exception as e:
        op = f"op {_op_name(mode.failed)}" if mode.failed is not None else "the model"
        raise CaptureError(
            f"torch.export cannot capture the model: {op}{_user_frame(e)} failed: {type(e).__name__}: {_said(e)}"
        ) from e


def _said(e: Exception, lines: int = 8) -> str:
    """What torch.export said: its first line, then the detail that follows it (which Dim was
    specialized, and the fix it suggests), without its closing boilerplate."""
    said = []
    for line in str(e).strip().splitlines():
        if line.startswith("The error above occurred when calling torch.export.export"):
            break
        if line.strip():
            said.append(line.rstrip())
    if not said:
        return type(e).__name__
    more = said[1:lines]
    return "\n".join(said[:1] + ["  " + line for line in more] + (["  ..."] if len(said) > lines else []))


def _check_arguments(model, mb_args: tuple, mb_kwargs, split_spec, dynamic_shapes) -> None:
    """What torch.export would fail on deep inside, or blame on the wrong line, said here."""
    if not isinstance(model, torch.nn.Module):
        raise CaptureError(f"pipeline() takes a torch.nn.Module, got {type(model).__name__}")
    if mb_kwargs is not None and not isinstance(mb_kwargs, dict):
        raise CaptureError(f"mb_kwargs must be a dict of keyword inputs, got {type(mb_kwargs).__name__}")
    try:
        inspect.signature(model.forward).bind(*mb_args, **(mb_kwargs or {}))
    except TypeError as e:
        raise CaptureError(f"mb_args and mb_kwargs (one microbatch's inputs, {len(mb_args)} positional, keywords "
                           f"{sorted(mb_kwargs or {})}) do not fit {type(model).__name__}.forward: {e}") from None
    if split_spec is not None and not isinstance(split_spec, dict):
        raise CaptureError(f"split_spec must be a dict {{module name: SplitPoint.BEGINNING or SplitPoint.END}}, "
                           f"got {type(split_spec).__name__}")
    if isinstance(dynamic_shapes, (tuple, list)):  # one entry per input: {dimension: Dim}
        for i, (arg, dims) in enumerate(zip(mb_args, dynamic_shapes)):
            if not isinstance(arg, torch.Tensor) or not isinstance(dims, dict):
                continue
            for d in dims:
                if isinstance(d, bool) or not isinstance(d, int) or not -arg.dim() <= d < arg.dim():
                    raise CaptureError(f"dynamic_shapes[{i}] names dimension {d!r} of input {i}, which has "
                                       f"{arg.dim()} (0 to {arg.dim() - 1}, or counted from the end)")


def _assign_partitions(gm: torch.fx.GraphModule, ep: torch.export.ExportedProgram) -> tuple[dict, int]:
    part, stage = {}, 0
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target == PIPE_SPLIT:
            stage += 1
        part[n] = stage
    mutated = None
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            if any(u.op == "output" for u in n.users):  # before the check of shared tensors, which misnamed it
                raise CaptureError(f"model output {_aliases(gm, n.target)} is not a tensor computed by a stage "
                                   "(it is a parameter or buffer: return a computed tensor)")
            users = sorted({part[u] for u in n.users})
            if len(users) > 1:
                mutated = _mutated(ep) if mutated is None else mutated
                _check_shareable(gm, n.target, users, mutated)
            part[n] = users[0] if users else 0
    return part, stage + 1


def _check_shareable(gm: torch.fx.GraphModule, fqn: str, users: list[int], mutated: set[str]) -> None:
    """A tensor used by several stages is replicated into each (every rank holds the whole
    model), which is right only while no stage changes it: a constant buffer (a causal mask, a
    rotary table) or a frozen parameter. One that is trained or written in place is refused."""
    t = _attr(gm, fqn)
    if fqn in mutated:
        raise CaptureError(
            f"{'parameter' if isinstance(t, torch.nn.Parameter) else 'buffer'} {_aliases(gm, fqn)} is updated in "
            f"place by the model and used by stages {users}: each stage runs in its own process, so one stage's "
            f"update would not reach the others; give each stage its own")
    if isinstance(t, torch.nn.Parameter) and t.requires_grad:
        raise CaptureError(
            f"parameter {_aliases(gm, fqn)} is trained and used by stages {users}: a tensor shared across "
            f"stages (tied weights) cannot be trained by each stage's own optimizer; untie it, or freeze it "
            f"(requires_grad=False) to have each stage hold a copy")


def _mutated(ep: torch.export.ExportedProgram) -> set[str]:
    """The parameters and buffers the model writes in place. The exported graph keeps in-place
    ops, and not every op's schema says what it writes (batch_norm's running statistics):
    functionalizing the program lists them all."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # torch's own deprecations, inside its copy
        sig = ep.run_decompositions({}).graph_signature
    return set(sig.buffers_to_mutate.values()) | set(sig.parameters_to_mutate.values())


def partition(ep: torch.export.ExportedProgram) -> tuple[list[StageGraph], list[Ref], list[torch.fx.Node]]:
    """Cuts the exported program at its pipe_split nodes.

    Returns the stages, the model's outputs (as Refs) and the model's input placeholders."""
    gm = ep.module()
    graph = gm.graph
    for n in list(graph.nodes):
        if n.op == "call_module" and n.target == "_guards_fn":  # input guards: checked per microbatch
            graph.erase_node(n)
    part, num_stages = _assign_partitions(gm, ep)
    for n in list(graph.nodes):
        if n.op == "call_function" and n.target == PIPE_SPLIT:
            graph.erase_node(n)
    _local_sizes(graph, part)
    _make_on_host(gm)
    gm.recompile()
    for s in range(num_stages):
        if not any(p == s and n.op == "call_function" for n, p in part.items()):
            raise CaptureError(f"stage {s} has no computation: two split points are adjacent, or one is "
                               f"at the very beginning or end of the model")
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    top = split_module(gm, gm, lambda n: part[n], keep_original_order=True)
    return _read_top_graph(gm, top, inputs, num_stages)


def _make_on_host(gm: torch.fx.GraphModule) -> None:
    """A model captured on the meta device (so that no rank holds all of its weights) leaves
    ``device=meta`` in the calls that make a tensor on an input's device (``torch.ones(n,
    device=x.device)``). Stages run on the host, so those calls make their tensors there."""
    inputs = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    if not any(t.device.type == "meta" for t in (*gm.parameters(), *gm.buffers(), *inputs)
               if isinstance(t, torch.Tensor)):
        return  # captured with memory: a meta device in it is the model's own
    host = torch.device("cpu")

    def on_host(a):
        return host if isinstance(a, torch.device) and a.type == "meta" else a

    for n in gm.graph.nodes:
        if n.op == "call_function":
            n.args, n.kwargs = map_aggregate(n.args, on_host), map_aggregate(n.kwargs, on_host)


def _local_sizes(graph: torch.fx.Graph, part: dict) -> None:
    """A symbolic size (``sym_size``, e.g. a sequence length read off an input) used by a later
    stage is read there again off a tensor that stage has (one it computes or receives), so
    that only tensors cross stages: the tensors carry their sizes."""
    for n in list(graph.nodes):
        val = n.meta.get("val")
        if not isinstance(val, torch.SymInt):
            continue
        for user in [u for u in n.users if u.op != "output" and part[u] != part[n]]:
            found = _tensor_with_size(graph, part, user, val.node.expr)
            if found is None:
                raise CaptureError(
                    f"stage {part[user]} uses the size {val} ({n.name}) computed in stage {part[n]}, and no tensor "
                    f"that stage computes or receives has a dimension of that size: only tensors cross stages")
            tensor, dim = found
            with graph.inserting_before(user):
                size = graph.call_function(torch.ops.aten.sym_size.int, (tensor, dim))
            size.meta["val"] = tensor.meta["val"].shape[dim]
            part[size] = part[user]
            user.replace_input_with(n, size)


def _tensor_with_size(graph: torch.fx.Graph, part: dict, user: torch.fx.Node, expr) -> tuple | None:
    """(tensor, dim): a tensor available to ``user``'s stage before ``user`` (computed there, or
    already crossing into it) with a dimension equal to ``expr``."""
    stage = part[user]
    for n in graph.nodes:
        if n is user:
            break
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        here = part[n] == stage or (part[n] < stage and any(part[u] == stage for u in n.users))
        if not here:
            continue
        for d, size in enumerate(val.shape):
            if isinstance(size, torch.SymInt) and size.node.expr == expr:
                return n, d
    return None


def _read_top_graph(gm, top, inputs, num_stages):
    where: dict[torch.fx.Node, Ref] = {}
    tuple_calls: dict[torch.fx.Node, int] = {}  # call of a stage that returns a tuple -> stage
    stages: list[StageGraph] = []
    input_index = {n.name: i for i, n in enumerate(inputs)}
    outputs: list[Ref] = []
    for n in top.graph.nodes:
        if n.op == "placeholder":
            where[n] = Ref("input", 0, input_index[n.name])
        elif n.op == "get_attr":
            where[n] = Ref("param", name=n.target)
        elif n.op == "call_module":
            i = int(n.target.rsplit("_", 1)[1])
            sub = getattr(top, n.target)
            out = next(o for o in sub.graph.nodes if o.op == "output").args[0]
            is_tuple = isinstance(out, (tuple, list))
            outs = list(out) if is_tuple else [out]
            args = [where[a] for a in n.args]
            params = {r.name: _attr(gm, r.name) for r in args if r.kind == "param"}
            stages.append(StageGraph(i, sub, args, outs, is_tuple, params))
            if is_tuple:
                tuple_calls[n] = i
            else:
                where[n] = Ref("value", i, 0)
        elif n.op == "call_function" and n.target is operator.getitem and n.args[0] in tuple_calls:
            where[n] = Ref("value", tuple_calls[n.args[0]], int(n.args[1]))
        elif n.op == "output":
            vals = n.args[0]
            for v in (vals if isinstance(vals, (tuple, list)) else [vals]):
                if not isinstance(v, torch.fx.Node) or v not in where or where[v].kind == "param":
                    raise CaptureError(f"model output {v!r} is not a tensor computed by a stage"
                                       + (" (it is a parameter or buffer: return a computed tensor)"
                                          if v in where else ""))
                outputs.append(where[v])
        else:
            raise CaptureError(f"unexpected node {n.format_node()} in the partitioned graph")
    stages.sort(key=lambda s: s.index)
    if [s.index for s in stages] != list(range(num_stages)):
        empty = sorted(set(range(num_stages)) - {s.index for s in stages})
        raise CaptureError(f"stage {', '.join(map(str, empty)) or '?'} of {num_stages} has no computation: two split "
                           "points are adjacent, or one is at the very beginning or end of the model")
    return stages, outputs, inputs


def _aliases(gm: torch.nn.Module, fqn: str) -> str:
    """``'fqn'``, and the other names the model gives that tensor (tied weights: export keeps
    one name, often not the one the user tied), for messages."""
    t = _attr(gm, fqn)
    named = itertools.chain(gm.named_parameters(remove_duplicate=False), gm.named_buffers(remove_duplicate=False))
    others = sorted({name for name, p in named if p is t and name != fqn})
    return f"'{fqn}'" + (f" (also {', '.join(repr(o) for o in others)})" if others else "")


def _attr(gm: torch.nn.Module, fqn: str) -> torch.Tensor:
    obj = gm
    for part in fqn.split("."):
        obj = getattr(obj, part)
    return obj


__all__ = ["CaptureError", "Ref", "SplitPoint", "StageGraph", "export", "partition", "pipe_split"]
