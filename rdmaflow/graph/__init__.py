"""RDMA-aware graph layer: pipeline-parallel training and inference (Xue et al., EuroSys '19, §3.4 and §4).

A training script changes a few lines, in the conventions of torch.distributed.pipelining::

    from rdmaflow import graph

    pipe = graph.pipeline(model, mb_args=(x[:mb],), split_spec={"layers.2": graph.SplitPoint.BEGINNING})
    stage = pipe.build_stage()                      # rank r runs stage r ($RANK, $WORLD_SIZE)
    schedule = graph.ScheduleGPipe(stage, n_microbatches=4, loss_fn=loss_fn)
    opt = torch.optim.SGD(stage.submod.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        schedule.step(x, target=y)                  # inputs used by the first stage, target by the last
        opt.step()

Start it with ``rdmaflow launch`` or torchrun (one process per stage). ``pipe.plan(4).explain()``
prints the analysis: every cross-stage edge's class, mechanism, bytes and whether its send is
zero-copy, and why.
"""
from rdmaflow.graph.analysis import BOUNDED, DYNAMIC, STATIC, Edge, Plan
from rdmaflow.graph.capture import CaptureError, SplitPoint, pipe_split
from rdmaflow.graph.pipe import Pipe, pipeline
from rdmaflow.graph.rendezvous import PlanMismatchError
from rdmaflow.graph.schedule import Schedule1F1B, ScheduleGPipe
from rdmaflow.graph.stage import PipelineStage

__all__ = [
    "BOUNDED",
    "DYNAMIC",
    "STATIC",
    "CaptureError",
    "Edge",
    "Pipe",
    "PipelineStage",
    "Plan",
    "PlanMismatchError",
    "Schedule1F1B",
    "ScheduleGPipe",
    "SplitPoint",
    "pipe_split",
    "pipeline",
]
