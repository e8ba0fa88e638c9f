"""``nixl`` of ``rdmaflow bench latency``: NIXL (NVIDIA's one-sided transfer library on UCX)
WRITE with a notification, host memory, a WRITE back for every notification received. The
agent is set up as :mod:`.nixl_agent` describes (progress thread off, UCX backend with
``ucx_error_handling_mode: none``).

Each process registers one buffer of ``2 * max_size`` bytes: the first half is what it sends,
the second what its peer writes. One prepared WRITE per size is reposted every round trip (a
handle is reposted only once its previous post is done).
"""
from __future__ import annotations

from rdmaflow.bench._latency_worker import marker, other, round_trips, wrong
from rdmaflow.bench.baselines.nixl_agent import NixlAgentWorker
from rdmaflow.deadline import Deadline

NOTIF = b"rdmaflow-bench"


class NixlLatencyWorker(NixlAgentWorker):
    def __init__(self, role: str, max_size: int) -> None:
        super().__init__(role, 2 * max_size)
        self.max_size = max_size
        self.info["addr"] += max_size  # where the peer writes

    def _handle(self, cmd: dict):
        size = cmd["size"]
        if size > self.max_size:
            raise ValueError(f"size {size} exceeds this worker's --max-size {self.max_size}")
        h = self.write_handle(size, cmd["peer"], self.buf.data_ptr(), cmd["peer"]["addr"], size, NOTIF)
        self.buf[:size].fill_(marker(cmd["tag"], self.role))
        return h

    def _exchange(self, handle, deadline: Deadline, answer: bool) -> None:
        """ping (``answer`` False): post, then wait until the post is done and the peer's
        message came. pong (``answer`` True): wait for the peer's message, then post the
        answer and wait until that post is done."""
        if answer:
            self.wait_notes(1, deadline, "the peer's message")
        self.post(handle)
        self.wait_notes(1, deadline, "the peer's answer")
        self.wait_done(handle, deadline)
        self.notes -= 1

    def _landed(self, cmd: dict) -> int:
        """1 if some byte the peer wrote last is wrong."""
        return wrong(self.buf[self.max_size:self.max_size + cmd["size"]], cmd["tag"], other(self.role))

    def pong(self, cmd: dict, ready) -> dict:
        h = self._handle(cmd)
        ready()
        deadline = Deadline(cmd["timeout"])
        for _ in range(cmd["count"]):
            self._exchange(h, deadline, True)
        return {"bad": self._landed(cmd)}

    def ping(self, cmd: dict) -> dict:
        h = self._handle(cmd)
        deadline = Deadline(cmd["timeout"])
        times = round_trips(cmd["count"], lambda: self._exchange(h, deadline, False))
        return {"one_way_us": times, "bad": self._landed(cmd)}
