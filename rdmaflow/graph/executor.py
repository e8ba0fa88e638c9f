"""The polling-async executor of one rank (Xue et al., EuroSys '19, §4).

One ready queue holds three kinds of operations:

- a receive: polls the flag of its edge's next transfer (``Receiver.poll()``, never blocks);
  not landed -> back to the tail of the queue; landed -> the compute that needs it may run
  (the compute takes the tensor, and only then is the previous slot acknowledged);
- a compute (a microbatch's forward or backward): enters the queue, in the schedule's order,
  once every receive it needs has landed; it posts its sends;
- a send: goes out when the credit rule allows (the receiver acknowledged the transfer that
  used the slot before) and every earlier send of its sender has gone out, else back to the
  tail; it never waits inside the queue. A receiver takes its edge's transfers as microbatches
  in the order they come, so a send that found no credit must not be overtaken by the next
  microbatch's send of the same edge once the credit is there.

When a full pass over the queue makes no progress and only receives (and credit-blocked sends)
remain, the rank sleeps in ``wait_any`` over the pending receives: no core is burnt, and the
store's abort key and the step's deadline are checked between slices.
"""
from __future__ import annotations

import time
from collections import deque

import rdmaflow
from rdmaflow.transfer import peer_failed, wait_any

IDLE_SLICE = 0.5      # seconds of one wait_any before the abort key is read again
SEND_RETRY = 200e-6   # sleep while only credit-blocked sends could make progress


class RecvOp:
    """The receives of one edge within a step, one microbatch after another."""

    kind = "recv"

    def __init__(self, edge, receiver, count: int):
        self.edge, self.receiver, self.count = edge, receiver, count
        self.mb = 0              # the microbatch whose transfer is awaited
        self.landed = False
        self.holds: list = []    # futures of sends that read the slot handed out last

    @property
    def name(self) -> str:
        return f"recv {self.edge.name} mb{self.mb}"

    def poll(self) -> bool:
        if not self.landed and self.receiver.poll():
            self.landed = True
        return self.landed

    def take(self, timeout: float | None):
        """The landed tensor of microbatch ``self.mb``; acknowledges the slot handed out before."""
        for f in self.holds:  # a zero-copy send still reading the previous slot finishes first
            f.result(timeout)
        self.holds = []
        t = self.receiver.recv(timeout=timeout)
        self.mb += 1
        self.landed = False
        return t


class SendOp:
    kind = "send"

    def __init__(self, edge, sender, tensor, mb: int, done):
        self.edge, self.sender, self.tensor, self.mb, self.done = edge, sender, tensor, mb, done

    @property
    def name(self) -> str:
        return f"send {self.edge.name} mb{self.mb}"

    def credit(self) -> bool:
        return self.sender.has_credit()

    def run(self, timeout: float | None):
        fut = self.sender.send(self.tensor, timeout=timeout)
        self.done(self, fut)
        return fut


class ComputeOp:
    kind = "compute"

    def __init__(self, name: str, needs: list[tuple[RecvOp, int]], fn):
        """``fn(inputs)`` gets {edge id: tensor} of the receives in ``needs`` and returns the
        SendOps it posts."""
        self.name, self.needs, self.fn = name, needs, fn

    def ready(self) -> bool:
        return all(op.mb == mb and op.landed for op, mb in self.needs)


class Executor:
    """Runs one step's computes (in schedule order), sends and receives on one ready queue."""

    def __init__(self, stage_name: str, timeout: float, check_abort, trace: list | None = None):
        self.stage_name = stage_name
        self.timeout = timeout
        self.check_abort = check_abort  # raises if the job was aborted
        self.trace = trace
        self.futures: list = []
        self._due: dict[int, deque] = {}  # per sender (by id): its posted sends, oldest first

    def _event(self, kind: str, name: str, **extra) -> None:
        if self.trace is not None:
            self.trace.append(dict(t=time.monotonic(), kind=kind, name=name, **extra))

    def run(self, computes: list[ComputeOp], recvs: list[RecvOp]) -> None:
        queue: deque = deque(op for op in recvs if op.count > 0)
        todo = deque(computes)
        idle_since = time.monotonic()
        misses = 0
        while todo or queue:
            if todo and todo[0].ready() and not any(op.kind == "compute" for op in queue):
                queue.append(todo.popleft())
            if not queue:
                raise rdmaflow.RdmaflowError(f"{self.stage_name}: {todo[0].name} waits for a receive nobody posts")
            op = queue.popleft()
            progressed = self._run_one(op, queue, recvs)
            if progressed:
                misses, idle_since = 0, time.monotonic()
                continue
            misses += 1
            if misses >= len(queue) and not (todo and todo[0].ready()):
                self._idle(queue, todo, idle_since)
                misses = 0

    def _run_one(self, op, queue: deque, recvs: list[RecvOp]) -> bool:
        if op.kind == "recv":
            if op.poll():
                self._event("landed", op.name)
                return True  # parked until its compute takes it
            self._event("poll_miss", op.name)
            queue.append(op)
            return False
        if op.kind == "send":
            due = self._due[id(op.sender)]
            if due[0] is not op or not op.credit() and not op.sender.receiver_closed:
                queue.append(op)
                return False
            due.popleft()
            self.futures.append(op.run(self.timeout))
            self._event("send", op.name)
            return True
        inputs = {}
        for r, _ in op.needs:
            inputs[r.edge.id] = r.take(self.timeout)
            if r.mb < r.count:
                queue.append(r)  # polls for the next microbatch while this one computes
        pending = [r.name for r in recvs if r.mb < r.count and not r.landed]
        self._event("compute_start", op.name, pending=pending)
        for send in op.fn(inputs) or ():
            self._due.setdefault(id(send.sender), deque()).append(send)
            queue.append(send)
        self._event("compute_end", op.name)
        return True

    def _idle(self, queue: deque, todo: deque, idle_since: float) -> None:
        recvs = [op for op in queue if op.kind == "recv" and not op.landed]
        sends = [op for op in queue if op.kind == "send"]
        t0, c0 = time.monotonic(), time.process_time()
        if t0 - idle_since > self.timeout:
            waiting = [op.name for op in queue] or [todo[0].name]
            raise rdmaflow.TimeoutError(f"{self.stage_name}: nothing arrived for {self.timeout:.0f} s; "
                                        f"waiting for {', '.join(waiting)}")
        self.check_abort()
        if recvs:
            try:
                wait_any([op.receiver for op in recvs], timeout=SEND_RETRY if sends else IDLE_SLICE)
            except rdmaflow.TimeoutError:
                pass
        else:
            for s in sends:
                if s.sender.channel.failed:
                    raise peer_failed(f"{self.stage_name}: {s.name}", s.sender.channel)
            time.sleep(SEND_RETRY)
        self._event("wait", ",".join(op.name for op in recvs), wall=time.monotonic() - t0,
                    cpu=time.process_time() - c0)

    def finish(self) -> None:
        """Waits (bounded) until every send of the step is visible at its receiver."""
        for f in self.futures:
            f.result(self.timeout)
        self.futures = []
