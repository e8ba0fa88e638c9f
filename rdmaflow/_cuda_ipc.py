"""The same-host GPU path: CUDA IPC handles for a GPU arena, and mapping a peer's.

A peer on this host maps a GPU arena through CUDA IPC and moves the data with a copy kernel on
its own stream, as the same-host path does for host memory with a CPU copy: UCX's cuda_ipc put
moves about 0.6 of a kernel's bandwidth within one GPU, and its reads are off on GPUs without
NVLink (docs/transfer.md, "GPU tensors").
"""
from __future__ import annotations

import os

import torch

from rdmaflow._core import RdmaflowError, cuda_ipc_export, cuda_ipc_open

GPU_IPC_ENV = "RDMAFLOW_GPU_IPC"  # 0: GPU memory of same-host peers only through UCX


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def gpu_ipc_info(base: int, nbytes: int, cuda_device: torch.device) -> dict | None:
    """What a peer on this host needs to map the GPU memory at ``base`` (``nbytes`` of it, on
    ``cuda_device``: a GPU arena); None where CUDA IPC cannot export it (the peer then goes
    through UCX) or $RDMAFLOW_GPU_IPC is 0."""
    if os.environ.get(GPU_IPC_ENV, "1").strip() == "0":
        return None
    try:
        handle, offset = cuda_ipc_export(base, cuda_device.index)
    except RdmaflowError:
        return None
    return {"handle": handle.hex(), "offset": offset, "nbytes": nbytes, "boot_id": _boot_id()}


class _Mapped:
    """GPU memory as torch.as_tensor takes it (a peer's arena, mapped for the process's life)."""

    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "version": 2}


def map_gpu_ipc(info, nbytes: int) -> torch.Tensor | None:
    """A uint8 CUDA tensor over a peer's GPU arena described by ``info`` (:func:`gpu_ipc_info`),
    opened on the current CUDA device; None when the peer is on another host, its arena cannot be
    mapped, ``info`` does not describe ``nbytes`` (the size its authenticated descriptor says), or
    $RDMAFLOW_GPU_IPC is 0: the caller then goes through UCX."""
    if (not isinstance(info, dict) or os.environ.get(GPU_IPC_ENV, "1").strip() == "0"
            or not torch.cuda.is_available() or info.get("boot_id") != _boot_id()
            or info.get("nbytes") != nbytes):
        return None
    here = torch.device("cuda", torch.cuda.current_device())
    try:
        base = cuda_ipc_open(bytes.fromhex(str(info["handle"])), here.index)
        return torch.as_tensor(_Mapped(base + int(info["offset"]), nbytes), device=here)
    except (RdmaflowError, ValueError, KeyError, TypeError, RuntimeError):
        return None
