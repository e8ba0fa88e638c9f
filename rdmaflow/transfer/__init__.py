"""Zero-copy tensor transfer over the device (Xue et al., EuroSys '19, §3.2-§3.4).

- ``Arena`` / ``device.empty(shape, dtype)``: one registered region per device, carved up by an
  allocator, so tensors that will be sent are born in registered memory (``device.arena``,
  ``device.gpu_arena()``, ``device.create_arena``).
- ``StaticSender`` / ``StaticReceiver``: fixed shape and dtype, preallocated destination,
  one-sided WRITE of data, fence, flag; reused every iteration with no handshake.
- ``BoundedSender`` / ``BoundedReceiver``: fixed dtype, each dimension at most a declared maximum;
  a slot preallocated at the maxima, the actual shape written beside the data before the flag.
- ``DynamicSender`` / ``DynamicReceiver``: any shape; fixed-size metadata written, the receiver
  allocates and READs the data.
- ``receiver.poll()`` and ``wait_any(receivers)``: whether a transfer has landed, and the
  first of several to land; ``sender.has_credit()``: whether the next send finds its slot free.
  None of them blocks.

The building blocks the upper layers share: ``Word`` and ``wait_flag`` (8-byte flags in
registered memory and the one loop that waits on them), ``pack_header`` / ``unpack_header``
(what a receiver publishes under its name), and the dtype table (``FLOAT_DTYPES``,
``dtype_name``, ``dtype_code``).
"""
from rdmaflow.arena import Arena
from rdmaflow.transfer.bounded import SIZE_RECORD_BYTES, BoundedReceiver, BoundedSender
from rdmaflow.transfer.common import CTL_BYTES, FLAG_STRIDE, pack_header, unpack_header
from rdmaflow.transfer.dtypes import FLOAT_DTYPES, describe, dtype_code, dtype_name
from rdmaflow.transfer.dynamic import MAX_RANK, DynamicReceiver, DynamicSender
from rdmaflow.transfer.flag import Word, peer_failed, wait_any, wait_flag
from rdmaflow.transfer.static import StaticReceiver, StaticSender

__all__ = [
    "CTL_BYTES",
    "FLAG_STRIDE",
    "FLOAT_DTYPES",
    "MAX_RANK",
    "SIZE_RECORD_BYTES",
    "Arena",
    "BoundedReceiver",
    "BoundedSender",
    "DynamicReceiver",
    "DynamicSender",
    "StaticReceiver",
    "StaticSender",
    "Word",
    "describe",
    "dtype_code",
    "dtype_name",
    "pack_header",
    "peer_failed",
    "unpack_header",
    "wait_any",
    "wait_flag",
]
