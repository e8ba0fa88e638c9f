"""The optimizer of one shard's units, chunk by chunk: shared by a shard (its own units) and a
backup's mirror of another shard's units (dense_replica.py), so that both run the same code on
the same inputs and hold bit-identical weights and optimizer state."""
from __future__ import annotations

import torch

from rdmaflow import RdmaflowError
from rdmaflow.ps.layout import runs_of, units_holding
from rdmaflow.ps.optim import build_optimizer, describe_optimizer, hyper_values, set_hyper


class UnitOptimizers:
    """Needs ``plan``, ``weights`` (the units' elements) and ``hyper_fields`` before
    ``build_optimizers``."""

    def build_optimizers(self, shard: int, chunk_bytes: int, optim: dict) -> None:
        self.chunks = self.plan.chunks_of(shard, chunk_bytes)
        self.chunk_runs = [runs_of(chunk) for chunk in self.chunks]  # one WRITE each
        # Per chunk, per unit: the parameters [first, last) it holds part of (to skip the units
        # whose parameters have no gradient).
        starts = [info.offset for info in self.plan.params]
        held = [[units_holding(starts, u.offset, u.offset + u.numel) for u in chunk] for chunk in self.chunks]
        self.unit_params = [(torch.tensor([r.start for r in rs], dtype=torch.long),
                             torch.tensor([r.stop for r in rs], dtype=torch.long)) for rs in held]
        self._skipped_for: tuple | None = None  # (has, skip): the last answer of skipped()
        # One optimizer per chunk, so that a chunk's weights can be updated and sent while the
        # next chunk is computed (the optimizers are elementwise: the same numbers as one).
        self.spans = []
        self.optimizers = []
        for chunk in self.chunks:
            lo = chunk[0].shard_offset
            hi = chunk[-1].shard_offset + chunk[-1].numel
            self.spans.append((lo, hi))
            params = [self.weights[u.shard_offset : u.shard_offset + u.numel] for u in chunk]
            self.optimizers.append((params, build_optimizer(optim, params)))

    def load_optimizers(self, states: list, step: int, error=RdmaflowError) -> None:
        if len(states) != len(self.optimizers):
            raise error(f"checkpoint of step {step} has {len(states)} optimizer chunks, "
                               f"this shard {len(self.optimizers)} (another RDMAFLOW_PS_CHUNK_BYTES?)")
        for (_, opt), st in zip(self.optimizers, states):
            opt.load_state_dict(st)

    def start_hyper(self, optim: dict) -> None:
        """The hyperparameters in use: the job's, or those a checkpoint brought back."""
        desc = describe_optimizer(self.optimizers[0][1]) if self.optimizers else optim
        self.hyper_start = self.hyper_in_use = hyper_values(desc["hyper"], self.hyper_fields)

    def apply_chunk(self, k: int, grads: torch.Tensor, skip=()) -> None:
        """Runs the optimizer on chunk k; ``grads`` is laid out like the chunk's weights. The
        units at positions ``skip`` have no gradient: the optimizer leaves them alone."""
        params, opt = self.optimizers[k]
        lo = self.spans[k][0]
        for j, (p, u) in enumerate(zip(params, self.chunks[k])):
            p.grad = None if j in skip else grads[u.shard_offset - lo : u.shard_offset - lo + u.numel]
        opt.step()

    def skipped(self, records: list) -> list[set[int]] | None:
        """Per chunk, the positions of its units that no parameter with a gradient touches in the
        pushes of ``records`` (torch's optimizer skips a parameter whose grad is None); None if
        there are none."""
        if any(r is None for r in records):
            return None  # a push without a record has every gradient
        has = records[0][1].clone()
        for r in records[1:]:
            has |= r[1]
        if bool(has.all()):
            return None
        if self._skipped_for is not None and torch.equal(self._skipped_for[0], has):
            return self._skipped_for[1]  # a model's unused parameters are the same step after step
        with_grad = torch.zeros(len(has) + 1, dtype=torch.long)
        torch.cumsum(has, 0, out=with_grad[1:])  # parameters with a gradient before each index
        skip = [set(torch.nonzero(with_grad[hi] == with_grad[lo]).flatten().tolist()) for lo, hi in self.unit_params]
        skip = skip if any(skip) else None
        self._skipped_for = (has, skip)
        return skip

    def use_hyper(self, record) -> None:
        """Runs the optimizer with a record's hyperparameters; without them (no record, or the
        worker's are still the job's), with those it started with (the job's, or a checkpoint's)."""
        values = self.hyper_start if record is None or record[0] is None else record[0]
        if values == self.hyper_in_use:
            return
        for _, opt in self.optimizers:
            set_hyper(opt, self.hyper_fields, values)
        self.hyper_in_use = values

    def digest(self) -> str:
        """A hash of the units' weights and optimizer state (tests compare a backup's mirror with
        its primary)."""
        import hashlib

        h = hashlib.sha256(self.weights.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
        for _, opt in self.optimizers:
            for st in opt.state_dict()["state"].values():
                for key in sorted(st):
                    v = st[key]
                    h.update(key.encode())
                    h.update(v.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                             if isinstance(v, torch.Tensor) else repr(v).encode())
        return h.hexdigest()[:16]
