"""A step gate: file operations run concurrently with each other, a step runs alone.

Gradient writes and weight reads enter shared; a push (``fsync``) enters exclusive, so it
sees every write that returned before it and no read sees weights while a step rewrites them.
A waiting step holds back new operations, so a stream of writes cannot starve it. Every wait is
bounded."""
from __future__ import annotations

import errno
import threading
from contextlib import contextmanager


class GateTimeout(OSError):
    def __init__(self, what: str, timeout: float):
        super().__init__(errno.ETIMEDOUT, f"{what} waited more than {timeout:.0f} s for a step to finish")


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
    def shared(self, timeout: float, what: str = "an operation"):
        with self._cv:
            if not self._cv.wait_for(lambda: not self._stepping, timeout):
                raise GateTimeout(what, timeout)
            self._active += 1
        try:
            yield
        finally:
            with self._cv:
                self._active -= 1
                self._cv.notify_all()

    @contextmanager
    def exclusive(self, timeout: float, what: str = "a step"):
        with self._cv:
            if not self._cv.wait_for(lambda: not self._stepping, timeout):
                raise GateTimeout(what, timeout)
            self._stepping = True
            try:
                if not self._cv.wait_for(lambda: self._active == 0, timeout):
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
