"""``tensorpipe`` of ``rdmaflow bench latency``: ``torch.distributed.rpc`` (TensorPipe backend)
``rpc_sync(receiver, echo, args=(tensor,))``: the tensor goes to the receiver and comes back
as the reply. The RPC agent is :class:`.tensorpipe_transfer.TensorPipeWorker`'s; TensorPipe
pickles :func:`echo` by reference, so the receiver resolves it in this module."""
from __future__ import annotations

from rdmaflow.bench._latency_worker import marker, other, round_trips, wrong
from rdmaflow.bench._transfer_worker import CONSUMER
from rdmaflow.bench.baselines.tensorpipe_transfer import TensorPipeWorker


def echo(t):
    """Runs on the receiver, called by the sender through ``rpc_sync``: counts the call and
    sends the tensor back."""
    CONSUMER.consume(t)
    return t


class TensorPipeLatencyWorker(TensorPipeWorker):
    def __init__(self, system: str, role: str, transport: str, port: int, timeout: float) -> None:
        super().__init__(system, role, transport, port, timeout)
        self.role = role
        self.sources: dict[int, object] = {}

    def pong(self, cmd: dict, ready) -> dict:
        # The sender's tensor comes back to it: its own check covers both directions.
        CONSUMER.receive(dict(cmd, reduce=False), ready)
        return {"bad": 0}

    def ping(self, cmd: dict) -> dict:
        import torch

        size, timeout = cmd["size"], cmd["timeout"]
        src = self.sources.setdefault(size, torch.empty(size, dtype=torch.uint8))
        src.fill_(marker(cmd["tag"], self.role))
        last = []

        def one() -> None:
            last[:] = [self.rpc.rpc_sync(other(self.role), echo, args=(src,), timeout=timeout)]

        times = round_trips(cmd["count"], one)
        return {"one_way_us": times, "bad": wrong(last[0], cmd["tag"], self.role) if last else 0}
