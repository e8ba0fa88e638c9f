"""Words in registered memory that a peer WRITEs and this process waits on: the flags and acks
of transfers, the parameter server's push, pull and reply flags, the key-value store's
counters.

Every such wait goes through ``wait_flag``: one loop, so that how a wait spends the time
between a word's arrival and its reader noticing (spinning, yielding, sleeping) is decided in
one place. ``wait_any`` waits for the first of several receivers.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from rdmaflow import (
    Channel,
    InvalidArgumentError,
    PeerError,
    RdmaflowError,
    TimeoutError,
    wait_u64_at_least,
    wait_word,
)
from rdmaflow.deadline import Deadline

WAIT_SLICE = 0.05   # seconds between looks at the peer while a word has not arrived
ABORT_CHECK = 1.0   # seconds between reads of the job's abort reason (a store round trip)
# wait_any: polls that only yield the core (the progress thread applying the write may need
# it), then naps that double up to MAX_NAP: an idle wait costs a wakeup per MAX_NAP, not a core.
ANY_YIELDS = 50
MIN_NAP = 10e-6
MAX_NAP = 1e-3

# How receive_slot and DirectWindow.send_slot end (the core's WaitStatus).
OK, TIMED_OUT, PEER_FAILED, RECEIVER_CLOSED, OTHER_SENDER, MISMATCH = range(6)

# A peer to watch while waiting: a channel, or a callable giving one (None while there is none).
Peer = Channel | Callable[[], Channel | None] | None


def first_slice(timeout: float | None) -> float:
    """The first call's wait of a one-call send or receive with ``timeout`` (seconds, or None):
    at most WAIT_SLICE, and never below 0 (to the core, a negative wait has no end)."""
    return WAIT_SLICE if timeout is None or timeout > WAIT_SLICE else max(timeout, 0.0)


class Word:
    """An 8-byte counter in registered memory; waits read it with acquire semantics."""

    def __init__(self, tensor: torch.Tensor):
        self.t = tensor  # int64 view of one element
        self.address = tensor.data_ptr()

    @classmethod
    def at(cls, raw: torch.Tensor, offset: int) -> Word:
        """The word at byte ``offset`` of ``raw``, a uint8 view of registered memory."""
        return cls(raw[offset : offset + 8].view(torch.int64))

    def get(self) -> int:
        return int(self.t.item())

    def set(self, v: int) -> None:
        self.t.fill_(v)

    def wait_at_least(self, v: int, timeout: float | None) -> bool:
        return wait_u64_at_least(self.address, v, timeout)


def peer_failed(what: str, channel) -> PeerError:
    """The PeerError for a wait (``what``) whose channel failed, with the channel's reason."""
    why = channel.error
    return PeerError(f"{what}: peer {channel.remote_endpoint} failed" + (f" ({why})" if why else ""))


def wait_flag(word: Word, value: int, deadline: Deadline, what: str, *, peer: Peer = None,
              give_up: Callable[[], bool] | None = None, abort_reason: Callable[[], str | None] | None = None,
              aborted: type[Exception] = RdmaflowError, on_timeout: Callable[[], None] | None = None,
              poll: float = WAIT_SLICE, drive: bool = False) -> bool:
    """Waits until ``word >= value`` and returns True; ``what`` names the wait in errors.

    Each time ``poll`` seconds pass without the word, it looks, in this order, at:

    - ``peer``: a failed channel raises ``peer_failed(what, channel)``;
    - ``give_up()``: the caller's own check; it raises, or returns True to stop waiting (this
      then returns False);
    - ``abort_reason()``, at most once per ABORT_CHECK seconds: a reason raises
      ``aborted("the job was aborted: <reason>")``;
    - the deadline: ``on_timeout()`` raises, or returns to make this return False; without
      it, TimeoutError("timed out {what}").

    ``drive`` (with ``peer`` a Channel): the wait progresses the channel's worker itself, for a
    word the peer WRITEs over a transport whose puts this side's progress applies (tcp).
    """
    last_abort_check = time.monotonic()
    driven = peer if drive and isinstance(peer, Channel) else None

    def arrived(t: float | None) -> bool:
        if driven is None:
            return word.wait_at_least(value, t)
        return wait_word(word.address, value, -1.0 if t is None else t, driven, True) == OK

    while not arrived(deadline.slice(poll)):
        if peer is not None:
            channel = peer() if callable(peer) else peer
            if channel is not None and channel.failed:
                raise peer_failed(what, channel)
        if give_up is not None and give_up():
            return False
        if abort_reason is not None and time.monotonic() - last_abort_check >= ABORT_CHECK:
            last_abort_check = time.monotonic()
            reason = abort_reason()
            if reason:
                raise aborted(f"the job was aborted: {reason}")
        if deadline.passed():
            if on_timeout is None:
                raise TimeoutError(f"timed out {what}")
            on_timeout()
            return False
    return True


def wait_any(receivers: Sequence, timeout: float | None = None) -> int:
    """Blocks until one of ``receivers`` (static or dynamic) has its next transfer, and returns
    the index of the first that has (its ``recv()`` then returns at once).

    Raises TimeoutError after ``timeout`` seconds (None: no limit) and PeerError when the
    sender of a receiver that has nothing yet failed. Sleeps while nothing arrives.
    """
    if not isinstance(receivers, Sequence) or len(receivers) == 0:
        raise InvalidArgumentError(f"wait_any takes a non-empty sequence of receivers, got {receivers!r}")
    bad = [r for r in receivers if not callable(getattr(r, "poll", None))]
    if bad:
        raise InvalidArgumentError(f"wait_any takes receivers (a static, bounded or dynamic one), got {bad[0]!r}")
    deadline = Deadline(timeout)
    nap = MIN_NAP / 2
    rounds = 0
    while True:
        for i, receiver in enumerate(receivers):
            if receiver.poll():
                return i
        if deadline.passed():
            names = ", ".join(repr(getattr(r, "name", r)) for r in receivers)
            raise TimeoutError(f"none of the receivers {names} got a transfer within {timeout} s")
        rounds += 1
        if rounds <= ANY_YIELDS:
            time.sleep(0)
        else:
            nap = min(2 * nap, MAX_NAP)
            time.sleep(deadline.slice(nap))
