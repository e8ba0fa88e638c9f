"""rdmaflow: one-sided RDMA tensor transfer for distributed deep learning, over UCX.

Layers (a lower one never imports a higher one):
  rdmaflow._core    C++ device library: Device, MemRegion, Channel, memcpy (seed 000 §3.1)
  rdmaflow.device   the Python face of the device, with torch tensor views
  rdmaflow.bench, rdmaflow.cli   benchmarks and the ``rdmaflow`` command
"""
from rdmaflow import _ucx

_ucx.load()

from rdmaflow._core import (  # noqa: E402
    ArenaFullError,
    AuthError,
    DeviceClosedError,
    Direction,
    Future,
    InvalidArgumentError,
    OutOfBoundsError,
    PeerError,
    RdmaflowError,
    RegionError,
    RemoteRegion,
    TimeoutError,
    ucx_version,
)
from rdmaflow.device import Channel, Device, MemRegion, wait_all  # noqa: E402

WRITE = Direction.WRITE
READ = Direction.READ

__version__ = "0.1.0"

__all__ = [
    "ArenaFullError",
    "AuthError",
    "Channel",
    "Device",
    "DeviceClosedError",
    "Direction",
    "Future",
    "InvalidArgumentError",
    "MemRegion",
    "OutOfBoundsError",
    "PeerError",
    "READ",
    "RdmaflowError",
    "RegionError",
    "RemoteRegion",
    "TimeoutError",
    "WRITE",
    "ucx_version",
    "wait_all",
]
