"""Allocation sites: tensors that will be sent are born in registered memory (Xue et al., EuroSys '19, §3.4).

The paper instruments the allocator during the first iteration: it records buffer address ->
(graph node, i-th allocation in it), looks up each sent tensor's address, and from then on
allocates those nodes' outputs from the RDMA arena. On CPU PyTorch has no Python hook into the
allocator, so ``Placement`` is a ``TorchDispatchMode`` around each compute call of a stage (the
forward of a microbatch, or its backward). It numbers the ATen ops the call runs:

1. recording (the first call of each phase): for every op whose output has a storage none of
   its inputs had (a fresh allocation, not a view or an in-place update), it records storage
   address -> (op number, output number), later entries overwriting earlier ones at the same
   address, as in the paper;
2. ``learn(phase, tensor)`` (right after that call, for each tensor about to be sent) looks the
   tensor's storage up and marks that op as a site; or says why it cannot (a view of a stage
   input, an op with no ``out=`` overload, several outputs);
3. every later call of the phase runs a site's op through its ``out=`` overload into a tensor
   from the arena, under autograd (the mode sits below it), so the send needs no copy. A phase
   without a site (one that sends nothing, or only tensors that cannot be placed) runs without
   the mode after its first call.

A site whose op, shape or dtype no longer matches what was recorded runs normally (the send
then copies and ``stats`` counts it). Ops are identified by their position in the call, which
is the same for every microbatch of a static graph.

The mode is not free: every op of a phase that keeps a site pays a Python call, and a small
transformer block runs a hundred ops to send a few KiB. So, unless told to
place ``always``, ``settle(phase)`` weighs it after ``learn``: the phase's ops times the
mode's cost per op (measured once per process) against the copies its sites save (a copy of
each site's bytes into freshly allocated memory, also measured), and drops the phase's sites
when the mode costs more than ``MODE_COST_MARGIN`` times those copies; the sends then copy,
and ``settle`` says why.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import rdmaflow
from rdmaflow.errors import InvalidArgumentError

# Placement is declined only when the mode costs clearly more than the copies it saves: the
# estimate of either side is good to a factor of about two.
MODE_COST_MARGIN = 4.0

# "mode_us_per_op=X,copy_gb_per_s=Y": figures settle() uses instead of measuring them (a machine
# too loaded to time a few microseconds, or a deployment that wants the same decision every run).
COSTS_ENV = "RDMAFLOW_PLACEMENT_COSTS"
_COST_KEYS = ("mode_us_per_op", "copy_gb_per_s")


def given_costs() -> dict[str, float] | None:
    """$RDMAFLOW_PLACEMENT_COSTS parsed; None when unset."""
    text = os.environ.get(COSTS_ENV)
    if not text:
        return None
    costs = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition("=")
        try:
            number = float(value) if sep and key in _COST_KEYS and key not in costs else None
        except ValueError:
            number = None
        if number is None or not number >= 0 or number == float("inf") or \
                (key == "copy_gb_per_s" and number == 0):
            raise InvalidArgumentError(
                f"${COSTS_ENV}={text!r}: expected mode_us_per_op=<microseconds >= 0>,"
                f"copy_gb_per_s=<GB/s > 0>, each once; {item.strip()!r} is not one of them")
        costs[key] = number
    if len(costs) != len(_COST_KEYS):
        raise InvalidArgumentError(f"${COSTS_ENV}={text!r}: give both {' and '.join(_COST_KEYS)}")
    return costs


def out_variant(func) -> tuple[object, list[str]] | None:
    """The ``out=`` overload of an ATen op that takes the same arguments, and the names of its
    out arguments (one per output); None if it has none."""
    packet = getattr(func, "overloadpacket", None)
    schema = getattr(func, "_schema", None)
    if packet is None or schema is None or not schema.returns:
        return None
    want = [(a.name, str(a.type)) for a in schema.arguments]
    for name in packet.overloads():
        cand = getattr(packet, name)
        args = cand._schema.arguments
        outs = [a.name for a in args if a.is_out]
        if len(outs) == len(schema.returns) and [(a.name, str(a.type)) for a in args if not a.is_out] == want:
            return cand, outs
    return None


def decomposes(func) -> bool:
    """The op is composite: at run time it dispatches to other ops, whose outputs may be sites."""
    name = getattr(func, "name", None)
    return callable(name) and torch._C._dispatch_has_kernel_for_dispatch_key(name(), "CompositeImplicitAutograd")


def aliases_input(func) -> bool:
    """The op returns a view of an input or updates one in place (schema alias annotations)."""
    schema = getattr(func, "_schema", None)
    return bool(schema and any(r.alias_info is not None for r in schema.returns))


def _nbytes(shape: tuple, dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for d in shape:
        n *= d
    return n


def op_name(func) -> str:
    return str(func)  # e.g. aten.addmm.default


@dataclass
class Alloc:
    """A fresh output recorded in a phase's first call: output ``k`` of op number ``index``."""

    index: int
    k: int
    func: object
    shapes: list[tuple]      # of every output of the op
    dtypes: list[torch.dtype]
    contiguous: bool


