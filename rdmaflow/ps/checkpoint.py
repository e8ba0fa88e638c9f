"""Shard checkpoints: each shard's weights and optimizer state after a synchronous step.

Layout of a checkpoint directory::

    step-00000100/shard-0-of-2.pt    {"step", "shard", "num_shards", "fingerprint", "weights", "optimizer"}
    step-00000100/shard-1-of-2.pt

A file is written under a temporary name and renamed, so a file that exists is whole; a step
is complete when every shard's file exists. ``rdmaflow launch --resume`` (RDMAFLOW_RESUME=1)
restarts from the latest complete step. The fingerprint (model spec digest, placement policy,
block size, number of shards, optimizer) must match the resumed job's, since a shard's weights
are a slice of the flat parameter space that only the same plan cuts the same way.
"""
from __future__ import annotations

import os
import re

import torch

from rdmaflow import InvalidArgumentError

_STEP = re.compile(r"^step-(\d+)$")
RESUME_ENV = "RDMAFLOW_RESUME"  # set to 1 by ``rdmaflow launch --resume``


def resuming() -> bool:
    """Whether this job was started to resume from its latest checkpoint."""
    return os.environ.get(RESUME_ENV, "") not in ("", "0")


def step_dir(root: str, step: int) -> str:
    return os.path.join(root, f"step-{step:08d}")


def shard_file(root: str, step: int, shard: int, num_shards: int) -> str:
    return os.path.join(step_dir(root, step), f"shard-{shard}-of-{num_shards}.pt")


def unwritable(root: str) -> str | None:
    """Why no checkpoint could be written under ``root`` (created if missing), or None: a shard
    asks at setup, so that a job learns it at its start, not at its first checkpoint."""
    try:
        os.makedirs(root, exist_ok=True)
        probe = os.path.join(root, f".probe-{os.getpid()}")
        with open(probe, "wb"):
            pass
        os.remove(probe)
    except OSError as e:
        return f"{type(e).__name__}: {e.strerror or e}"
    return None


def write_whole(obj, path: str) -> None:
    """torch.save(obj) to ``path`` under a temporary name, then renamed: a file that exists is
    whole, and one that was there before is replaced only by a whole one."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read(path: str, what: str) -> dict:
    """The dict torch.save wrote to ``path`` (tensors and plain values only), or
    InvalidArgumentError naming ``what`` and the path when it is missing or unreadable."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise InvalidArgumentError(f"{what} {path} is missing") from None
    except Exception as e:  # noqa: BLE001 - a truncated or foreign file
        raise InvalidArgumentError(f"{what} {path} is unreadable: {e}") from None
    if not isinstance(state, dict):
        raise InvalidArgumentError(f"{what} {path} holds a {type(state).__name__}, not what rdmaflow writes")
    return state


def save(root: str, step: int, shard: int, num_shards: int, fingerprint: dict, weights: torch.Tensor,
         optimizer_state: dict) -> str:
    path = shard_file(root, step, shard, num_shards)
    # A copy: the weights are a view into the registered arena, and torch.save writes a view's
    # whole storage. In host memory, also from a shard on a GPU.
    write_whole({"step": step, "shard": shard, "num_shards": num_shards, "fingerprint": fingerprint,
                 "weights": weights.detach().to("cpu", copy=True), "optimizer": optimizer_state}, path)
    return path


def steps(root: str, num_shards: int) -> list[int]:
    """The complete checkpoints' steps, ascending."""
    if not os.path.isdir(root):
        return []
    out = []
    for name in os.listdir(root):
        m = _STEP.match(name)
        if m and all(os.path.exists(shard_file(root, int(m.group(1)), s, num_shards)) for s in range(num_shards)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest(root: str, num_shards: int) -> int | None:
    found = steps(root, num_shards)
    return found[-1] if found else None


def load(root: str, step: int, shard: int, num_shards: int, fingerprint: dict) -> dict:
    path = shard_file(root, step, shard, num_shards)
    state = read(path, "checkpoint")
    if state.get("fingerprint") != fingerprint:
        raise InvalidArgumentError(
            f"checkpoint {path} was written by a different job: {state.get('fingerprint')} there, "
            f"{fingerprint} here (the model, placement, block size, shard count and optimizer must match)")
    return state
