"""``gloo`` of ``rdmaflow bench latency``: ``torch.distributed`` gloo ``send``/``recv`` into
preallocated tensors, a message back for every message (TCP on every transport: gloo has no
shared-memory transport). The process group is :class:`.gloo_transfer.GlooWorker`'s."""
from __future__ import annotations

from rdmaflow.bench._latency_worker import marker, other, round_trips, wrong
from rdmaflow.bench.baselines.gloo_transfer import GlooWorker


class GlooLatencyWorker(GlooWorker):
    def __init__(self, system: str, role: str, transport: str, port: int, timeout: float) -> None:
        super().__init__(system, role, transport, port, timeout)
        self.role = role
        self.peer_rank = 1 if role == "sender" else 0
        self.buffers: dict[int, tuple] = {}  # size -> (source, destination)

    def _buffers(self, cmd: dict):
        import torch

        size = cmd["size"]
        if size not in self.buffers:
            self.buffers[size] = (torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8))
        src, dst = self.buffers[size]
        src.fill_(marker(cmd["tag"], self.role))
        return src, dst

    def pong(self, cmd: dict, ready) -> dict:
        src, dst = self._buffers(cmd)
        ready()
        for _ in range(cmd["count"]):
            self.dist.recv(dst, src=self.peer_rank)
            self.dist.send(src, dst=self.peer_rank)
        return {"bad": wrong(dst, cmd["tag"], other(self.role)) if cmd["count"] else 0}

    def ping(self, cmd: dict) -> dict:
        src, dst = self._buffers(cmd)

        def one() -> None:
            self.dist.send(src, dst=self.peer_rank)
            self.dist.recv(dst, src=self.peer_rank)

        times = round_trips(cmd["count"], one)
        return {"one_way_us": times, "bad": wrong(dst, cmd["tag"], other(self.role)) if times else 0}
