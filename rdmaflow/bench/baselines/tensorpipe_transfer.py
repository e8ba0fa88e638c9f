"""``tensorpipe`` of ``rdmaflow bench transfer``: ``torch.distributed.rpc`` (TensorPipe
backend), ``rpc_async(receiver, consume, args=(tensor,))`` with at most ``window`` calls in
flight. TensorPipe pickles :func:`consume` by reference: the receiver resolves it in this
module, which it imported to make its worker.

With ``--device cuda`` the tensors are CUDA tensors and travel GPU to GPU through TensorPipe's
CUDA channels (:data:`~rdmaflow.bench.baselines.TENSORPIPE_CUDA_OPTIONS`: ``cuda_ipc`` between
two processes on one host): the sender's options map its device 0 to the receiver's device 0
(``set_device_map``), ``consume`` runs on the stream TensorPipe received on and returns None."""
from __future__ import annotations

import collections

from rdmaflow.bench._transfer_worker import CONSUMER, fill
from rdmaflow.bench.baselines import TENSORPIPE_CUDA_OPTIONS, TENSORPIPE_OPTIONS


def consume(t):
    """Runs on the receiver, called by the sender through ``rpc_async``: reduce_max."""
    return CONSUMER.consume(t)


class TensorPipeWorker:
    def __init__(self, system: str, role: str, transport: str, port: int, timeout: float,
                 device: str = "cpu") -> None:
        from torch.distributed import rpc

        self.rpc = rpc
        self.device = device
        cuda = device == "cuda"
        transports, channels = TENSORPIPE_CUDA_OPTIONS if cuda else TENSORPIPE_OPTIONS[transport]
        opts = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=timeout, num_worker_threads=4,
            _transports=transports, _channels=channels, **({"devices": [0]} if cuda else {}))
        if cuda and role == "sender":
            opts.set_device_map("receiver", {0: 0})  # CUDA tensors arrive on the receiver's GPU 0
        rank = 0 if role == "sender" else 1
        rpc.init_rpc(role, rank=rank, world_size=2, rpc_backend_options=opts)
        self.info = {"transports": transports, "channels": channels}

    def recv(self, cmd: dict, ready) -> dict:
        return CONSUMER.receive(cmd, ready)

    def send(self, cmd: dict) -> dict:
        import torch

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        timeout = cmd["timeout"]
        src = fill(torch.empty(size // 4, dtype=torch.float32, device=self.device), tag)
        pending: collections.deque = collections.deque()
        for _ in range(count):
            if len(pending) >= window:
                pending.popleft().wait()
            pending.append(self.rpc.rpc_async("receiver", consume, args=(src,), timeout=timeout))
        while pending:
            pending.popleft().wait()
        return {}

    def close(self) -> None:
        self.rpc.shutdown(graceful=True)
