"""``pipeline()``: a captured, partitioned model, from which each rank builds its stage."""
from __future__ import annotations

import torch

from rdmaflow.graph.analysis import Plan
from rdmaflow.graph.capture import export, partition


class Pipe:
    """The model's exported program cut into ``num_stages`` stage graphs.

    Every rank builds the same Pipe from the same model; ``plan()`` is the analysis for a
    number of microbatches and ``build_stage()`` the stage this rank runs."""

    def __init__(self, exported: torch.export.ExportedProgram):
        self.exported = exported
        self.stages, self.outputs, self.inputs = partition(exported)
        # The structure of the model's output (a tensor, a tuple, a dict of tuples...): the stages
        # handle its tensors flat, step() and loss_fn get them back in it.
        self.out_spec = exported.call_spec.out_spec
        # Likewise the inputs: (positional, keyword) as pipeline() captured them.
        self.in_spec = exported.call_spec.in_spec

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def plan(self, n_microbatches: int, training: bool = True, zero_copy: bool = True,
             schedule: str = "gpipe") -> Plan:
        """The RDMA-aware analysis for ``n_microbatches`` microbatches in flight."""
        return Plan(self.stages, self.outputs, self.inputs, n_microbatches, training, zero_copy, schedule,
                    self.exported.range_constraints)

    def build_stage(self, stage_index: int | None = None, *, zero_copy: bool | str = True,
                    timeout: float | None = None, trace: bool = False):
        """The stage of this rank (``$RANK`` unless ``stage_index``).

        ``zero_copy``: ``True`` (or ``"auto"``) places a sent tensor's op in the arena where that
        saves a copy and the placement mode costs less than the copy (docs/graph.md, "Allocation
        sites"); ``"always"`` places every site that can be placed; ``False`` turns placement
        off: every send copies (Xue et al., EuroSys '19: copy mode). ``stage.explain()`` says per edge why it
        copies."""
        from rdmaflow.graph.stage import PipelineStage

        return PipelineStage(self, stage_index, zero_copy=zero_copy, timeout=timeout, trace=trace)

    def __repr__(self) -> str:
        return f"<Pipe {self.num_stages} stages>"


def pipeline(module: torch.nn.Module, mb_args: tuple, split_spec: dict | None = None,
             dynamic_shapes=None, mb_kwargs: dict | None = None) -> Pipe:
    """Captures ``module`` with torch.export on one microbatch's arguments ``mb_args`` (and
    keyword arguments ``mb_kwargs``) and cuts it at its ``pipe_split()`` calls or at the modules
    named in ``split_spec`` ({fqn: SplitPoint.BEGINNING | SplitPoint.END}). ``dynamic_shapes``
    is torch.export's (``Dim`` objects); a dimension with a declared maximum makes a bounded
    edge. The first stage's ``step()`` then takes the batch's inputs in the same structure."""
    if not isinstance(mb_args, tuple):
        mb_args = (mb_args,)
    return Pipe(export(module, mb_args, split_spec, dynamic_shapes, mb_kwargs))
