"""Linux native asynchronous I/O (io_setup/io_submit/io_getevents) through the system calls
themselves, for benchmark clients that keep many requests in flight on one file descriptor,
as libaio does (iRDMA's clients). No library: ctypes and the kernel's ABI (linux/aio_abi.h).

Why not a thread pool: a thread's ``pwrite`` on a FUSE file opened for direct I/O holds the
file's inode lock until the filesystem answers (unless the server sets
FOPEN_PARALLEL_DIRECT_WRITES, which libfuse < 3.15 cannot), so the writes of 32 threads reach
the filesystem one at a time. An asynchronous direct write (``O_DIRECT``) is queued to the
filesystem and the lock released at once, so all of them are in flight together."""
from __future__ import annotations

import ctypes
import os
import platform

# (io_setup, io_destroy, io_getevents, io_submit)
_SYSCALLS = {"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)}
PREAD, PWRITE = 0, 1  # IOCB_CMD_*


class _Iocb(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("key", ctypes.c_uint32), ("rw_flags", ctypes.c_int32),
                ("opcode", ctypes.c_uint16), ("reqprio", ctypes.c_int16), ("fildes", ctypes.c_uint32),
                ("buf", ctypes.c_uint64), ("nbytes", ctypes.c_uint64), ("offset", ctypes.c_int64),
                ("reserved2", ctypes.c_uint64), ("flags", ctypes.c_uint32), ("resfd", ctypes.c_uint32)]


class _Event(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64), ("obj", ctypes.c_uint64), ("res", ctypes.c_int64),
                ("res2", ctypes.c_int64)]


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


def aio_problem() -> str | None:
    """Why this machine cannot run the asynchronous client, or None."""
    if platform.system() != "Linux" or platform.machine() not in _SYSCALLS:
        return f"Linux native AIO system call numbers are known here for {sorted(_SYSCALLS)} Linux only"
    return None


class Aio:
    """One AIO context of ``depth`` requests. ``run`` keeps up to ``depth`` in flight until
    every request is done; each wait is bounded."""

    def __init__(self, depth: int, timeout: float = 60.0):
        problem = aio_problem()
        if problem:
            raise OSError(problem)
        self._setup, self._destroy, self._getevents, self._submit = _SYSCALLS[platform.machine()]
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.syscall.restype = ctypes.c_long
        self.depth = depth
        self.timeout = timeout
        self._ctx = ctypes.c_ulong(0)
        self._call(self._setup, ctypes.c_long(depth), ctypes.byref(self._ctx))
        self._iocbs = (_Iocb * depth)()
        self._events = (_Event * depth)()

    def _call(self, nr: int, *args) -> int:
        rc = self._libc.syscall(ctypes.c_long(nr), *args)
        if rc < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"AIO system call {nr}: {os.strerror(e)}")
        return rc

    def run(self, fd: int, opcode: int, requests: list[tuple[int, int, int]]) -> None:
        """Performs every (buffer address, bytes, file offset) request on ``fd``; raises OSError
        on a failed or short one."""
        free = list(range(self.depth))
        todo = list(reversed(requests))
        pending = 0
        wait = _Timespec(int(self.timeout), 0)
        while todo or pending:
            batch = []
            while todo and free:
                slot = free.pop()
                addr, n, off = todo.pop()
                cb = self._iocbs[slot]
                ctypes.memset(ctypes.byref(cb), 0, ctypes.sizeof(cb))
                cb.data, cb.opcode, cb.fildes, cb.buf, cb.nbytes, cb.offset = slot, opcode, fd, addr, n, off
                batch.append(ctypes.pointer(cb))
            if batch:
                ptrs = (ctypes.POINTER(_Iocb) * len(batch))(*batch)
                done = self._call(self._submit, self._ctx, ctypes.c_long(len(batch)), ptrs)
                if done != len(batch):
                    raise OSError(f"io_submit took {done} of {len(batch)} requests")
                pending += done
            got = self._call(self._getevents, self._ctx, ctypes.c_long(1), ctypes.c_long(self.depth), self._events,
                             ctypes.byref(wait))
            if got == 0:
                raise OSError(f"no AIO request finished within {self.timeout:.0f} s")
            for ev in self._events[:got]:
                slot = int(ev.data)
                if ev.res != self._iocbs[slot].nbytes:
                    err = -ev.res if ev.res < 0 else 0
                    raise OSError(err, f"AIO request at offset {self._iocbs[slot].offset}: "
                                       + (os.strerror(err) if err else f"{ev.res} of {self._iocbs[slot].nbytes} bytes"))
                free.append(slot)
            pending -= got

    def close(self) -> None:
        if self._ctx.value:
            self._libc.syscall(ctypes.c_long(self._destroy), self._ctx)
            self._ctx = ctypes.c_ulong(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
