"""The processes of ``rdmaflow bench latency``: the two ends of one system's ping-pong.

Started by :mod:`rdmaflow.bench.latency` as ``python -m rdmaflow.bench.latency --worker SYSTEM
ROLE ...`` and served by :func:`rdmaflow.bench._transfer_worker.serve` (JSON lines, the same
protocol as ``bench transfer``'s workers). The "sender" starts every round trip and times it;
the "receiver" answers each message with one of the same size.

* receiver ``{"cmd": "pong", "size", "count", "tag", "timeout", "peer"}``: sets up, answers
  ``{"ok": true, "ready": true}``, answers ``count`` pings, then ``{"ok": true, "bad": n}``.
* sender ``{"cmd": "ping", "size", "count", "tag", "timeout", "peer"}``: ``count`` round
  trips; answers ``{"ok": true, "one_way_us": [...], "bad": n}``, each round trip's time
  halved, in the order they ran (the driver drops the warm-up ones).

``peer`` is the other process's hello ``info``. Every byte of the last message each way is
checked (``bad``: 1 if any is wrong): the sender's bytes are :func:`marker` ``(tag, "sender")``,
the receiver's ``marker(tag, "receiver")``.
"""
from __future__ import annotations

import contextlib
import time

from rdmaflow.deadline import Deadline

clock = time.perf_counter  # CLOCK_MONOTONIC on Linux, nanosecond resolution


def marker(tag: int, role: str) -> int:
    """The byte value every byte of ``role``'s messages holds in measurement ``tag``."""
    return (2 * tag + (role == "receiver")) % 250 + 1


def other(role: str) -> str:
    return "receiver" if role == "sender" else "sender"


def wrong(t, tag: int, role: str) -> int:
    """1 if some byte of ``t`` (uint8) is not ``marker(tag, role)``, else 0."""
    return int(not bool((t == marker(tag, role)).all()))


def round_trips(count: int, one: callable) -> list[float]:
    """Runs ``one()`` (a whole round trip) ``count`` times; each one's time halved, in us."""
    out = []
    for _ in range(count):
        t0 = clock()
        one()
        out.append((clock() - t0) * 0.5e6)
    return out


# ------------------------------------------------------------------------------------------
# rdmaflow: a StaticSender/StaticReceiver pair each way


class RdmaflowWorker:
    """Per size, a ``StaticReceiver`` (depth 1) for the peer's messages and a zero-copy
    ``StaticSender`` from an arena tensor to the peer's receiver, made at the first measurement
    of that size and reused, as a model reuses its static pairs every iteration."""

    def __init__(self, role: str, arena_bytes: int, busy_poll: bool) -> None:
        import rdmaflow

        self.role = role
        self.dev = rdmaflow.Device("127.0.0.1:0", busy_poll=busy_poll)
        self.dev.create_arena(arena_bytes)
        self.info = {"endpoint": self.dev.endpoint}
        self.pairs: dict[int, tuple] = {}  # size -> (sender, receiver, source)

    def _receiver(self, cmd: dict):
        import torch

        from rdmaflow.transfer import StaticReceiver

        size = cmd["size"]
        if size not in self.pairs:
            r = StaticReceiver(self.dev, f"{self.role}-{size}", (size,), torch.uint8, timeout=cmd["timeout"])
            self.pairs[size] = (None, r, self.dev.empty((size,), torch.uint8))
        return self.pairs[size]

    def _pair(self, cmd: dict):
        """(sender, receiver, source) of this size; the sender's lookup retries until the peer
        has published its receiver (bounded by the command's timeout)."""
        import torch

        from rdmaflow import InvalidArgumentError
        from rdmaflow.transfer import StaticSender

        s, r, src = self._receiver(cmd)
        size, deadline = cmd["size"], Deadline(cmd["timeout"])
        while s is None:
            try:
                s = StaticSender(self.dev, cmd["peer"]["endpoint"], f"{other(self.role)}-{size}", (size,),
                                 torch.uint8, mode="zerocopy", timeout=cmd["timeout"])
            except InvalidArgumentError as e:
                if "published nothing" not in str(e) or deadline.passed():
                    raise
                time.sleep(0.01)
        self.pairs[size] = (s, r, src)
        src.fill_(marker(cmd["tag"], self.role))
        return s, r, src

    def pong(self, cmd: dict, ready) -> dict:
        self._receiver(cmd)
        ready()
        s, r, src = self._pair(cmd)
        bad, count = 0, cmd["count"]
        for i in range(count):
            t = r.recv()
            if i == count - 1:  # checked before the pong hands its slot back
                bad = wrong(t, cmd["tag"], other(self.role))
            s.send(src, release=r)  # the ping's slot goes back with the pong
        return {"bad": bad}

    def ping(self, cmd: dict) -> dict:
        s, r, src = self._pair(cmd)
        last = []

        def one() -> None:
            s.send(src, release=r)  # the previous pong's slot goes back with this ping
            last[:] = [r.recv()]

        times = round_trips(cmd["count"], one)
        bad = wrong(last[0], cmd["tag"], other(self.role)) if last else 0
        r.release()
        return {"one_way_us": times, "bad": bad}

    def close(self) -> None:
        from rdmaflow import RdmaflowError

        for s, r, _ in self.pairs.values():
            for p in (s, r):
                if p is not None:
                    with contextlib.suppress(RdmaflowError):  # best effort: the peer may be gone already
                        p.close()
        self.pairs.clear()
        self.dev.close()


def make_worker(args):
    if args.system == "rdmaflow":
        return RdmaflowWorker(args.role, args.arena_bytes, args.busy_poll)
    if args.system == "rdmaflow-profile":
        from rdmaflow.bench.latency_profile import ProfileWorker

        return ProfileWorker(args.role, args.arena_bytes, args.busy_poll)
    if args.system == "gloo":
        from rdmaflow.bench.baselines.gloo_latency import GlooLatencyWorker

        return GlooLatencyWorker(args.system, args.role, args.transport, args.port, args.timeout)
    if args.system == "tensorpipe":
        from rdmaflow.bench.baselines.tensorpipe_latency import TensorPipeLatencyWorker

        return TensorPipeLatencyWorker(args.system, args.role, args.transport, args.port, args.timeout)
    if args.system == "nixl":
        from rdmaflow.bench.baselines.nixl_latency import NixlLatencyWorker

        return NixlLatencyWorker(args.role, args.max_size)
    raise ValueError(f"unknown system {args.system!r}")
