"""Several threads waiting on one flag word for targets of their own (the file view's readers,
each waiting for the weight chunks its range needs): one of them polls the word, for the
smallest target any of them asked for, in short slices; the others sleep on a condition until
the poller's slice ends, then look again. Many threads spinning on one word would starve the
threads that deliver it (the progress threads, the receiving CPU) on a small machine.
"""
from __future__ import annotations

import errno
import threading
from collections.abc import Callable

from rdmaflow import TimeoutError
from rdmaflow.deadline import Deadline

SLICE = 0.002  # seconds a poller waits before it looks again for a smaller target
SLEEP = 0.05  # at most this long a sleeping waiter goes without looking at its deadline


class SharedWait:
    """Waits on one word shared by several threads. ``value()`` reads the word; ``poll(target,
    what, seconds)`` waits up to ``seconds`` for it to reach ``target``, raising TimeoutError when
    the slice passes (and whatever the word's own failures raise: a dead peer). ``writer`` names
    who writes the word, for messages ("shard 2"). Thread-safe."""

    def __init__(self, writer: str, value: Callable[[], int], poll: Callable[[int, str, float], None]):
        self.writer, self._value, self._poll = writer, value, poll
        self._cv = threading.Condition()
        self._polling = False  # a thread polls now
        self._targets: list[int] = []  # of the threads in wait()

    def wait(self, target: int, what: str, deadline: Deadline, give_up: Callable[[], bool] | None = None) -> None:
        """Returns once the word is >= ``target``; TimeoutError naming ``what`` once ``deadline``
        passed; InterruptedError once ``give_up()`` (looked at between slices) says so; a poll's
        own error reaches the thread that polled."""
        if self._value() >= target:
            return
        with self._cv:
            self._targets.append(target)
            try:
                while self._value() < target:
                    if deadline.passed():
                        raise TimeoutError(f"{self.writer} did not deliver {what} within {deadline.timeout:g} s")
                    if give_up is not None and give_up():
                        raise InterruptedError(errno.EINTR, f"the wait for {what} from {self.writer} was interrupted")
                    if self._polling:
                        self._cv.wait(deadline.slice(SLEEP))
                        continue
                    self._polling = True
                    low = min(self._targets)
                    self._cv.release()
                    try:
                        self._poll(low, what, deadline.slice(SLICE))
                    except TimeoutError:
                        pass  # a slice: look again at the smallest target and the deadline
                    finally:
                        self._cv.acquire()
                        self._polling = False
                        self._cv.notify_all()
            finally:
                self._targets.remove(target)
