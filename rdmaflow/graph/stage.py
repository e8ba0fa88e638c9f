"""One pipeline stage at run time: its module, its transfer pairs, its microbatch computes.

``pipe.build_stage()`` makes the stage of this rank; a schedule (schedule.py) sets it up, once,
for its number of microbatches: every rank computes the plan and checks it against the
others', registers one arena of the size the plan gives, creates a receiver per incoming edge
(slots for every microbatch in flight), and only then a sender per outgoing edge, so that every
address is handed out once, before execution. A step then runs the schedule's computes on the
polling-async executor.
"""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten  # torch.export's own (its specs are these TreeSpecs)
from typing_extensions import Self

import rdmaflow
from rdmaflow.deadline import seconds_setting
from rdmaflow.graph.analysis import BOUNDED, DYNAMIC, GRADIENT, STATIC, TOKEN, Edge, Plan
from rdmaflow.graph.capture import StageGraph
from rdmaflow.graph.executor import ComputeOp, Executor, RecvOp, SendOp
from rdmaflow.graph.placement import Placement
from rdmaflow.graph.rendezvous import Rendezvous, env_rank
from rdmaflow.transfer import (
    BoundedReceiver,
    BoundedSender,
    DynamicReceiver,
    DynamicSender,
    StaticReceiver,
    StaticSender,
)

# True is "auto": allocation-site placement where it saves a copy and pays for itself (see
# Placement.settle); "always": every site that can be placed is; False: copy mode.
ZERO_COPY = (True, False, "auto", "always")

CLOSED_CHECK = 0.5  # seconds between looks (while waiting) for a stage that closed early
TIMEOUT_ENV = "RDMAFLOW_GRAPH_TIMEOUT"
DEFAULT_TIMEOUT = 60.0


class StageModule(torch.nn.Module):
    """The parameters and buffers of one stage under the model's own names, and its graph."""

    def __init__(self, graph: StageGraph):
        super().__init__()
        self.__dict__["_graph"] = graph.module  # not a child: it owns no parameters
        self._refs = graph.args
        for fqn, t in graph.params.items():
            owner = self
            *path, leaf = fqn.split(".")
            for p in path:
                if not hasattr(owner, p):
                    owner.add_module(p, torch.nn.Module())
                owner = getattr(owner, p)
            if isinstance(t, torch.nn.Parameter):
                owner.register_parameter(leaf, t)
            else:
                owner.register_buffer(leaf, t)

    def forward(self, *values):
        it = iter(values)
        args = [self.get_parameter(r.name) if r.kind == "param" and _is_param(self, r.name)
                else self.get_buffer(r.name) if r.kind == "param" else next(it) for r in self._refs]
        return self._graph(*args)


def _is_param(mod: torch.nn.Module, fqn: str) -> bool:
    try:
        mod.get_parameter(fqn)
        return True
    except AttributeError:
        return False


@dataclass
class EdgeStats:
    sends: int = 0
    zero_copy: int = 0
    steady_sends: int = 0        # from the second step on
    steady_zero_copy: int = 0
    copy_reason: str | None = None


@dataclass
class Microbatch:
    leaves: dict = field(default_factory=dict)   # forward edge id -> the leaf tensor fed to the graph
    received: dict = field(default_factory=dict)  # edge id -> the tensor its receive returned
    sent: dict = field(default_factory=dict)     # forward edge id -> the tensor sent on it
    loss: torch.Tensor | None = None


def _check_tensor(t, what: str, shape: list, max_shape: list | None, dtype: str, cls: str) -> None:
    got = f"{str(t.dtype).replace('torch.', '')}[{', '.join(str(s) for s in t.shape)}]"
    want = f"{dtype}[{', '.join(str(s) for s in shape)}]"
    bad = str(t.dtype).replace("torch.", "") != dtype or t.dim() != len(shape)
    if not bad and cls != DYNAMIC:
        for d, s, mx in zip(t.shape, shape, max_shape or shape):
            if isinstance(s, int) and d != s or mx is not None and d > mx:
                bad = True
    if bad:
        bound = f" (at most {max_shape})" if cls != STATIC and max_shape else ""
        raise rdmaflow.InvalidArgumentError(f"{what} is {got}; the plan says {want}{bound}")


