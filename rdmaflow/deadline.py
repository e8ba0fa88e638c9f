"""Deadlines: every wait in the library is bounded by one of these."""
from __future__ import annotations

import time


class Deadline:
    """The moment a bounded wait gives up; ``Deadline(None)`` never comes.

    Made once per operation and handed down, so that the steps of one operation share its
    timeout instead of each getting the whole of it.
    """

    __slots__ = ("at",)

    def __init__(self, timeout: float | None):
        self.at = None if timeout is None else time.monotonic() + timeout

    def left(self) -> float | None:
        """Seconds left (never negative), or None for no limit."""
        return None if self.at is None else max(0.0, self.at - time.monotonic())

    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    def slice(self, most: float) -> float:
        """``most`` seconds, or what is left if that is less: one step of a waiting loop."""
        left = self.left()
        return most if left is None else min(most, left)

    def __repr__(self) -> str:
        left = self.left()
        return "<Deadline never>" if left is None else f"<Deadline in {left:.3f} s>"


def time_left(timeout: float | Deadline | None) -> float | None:
    """Seconds a wait may take: ``timeout`` itself, or what is left of a :class:`Deadline`
    (None: no limit). For steps that take either form without making a Deadline per call."""
    return timeout.left() if isinstance(timeout, Deadline) else timeout
