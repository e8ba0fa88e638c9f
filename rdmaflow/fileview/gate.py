"""A step gate: file operations run concurrently with each other, a step runs alone.

Gradient writes and weight reads enter shared; a push (``fsync``) enters exclusive, so it
sees every write that returned before it and no read sees weights while a step rewrites them.
A waiting step holds back new operations, so a stream of writes cannot starve it. Every wait is
bounded, and a caller's ``give_up()`` (an interrupted FUSE request) ends it early."""
from __future__ import annotations

import errno
import threading
import time
from contextlib import contextmanager


class GateTimeout(OSError):
    def __init__(self, what: str, timeout: float):
        super().__init__(errno.ETIMEDOUT, f"{what} waited more than {timeout:.0f} s for a step to finish")


LOOK = 0.05  # seconds between looks at whether a waiting operation's caller gave up


def _wait_for(cv: threading.Condition, ready, timeout: float, give_up, what: str) -> bool:
    """``cv.wait_for(ready, timeout)``, and InterruptedError once ``give_up()`` says so."""
    if give_up is None:
        return cv.wait_for(ready, timeout)
    deadline = time.monotonic() + timeout
    while not ready():
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        if give_up():
            raise InterruptedError(errno.EINTR, f"{what} was interrupted while it waited for a step to finish")
        cv.wait(min(left, LOOK))
    return True


class StepGate:
    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._active = 0       # operations inside, shared
        self._stepping = False  # a step holds or waits for the gate

    @property
    def busy(self) -> bool:
        """Whether an operation or a step is in flight."""
        with self._cv:
            return self._active > 0 or self._stepping

    @contextmanager
    def shared(self, timeout: float, what: str = "an operation", give_up=None):
        with self._cv:
            if not _wait_for(self._cv, lambda: not self._stepping, timeout, give_up, what):
                raise GateTimeout(what, timeout)
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self, timeout: float, what: str = "a step", give_up=None):
        with self._cv:
            if not _wait_for(self._cv, lambda: not self._stepping, timeout, give_up, what):
                raise GateTimeout(what, timeout)
            self._stepping = True
            try:
                if not _wait_for(self._cv, lambda: self._active == 0, timeout, give_up, what):
                    raise GateTimeout(what, timeout)
            except BaseException:
                self._stepping = False
                self._cv.notify_all()
                raise
        try:
            yield
        finally:
            with self._cv:
                self._stepping = False
                self._cv.notify_all()
