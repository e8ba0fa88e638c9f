"""``memcpy`` of ``rdmaflow bench transfer``: single-thread ``dst.copy_(src)`` of the same
size in one process, the machine's ceiling.

``d2d-copy`` (``--device cuda``): the same with CUDA tensors on one GPU, a device-to-device
copy: ``count`` copies queued back to back on the current stream, each followed by a CUDA
event, so the per-copy times are the GPU's (no host clock, no launch gaps counted): the
ceiling of a transfer between two processes on that GPU."""
from __future__ import annotations

from rdmaflow.bench._transfer_worker import fill, marker, now


class MemcpyWorker:
    def __init__(self, device: str = "cpu") -> None:
        import torch

        torch.set_num_threads(1)
        self.device = device
        self.info = {"threads": torch.get_num_threads(), "device": device}
        if device == "cuda":
            self.info["gpu"] = torch.cuda.get_device_name()
        self._src = self._dst = None

    def _buffers(self, numel: int):
        import torch

        # One pair of buffers, grown to the largest size seen: no page faults per measurement.
        if self._src is None or self._src.numel() < numel:
            self._src = self._dst = None
            self._src = torch.empty(numel, dtype=torch.float32, device=self.device).fill_(1.0)
            self._dst = torch.empty(numel, dtype=torch.float32, device=self.device).fill_(0.0)
        return self._src[:numel], self._dst[:numel]

    def memcpy(self, cmd: dict) -> dict:
        size, count, loops, tag = cmd["size"], cmd["count"], cmd.get("loops", 3), cmd.get("tag", 0)
        src, dst = self._buffers(size // 4)
        fill(src, tag)
        dst.copy_(src)  # warm
        loop = self._cuda_loop if self.device == "cuda" else self._host_loop
        best: list[float] | None = None
        for _ in range(loops):
            stamps = loop(src, dst, count)
            if best is None or stamps[-1] - stamps[0] < best[-1] - best[0]:
                best = stamps
        return {"times": best, "bad": int(float(dst.max()) != marker(tag))}

    @staticmethod
    def _host_loop(src, dst, count: int) -> list[float]:
        stamps = [now()]
        for _ in range(count):
            dst.copy_(src)
            stamps.append(now())
        return stamps

    @staticmethod
    def _cuda_loop(src, dst, count: int) -> list[float]:
        """``count`` copies on the current stream; the instants (seconds) of the CUDA events
        around them, relative to the first."""
        import torch

        events = [torch.cuda.Event(enable_timing=True) for _ in range(count + 1)]
        events[0].record()
        for e in events[1:]:
            dst.copy_(src)
            e.record()
        events[-1].synchronize()
        return [0.0] + [events[0].elapsed_time(e) / 1e3 for e in events[1:]]

    def close(self) -> None:
        pass
