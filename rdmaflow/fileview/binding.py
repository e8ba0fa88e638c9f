"""mfusepy's ``FUSE`` with reads and writes served by address.

mfusepy (pinned: these two methods override its callbacks for libfuse's ``read`` and ``write``)
hands a write's data to Python as a ``bytes`` copied with ``ctypes.string_at`` and copies a
read's returned ``bytes`` into libfuse's buffer: a copy each way beyond the kernel's, both under
the GIL, which serializes libfuse's threads. Here the operations get libfuse's buffer itself:
a write adds straight out of it, a read ``memmove``s straight into it (a foreign call, so the
GIL is released while the bytes move)."""
from __future__ import annotations

import ctypes

import mfusepy
from mfusepy import FUSE


def interrupted() -> bool:
    """Whether the kernel has interrupted the FUSE request this thread serves (its client got a
    signal: Ctrl-C, kill, timeout). libfuse records the kernel's INTERRUPT for the request;
    mfusepy does not wrap ``fuse_interrupted``, so it is called from the library it loaded."""
    return bool(_fuse_interrupted())


_fuse_interrupted = mfusepy._libfuse.fuse_interrupted
_fuse_interrupted.restype = ctypes.c_int
_fuse_interrupted.argtypes = []


def _address(buf) -> int:
    return ctypes.cast(buf, ctypes.c_void_p).value or 0


class BufferFUSE(FUSE):
    """``FUSE`` whose operations implement ``read_into(path, dest, size, offset, fh) -> int``
    and ``write_from(path, src, size, offset, fh) -> int`` (addresses, valid for the call)."""

    def _path(self, path: bytes | None) -> str | None:
        return None if path is None else path.decode(self.encoding, self.errors)

    def read(self, path, buf, size, offset, fip) -> int:
        return self.operations.read_into(self._path(path), _address(buf), size, offset,
                                         fip.contents.fh)

    def write(self, path, buf, size, offset, fip) -> int:
        return self.operations.write_from(self._path(path), _address(buf), size, offset,
                                          fip.contents.fh)
