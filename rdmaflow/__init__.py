"""rdmaflow: one-sided RDMA tensor transfer for distributed deep learning, over UCX.

Layers (a lower one never imports a higher one; upper layers take these names from here):
  rdmaflow._core, rdmaflow._ucx   the C++ device library (Device, MemRegion, Channel, memcpy)
  rdmaflow (device layer)         this package: device.py, arena.py, _cuda_ipc.py, _args.py,
                                  errors.py, deadline.py
  rdmaflow.transfer               zero-copy tensor transfer (static and dynamic placement)
  rdmaflow.ps                     the parameter server and key-value store
  rdmaflow.launch, rdmaflow.cli, rdmaflow.bench   the ``rdmaflow`` command and benchmarks
"""
from rdmaflow import _ucx

_ucx.load()

from rdmaflow._core import Direction, DirectWindow, receive_slot, ucx_version, wait_u64_at_least, wait_word
from rdmaflow.arena import Arena
from rdmaflow.device import Channel, Device, FlaggedWrites, Future, MemRegion, RemoteRegion, SameHost, wait_all
from rdmaflow.errors import (
    ArenaFullError,
    AuthError,
    DeviceClosedError,
    InvalidArgumentError,
    OutOfBoundsError,
    PeerError,
    RdmaflowError,
    RegionError,
    TimeoutError,
)

WRITE = Direction.WRITE
READ = Direction.READ

__version__ = "0.1.0"

__all__ = [
    "READ",
    "WRITE",
    "Arena",
    "ArenaFullError",
    "AuthError",
    "Channel",
    "Device",
    "DeviceClosedError",
    "DirectWindow",
    "Direction",
    "FlaggedWrites",
    "Future",
    "InvalidArgumentError",
    "MemRegion",
    "OutOfBoundsError",
    "PeerError",
    "RdmaflowError",
    "RegionError",
    "RemoteRegion",
    "SameHost",
    "TimeoutError",
    "receive_slot",
    "ucx_version",
    "wait_all",
    "wait_u64_at_least",
    "wait_word",
]
