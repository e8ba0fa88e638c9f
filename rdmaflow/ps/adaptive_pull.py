"""Adaptive pulling (iRDMA §IV-B): in the asynchronous modes with overlap a worker computes on
one parameter buffer while the shards write the next weights into the other. The request for
them is timed so that they land as the computation ends: it waits the "bubble", 0.9 of the
average compute time less the average pull latency, both moving averages (weight EMA for the
newest sample). The later the request, the fresher the weights: asked at once, they would
miss what other workers push meanwhile (docs/parameter-server.md, "Asynchronous modes with
overlap").

The worker says how to post a request and how to wait for its weights; this module decides
when, and measures each pull's latency on the thread that posts it.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

EMA = 0.3  # weight of the newest sample in the moving averages
SHARE = 0.9  # of the average compute time, the part a pull may overlap


def moving_average(avg: float | None, sample: float) -> float:
    return sample if avg is None else (1 - EMA) * avg + EMA * sample


class AdaptivePull:
    """Times one worker's pull requests. ``send(r)`` posts pull r's request to every shard;
    ``landed(r)`` waits (bounded) until its weights are in, and returns whether they are.

    Threads: the worker's step thread calls ``computed``, ``request``, ``next_delay`` and
    ``join``; each request runs ``send`` and ``landed`` on a timer thread of its own, at most one
    at a time (``join`` the last one before the next ``request``)."""

    def __init__(self, send: Callable[[int], None], landed: Callable[[int], bool], last: int = 0):
        self._send, self._landed = send, landed
        self._timer: threading.Timer | None = None
        self.last = last  # the pull requested last; at first the job's start step (its initial weights)
        self.avg_compute: float | None = None
        self.avg_pull: float | None = None
        self._latency: float | None = None  # of the last pull, once its weights landed
        self.bubbles: list[float] = []  # every delay next_delay() chose, in seconds

    def computed(self, seconds: float) -> None:
        """One step's compute time (forward and backward), for the average."""
        self.avg_compute = moving_average(self.avg_compute, seconds)

    def request(self, r: int, delay: float) -> None:
        """Posts pull r's request after ``delay`` seconds, on a timer thread; returns at once."""
        self.last, self._latency = r, None

        def run() -> None:
            t0 = time.monotonic()
            self._send(r)
            if self._landed(r):  # a pull that gave up leaves the averages as they were
                self._latency = time.monotonic() - t0

        self._timer = threading.Timer(max(delay, 0.0), run)
        self._timer.daemon = True
        self._timer.start()

    def join(self, timeout: float | None) -> None:
        """Waits (up to ``timeout`` seconds) for the last request's thread to finish."""
        if self._timer is not None:
            self._timer.join(timeout)

    def next_delay(self) -> float:
        """Folds the last pull's latency into its average (when it landed) and returns how long
        the next request should wait: the bubble, 0 until both averages exist."""
        if self._latency is not None:
            self.avg_pull = moving_average(self.avg_pull, self._latency)
        bubble = 0.0
        if self.avg_compute is not None and self.avg_pull is not None:
            bubble = max(0.0, SHARE * self.avg_compute - self.avg_pull)
        self.bubbles.append(bubble)
        return bubble