@dataclass
class Site:
    """The op of a phase whose output ``k`` is placed in the arena (its other outputs, if any,
    in ordinary memory)."""

    alloc: Alloc
    out_op: object
    out_args: list[str]
    max_nbytes: int | None = None   # a bounded output: its arena buffer holds the maxima


@dataclass
class PhaseTrace:
    recorded: bool = False
    ops: int = 0             # ATen ops the recorded call ran under the mode
    alloc: dict[int, Alloc] = field(default_factory=dict)
    sites: dict[int, Site] = field(default_factory=dict)
    settled: bool = False


def _best_of_each(trials: int, *fns) -> list[float]:
    """The fastest of ``trials`` timed calls of each of ``fns``, the calls interleaved so that a
    slow stretch of the machine (another process's time slice, a stolen virtual CPU) slows them
    alike rather than one of them only."""
    best = [float("inf")] * len(fns)
    for _ in range(trials):
        for i, fn in enumerate(fns):
            t = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def _best_of(trials: int, fn) -> float:
    return _best_of_each(trials, fn)[0]


def mode_cost_per_op() -> float:
    """Seconds that running under ``Placement`` (a phase already recorded) adds to one ATen op:
    as given by $RDMAFLOW_PLACEMENT_COSTS, else measured once per process."""
    given = given_costs()
    return given["mode_us_per_op"] * 1e-6 if given is not None else _measured_mode_cost_per_op()


@functools.cache
def _measured_mode_cost_per_op() -> float:
    """On small adds, with and without the mode."""
    a, n = torch.zeros(4), 200

    def ops() -> None:
        for _ in range(n):
            torch.add(a, a)

    mode = Placement(None)
    mode._trace = PhaseTrace(recorded=True)

    def under_mode() -> None:
        with mode:
            ops()

    ops()
    under_mode()
    with_mode, without = _best_of_each(9, under_mode, ops)
    return max(0.0, (with_mode - without) / n)


COPY_PROBE_MAX = 64 << 20  # larger copies are timed at this size and scaled


def copy_cost(nbytes: int) -> float:
    """Seconds a send's copy of ``nbytes`` costs: as given by $RDMAFLOW_PLACEMENT_COSTS, else
    measured once per size."""
    given = given_costs()
    return nbytes / (given["copy_gb_per_s"] * 1e9) if given is not None else _measured_copy_cost(nbytes)


@functools.cache
def _measured_copy_cost(nbytes: int) -> float:
    """Into freshly allocated memory, as the output of an unplaced op is (a fresh buffer of
    megabytes is often new pages to fault in)."""
    n = max(1, min(nbytes, COPY_PROBE_MAX))
    src = torch.ones(n, dtype=torch.uint8)
    return _best_of(5, lambda: torch.empty(n, dtype=torch.uint8).copy_(src)) * nbytes / n


