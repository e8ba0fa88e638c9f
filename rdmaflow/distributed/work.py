"""The ``Work`` an op of the rdmaflow process group returns.

Sends and collectives run when they are called (a send returns once its message is posted:
the receiver READs it later), so their Work is complete when it is handed out. A receive is
run by the first ``wait()`` (or an ``is_completed()`` that finds its message there): receives
of one (peer, tag) complete in the order they were posted, as c10d orders them, whichever of
their Works is waited for first.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


class Work(dist.Work):
    """A completed op's Work (``result``: what its future holds), or a pending receive's
    (``run(block)``: completes it and returns True, or with ``block`` False returns False when
    its message is not there yet)."""

    def __init__(self, result=None, run=None, source: int = -1, error: BaseException | None = None):
        super().__init__()
        self._result = result
        self._run = run
        self._source = source
        self._error = error
        self._future: torch.futures.Future = torch.futures.Future()
        if run is None:
            self._settle()

    def _settle(self) -> None:
        if self._future.done():
            return
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._result)

    def _complete(self, block: bool, timeout: float | None = None) -> bool:
        if self._run is None:
            return True
        try:
            if not self._run(block, timeout):
                return False
        except Exception as e:  # noqa: BLE001 - kept for exception() and the future, raised by wait()
            self._error = e
        self._run = None
        self._settle()
        return True

    def wait(self, timeout: datetime.timedelta | float | None = None) -> bool:
        """Completes the op (bounded by the group's timeout, or ``timeout`` when shorter) and
        raises its error, if it failed."""
        if isinstance(timeout, datetime.timedelta):
            timeout = timeout.total_seconds() or None  # c10d passes 0 for "the group's timeout"
        self._complete(True, timeout)
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._complete(False)

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def get_future(self) -> torch.futures.Future:
        """The op's future: completed already for sends and collectives; for a receive, by its
        ``wait()`` or an ``is_completed()`` that finds the message."""
        return self._future

    def result(self):
        self.wait()
        return self._result

    def synchronize(self) -> None:
        self.wait()

    def source_rank(self) -> int:
        return self._source_rank()

    def _source_rank(self) -> int:
        self.wait()
        return self._source
