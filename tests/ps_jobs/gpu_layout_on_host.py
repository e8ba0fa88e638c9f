"""Runs tests/ps_jobs/train.py with the GPU memory layout of the parameter server, emulated in
host memory, so that machines without a GPU test it too (tests/test_ps_training.py).

Workers take the CUDA worker's path and shards the GPU shard's path (``shard_device="cuda"``),
with one change: what would be the process's GPU arena is a second registered host region. So
the gradients (and a worker's parameters, a shard's weights and gradient slots) live in another
region than the flags, as on a GPU: the layouts, offsets, word regions and weight copies are
those of the GPU paths; only UCX's CUDA transports and stream waits are not exercised.

Each process prints ``emulated GPU arena`` when it made one.
"""
from __future__ import annotations

import runpy
import sys

import numpy as np
import torch

import rdmaflow.device as device_module
import rdmaflow.ps.shard as shard_module
import rdmaflow.ps.worker as worker_module

OFFSET = 4096  # blocks start inside the region, not at its start, as an arena's may


class Block(np.ndarray):
    """An arena block: memory torch.as_tensor views, and its offset in the region."""

    offset: int


class HostArena:
    """The part of a GPU arena the parameter server uses, over a registered host region."""

    def __init__(self, dev, nbytes: int):
        self.region = dev.alloc_region(nbytes + 2 * OFFSET)
        self.cuda_device = torch.device("cpu")
        self._raw = self.region.tensor(torch.uint8, nbytes + 2 * OFFSET)

    def allocate(self, nbytes: int) -> Block:
        block = self._raw[OFFSET : OFFSET + nbytes].numpy().view(Block)
        block.offset = OFFSET
        return block


_create_arena = device_module.Device.create_arena


def create_arena(self, nbytes=None, device=None):
    if device is None:
        return _create_arena(self, nbytes)
    print("emulated GPU arena", flush=True)
    return HostArena(self, nbytes)


def main() -> None:
    device_module.Device.create_arena = create_arena
    worker_module.model_device = lambda named: torch.device("cpu")  # not None: the CUDA path
    worker_module.stream_done = shard_module.stream_done = lambda t: None
    script = sys.argv[1]
    sys.argv = [script]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
