"""Deadlines: every wait in the library is bounded by one of these."""
from __future__ import annotations

import math
import numbers
import os
import time

from rdmaflow._core import InvalidArgumentError

# The longest bound taken (about three years): longer ones overflow the integer milliseconds and
# nanoseconds that c10d's store and the core's waits count in. Per-call timeouts beyond it are no
# limit, as infinity is; a job's bounds, which must be finite, are refused beyond it.
MAX_SECONDS = 1e8


class _EndpointTimeout:
    """The default of a transfer call's ``timeout``: the endpoint's own, given at its
    construction. A sentinel, not a number, so that every number a caller passes means itself
    (a negative one: look without waiting)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "ENDPOINT_TIMEOUT"


ENDPOINT_TIMEOUT = _EndpointTimeout()


def call_timeout(timeout, endpoint_timeout: float | None) -> float | None:
    """A transfer call's ``timeout``: the endpoint's for ENDPOINT_TIMEOUT, else checked."""
    return endpoint_timeout if timeout is ENDPOINT_TIMEOUT else checked_timeout(timeout)


def checked_timeout(timeout, what: str = "timeout") -> float | None:
    """``timeout`` as seconds (a float), or None for no limit: None, infinity and anything over
    MAX_SECONDS. Raises InvalidArgumentError for what is not a number of seconds (NaN, a bool, a
    string), where a wait would otherwise never end or end at once by accident."""
    if timeout is None:
        return None
    if type(timeout) is not float:
        if isinstance(timeout, (bool, str, bytes)):
            raise InvalidArgumentError(f"{what} must be a number of seconds or None, got {timeout!r}")
        try:
            timeout = float(timeout)
        except (TypeError, ValueError):
            raise InvalidArgumentError(f"{what} must be a number of seconds or None, got {timeout!r}") from None
    if math.isnan(timeout):
        raise InvalidArgumentError(f"{what} must be a number of seconds or None, got nan")
    return None if timeout > MAX_SECONDS else timeout


def positive_seconds(value, what: str) -> float:
    """A bound that every wait of a device or a job takes from (connecting, side RPCs, steps): a
    positive, finite number of seconds, else InvalidArgumentError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 < value <= MAX_SECONDS:
        raise InvalidArgumentError(f"{what} must be a positive, finite number of seconds (at most {MAX_SECONDS:g}, "
                                   f"about three years), got {value!r}")
    return float(value)


def seconds_setting(value, name: str, env: str, default: float) -> float:
    """A job's bound: ``value``, else ``$env`` (read as a number), else ``default``; checked by
    ``positive_seconds`` under the name it came by."""
    if value is None and os.environ.get(env):
        value, name = os.environ[env], f"${env}"
        try:
            value = float(value)
        except ValueError:
            raise InvalidArgumentError(f"{name} must be a number of seconds, got {value!r}") from None
    elif value is None:
        return default
    return positive_seconds(value, name)


class Deadline:
    """The moment a bounded wait gives up; ``Deadline(None)`` never comes.

    Made once per operation and handed down, so that the steps of one operation share its
    timeout instead of each getting the whole of it. ``timeout``: what it was made with, for
    messages. Raises InvalidArgumentError for a timeout that is not a number of seconds.
    """

    __slots__ = ("at", "timeout")

    def __init__(self, timeout: float | None):
        self.timeout = timeout = checked_timeout(timeout)
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
