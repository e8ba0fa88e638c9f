"""The library's exceptions. The C++ core raises them; the Python layers raise the same ones.

    RdmaflowError (RuntimeError)
    ├── InvalidArgumentError (ValueError)    bad input, named in the message
    ├── OutOfBoundsError (IndexError)        an offset or size outside a region
    ├── PeerError (ConnectionError)          a peer died or cannot be reached
    │   └── AuthError                        the peer does not know the job secret
    ├── RegionError                          a freed or unknown region
    ├── DeviceClosedError                    the device is closed
    ├── TimeoutError (TimeoutError)          a bounded wait ran out
    └── ArenaFullError (MemoryError)         the registered arena has no room
"""
from rdmaflow._core import (
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

__all__ = [
    "ArenaFullError",
    "AuthError",
    "DeviceClosedError",
    "InvalidArgumentError",
    "OutOfBoundsError",
    "PeerError",
    "RdmaflowError",
    "RegionError",
    "TimeoutError",
]
