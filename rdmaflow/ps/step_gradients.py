"""What a worker's step has written of its gradient, and what it must write again.

With overlap, backward writes a gradient unit to its shard's slot the moment every parameter
in it has its gradient (a post-accumulate-grad hook). A loop may then change what was written
before ``step()``: a second backward (gradient accumulation), a ``zero_grad()`` (a discarded
backward), ``clip_grad_norm_``, a scaling, a new ``p.grad``. The shard must apply what the
gradient is at ``step()``, as torch's optimizer would. This class is the bookkeeping of that,
with no I/O: the worker posts the WRITEs, and rewrites each unit named here behind a fence, so
that it lands after its earlier WRITE (docs/parameter-server.md, "A step, who writes what where").

Not thread-safe: the worker calls it under its lock.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from rdmaflow.ps.layout import Unit, covered_once


class StepGradients:
    """One step's written and to-be-rewritten units, of ``unit_count`` units indexed by offset.
    ``units_of_param[i]`` are the indices of the units parameter i's gradient touches; a unit is ready once each of its parameters'
    hooks fired. With ``zero_copy`` every gradient is a view of one send buffer, whose version
    counter all views share."""

    def __init__(self, units_of_param: Sequence[Sequence[int]], unit_count: int, zero_copy: bool):
        self.units_of_param = [list(us) for us in units_of_param]
        self.unit_count = unit_count
        self.zero_copy = zero_copy
        self._need = [0] * unit_count
        for us in self.units_of_param:
            for u in us:
                self._need[u] += 1
        self.reset()

    def reset(self) -> None:
        """A new step: nothing written, nothing fired."""
        self.written: set[int] = set()   # units WRITten this step (or queued to be)
        self.dirty: set[int] = set()     # of those, the ones to write again behind a fence
        self.fired: set[int] = set()     # parameters whose hook ran this step
        self._pending = list(self._need)  # per unit, its parameters whose hook has not run
        # Each fired parameter's gradient as its hook left it, and its version counter; and the
        # send buffer's version counter after the latest hook.
        self._at_hook: dict[int, tuple[torch.Tensor, int]] = {}
        self._hook_version = -1
        # A hook ran twice: a second backward, after accumulating or after the model's own
        # in-place zero_grad(), which cannot be told apart (with zero copy both move the buffer's
        # one version counter).
        self._refired = False
        self.ranges: list[tuple[int, int]] = []  # element ranges push_range wrote this step

    def hook(self, i: int, grad: torch.Tensor, buffer_version: int) -> list[int]:
        """Parameter i's hook ran, leaving ``grad`` (the send buffer's version counter is now
        ``buffer_version``). Returns the units now ready to be written for the first time; a
        unit written before is marked to be written again."""
        self._at_hook[i] = (grad, grad._version)
        self._hook_version = buffer_version
        self._refired |= i in self.fired
        self.fired.add(i)
        ready = []
        for u in self.units_of_param[i]:
            self._pending[u] -= 1
            if u in self.written:
                self.dirty.add(u)  # accumulated again: write again at step()
            elif self._pending[u] <= 0:
                ready.append(u)
        return ready

    def discard(self) -> None:
        """zero_grad() before step(): a backward thrown away. Every unit written is written
        again (from the zeroed buffer, or what the kept backward puts there), and every unit
        waits for its parameters' hooks anew."""
        self.dirty |= self.written
        self.fired = set()
        self._at_hook = {}
        self._refired = False
        self._pending = list(self._need)

    def changed(self, grads: Sequence[torch.Tensor | None], buffer_version: int) -> list[int]:
        """The fired parameters whose gradient (``grads[i]``, p.grad now) changed since its hook:
        replaced, or modified in place. With zero copy, views share the send buffer's version
        counter, which every accumulation moves: all changed if it moved after the latest hook,
        or if a second backward ran (a gradient only the first reached may have been zeroed in
        place between them: the model's zero_grad(set_to_none=False)). A gradient set to None
        since (the model's zero_grad()) is no gradient: not a change to stage, which would put
        the zeroed buffer back in p.grad."""
        moved = self.zero_copy and (self._refired or buffer_version != self._hook_version)
        out = []
        for i in sorted(self.fired):
            g, version = self._at_hook[i]
            now = grads[i]
            if now is None:
                continue
            if now is not g or moved or (not self.zero_copy and now._version != version):
                out.append(i)
        return out

    def rewrite(self, i: int) -> None:
        """Parameter i's gradient changed after its units were written: write them again."""
        self.dirty.update(u for u in self.units_of_param[i] if u in self.written)

    def apply_ranges(self, units: Sequence[Unit]) -> None:
        """The ranges push_range wrote decide what is written: a unit they covered whole and
        once is done; one they touched otherwise is written again, whole."""
        if self.ranges:
            self.written, touched = covered_once(units, self.ranges)
            self.dirty = touched - self.written

    def to_write(self) -> list[int]:
        """The units step() writes: never written, or to be written again."""
        return [u for u in range(self.unit_count) if u not in self.written or u in self.dirty]
