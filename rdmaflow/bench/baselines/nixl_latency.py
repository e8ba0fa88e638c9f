"""``nixl`` of ``rdmaflow bench latency``: NIXL (NVIDIA's one-sided transfer library on UCX)
WRITE with a notification, host memory, a WRITE back for every notification received.

Set up as NIXL is fastest on a small host (docs/benchmarks.md): the Python agent's progress
thread is off (it spins and starves a 2-core machine), so the caller polls the transfer's
state and the notifications, which drives UCX's progress; the UCX backend is made with
``ucx_error_handling_mode: none``, which lets notifications use shared memory (its default,
"peer", sends them over TCP). NIXL's UCX is its own (bundled in the ``nixl-cu12`` wheel); it
reads the same ``UCX_TLS``/``UCX_NET_DEVICES`` as rdmaflow, so both run on the transport's
environment.

Each process registers one buffer of ``2 * max_size`` bytes: the first half is what it
sends, the second what its peer writes. Metadata goes through the benchmark driver: the hello
carries this agent's name, its metadata and where its landing half is; ``peer`` in a command
is the other agent's hello. One prepared WRITE per size is reposted every round trip (a
handle is reposted only once its previous post is done).
"""
from __future__ import annotations

import base64
import contextlib
import os

from rdmaflow.bench._latency_worker import marker, other, round_trips, wrong
from rdmaflow.deadline import Deadline

NOTIF = b"rdmaflow-bench"


class NixlLatencyWorker:
    def __init__(self, role: str, max_size: int) -> None:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        self.role = role
        self.name = f"rdmaflow-bench-{role}-{os.getpid()}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        self.max_size = max_size
        self.buf = torch.zeros(2 * max_size, dtype=torch.uint8)
        self.reg = self.agent.register_memory(self.buf)
        self.info = {"agent": self.name, "addr": self.buf.data_ptr() + max_size,
                     "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}
        self.peers: set[str] = set()
        self.handles: dict[int, object] = {}  # size -> prepared WRITE to the peer
        self.notes = 0  # notifications received and not yet consumed

    def _handle(self, cmd: dict):
        size, peer = cmd["size"], cmd["peer"]
        if size > self.max_size:
            raise ValueError(f"size {size} exceeds this worker's --max-size {self.max_size}")
        if peer["agent"] not in self.peers:
            self.agent.add_remote_agent(base64.b64decode(peer["metadata"]))
            self.agent.make_connection(peer["agent"])
            self.peers.add(peer["agent"])
        h = self.handles.get(size)
        if h is None:
            local = self.agent.get_xfer_descs([(self.buf.data_ptr(), size, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(peer["addr"], size, 0)], "DRAM")
            h = self.handles[size] = self.agent.initialize_xfer("WRITE", local, remote, peer["agent"], NOTIF)
        self.buf[:size].fill_(marker(cmd["tag"], self.role))
        return h

    def _poll(self, handle, posted: bool) -> bool:
        """One look: counts the notifications that came in; whether ``handle``'s post (if
        ``posted``) is still in flight."""
        for msgs in self.agent.get_new_notifs().values():
            self.notes += len(msgs)
        if not posted:
            return False
        state = self.agent.check_xfer_state(handle)
        if state == "ERR":
            raise RuntimeError("NIXL reported an error on the WRITE")
        return state != "DONE"

    def _exchange(self, handle, deadline: Deadline, answer: bool) -> None:
        """ping (``answer`` False): post, then wait until the post is done and the peer's
        message came. pong (``answer`` True): wait for the peer's message, then post the
        answer and wait until that post is done."""
        while answer and self.notes == 0:
            self._poll(handle, False)
            if deadline.passed():
                raise TimeoutError("no NIXL notification in time")
        state = self.agent.transfer(handle)
        if state == "ERR":
            raise RuntimeError("NIXL could not post the WRITE")
        posted = state != "DONE"
        while posted or self.notes == 0:
            posted = self._poll(handle, posted)
            if deadline.passed():
                raise TimeoutError("NIXL WRITE or notification did not come in time")
        self.notes -= 1

    def pong(self, cmd: dict, ready) -> dict:
        h = self._handle(cmd)
        ready()
        deadline = Deadline(cmd["timeout"])
        for _ in range(cmd["count"]):
            self._exchange(h, deadline, True)
        size = cmd["size"]
        return {"bad": wrong(self.buf[self.max_size:self.max_size + size], cmd["tag"], other(self.role))}

    def ping(self, cmd: dict) -> dict:
        h = self._handle(cmd)
        deadline = Deadline(cmd["timeout"])
        times = round_trips(cmd["count"], lambda: self._exchange(h, deadline, False))
        size = cmd["size"]
        return {"one_way_us": times,
                "bad": wrong(self.buf[self.max_size:self.max_size + size], cmd["tag"], other(self.role))}

    def close(self) -> None:
        # Best effort (NIXL raises its own errors): the process exits next.
        with contextlib.suppress(Exception):
            for h in self.handles.values():
                h.release()
            self.handles.clear()
            self.agent.deregister_memory(self.reg)
