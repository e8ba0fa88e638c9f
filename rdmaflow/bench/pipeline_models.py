"""The models of ``rdmaflow bench pipeline``, fixed so that results compare across runs,
with their batches, split points and loss.

- ``comm`` (communication-bound): every stage one residual block of LayerNorm, GELU and
  elementwise ops over float32 activations of [32, 32768] (4 MiB per microbatch).
- ``compute`` (compute-bound): every stage four ``Linear(2048, 2048)`` with ReLU, microbatch 64.
- ``varlen``: a small pre-norm transformer whose sequence length changes every batch, drawn
  from a fixed seed in [16, 512] (``Dim("seq", min=16, max=512)``); the systems that cannot
  carry a changing shape run it padded to 512, and the loss covers only the batch's real
  positions, so padded and unpadded training compute the same gradients (attention is causal:
  padding at the end changes no real position's output).

Each model's ``split_spec`` cuts it into ``stages`` stages with ``SplitPoint.BEGINNING`` at
module names, the convention of both ``rdmaflow.graph`` and ``torch.distributed.pipelining``.
The transformer's ``Block`` is also the one tests/graph_jobs/train.py trains.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

MODELS = ("comm", "compute", "varlen")
MICROBATCHES = 8

COMM_ROWS, COMM_WIDTH = 32, 32768      # one microbatch: [32, 32768] float32 = 4 MiB
COMPUTE_ROWS, COMPUTE_WIDTH, COMPUTE_LAYERS = 64, 2048, 4
SEQ_MIN, SEQ_MAX = 16, 512
VARLEN_ROWS, VARLEN_IN, VARLEN_OUT, VARLEN_D_MODEL, VARLEN_HEADS = 4, 8, 4, 16, 2


class ResidualNorm(torch.nn.Module):
    """x + GELU(LayerNorm(x)) * gain + shift: memory-bound elementwise work over a wide row."""

    def __init__(self, width: int):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.gain = torch.nn.Parameter(torch.full((width,), 0.5))
        self.shift = torch.nn.Parameter(torch.zeros(width))

    def forward(self, x):
        return x + torch.nn.functional.gelu(self.norm(x)) * self.gain + self.shift


class LinearStack(torch.nn.Module):
    """``layers`` × (Linear(width, width), ReLU)."""

    def __init__(self, width: int, layers: int):
        super().__init__()
        self.layers = torch.nn.Sequential(*(m for _ in range(layers)
                                            for m in (torch.nn.Linear(width, width), torch.nn.ReLU())))

    def forward(self, x):
        return self.layers(x)


class Block(torch.nn.Module):
    """A pre-norm transformer block: causal multi-head self-attention, then an MLP, each residual."""

    def __init__(self, d_model: int, heads: int):
        super().__init__()
        self.d_model, self.heads = d_model, heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(d_model), torch.nn.LayerNorm(d_model)
        self.qkv, self.proj = torch.nn.Linear(d_model, 3 * d_model), torch.nn.Linear(d_model, d_model)
        self.fc1, self.fc2 = torch.nn.Linear(d_model, 2 * d_model), torch.nn.Linear(2 * d_model, d_model)

    def forward(self, x):
        b, s, _ = x.shape
        d, h = self.d_model, self.heads
        q, k, v = (t.view(b, s, h, d // h).transpose(1, 2) for t in self.qkv(self.ln1(x)).split(d, dim=-1))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


class Transformer(torch.nn.Module):
    """[batch, length, n_in] -> [batch, length, n_out]; the length may change from batch to batch."""

    def __init__(self, n_in: int, d_model: int, heads: int, blocks: int, n_out: int):
        super().__init__()
        self.embed = torch.nn.Linear(n_in, d_model)
        self.blocks = torch.nn.Sequential(*(Block(d_model, heads) for _ in range(blocks)))
        self.head = torch.nn.Linear(d_model, n_out)

    def forward(self, x):
        return self.head(self.blocks(self.embed(x)))


@dataclass(frozen=True)
class Workload:
    """One benchmark model cut into ``stages``: how to build it, its batches and its loss."""
    name: str
    stages: int
    seed: int = 0

    @property
    def microbatch_rows(self) -> int:
        return {"comm": COMM_ROWS, "compute": COMPUTE_ROWS, "varlen": VARLEN_ROWS}[self.name]

    @property
    def batch_rows(self) -> int:
        return self.microbatch_rows * MICROBATCHES

    @property
    def varlen_blocks(self) -> int:
        return max(4, self.stages)

    def model(self) -> torch.nn.Module:
        torch.manual_seed(self.seed)
        if self.name == "comm":
            return torch.nn.Sequential(*(ResidualNorm(COMM_WIDTH) for _ in range(self.stages)))
        if self.name == "compute":
            return torch.nn.Sequential(*(LinearStack(COMPUTE_WIDTH, COMPUTE_LAYERS) for _ in range(self.stages)))
        if self.name == "varlen":
            return Transformer(VARLEN_IN, VARLEN_D_MODEL, VARLEN_HEADS, self.varlen_blocks, VARLEN_OUT)
        raise ValueError(f"unknown model {self.name!r}; one of {', '.join(MODELS)}")

    def split_names(self) -> list[str]:
        """The modules each stage after the first begins with."""
        if self.name == "varlen":
            return [f"blocks.{i * self.varlen_blocks // self.stages}" for i in range(1, self.stages)]
        return [str(i) for i in range(1, self.stages)]

    def lengths(self, steps: int) -> list[int]:
        """The sequence length of each step (varlen), from the fixed seed; 0 for the other models."""
        rng = random.Random(self.seed * 1000003 + 15)
        return [rng.randint(SEQ_MIN, SEQ_MAX) if self.name == "varlen" else 0 for _ in range(steps)]

    def batch(self, step: int, length: int, pad_to: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step``'s (inputs, target); varlen: ``length`` real positions, zero-padded to
        ``pad_to`` when given."""
        g = torch.Generator().manual_seed(self.seed * 7919 + step)
        n = self.batch_rows
        if self.name == "comm":
            return torch.randn(n, COMM_WIDTH, generator=g), torch.randn(n, COMM_WIDTH, generator=g)
        if self.name == "compute":
            return torch.randn(n, COMPUTE_WIDTH, generator=g), torch.randn(n, COMPUTE_WIDTH, generator=g)
        x = torch.randn(n, length, VARLEN_IN, generator=g)
        y = torch.randn(n, length, VARLEN_OUT, generator=g)
        if pad_to is not None and pad_to > length:
            x = torch.nn.functional.pad(x, (0, 0, 0, pad_to - length))
            y = torch.nn.functional.pad(y, (0, 0, 0, pad_to - length))
        return x, y

    def example(self, length: int = 64) -> torch.Tensor:
        """One microbatch of inputs to capture the model with (varlen: of ``length`` positions)."""
        x, _ = self.batch(0, length)
        return x[: self.microbatch_rows]

    def dynamic_shapes(self):
        if self.name != "varlen":
            return None
        return ({1: torch.export.Dim("seq", min=SEQ_MIN, max=SEQ_MAX)},)


def masked_mse(real_length: list[int]):
    """The loss of every system: mean squared error over the first ``real_length[0]`` positions
    of a sequence (all of them without a length), so that padding adds nothing to it."""
    def loss_fn(output, target):
        n = real_length[0]
        if n and output.dim() == 3:
            output, target = output[:, :n], target[:, :n]
        return torch.nn.functional.mse_loss(output, target)
    return loss_fn
