"""rdmaflow as a torch.distributed backend: ``import rdmaflow.distributed`` registers "rdmaflow".

    import rdmaflow.distributed  # noqa: F401
    torch.distributed.init_process_group("rdmaflow")          # torchrun, env://, or any store
    group = torch.distributed.new_group(backend="rdmaflow")   # sub-groups too

Point to point (send, recv, isend, irecv, batch_isend_irecv, recv from any source) and the
collectives move host tensors over the transfer layer's pairs, one-sided (docs/distributed.md).
The backend is a Python ``ProcessGroup``: it replaces the whole group, so device-backend
strings such as "cpu:rdmaflow,cuda:nccl" are refused (they need a C++ c10d backend).
"""
from __future__ import annotations

import sys

import torch.distributed as dist

from rdmaflow import InvalidArgumentError
from rdmaflow.distributed.group import BACKEND, ProcessGroupRdmaflow, UnsupportedOpError
from rdmaflow.distributed.mailbox import COLLECTIVE_TAG
from rdmaflow.distributed.work import Work

__all__ = ["BACKEND", "COLLECTIVE_TAG", "ProcessGroupRdmaflow", "UnsupportedOpError", "Work", "register"]


def _mixed_backend() -> str | None:
    """The device-backend string c10d is making a group for, when it names another backend
    beside rdmaflow (found in the caller's frames: c10d passes the creator no backend)."""
    frame = sys._getframe(2)
    while frame is not None:
        config = frame.f_locals.get("backend_config")
        if config is not None and hasattr(config, "get_device_backend_map"):
            backends = {str(b).lower() for b in config.get_device_backend_map().values()}
            if backends != {BACKEND}:
                return str(config)
            return None
        frame = frame.f_back
    return None


def _create(opts, backend_options=None) -> ProcessGroupRdmaflow:
    mixed = _mixed_backend()
    if mixed is not None:
        raise InvalidArgumentError(
            f"the rdmaflow backend cannot share a group with other backends ({mixed}): it is a Python "
            "ProcessGroup, which c10d uses as the whole group; a device-backend string such as "
            "'cpu:rdmaflow,cuda:nccl' would need a C++ c10d backend. Use backend='rdmaflow' for a group of host "
            "tensors, and another group (new_group(backend='nccl')) for CUDA tensors")
    return ProcessGroupRdmaflow(opts.store, opts.group_rank, opts.group_size, opts.timeout,
                                group_name=str(getattr(opts, "group_id", "") or ""))


def register() -> None:
    """Registers the "rdmaflow" backend with torch.distributed (done on import; again: no-op)."""
    if BACKEND.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu"])


register()
