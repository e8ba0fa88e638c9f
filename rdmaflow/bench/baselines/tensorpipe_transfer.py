"""``tensorpipe`` of ``rdmaflow bench transfer``: ``torch.distributed.rpc`` (TensorPipe
backend), ``rpc_async(receiver, consume, args=(tensor,))`` with at most ``window`` calls in
flight. TensorPipe pickles :func:`consume` by reference: the receiver resolves it in this
module, which it imported to make its worker."""
from __future__ import annotations

import collections

from rdmaflow.bench._transfer_worker import CONSUMER, fill
from rdmaflow.bench.baselines import TENSORPIPE_OPTIONS


def consume(t):
    """Runs on the receiver, called by the sender through ``rpc_async``: reduce_max."""
    return CONSUMER.consume(t)


class TensorPipeWorker:
    def __init__(self, system: str, role: str, transport: str, port: int, timeout: float) -> None:
        from torch.distributed import rpc

        self.rpc = rpc
        transports, channels = TENSORPIPE_OPTIONS[transport]
        opts = rpc.TensorPipeRpcBackendOptions(
            init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=timeout, num_worker_threads=4,
            _transports=transports, _channels=channels)
        rank = 0 if role == "sender" else 1
        rpc.init_rpc(role, rank=rank, world_size=2, rpc_backend_options=opts)
        self.info = {"transports": transports, "channels": channels}

    def recv(self, cmd: dict, ready) -> dict:
        return CONSUMER.receive(cmd, ready)

    def send(self, cmd: dict) -> dict:
        import torch

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        timeout = cmd["timeout"]
        src = fill(torch.empty(size // 4, dtype=torch.float32), tag)
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
