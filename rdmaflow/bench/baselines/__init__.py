"""The systems rdmaflow is measured against, one module each.

``rdmaflow bench transfer`` (one-way tensor transfer; each module a worker class driven by
:mod:`rdmaflow.bench._transfer_worker`): :mod:`.grpc_transfer`, :mod:`.tensorpipe_transfer`,
:mod:`.gloo_transfer`, :mod:`.nixl_transfer`, :mod:`.memcpy`.

``rdmaflow bench latency`` (ping-pong; each a worker class driven by
:mod:`rdmaflow.bench._latency_worker`): :mod:`.gloo_latency`, :mod:`.tensorpipe_latency`,
:mod:`.nixl_latency`. Both NIXL peers set their agent up with :mod:`.nixl_agent`.

``rdmaflow bench train`` (one process of a training job; each module a ``run(cfg, me, wd)``
listed in :mod:`rdmaflow.bench.train_systems`): :mod:`.local`, :mod:`.ddp`,
:mod:`.tensorpipe_ps` and :mod:`.grpc_ps` (parameter servers built on :mod:`.sync_shard`).

``rdmaflow bench kv --sparse`` (an embedding table's pulls and pushes): :mod:`.dict_server`, a
dictionary of rows served over TensorPipe RPC and gRPC.

What they share is here: the gRPC channel options and the TensorPipe transports per
benchmark transport.
"""
from __future__ import annotations

#: gRPC messages of any size (a tensor's bytes can exceed the 4 MiB default).
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]

#: benchmark transport -> (TensorPipe transports, channels). "uv" is its libuv TCP transport,
#: "basic" sends tensor data over the transport's connection; "shm" is a shared-memory ring,
#: "cma" copies with process_vm_readv.
TENSORPIPE_OPTIONS = {
    "tcp": (["uv"], ["basic"]),
    "sm": (["shm", "uv"], ["cma", "basic"]),
}

#: CUDA tensors between two processes on one host (``bench transfer --device cuda``): the
#: ``cuda_ipc`` channel (the receiver copies from the sender's GPU memory through a CUDA IPC
#: handle), ``cuda_basic`` (through host memory) only where it is not viable, and the host
#: channels for the rest of a message. The list's order is the channels' priority.
TENSORPIPE_CUDA_OPTIONS = (["shm", "uv"], ["cuda_ipc", "cuda_basic", "cma", "basic"])
