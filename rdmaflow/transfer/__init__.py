"""Zero-copy tensor transfer over the device (seed 000 §3.2-§3.4).

- ``Arena`` / ``device.empty(shape, dtype)``: one registered region per device, carved up by an
  allocator, so tensors that will be sent are born in registered memory.
- ``StaticSender`` / ``StaticReceiver``: fixed shape and dtype, preallocated destination,
  one-sided WRITE of data, fence, flag; reused every iteration with no handshake.
- ``DynamicSender`` / ``DynamicReceiver``: any shape; fixed-size metadata written, the receiver
  allocates and READs the data.
"""
from rdmaflow.transfer.arena import Arena, arena_of, create_arena
from rdmaflow.transfer.dynamic import MAX_RANK, DynamicReceiver, DynamicSender
from rdmaflow.transfer.static import StaticReceiver, StaticSender

__all__ = [
    "Arena",
    "DynamicReceiver",
    "DynamicSender",
    "MAX_RANK",
    "StaticReceiver",
    "StaticSender",
    "arena_of",
    "create_arena",
]
