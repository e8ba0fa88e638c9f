"""What a worker tells each shard with a push besides the gradient: the step record.

A shard applies a push with the job's hyperparameters and to every parameter, unless the
record of that push says otherwise: the optimizer's numeric hyperparameters once they differ
from the job's (an LR scheduler's lr), and which parameters have a gradient (torch's optimizer
skips one whose grad is None). Each shard has one record slot per push buffer; a worker writes
a record into the slot of push t only when it differs from what that slot last got, so a loop
that changes neither sends none. The WRITE goes before the push flag on the same channel, so
the shard reads the record with its push (docs/parameter-server.md, "A step, who writes what
where").

This class decides and encodes; the worker posts the WRITEs from the source buffer named here.
Not thread-safe: the worker calls it under its lock.
"""
from __future__ import annotations

import torch

from rdmaflow import InvalidArgumentError
from rdmaflow.ps.optim import describe_optimizer, fixed_changes, hyper_fields, hyper_values
from rdmaflow.ps.protocol import write_record

Record = tuple  # (hyperparameters, or None where the job's hold; which parameters have a gradient)


class StepRecord:
    """The records of one worker's pushes. ``job_optim``: the job's optimizer as
    ``describe_optimizer`` gives it (the shards start from its hyperparameters); ``own_optim``:
    this worker's, whose other hyperparameters must not change. ``slots``: the shards' record
    slots (one per push buffer); ``sources``: two registered buffers, ``protocol.record_bytes``
    long, that records are encoded into in turn, so that one can be written while the other's
    WRITE is in flight."""

    def __init__(self, job_optim: dict, own_optim: dict, params: int, slots: int, sources: list[torch.Tensor]):
        self.fields = hyper_fields(job_optim)
        self._own = own_optim
        self._start = hyper_values(job_optim["hyper"], self.fields)
        self.every_grad = [True] * params
        # Per slot, what was last written there: at first, what a shard does without a record.
        self._sent: list[Record] = [(None, self.every_grad)] * slots
        self._sources = sources
        self._futs: list[list] = [[] for _ in sources]
        self._next = 0

    def of(self, optimizer: torch.optim.Optimizer, has: list[bool]) -> Record:
        """The record of a push now, with ``has`` (which parameters have a gradient). Raises
        InvalidArgumentError if a hyperparameter that is not a number (or another parameter
        group) changed: the shards cannot follow it."""
        now = describe_optimizer(optimizer)  # also refuses a second parameter group
        fixed = fixed_changes(self._own, now, self.fields)
        if fixed:
            raise InvalidArgumentError(f"the optimizer's {', '.join(fixed)} changed during training: only its "
                                       f"numeric hyperparameters may ({', '.join(sorted({k for k, _ in self.fields}))})")
        hyper = hyper_values(now["hyper"], self.fields)
        return None if hyper == self._start else hyper, has

    def encode(self, t: int, record: Record, timeout: float | None) -> int | None:
        """The index of the source that now holds push ``t``'s record, encoded; None when the
        slot of push t already holds that record (nothing to write). Waits, at most
        ``timeout`` seconds each, for the WRITEs that last sent from that source."""
        slot = t % len(self._sent)
        if record == self._sent[slot]:
            return None
        values, has = record
        i = self._next
        for f in self._futs[i]:  # that source was last sent a record ago
            f.result(timeout)
        write_record(self._sources[i], t, values, has, len(self.fields))
        self._next, self._sent[slot] = (i + 1) % len(self._sources), record
        return i

    def sent(self, i: int, futures: list) -> None:
        """Source ``i``'s record was posted as ``futures`` (one WRITE per shard)."""
        self._futs[i] = futures