def _check_input(t, what: str, shape: list, ranges: list, dtype: str) -> None:
    """A microbatch of a model input: its dtype and every static dimension as planned, every
    symbolic one within its declared ``Dim`` range (refused here, before anything is sent)."""
    _check_tensor(t, what, shape, [s if isinstance(s, int) else None for s in shape], dtype, STATIC)
    for i, (d, s, (lo, hi)) in enumerate(zip(t.shape, shape, ranges)):
        if not isinstance(s, int) and (d < lo or hi is not None and d > hi):
            got = f"{str(t.dtype).replace('torch.', '')}[{', '.join(str(x) for x in t.shape)}]"
            raise rdmaflow.InvalidArgumentError(
                f"{what} is {got}: dimension {i} ({s}) is {d}, outside its declared bound "
                f"[{lo}, {'inf' if hi is None else hi}]")


class PipelineStage:
    """The stage this rank runs (rank r runs stage r). Its ``submod`` holds the stage's
    parameters under the model's names: give ``submod.parameters()`` to the stage's optimizer."""

    def __init__(self, pipe, stage_index: int | None = None, *, zero_copy: bool | str = True,
                 timeout: float | None = None, trace: bool = False):
        if zero_copy not in ZERO_COPY:
            raise rdmaflow.InvalidArgumentError(f"zero_copy must be one of {ZERO_COPY}, got {zero_copy!r}")
        rank, world = env_rank()
        self.timeout = seconds_setting(timeout, "timeout", TIMEOUT_ENV, DEFAULT_TIMEOUT)
        if stage_index is not None and (not isinstance(stage_index, int) or isinstance(stage_index, bool)
                                        or stage_index != rank):
            raise rdmaflow.InvalidArgumentError(f"stage_index is {stage_index!r} on rank {rank}: rank r runs stage r "
                                                "(leave stage_index out, or pass $RANK)")
        self.stage_index = rank
        self.rdv = Rendezvous(rank, world, self.timeout)
        problem = None
        if world != pipe.num_stages:
            problem = (f"rank {rank} split the model into {pipe.num_stages} stages but the job has WORLD_SIZE={world} "
                       f"processes: start one process per stage and no shard: `rdmaflow launch --shards-per-node 0 "
                       f"--nproc-per-node {pipe.num_stages} SCRIPT` (on several hosts: --nnodes M and "
                       f"--nproc-per-node {pipe.num_stages}/M on each)")
        elif not 0 <= self.stage_index < pipe.num_stages:
            problem = f"stage {self.stage_index} does not exist ({pipe.num_stages} stages)"
        if problem:
            self.rdv.abort(problem)  # the other ranks raise instead of waiting for this one's plan
            raise rdmaflow.InvalidArgumentError(problem)
        self.pipe, self.rank = pipe, rank
        self.num_stages = pipe.num_stages
        self.graph = pipe.stages[self.stage_index]
        self.submod = StageModule(self.graph)
        self.zero_copy = zero_copy is not False
        self.always_place = zero_copy == "always"
        self.trace: list | None = [] if trace else None
        self.plan: Plan | None = None
        self.device = None
        self.senders: dict[int, object] = {}
        self.receivers: dict[int, object] = {}
        self.stats: dict[int, EdgeStats] = {}
        self.steps = 0
        self._next_closed_check = 0.0
        self.closed = False
        self._learned: set[str] = set()

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"<PipelineStage {self.stage_index} of {self.num_stages}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- setup ----------------------------------------------------------------------------------
    def setup(self, n_microbatches: int, training: bool, schedule: str) -> Plan:
        """Plans, agrees with the other ranks, and connects every edge (once)."""
        if self.plan is not None:
            raise rdmaflow.InvalidArgumentError("this stage is already set up for a schedule; build a new stage")
        if self.closed:
            raise rdmaflow.InvalidArgumentError(f"stage {self.stage_index} is closed: build a new stage")
        plan = self.pipe.plan(n_microbatches, training=training, zero_copy=self.zero_copy, schedule=schedule)
        self.rdv.agree(plan.to_json())
        try:
            self._connect(plan)
        except BaseException as e:
            self.rdv.abort(f"stage {self.stage_index} (rank {self.rank}) failed to set up: {e}")
            raise
        self.plan = plan
        return plan

    def _connect(self, plan: Plan) -> None:
        me = self.stage_index
        self.device = rdmaflow.Device(f"{self.rdv.host}:0", secret=self.rdv.secret)
        self.device.create_arena(plan.arena_bytes(me))
        endpoints = self.rdv.exchange(self.device.endpoint)
        sends, recvs = plan.edges_of(me)
        tag = f"rdmaflow/{self.rdv.prefix}"
        for e in recvs:
            if e.cls != DYNAMIC:
                cls = StaticReceiver if e.cls == STATIC else BoundedReceiver
                self.receivers[e.id] = cls(self.device, tag + e.name, e.max_shape, _dtype(e.dtype), depth=e.depth,
                                           timeout=self.timeout)
            else:
                self.receivers[e.id] = DynamicReceiver(self.device, tag + e.name, depth=e.depth, timeout=self.timeout)
        self.rdv.barrier("receivers")
        for e in sends:
            cls = {STATIC: StaticSender, BOUNDED: BoundedSender, DYNAMIC: DynamicSender}[e.cls]
            args = (e.max_shape, _dtype(e.dtype)) if e.cls != DYNAMIC else ()
            self.senders[e.id] = cls(self.device, endpoints[e.consumer], tag + e.name, *args, timeout=self.timeout)
            self.stats[e.id] = EdgeStats(copy_reason=None if e.zero_copy else e.why)
        self.rdv.barrier("senders")  # every pair introduced: nothing is exchanged from here on
        self.placement = Placement(self.device.arena, enabled=self.zero_copy, weigh=not self.always_place)
        self._edges = plan.edges
        self._fwd_in = {e.source: e for e in recvs if e.direction == "forward"}
        self._fwd_out = [e for e in sends if e.direction == "forward"]
        self._bwd_in = [e for e in recvs if e.direction == "backward"]
        self._bwd_out = {e.forward_id: e for e in sends if e.direction == "backward"}

    # -- one step -------------------------------------------------------------------------------
    def run_step(self, order: list[tuple[str, int]], args: tuple, kwargs: dict, target, losses: list | None,
                 loss_fn):
        """Runs one step of the schedule ``order`` ([("F"|"B", microbatch), ...])."""
        if self.closed:
            raise rdmaflow.InvalidArgumentError(f"stage {self.stage_index} is closed: build a new stage for more steps")
        if self.plan is None:
            raise rdmaflow.InvalidArgumentError("the stage is not set up: create a schedule for it first")
        if losses is not None and not isinstance(losses, list):
            raise rdmaflow.InvalidArgumentError(f"losses= takes a list (the last stage appends each microbatch's "
                                                f"loss to it), got {type(losses).__name__}")
        try:
            return self._run_step(order, args, kwargs, target, losses, loss_fn)
        except BaseException as e:
            mine = f"stage {self.stage_index} (rank {self.rank}): {type(e).__name__}: {e}"
            first = self.rdv.abort(mine)
            # A peer that failed records why before it closes its pairs (a `with` or finally
            # block): the channel error it left here says only that the peer went away.
            if isinstance(e, rdmaflow.PeerError) and first not in (None, mine) and str(e) != self._aborted(first):
                raise rdmaflow.PeerError(self._aborted(first)) from e
            raise

    def _run_step(self, order, args, kwargs, target, losses, loss_fn):
        plan, M = self.plan, self.plan.n_microbatches
        # Checked here, inside run_step's abort: the other ranks raise too instead of timing out.
        if self.is_first and not args and not kwargs:
            raise rdmaflow.InvalidArgumentError("the first stage's step() takes the model's inputs")
        if plan.training and self.is_last and target is None:
            raise rdmaflow.InvalidArgumentError("the last stage's step() takes target= for its loss_fn")
        if not self.steps:
            self._check_materialized()
        self._chunks = self._split_inputs(args, kwargs) if self.is_first else None
        self._targets, self._shares = self._split_target(target) if self.is_last and plan.training else (None, None)
        self._mbs = [Microbatch() for _ in range(M)]
        self._outputs: list = [None] * M
        self._loss_fn = loss_fn
        recv_ops = {e.id: RecvOp(e, self.receivers[e.id], M) for e in self.plan.edges if e.id in self.receivers}
        self._recv_ops = recv_ops
        fwd_needs = [recv_ops[e.id] for e in self._fwd_in.values()]
        bwd_needs = [recv_ops[e.id] for e in self._bwd_in]
        computes = []
        for kind, m in order:
            needs = [(r, m) for r in (fwd_needs if kind == "F" else bwd_needs)]
            fn = (lambda inputs, m=m: self._forward(m, inputs)) if kind == "F" else (
                lambda inputs, m=m: self._backward(m, inputs))
            computes.append(ComputeOp(f"{kind}{m}", needs, fn))
        ex = Executor(f"stage {self.stage_index}", self.timeout, self._check_abort, self.trace)
        ex.run(computes, list(recv_ops.values()))
        ex.finish()
        self.steps += 1
        if losses is not None and self.is_last and plan.training:
            losses.extend(mb.loss.detach() for mb in self._mbs)
        self._mbs = []
        if self.is_last and not plan.training:
            return tree_unflatten(_concat(self._outputs), self.pipe.out_spec)
        return None

    def _check_abort(self) -> None:
        """Raises if the job was aborted, or if another stage closed without running this step
        (ranks that run different numbers of steps: this one would wait out its timeout)."""
        reason = self.rdv.aborted()
        if reason:
            raise rdmaflow.PeerError(self._aborted(reason))
        now = time.monotonic()
        if now < self._next_closed_check:  # the executor calls this as often as every 200 us
            return
        self._next_closed_check = now + CLOSED_CHECK
        for r, steps in self.rdv.closed().items():
            if steps <= self.steps:
                raise rdmaflow.PeerError(
                    f"stage {self.stage_index}: stage {r} (rank {r}) closed after {steps} steps while this stage "
                    f"runs step {self.steps + 1}: every stage must run the same number of steps")

    def _aborted(self, reason: str) -> str:
        return f"stage {self.stage_index}: the job was aborted: {reason}"

    def _split(self, x, what: str) -> list:
        M = self.plan.n_microbatches
        if not isinstance(x, torch.Tensor):
            raise rdmaflow.InvalidArgumentError(f"the {what} of stage {self.stage_index} must be a tensor, got "
                                                f"{type(x).__name__}")
        if x.dim() == 0 or x.shape[0] < M:
            raise rdmaflow.InvalidArgumentError(f"the {what} has shape {list(x.shape)}: its first dimension cannot "
                                                f"be split into {M} microbatches")
        return list(torch.tensor_split(x, M, dim=0))

    def _split_target(self, target) -> tuple[list, list[float]]:
        """The target (a tensor, or a tuple or dict of them) cut into the microbatches, and each
        microbatch's share of the batch's rows (of its first tensor)."""
        leaves, spec = tree_flatten(target)
        if not leaves:
            raise rdmaflow.InvalidArgumentError("target= holds no tensor")
        names = ["target" if len(leaves) == 1 else f"target's tensor {i}" for i in range(len(leaves))]
        per_leaf = [self._split(t, name) for t, name in zip(leaves, names)]
        # Microbatch m's target must be the rows of microbatch m's inputs: cut from a batch of
        # other rows, it would be another microbatch's (a loss of another shape, or silently wrong).
        M = self.plan.n_microbatches
        captured = next((shape[0] for shape, _ in self.plan.inputs if shape and isinstance(shape[0], int)), None)
        for t, name in zip(leaves, names):
            if captured is not None and t.shape[0] != M * captured:
                raise rdmaflow.InvalidArgumentError(
                    f"the {name} has {t.shape[0]} rows; the batch has {M * captured} ({M} microbatches of the "
                    f"{captured} rows pipeline() captured): a target holds the batch's rows, in its order")
        targets = [tree_unflatten([chunks[m] for chunks in per_leaf], spec) for m in range(self.plan.n_microbatches)]
        return targets, [c.shape[0] / leaves[0].shape[0] for c in per_leaf[0]]

    def _split_inputs(self, args: tuple, kwargs: dict) -> list[list[torch.Tensor]]:
        """Each of the model's inputs (flattened as torch.export flattens them: the positional
        ones, then the keyword ones in the order captured) cut into the microbatches."""
        plan, spec = self.plan, self.pipe.in_spec
        pos, kw = spec.children()
        if set(kwargs) == set(kw.context):  # keywords in any order, as Python takes them
            kwargs = {k: kwargs[k] for k in kw.context}
        flat, got = tree_flatten((args, kwargs))
        if got != spec:
            raise rdmaflow.InvalidArgumentError(
                f"stage 0 takes the model's inputs as pipeline() captured them: {pos.num_children} positional and "
                f"keywords {list(kw.context)}, {len(plan.inputs)} tensors in all; got {len(args)} positional and "
                f"keywords {list(kwargs)}" + (", nested otherwise" if len(args) == pos.num_children
                                              and list(kwargs) == list(kw.context) else ""))
        per_input = [self._split(a, f"input {i}") for i, a in enumerate(flat)]
        for i, chunks in enumerate(per_input):
            shape, dtype = plan.inputs[i]
            rows, M = flat[i].shape[0], plan.n_microbatches
            if shape and isinstance(shape[0], int) and rows != M * shape[0]:
                raise rdmaflow.InvalidArgumentError(
                    f"input {i} has {rows} rows: {M} microbatches of the {shape[0]} rows pipeline() captured take "
                    f"{M * shape[0]} (a Dim on dimension 0 in pipeline()'s dynamic_shapes takes other batch sizes)")
            for m, c in enumerate(chunks):
                _check_input(c, f"microbatch {m} of input {i}", shape, plan.input_ranges[i], dtype)
        return [[chunks[m] for chunks in per_input] for m in range(plan.n_microbatches)]

    def _check_materialized(self) -> None:
        """A model made on the meta device (so that no rank holds all of it) is captured and
        split as any other, but each stage must give its own part memory before it runs."""
        meta = [n for n, t in (*self.submod.named_parameters(), *self.submod.named_buffers()) if t.is_meta]
        if meta:
            raise rdmaflow.InvalidArgumentError(
                f"stage {self.stage_index}'s {', '.join(meta[:3])}{' ...' if len(meta) > 3 else ''} "
                f"{'is' if len(meta) == 1 else 'are'} on the meta device: before the first step, materialize "
                f"the stage's part (stage.submod.to_empty(device='cpu'), then load_state_dict or initialize), "
                f"and make its optimizer after that")

    # -- computes -------------------------------------------------------------------------------
    def _forward(self, m: int, inputs: dict) -> list[SendOp]:
        mb, training = self._mbs[m], self.plan.training
        vals = []
        for ref in self.graph.args:
            if ref.kind == "param":
                continue
            if ref.kind == "input" and self.is_first:
                vals.append(self._chunks[m][ref.index])
                continue
            vals.append(self._leaf(mb, self._fwd_in[_key(ref)], inputs))
        with torch.set_grad_enabled(training):
            out = self.placement.run("forward", self.submod, *vals)
            outs = list(out) if self.graph.tuple_output else [out]
            if self.is_last:
                self._finish_forward(m, mb, outs, inputs)
        sends = []
        for e in self._fwd_out:
            t = self._chunks[m][int(e.source.split()[1])] if e.source.startswith("input") else outs[
                int(e.source.rsplit(" ", 1)[1])]
            mb.sent[e.id] = t
            sends.append(self._send(e, t, m, "forward"))
        self._settle("forward", self._fwd_out)
        self._learned.add("forward")
        return sends

    def _leaf(self, mb: Microbatch, e: Edge, inputs: dict) -> torch.Tensor:
        leaf = mb.leaves.get(e.id)
        if leaf is None:
            t = mb.received[e.id] = inputs[e.id]
            _check_tensor(t, f"edge {e.name} ({e.source} from stage {e.producer})", e.shape, e.max_shape, e.dtype,
                          e.cls)
            leaf = t.detach().requires_grad_(self.plan.training and e.requires_grad)
            mb.leaves[e.id] = leaf
        return leaf

    def _finish_forward(self, m: int, mb: Microbatch, outs: list, inputs: dict) -> None:
        values = []
        for ref in self.pipe.outputs:
            if ref.kind == "value" and ref.stage == self.stage_index:
                values.append(outs[ref.index])
            elif ref.kind == "input" and self.is_first:  # a one-stage model returning its input
                values.append(self._chunks[m][ref.index])
            else:
                values.append(self._leaf(mb, self._fwd_in[_key(ref)], inputs))
        if self.plan.training:
            loss = self._loss_fn(tree_unflatten(values, self.pipe.out_spec), self._targets[m])
            if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
                raise rdmaflow.InvalidArgumentError("loss_fn must return a scalar tensor")
            if not loss.requires_grad:
                raise rdmaflow.InvalidArgumentError("loss_fn's result does not require grad: compute it from the "
                                                    "model's output, without detaching it")
            mb.loss = loss.reshape(())
        else:  # the slots the outputs may view are rewritten by the next step
            self._outputs[m] = [v.detach().clone() for v in values]

    def _backward(self, m: int, inputs: dict) -> list[SendOp]:
        mb = self._mbs[m]
        tensors, grads = [], []
        if self.is_last:  # the microbatch's share of the batch (1/M when M divides it): the batch's mean loss
            with torch.enable_grad():  # as the forward ran: a step called under no_grad trains too
                tensors.append(mb.loss * self._shares[m])
            grads.append(torch.ones((), dtype=mb.loss.dtype))
        by_tensor: dict[int, list] = {}
        for e in self._bwd_in:
            if e.payload != GRADIENT:
                continue
            sent = mb.sent[e.forward_id]
            g = mb.received[e.id] = inputs[e.id]
            _check_tensor(g, f"gradient edge {e.name} from stage {e.producer}", e.shape, e.max_shape, e.dtype, e.cls)
            by_tensor.setdefault(id(sent), [sent, None])
            acc = by_tensor[id(sent)]
            acc[1] = g if acc[1] is None else acc[1] + g
        for sent, g in by_tensor.values():
            if sent.requires_grad:
                tensors.append(sent)
                grads.append(g)
        if tensors:
            self.placement.run("backward", torch.autograd.backward, tensors, grads)
        sends = []
        for fid, e in self._bwd_out.items():
            if e.payload == TOKEN:
                t = torch.empty(0)
            else:
                leaf = mb.leaves[fid]
                t = leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
            sends.append(self._send(e, t, m, "backward"))
        self._settle("backward", self._bwd_out.values())
        self._learned.add("backward")
        self._mbs[m].leaves, self._mbs[m].sent = {}, {}  # frees the graph of this microbatch
        return sends

    def _send(self, e: Edge, t: torch.Tensor, m: int, phase: str) -> SendOp:
        _check_tensor(t, f"stage {self.stage_index}'s {e.source} for edge {e.name} (microbatch {m})", e.shape,
                      e.max_shape, e.dtype, e.cls)
        if not t.is_contiguous():
            t = t.contiguous()
        st = self.stats[e.id]
        if phase not in self._learned and e.payload != TOKEN and st.copy_reason is None:
            sender = self.senders[e.id]
            if not self.always_place and getattr(sender, "copies_from_any_memory", False):
                st.copy_reason = ("on one host a send is one copy into the receiver's slot from any memory: "
                                  "placement would save none")
            else:
                st.copy_reason = self.placement.learn(phase, t, e.nbytes if e.cls == BOUNDED else None)
        zero = e.payload == TOKEN or self.device.arena.offset_of(t) is not None
        st.sends += 1
        st.zero_copy += zero
        if self.steps > 0:
            st.steady_sends += 1
            st.steady_zero_copy += zero
        holder = self._slot_holder(t, m)
        done = (lambda op, fut: holder.holds.append(fut)) if holder is not None else (lambda op, fut: None)
        return SendOp(e, self.senders[e.id], t, m, done)

    def _settle(self, phase: str, edges) -> None:
        """After the first call of ``phase``: its sites stay, or are declined for what the
        placement mode would cost (Placement.settle); the edges then say why they copy."""
        if phase in self._learned:
            return
        why = self.placement.settle(phase)
        if why is not None:
            for e in edges:
                st = self.stats[e.id]
                if e.payload != TOKEN and st.copy_reason is None and st.zero_copy < st.sends:
                    st.copy_reason = why

    def _slot_holder(self, t: torch.Tensor, m: int) -> RecvOp | None:
        """The receive whose slot ``t`` views (a tensor passed through this stage): its slot must
        not be handed back before this send has read it."""
        if t.numel() == 0:
            return None
        for eid, r in self._mbs[m].received.items():
            if r.data_ptr() == t.data_ptr() and self.plan.edges[eid].cls != DYNAMIC:
                return self._recv_ops[eid]
        return None

    # -- reporting ------------------------------------------------------------------------------
    @property
    def send_stats(self) -> dict:
        """Per edge this stage sends: {name: {sends, zero_copy, steady_sends, steady_zero_copy, copy_reason}}."""
        return {self._edge(eid).name: vars(st).copy() for eid, st in self.stats.items()}

    def _edge(self, eid: int) -> Edge:
        return self._edges[eid]

    def explain(self) -> str:
        """The plan's table with what this stage observed for the edges it sends."""
        return self.plan.explain(self.send_stats)

    def close(self) -> None:
        """Waits until every stage is done (bounded; a failed job does not wait), then closes
        the pairs and the device: a stage may still acknowledge its peers' last transfers.
        Raises nothing; a RuntimeWarning says when the others did not all close in time."""
        if self.plan is not None and self.device is not None and not self.rdv.aborted():
            try:
                self.rdv.closing(self.steps)
            except rdmaflow.RdmaflowError as e:  # close() raises nothing: it says so
                warnings.warn(f"stage {self.stage_index} closes after {self.steps} steps without every stage of "
                              f"the job closing: {e}", RuntimeWarning, stacklevel=2)
        for x in list(self.senders.values()) + list(self.receivers.values()):
            try:
                x.close()
            except rdmaflow.RdmaflowError:
                pass
        if self.device is not None:
            self.device.close()
            self.device = None
        self.closed = True


def _key(ref) -> str:
    return f"input {ref.index}" if ref.kind == "input" else f"stage {ref.stage} output {ref.index}"


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def _concat(outputs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The microbatches' flat outputs joined along dimension 0, output by output, as
    torch.distributed.pipelining merges them: a per-sample output becomes the batch's; a scalar,
    one element per microbatch."""
    def join(ts: list) -> torch.Tensor:
        return torch.stack(ts) if ts[0].dim() == 0 else torch.cat(ts)

    return [join([o[i] for o in outputs]) for i in range(len(outputs[0]))]


__all__ = ["PipelineStage", "StageModule"]
