"""Microbatch schedules, named as in torch.distributed.pipelining.

A schedule is the order in which a stage runs its microbatches' forwards (F) and backwards (B)
within a step; the executor runs them in that order and interleaves the sends and receives.

- ``ScheduleGPipe`` (fill-drain): every forward, then every backward.
- ``Schedule1F1B``: stage s runs S-1-s forwards to fill the pipeline, then alternates one
  forward and one backward, then drains the remaining backwards, which bounds the activations
  a stage holds by the number of stages instead of the number of microbatches.

Without a ``loss_fn`` a schedule runs inference: forwards only, and the last stage's
``step()`` returns the outputs of the whole batch.
"""
from __future__ import annotations

import rdmaflow


class _Schedule:
    name = ""

    def __init__(self, stage, n_microbatches: int, loss_fn=None):
        if loss_fn is not None and not callable(loss_fn):
            raise rdmaflow.InvalidArgumentError("loss_fn must be callable: loss_fn(output, target) -> scalar tensor")
        self.stage = stage
        self.n_microbatches = n_microbatches
        self.loss_fn = loss_fn
        self.training = loss_fn is not None
        stage.setup(n_microbatches, training=self.training, schedule=self.name if self.training else "forward")

    def order(self) -> list[tuple[str, int]]:
        raise NotImplementedError

    def step(self, *args, target=None, losses: list | None = None, **kwargs):
        """One step over a batch. The first stage uses the model's inputs ``args`` and
        ``kwargs``, in the structure ``pipeline()`` captured (other stages ignore them, so every
        rank may run the same line), the last stage the target (training: a tensor, or a tuple or
        dict of them, each cut into the microbatches); ``losses`` (last stage) gets each
        microbatch's loss. Gradients accumulate into ``stage.submod``'s parameters, scaled so
        that they equal those of the whole batch's mean loss; run the stage's optimizer after
        it. Inference: the last stage gets the batch's outputs in the structure the model
        returns (a tensor, a tuple, a dict), the others None. Blocks until this stage's part of
        the step is done (bounded by the stage's timeout); not thread-safe."""
        st = self.stage
        order = self.order() if self.training else [("F", m) for m in range(self.n_microbatches)]
        return st.run_step(order, args if st.is_first else (), kwargs if st.is_first else {}, target, losses,
                           self.loss_fn)


class ScheduleGPipe(_Schedule):
    name = "gpipe"

    def order(self) -> list[tuple[str, int]]:
        M = self.n_microbatches
        return [("F", m) for m in range(M)] + [("B", m) for m in range(M)]


class Schedule1F1B(_Schedule):
    name = "1f1b"

    def order(self) -> list[tuple[str, int]]:
        M, S, s = self.n_microbatches, self.stage.num_stages, self.stage.stage_index
        warmup = min(S - 1 - s, M)
        out = [("F", m) for m in range(warmup)]
        for i in range(M - warmup):
            out += [("F", warmup + i), ("B", i)]
        out += [("B", m) for m in range(M - warmup, M)]
        return out
