"""``memcpy`` of ``rdmaflow bench transfer``: single-thread ``dst.copy_(src)`` of the same
size in one process, the machine's ceiling."""
from __future__ import annotations

from rdmaflow.bench._transfer_worker import fill, marker, now


class MemcpyWorker:
    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        self.info = {"threads": torch.get_num_threads()}
        self._src = self._dst = None

    def _buffers(self, numel: int):
        import torch

        # One pair of buffers, grown to the largest size seen: no page faults per measurement.
        if self._src is None or self._src.numel() < numel:
            self._src = self._dst = None
            self._src = torch.empty(numel, dtype=torch.float32).fill_(1.0)
            self._dst = torch.empty(numel, dtype=torch.float32).fill_(0.0)
        return self._src[:numel], self._dst[:numel]

    def memcpy(self, cmd: dict) -> dict:
        size, count, loops, tag = cmd["size"], cmd["count"], cmd.get("loops", 3), cmd.get("tag", 0)
        src, dst = self._buffers(size // 4)
        fill(src, tag)
        dst.copy_(src)  # warm
        best: list[float] | None = None
        for _ in range(loops):
            stamps = [now()]
            for _ in range(count):
                dst.copy_(src)
                stamps.append(now())
            if best is None or stamps[-1] - stamps[0] < best[-1] - best[0]:
                best = stamps
        return {"times": best, "bad": int(float(dst.max()) != marker(tag))}

    def close(self) -> None:
        pass
