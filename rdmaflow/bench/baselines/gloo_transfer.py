"""``gloo`` of ``rdmaflow bench transfer``: ``torch.distributed`` gloo ``isend``/``irecv``
(TCP on every transport: gloo has no shared-memory transport); the receiver keeps ``window``
receives posted."""
from __future__ import annotations

import collections

from rdmaflow.bench._transfer_worker import fill, marker, now


class GlooWorker:
    def __init__(self, system: str, role: str, transport: str, port: int, timeout: float) -> None:
        import datetime

        import torch.distributed as dist

        self.dist = dist
        rank = 0 if role == "sender" else 1
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=timeout))
        self.info = {}

    def recv(self, cmd: dict, ready) -> dict:
        import torch

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        want = marker(tag)
        reduce = cmd.get("reduce", True)
        bufs = [torch.empty(size // 4, dtype=torch.float32) for _ in range(min(window, count))]
        # Keep `window` receives posted, as rdmaflow keeps `window` slots: the sender may run
        # that far ahead while the receiver reduces.
        works = [self.dist.irecv(b, src=0) for b in bufs]
        times: list[float] = []
        bad = 0
        ready()
        for i in range(count):
            j = i % len(bufs)
            works[j].wait()
            v = float(bufs[j].max()) if reduce else want
            times.append(now())
            bad += v != want
            if i + len(bufs) < count:
                works[j] = self.dist.irecv(bufs[j], src=0)
        return {"times": times, "bad": bad}

    def send(self, cmd: dict) -> dict:
        import torch

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        src = fill(torch.empty(size // 4, dtype=torch.float32), tag)
        pending: collections.deque = collections.deque()
        for _ in range(count):
            if len(pending) >= window:
                pending.popleft().wait()
            pending.append(self.dist.isend(src, dst=1))
        while pending:
            pending.popleft().wait()
        return {}

    def close(self) -> None:
        self.dist.destroy_process_group()
