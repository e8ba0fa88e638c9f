"""What the NIXL peers of ``bench latency`` and ``bench transfer`` share: an agent set up the
way NIXL is fastest on a small host, one registered host buffer, the peer's metadata, and the
notifications counted as they come.

* The Python agent's progress thread is off: it spins and starves a 2-core machine. The
  caller polls instead (``check_xfer_state``, ``get_new_notifs``), which drives UCX's progress;
  without it a tcp transfer only moves while someone polls.
* The UCX backend is made with ``ucx_error_handling_mode: none``, which lets notifications use
  shared memory (its default, "peer", sends them over TCP).
* NIXL's UCX is its own (bundled in the ``nixl-cu12`` wheel); it reads the same ``UCX_TLS`` and
  ``UCX_NET_DEVICES`` as rdmaflow, so both run on the transport's environment.

Metadata goes through the benchmark driver: a worker's hello carries its agent's name, its
metadata (base64) and the address of its buffer; ``peer`` in a command is the other's hello.
"""
from __future__ import annotations

import base64
import contextlib
import os

from rdmaflow.deadline import Deadline


class NixlAgentWorker:
    """A NIXL agent with ``buf`` (a torch tensor of ``nbytes`` bytes, dtype ``dtype``) registered."""

    def __init__(self, role: str, nbytes: int, dtype=None) -> None:
        import torch
        from nixl._api import nixl_agent, nixl_agent_config

        dtype = dtype or torch.uint8
        self.role = role
        self.name = f"rdmaflow-bench-{role}-{os.getpid()}"
        self.agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=False, backends=[]))
        self.agent.create_backend("UCX", {"ucx_error_handling_mode": "none"})
        self.buf = torch.zeros(max(1, nbytes // dtype.itemsize), dtype=dtype)
        self.reg = self.agent.register_memory(self.buf)
        self.info = {"agent": self.name, "addr": self.buf.data_ptr(),
                     "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode()}
        self.peers: set[str] = set()
        self.handles: dict = {}  # key -> prepared WRITE
        self.inflight: list = []  # handles posted and not yet seen done
        self.notes = 0  # notifications received and not yet consumed
        self.expect: bytes | None = None  # count only notifications with this message (None: all)

    def connect(self, peer: dict) -> str:
        """Loads the peer's metadata (once) and connects; its agent name."""
        if peer["agent"] not in self.peers:
            self.agent.add_remote_agent(base64.b64decode(peer["metadata"]))
            self.agent.make_connection(peer["agent"])
            self.peers.add(peer["agent"])
        return peer["agent"]

    def write_handle(self, key, peer: dict, local_addr: int, remote_addr: int, nbytes: int, notif: bytes):
        """The prepared WRITE ``key`` of ``nbytes`` from ``local_addr`` to the peer's
        ``remote_addr`` with notification ``notif``, made on first use."""
        h = self.handles.get(key)
        if h is None:
            local = self.agent.get_xfer_descs([(local_addr, nbytes, 0)], "DRAM")
            remote = self.agent.get_xfer_descs([(remote_addr, nbytes, 0)], "DRAM")
            h = self.handles[key] = self.agent.initialize_xfer("WRITE", local, remote, self.connect(peer), notif)
        return h

    def post(self, handle, notif: bytes = b"") -> None:
        """Posts ``handle`` (with ``notif`` instead of its prepared notification, if given)."""
        state = self.agent.transfer(handle, notif)
        if state == "ERR":
            raise RuntimeError("NIXL could not post the WRITE")
        if state != "DONE":
            self.inflight.append(handle)

    def poll(self) -> None:
        """One look: counts the notifications that came in, and checks every post still in
        flight. Without a progress thread a WRITE moves on (its flush, then its notification)
        only while its state is checked: every wait checks them all."""
        for msgs in self.agent.get_new_notifs().values():
            self.notes += sum(1 for m in msgs if self.expect is None or m == self.expect)
        for h in list(self.inflight):
            state = self.agent.check_xfer_state(h)
            if state == "ERR":
                raise RuntimeError("NIXL reported an error on a WRITE")
            if state == "DONE":
                self.inflight.remove(h)

    def wait_notes(self, n: int, deadline: Deadline, what: str) -> None:
        """Polls until at least ``n`` notifications are counted."""
        while self.notes < n:
            self.poll()
            if deadline.passed():
                raise TimeoutError(f"timed out waiting for {what} ({self.notes} of {n} notifications)")

    def wait_done(self, handle, deadline: Deadline) -> None:
        """Polls until ``handle``'s last post is done."""
        while handle in self.inflight:
            self.poll()
            if deadline.passed():
                raise TimeoutError("a NIXL WRITE did not complete in time")

    def close(self) -> None:
        # Best effort (NIXL raises its own errors): the process exits next.
        with contextlib.suppress(Exception):
            for h in self.handles.values():
                h.release()
            self.handles.clear()
            self.agent.deregister_memory(self.reg)
