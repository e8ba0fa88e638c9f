"""RDMA-aware analysis of a partitioned graph (Xue et al., EuroSys '19, §3.4).

For every tensor that crosses stages (forward, and in training the gradient coming back):

- class: ``static`` (every dimension a plain int), ``bounded`` (a symbolic dimension from an
  input ``Dim`` with a declared maximum) or ``dynamic`` (data-dependent: an unbacked symbol,
  e.g. the length of ``nonzero``'s result; or a ``Dim`` with no maximum);
- mechanism: static placement (a preallocated slot per microbatch in flight), static placement
  at the maxima with the actual shape in a size record before the flag (transfer/bounded.py),
  or dynamic allocation (a metadata slot; the receiver READs the data);
- whether its send is zero-copy, and why or why not;
- each rank's arena: receive slots x microbatches in flight + metadata slots + flags and
  control blocks + the send-side tensors born in it.

In training every forward edge has a backward edge: the gradient (same shape and dtype), or,
for a tensor that carries no gradient, a flag-only token. Either way the producer's next step
cannot start before the consumer's backward is done with the slot (the credit rule across
steps), because it waits for that backward edge.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import sympy
import torch
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.utils._sympy.numbers import int_oo

from rdmaflow.errors import InvalidArgumentError
from rdmaflow.graph.capture import CaptureError, Ref, StageGraph
from rdmaflow.graph.placement import aliases_input, decomposes, op_name, out_variant
from rdmaflow.graph.report import explain_table
from rdmaflow.transfer import CTL_BYTES, FLAG_STRIDE, SIZE_RECORD_BYTES

STATIC, BOUNDED, DYNAMIC = "static", "bounded", "dynamic"
ACTIVATION, GRADIENT, TOKEN = "activation", "gradient", "token"
ALLOC_ALIGN = 256          # the arena allocator's alignment
RECORD_BYTES = 128         # a dynamic transfer's metadata record
ACK_BYTES = 8 * 16         # a receiver's registered ack cells
UNBOUNDED_FACTOR = 4       # a dynamic edge with no maximum: reserve this many example sizes
ARENA_SLACK = 1 << 20      # plus 1/4 of the total: allocator fragmentation
# Ops whose floating-point output carries no gradient even when an input does.
NON_DIFFERENTIABLE = {
    "aten.detach.default", "aten.zeros_like.default", "aten.ones_like.default", "aten.empty_like.default",
    "aten.full_like.default", "aten.rand_like.default", "aten.randn_like.default", "aten.randint_like.default",
}


@dataclass
class Edge:
    """One tensor crossing stages; ``shape`` holds ints and symbolic expressions as strings."""

    id: int
    direction: str              # "forward" or "backward"
    payload: str                # activation, gradient or token
    producer: int
    consumer: int
    source: str                 # what it is: "input 0", "stage 0 output 1"
    producer_op: str            # the node (or autograd) that computes it
    consumer_use: str           # what the consumer does with it
    shape: list
    max_shape: list | None      # static: the shape; bounded: at the maxima; dynamic: None
    dtype: str
    cls: str
    cls_why: str
    nbytes: int                 # bytes of one transfer (bounded: at the maximum; dynamic: example)
    mechanism: str
    zero_copy: bool
    why: str
    depth: int                  # slots: microbatches in flight
    forward_id: int = -1        # a backward edge: the forward edge it answers
    requires_grad: bool = False

    @property
    def name(self) -> str:
        return f"{'f' if self.direction == 'forward' else 'b'}{self.id}"


def edge_depth(n_microbatches: int) -> int:
    """Slots of an edge's receiver: a microbatch in flight each, and at least two. A receiver
    hands slot k - 1 back when it takes transfer k, and the executor polls for k before it
    takes it: with one slot, k's sender waited for the hand-back of k - 1 while the receiver
    waited for k (the second step of n_microbatches=1 hung)."""
    return max(2, n_microbatches)


def align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def classify(val) -> tuple[str, list, list | None, str]:
    """(class, shape, shape at the maxima, why) of a FakeTensor from ``node.meta["val"]``."""
    shape, maxima, why = [], [], []
    cls = STATIC
    for i, d in enumerate(val.shape):
        if isinstance(d, int):
            shape.append(d)
            maxima.append(d)
            continue
        shape.append(str(d))
        expr = d.node.expr
        if free_unbacked_symbols(d):
            cls = DYNAMIC
            why.append(f"dim {i} = {d} depends on the data")
            maxima.append(None)
            continue
        upper = d.node.shape_env.bound_sympy(expr).upper
        if upper not in (int_oo, sympy.oo):  # int_oo calls itself finite
            maxima.append(int(upper))
            why.append(f"dim {i} = {d} <= {int(upper)}")
            if cls == STATIC:
                cls = BOUNDED
        else:
            cls = DYNAMIC
            maxima.append(None)
            why.append(f"dim {i} = {d} has no declared maximum")
    text = "every dimension is known" if cls == STATIC else "; ".join(why)
    return cls, shape, (None if cls == DYNAMIC else maxima), text


def _shape_list(val) -> list:
    return [d if isinstance(d, int) else str(d) for d in val.shape]


def dim_ranges(val, declared: dict | None = None) -> list[list]:
    """[min, max] of each dimension of a FakeTensor (max None: no declared maximum).

    ``declared``: the exported program's ``range_constraints``, which hold a model input's
    ``Dim`` as the user declared it; the tracer's own ranges start at 2 (it specializes sizes 0
    and 1), so a ``Dim(min=1)`` would read as 2 there."""
    out = []
    for d in val.shape:
        if isinstance(d, int):
            out.append([d, d])
            continue
        r = (declared or {}).get(d.node.expr) or d.node.shape_env.bound_sympy(d.node.expr)
        lo = int(r.lower) if r.lower not in (-int_oo, -sympy.oo) and r.lower.is_finite else 0
        out.append([max(lo, 0), None if r.upper in (int_oo, sympy.oo) else int(r.upper)])
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _example_numel(val) -> int:
    """Elements of the example; a data-dependent dimension counts at its bound where the graph
    asserts one (e.g. a mask's rows: at most the rows masked), else as 1."""
    n = 1
    for d, (_, hi) in zip(val.shape, dim_ranges(val)):
        if isinstance(d, int):
            n *= d
        elif d.node.hint is not None:
            n *= int(d.node.hint)
        else:
            n *= hi if hi is not None else 1
    return n


MECHANISM = {STATIC: "static slot", BOUNDED: "max slot + size", DYNAMIC: "dynamic (READ)"}
TOKEN_MECHANISM = "flag only"
DYNAMIC_COPY = ("its size is known only once the op has run (a dynamic shape), so no buffer can be placed "
                "for it ahead: one copy into registered memory")
GRADIENT_SITE = "the op that produces the input's gradient (traced in the first backward) writes into the arena"


def grad_nodes(stages: list[StageGraph]) -> set[str]:
    """Names of the original graph's values that carry a gradient (they depend on a
    trainable parameter through differentiable floating-point ops)."""
    carries: set[str] = set()
    for st in stages:
        local: dict[torch.fx.Node, bool] = {}
        for n in st.module.graph.nodes:
            if n.op == "placeholder":
                ref = st.args[[p for p in st.module.graph.nodes if p.op == "placeholder"].index(n)]
                if ref.kind == "param":
                    local[n] = bool(getattr(st.params[ref.name], "requires_grad", False))
                elif ref.kind == "value":
                    local[n] = _value_key(ref) in carries
                else:
                    local[n] = False
            elif n.op == "call_function":
                val = n.meta.get("val")
                floating = isinstance(val, torch.Tensor) and (val.dtype.is_floating_point or val.dtype.is_complex)
                ins = [a for a in n.all_input_nodes if local.get(a)]
                local[n] = bool(floating and ins and str(n.target) not in NON_DIFFERENTIABLE)
        for k, o in enumerate(st.outputs):
            if local.get(o):
                carries.add(_value_key(Ref("value", st.index, k)))
    return carries


def _value_key(ref: Ref) -> str:
    return f"input {ref.index}" if ref.kind == "input" else f"stage {ref.stage} output {ref.index}"


def _forward_zero_copy(st: StageGraph | None, ref: Ref, input_refs: dict, zero_copy: bool) -> tuple[bool, str]:
    """Whether the send of ``ref`` from its producing stage is zero-copy in steady state."""
    if not zero_copy:
        return False, "allocation-site placement is switched off (copy mode)"
    if ref.kind == "input":
        return False, "a model input lives in the caller's memory: one copy into registered staging"
    node = st.outputs[ref.index]
    while node.op == "call_function" and aliases_input(node.target):
        if str(node.target) in ("aten.t.default", "aten.transpose.int", "aten.permute.default"):
            return False, f"{node.name} ({op_name(node.target)}) is a non-contiguous view: one copy"
        node = node.args[0]
    if node.op == "placeholder":
        origin = input_refs.get(node.name)
        if origin is not None and origin.kind == "value":
            return True, "forwards a tensor received into this stage's arena"
        return False, f"{node.name} is a stage input from the caller's memory: one copy"
    if node.op != "call_function":
        return False, f"{node.name} is not computed by an op: one copy"
    if decomposes(node.target):
        return True, (f"{node.name} ({op_name(node.target)}) is composite: the op it runs as, traced in the first "
                      f"microbatch, writes into the arena")
    if out_variant(node.target) is None:
        return False, f"{op_name(node.target)} has no out= overload to place its output: one copy"
    return True, f"{node.name}'s allocation site (traced in the first microbatch) writes into the arena"


@dataclass
class StageMemory:
    """A rank's arena, by purpose (bytes)."""

    receive_slots: int = 0
    metadata_slots: int = 0
    control: int = 0
    send_tensors: int = 0

    @property
    def total(self) -> int:
        raw = self.receive_slots + self.metadata_slots + self.control + self.send_tensors
        return raw + raw // 4 + ARENA_SLACK


SCHEDULES = ("gpipe", "1f1b", "forward")


def microbatch_count(n) -> int:
    """``n`` microbatches in flight: a positive integer, else InvalidArgumentError."""
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise InvalidArgumentError(f"n_microbatches must be a positive integer, got {n!r}")
    return n


class Plan:
    """What every rank agrees on before execution: edges, classes, mechanisms, arena sizes."""

    def __init__(self, stages: list[StageGraph], outputs: list[Ref], inputs: list, n_microbatches: int,
                 training: bool, zero_copy: bool, schedule: str, declared: dict | None = None):
        if schedule not in SCHEDULES:
            raise InvalidArgumentError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        if not isinstance(training, bool) or not isinstance(zero_copy, bool):
            raise InvalidArgumentError(f"training and zero_copy are bools, got {training!r} and {zero_copy!r}")
        self.num_stages = len(stages)
        self.n_microbatches = microbatch_count(n_microbatches)
        self.training = training
        self.zero_copy = zero_copy
        self.schedule = schedule
        self.inputs = [(_shape_list(n.meta["val"]), _dtype_name(n.meta["val"].dtype)) for n in inputs]
        self.input_ranges = [dim_ranges(n.meta["val"], declared) for n in inputs]
        self.input_vals = [n.meta["val"] for n in inputs]
        self.edges: list[Edge] = []
        self._stage_summary = [self._summarize(st) for st in stages]
        self._build_edges(stages, outputs)
        self.memory = [self._size(s) for s in range(self.num_stages)]

    # -- edges ----------------------------------------------------------------------------------
    def _build_edges(self, stages: list[StageGraph], outputs: list[Ref]) -> None:
        carries = grad_nodes(stages) if self.training else set()
        uses: dict[tuple[Ref, int], list[str]] = {}
        for st in stages:
            phs = [p for p in st.module.graph.nodes if p.op == "placeholder"]
            for ref, ph in zip(st.args, phs):
                if ref.kind == "param" or (ref.kind == "input" and st.index == 0) or (
                        ref.kind == "value" and ref.stage == st.index):
                    continue
                uses.setdefault((ref, st.index), []).append(f"argument {ph.name}")
        last = self.num_stages - 1
        for k, ref in enumerate(outputs):
            if ref.kind == "value" and ref.stage == last or ref.kind == "input" and last == 0:
                continue
            uses.setdefault((ref, last), []).append(f"model output {k}")
        order = sorted(uses, key=lambda rc: (rc[0].stage if rc[0].kind == "value" else 0, rc[1], rc[0].kind,
                                             rc[0].index))
        for ref, consumer in order:
            self._add_forward(stages, ref, consumer, ", ".join(uses[(ref, consumer)]), carries)
        if self.training:
            for e in list(self.edges):
                self._add_backward(e)

    def _add_forward(self, stages, ref: Ref, consumer: int, use: str, carries: set) -> None:
        if ref.kind == "input":
            producer, st, val = 0, None, self.input_vals[ref.index]
            producer_op = f"model input {ref.index}"
        else:
            producer, st = ref.stage, stages[ref.stage]
            node = st.outputs[ref.index]
            val = node.meta.get("val")
            producer_op = f"{node.name} ({op_name(node.target)})" if node.op == "call_function" else node.name
        if not isinstance(val, torch.Tensor):
            raise CaptureError(f"stage {producer}'s output {ref.index} ({producer_op}) sent to stage {consumer} "
                          f"is a {type(val).__name__}, not a tensor: only tensors cross stages")
        cls, shape, maxima, why_cls = classify(val)
        input_refs = {} if st is None else {
            p.name: r for p, r in zip([p for p in st.module.graph.nodes if p.op == "placeholder"], st.args)}
        zc, why = _forward_zero_copy(st, ref, input_refs, self.zero_copy)
        if cls == DYNAMIC and zc and "received" not in why:
            zc, why = False, DYNAMIC_COPY
        self.edges.append(self._edge(
            len(self.edges), "forward", ACTIVATION, producer, consumer, _value_key(ref), producer_op, use,
            val, cls, shape, maxima, why_cls, zc, why, requires_grad=_value_key(ref) in carries))

    def _add_backward(self, f: Edge) -> None:
        if f.requires_grad:
            payload, use = GRADIENT, f"backward of {f.producer_op}"
            if f.cls == DYNAMIC:
                zc, why = False, DYNAMIC_COPY
            elif self.zero_copy:
                zc, why = True, GRADIENT_SITE
            else:
                zc, why = False, "allocation-site placement is switched off (copy mode)"
            self.edges.append(Edge(
                len(self.edges), "backward", payload, f.consumer, f.producer, f"gradient of {f.source}",
                "autograd", use, f.shape, f.max_shape, f.dtype, f.cls, f.cls_why, f.nbytes,
                f.mechanism, zc, why, f.depth, forward_id=f.id))
        else:
            self.edges.append(Edge(
                len(self.edges), "backward", TOKEN, f.consumer, f.producer, f"{f.source} consumed",
                "backward done", "step order", [0], [0], "float32", STATIC, "no data", 0,
                TOKEN_MECHANISM, True,
                "nothing to copy", f.depth, forward_id=f.id))

    def _edge(self, eid, direction, payload, producer, consumer, source, producer_op, use, val, cls, shape,
              maxima, why_cls, zc, why, requires_grad=False) -> Edge:
        itemsize = torch.empty((), dtype=val.dtype).element_size()
        nbytes = _numel(maxima) * itemsize if maxima is not None else _example_numel(val) * itemsize
        return Edge(eid, direction, payload, producer, consumer, source, producer_op, use, shape, maxima,
                    _dtype_name(val.dtype), cls, why_cls, nbytes, MECHANISM[cls], zc, why,
                    depth=edge_depth(self.n_microbatches), requires_grad=requires_grad)

    # -- memory ---------------------------------------------------------------------------------
    def _size(self, stage: int) -> StageMemory:
        m = StageMemory()
        for e in self.edges:
            d = e.depth
            data = e.nbytes if e.cls != DYNAMIC else e.nbytes * UNBOUNDED_FACTOR
            if e.consumer == stage:
                m.control += align(FLAG_STRIDE * d + CTL_BYTES, ALLOC_ALIGN) + align(ACK_BYTES, ALLOC_ALIGN)
                if e.cls == DYNAMIC:
                    m.metadata_slots += RECORD_BYTES * d
                    m.receive_slots += align(data, ALLOC_ALIGN) * d  # tensors the receiver allocates
                else:  # a bounded slot: its size record, then the data at the maxima
                    size_record = SIZE_RECORD_BYTES if e.cls == BOUNDED else 0
                    m.receive_slots += align(max(size_record + e.nbytes, 1), 64) * d
            if e.producer == stage:
                m.control += align(64 + FLAG_STRIDE * d + 64 + CTL_BYTES, ALLOC_ALIGN)
                if e.cls != STATIC:  # the records the sender writes from: metadata or sizes
                    m.metadata_slots += align(RECORD_BYTES * d, ALLOC_ALIGN)
                # born in the arena (every microbatch in flight) + staging for copies
                staging = d if not e.zero_copy else 1
                m.send_tensors += align(data, ALLOC_ALIGN) * (d + staging) if data else 0
        return m

    # -- agreement ------------------------------------------------------------------------------
    @staticmethod
    def _summarize(st: StageGraph) -> dict:
        return {
            "nodes": [f"{n.name}={op_name(n.target)}" for n in st.module.graph.nodes if n.op == "call_function"],
            "params": {k: [list(v.shape), _dtype_name(v.dtype)] for k, v in sorted(st.params.items())},
        }

    def to_json(self) -> dict:
        return {
            "stages": self._stage_summary,
            "inputs": self.inputs,
            "input_ranges": self.input_ranges,
            "n_microbatches": self.n_microbatches,
            "training": self.training,
            "zero_copy": self.zero_copy,
            "schedule": self.schedule,
            "edges": [asdict(e) for e in self.edges],
        }

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_json(), sort_keys=True).encode()).hexdigest()

    def arena_bytes(self, stage: int) -> int:
        return self.memory[stage].total

    def edges_of(self, stage: int) -> tuple[list[Edge], list[Edge]]:
        """(edges this stage sends, edges it receives)."""
        return ([e for e in self.edges if e.producer == stage], [e for e in self.edges if e.consumer == stage])

    # -- explain --------------------------------------------------------------------------------
    def explain(self, stats: dict | None = None) -> str:
        """One row per edge: producer, consumer, shape and dtype, class, bytes, mechanism,
        zero-copy or copy, and why. ``stats`` (a running stage's ``send_stats``) adds what was
        observed: sends that were zero-copy out of all, and the reason of any copy."""
        return explain_table(self, stats)
