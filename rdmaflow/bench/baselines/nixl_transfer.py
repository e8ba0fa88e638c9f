"""``nixl`` of ``rdmaflow bench transfer``: NIXL WRITEs with a notification each, host memory,
at most ``window`` in flight; the receiver reduces each tensor when its notification comes and
hands its slot back with a notification of its own (the credit). The agents are set up as
:mod:`.nixl_agent` describes (progress thread off, so each side polls; UCX backend with
``ucx_error_handling_mode: none``).

The receiver registers its slots at start (``--arena-bytes``: the most ``window * size`` of
the run) and says where they are in its hello; the sender registers one source tensor of the
largest size. One prepared WRITE per (size, slot), reposted when its slot comes round again:
after the receiver handed the slot back, and once its previous post is done.
"""
from __future__ import annotations

from rdmaflow.bench._transfer_worker import consume, consume_mode, fill, marker
from rdmaflow.bench.baselines.nixl_agent import NixlAgentWorker
from rdmaflow.deadline import Deadline

# Notifications carry the measurement's tag: a credit the receiver's UCX sends late (without a
# progress thread it moves only while the receiver polls, i.e. in its next measurement) is not
# counted in the wrong one.
DATA = "d{}"    # sender -> receiver: a tensor landed
CREDIT = "c{}"  # receiver -> sender: a slot is free again


class NixlTransferWorker(NixlAgentWorker):
    def __init__(self, role: str, nbytes: int) -> None:
        import torch

        super().__init__(role, nbytes, torch.float32)

    def _check(self, nbytes: int) -> None:
        if nbytes > self.buf.numel() * 4:
            raise ValueError(f"{nbytes} B exceed the {self.buf.numel() * 4} B registered (--arena-bytes)")

    def recv(self, cmd: dict, ready) -> dict:
        size, count, window = cmd["size"], cmd["count"], cmd["window"]
        self._check(window * size)
        peer = self.connect(cmd["peer"])
        deadline = Deadline(cmd["timeout"])
        want, mode, n = marker(cmd["tag"]), consume_mode(cmd), size // 4
        times: list[float] = []
        bad = 0
        self.notes = 0
        self.expect = DATA.format(cmd["tag"]).encode()
        credit = CREDIT.format(cmd["tag"]).encode()
        ready()
        for i in range(count):
            self.wait_notes(i + 1, deadline, f"tensor {i + 1} of {count}")
            t = self.buf[(i % window) * n:(i % window + 1) * n]
            t1, ok, _ = consume(t, mode, want, i == count - 1)
            times.append(t1)
            bad += not ok
            self.agent.send_notif(peer, credit)
        return {"times": times, "bad": bad}

    def send(self, cmd: dict) -> dict:
        size, count, window, peer = cmd["size"], cmd["count"], cmd["window"], cmd["peer"]
        self._check(size)
        deadline = Deadline(cmd["timeout"])
        fill(self.buf[: size // 4], cmd["tag"])
        self.notes = 0
        self.expect = CREDIT.format(cmd["tag"]).encode()
        data = DATA.format(cmd["tag"]).encode()
        for i in range(count):
            # Credits: never overwrite a slot the receiver has not consumed.
            self.wait_notes(i + 1 - window, deadline, "the receiver's credits")
            h = self.write_handle((size, i % window), peer, self.buf.data_ptr(), peer["addr"] + (i % window) * size,
                                  size, data)
            self.wait_done(h, deadline)  # its previous post
            self.post(h, data)
            self.poll()
        # Done when every post is: the receiver's reply says when it consumed the last one.
        for (s, _), h in self.handles.items():
            if s == size:
                self.wait_done(h, deadline)
        return {}
