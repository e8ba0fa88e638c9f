"""``gloo`` of ``rdmaflow bench transfer``: ``torch.distributed`` gloo ``isend``/``irecv``
(TCP on every transport: gloo has no shared-memory transport); the receiver keeps ``window``
receives posted.

With ``--device cuda``: gloo sends host tensors only (no CUDA point-to-point), so CUDA tensors
travel through host staging, as a gloo user has to: the sender copies the CUDA tensor into one
of ``window`` preallocated host tensors (``copy_``, the strongest form of ``.cpu()``: no
allocation per tensor) and ``isend``s it; the receiver ``irecv``s into host tensors and copies
each to the GPU (``.to("cuda")``) before consuming it."""
from __future__ import annotations

import collections

from rdmaflow.bench._transfer_worker import consume, consume_mode, fill, marker


class GlooWorker:
    def __init__(self, system: str, role: str, transport: str, port: int, timeout: float,
                 device: str = "cpu") -> None:
        import datetime

        import torch.distributed as dist

        self.dist = dist
        self.device = device
        self.host: dict[int, list] = {}  # CUDA runs: size -> the host tensors it is staged in
        rank = 0 if role == "sender" else 1
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=timeout))
        self.info = {}

    def _buffers(self, size: int, n: int) -> list:
        """``n`` host tensors of ``size`` bytes: made once per size on CUDA runs (the staging
        buffers a CUDA program keeps), per measurement on host runs (as measured before)."""
        import torch

        if self.device != "cuda":
            return [torch.empty(size // 4, dtype=torch.float32) for _ in range(n)]
        bufs = self.host.get(size)
        if bufs is None or len(bufs) < n:
            bufs = self.host[size] = [torch.empty(size // 4, dtype=torch.float32) for _ in range(n)]
        return bufs[:n]

    def recv(self, cmd: dict, ready) -> dict:
        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        want = marker(tag)
        mode = consume_mode(cmd)
        bufs = self._buffers(size, min(window, count))
        # Keep `window` receives posted, as rdmaflow keeps `window` slots: the sender may run
        # that far ahead while the receiver consumes.
        works = [self.dist.irecv(b, src=0) for b in bufs]
        times: list[float] = []
        bad = 0
        ready()
        for i in range(count):
            j = i % len(bufs)
            works[j].wait()
            t = bufs[j].to("cuda") if self.device == "cuda" else bufs[j]
            t1, ok, _ = consume(t, mode, want, i == count - 1)
            times.append(t1)
            bad += not ok
            del t
            if i + len(bufs) < count:
                works[j] = self.dist.irecv(bufs[j], src=0)
        return {"times": times, "bad": bad}

    def send(self, cmd: dict) -> dict:
        import torch

        size, count, window, tag = cmd["size"], cmd["count"], cmd["window"], cmd["tag"]
        if self.device == "cuda":
            return self._send_staged(size, count, window, tag)
        src = fill(torch.empty(size // 4, dtype=torch.float32), tag)
        pending: collections.deque = collections.deque()
        for _ in range(count):
            if len(pending) >= window:
                pending.popleft().wait()
            pending.append(self.dist.isend(src, dst=1))
        while pending:
            pending.popleft().wait()
        return {}

    def _send_staged(self, size: int, count: int, window: int, tag: int) -> dict:
        import torch

        src = fill(torch.empty(size // 4, dtype=torch.float32, device="cuda"), tag)
        stages = self._buffers(size, window)
        sent: list = [None] * len(stages)
        for i in range(count):
            j = i % len(stages)
            if sent[j] is not None:
                sent[j].wait()  # its previous isend is done: the buffer may be rewritten
            stages[j].copy_(src)  # device to host, done when copy_ returns
            sent[j] = self.dist.isend(stages[j], dst=1)
        for w in sent:
            if w is not None:
                w.wait()
        return {}

    def close(self) -> None:
        self.dist.destroy_process_group()