class Placement(TorchDispatchMode):
    """Records allocation sites in each phase's first call and redirects them afterwards."""

    def __init__(self, arena, enabled: bool = True, weigh: bool = True):
        super().__init__()
        self.arena = arena
        self.enabled = enabled
        self.weigh = weigh     # settle() may decline a phase whose mode costs more than its copies
        if enabled and weigh:
            given_costs()      # a malformed $RDMAFLOW_PLACEMENT_COSTS fails here, not mid-step
        self.phases: dict[str, PhaseTrace] = {}
        self._trace: PhaseTrace | None = None
        self._count = 0
        self.placed = 0        # outputs written into the arena
        self.misses = 0        # sites that ran normally (mismatch or arena full)

    # -- scope ----------------------------------------------------------------------------------
    def run(self, phase: str, fn, *args, **kwargs):
        """Runs ``fn`` as one call of ``phase`` under the mode."""
        trace = self.phases.setdefault(phase, PhaseTrace())
        if not self.enabled or trace.recorded and not trace.sites:
            # nothing of this phase is placed: the mode's cost per op (a Python call) buys nothing
            return fn(*args, **kwargs)
        self._trace, self._count = trace, 0
        try:
            with self:
                return fn(*args, **kwargs)
        finally:
            self._trace = None
            if not trace.recorded:
                trace.ops = self._count
            trace.recorded = True

    def learn(self, phase: str, tensor: torch.Tensor, max_nbytes: int | None = None) -> str | None:
        """After the first call of ``phase``: makes the op that allocated ``tensor``'s storage a
        site. Returns None when it will be placed (or already lives in the arena), else why not.
        ``max_nbytes``: the tensor's shape changes per call up to that many bytes (a bounded edge);
        the site's arena buffer is sized for it and the op sizes its output within it."""
        if not self.enabled:
            return "allocation-site placement is switched off (copy mode)"
        if self.arena.offset_of(tensor) is not None:
            return None
        trace = self.phases.get(phase)
        if trace is None:
            return "no call of this phase was traced"
        hit = trace.alloc.get(tensor.untyped_storage().data_ptr())
        if hit is None:
            return "its storage was not allocated by an op of this stage (a stage input or a model input)"
        if not hit.contiguous or not tensor.is_contiguous():
            return f"the sent tensor is a non-contiguous view of the output of {op_name(hit.func)}"
        out = out_variant(hit.func)
        if out is None:
            return f"{op_name(hit.func)} has no out= overload to place its output"
        trace.sites[hit.index] = Site(hit, out[0], out[1], max_nbytes)
        return None

    def settle(self, phase: str) -> str | None:
        """After the ``learn`` calls of ``phase``'s first call: keeps its sites, or (when
        weighing) drops them if the mode would cost more than ``MODE_COST_MARGIN`` times the
        copies they save, and returns why. Decides once per phase."""
        trace = self.phases.get(phase)
        if trace is None or trace.settled:
            return None
        trace.settled = True
        if not self.weigh or not trace.sites:
            return None
        saved = sum(copy_cost(s.max_nbytes if s.max_nbytes is not None
                              else _nbytes(s.alloc.shapes[s.alloc.k], s.alloc.dtypes[s.alloc.k]))
                    for s in trace.sites.values())
        mode = trace.ops * mode_cost_per_op()
        if mode <= MODE_COST_MARGIN * saved:
            return None
        trace.sites.clear()  # the phase now runs without the mode
        return (f"placement declined: its {phase} runs {trace.ops} ops under the placement mode "
                f"(~{mode * 1e6:.0f} µs) to save copies of ~{saved * 1e6:.0f} µs")

    # -- the mode -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        trace = self._trace
        index = self._count
        self._count += 1
        if trace is not None and trace.recorded:
            site = trace.sites.get(index)
            if site is not None and site.alloc.func is func:
                placed = self._placed(site, args, kwargs)
                if placed is not None:
                    return placed
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if trace is not None and not aliases_input(func):
            self._record(trace, index, func, args, kwargs, out)
        return out

    @staticmethod
    def _record(trace: PhaseTrace, index: int, func, args, kwargs, out) -> None:
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
            return  # an undefined output (a masked gradient): its out= overload cannot be used
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        shapes, dtypes = [tuple(t.shape) for t in outs], [t.dtype for t in outs]
        for k, t in enumerate(outs):
            ptr = t.untyped_storage().data_ptr() if t.numel() else 0
            if ptr and ptr not in inputs:
                trace.alloc[ptr] = Alloc(index, k, func, shapes, dtypes, t.is_contiguous())

    def _placed(self, site: Site, args, kwargs):
        a = site.alloc
        bounded = site.max_nbytes is not None
        try:
            if bounded:  # an empty view of a buffer at the maxima: the op sizes it, in place
                placed = self.arena.empty(site.max_nbytes // a.dtypes[a.k].itemsize, a.dtypes[a.k])[:0]
            else:
                placed = self.arena.empty(a.shapes[a.k], a.dtypes[a.k])
        except rdmaflow.ArenaFullError:
            self.misses += 1
            return None
        bufs = [placed if i == a.k else torch.empty(0 if bounded else shape, dtype=dtype)
                for i, (shape, dtype) in enumerate(zip(a.shapes, a.dtypes))]
        try:
            out = site.out_op(*args, **kwargs, **dict(zip(site.out_args, bufs)))
        except RuntimeError:  # the output outgrew the buffer (arena memory cannot be resized)
            self.misses += 1
            return None
        sent = out[a.k] if isinstance(out, (tuple, list)) else out
        shape_ok = bounded or tuple(sent.shape) == a.shapes[a.k]
        if not shape_ok or sent.dtype != a.dtypes[a.k] or sent.data_ptr() != placed.data_ptr():
            self.misses += 1  # the op resized its output: this call's shapes differ from the trace
        else:
            self.placed += 1
        return out
