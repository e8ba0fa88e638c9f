"""The file operations of a mounted model (mfusepy ``Operations``): which path is what, and what
each POSIX call does on it. Reads and writes take libfuse's buffer by address
(``read_into``/``write_from``, called by ``BufferFUSE``), so no Python ``bytes`` is made.

    /model.json           the metadata (read-only)
    /grad                 the flat gradient: write adds, fsync (or closing after a write) pushes
    /weights              the flat weights (read-only)
    /vars/<name>.grad     one variable's part of /grad
    /vars/<name>.weights  one variable's part of /weights

Errors are POSIX: a path that does not exist ``ENOENT``, a write past a file's end ``EINVAL``,
a write to a read-only file ``EBADF``, a push with elements only partly written ``EINVAL``, a
push of a step into which a gradient write was refused that write's errno (the step is discarded),
a new file ``EACCES``, removing, renaming, linking or chmod-ing one ``EPERM``, a request its
client gave up while it waited (a signal) ``EINTR``, and once the job failed (a shard died)
``EIO`` on every operation."""
from __future__ import annotations

import ctypes
import errno
import itertools
import os
import stat
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

from mfusepy import FuseOSError, Operations, fuse_get_context

from rdmaflow import RdmaflowError
from rdmaflow.fileview.binding import interrupted
from rdmaflow.fileview.flat import FlatModel
from rdmaflow.fileview.gate import StepGate


@dataclass(frozen=True)
class Node:
    kind: str      # "meta", "grad" or "weights"
    offset: int    # bytes, where the file starts in the flat model
    size: int


class ModelFiles(Operations):
    use_ns = True

    def __init__(self, flat: FlatModel, declaration, metadata: bytes, *, step_timeout: float, label: str):
        self.flat = flat
        self.metadata = metadata
        self.step_timeout = step_timeout
        self.label = label
        self.gate = StepGate()
        self.steps = 0
        self.failed: str | None = None   # why every operation now fails with EIO
        self.mounted = threading.Event()
        self._fh = itertools.count(1)
        self._wrote: dict[int, int] = {}  # file handle -> the step it last wrote into
        # The errno of a gradient write refused in this step, if any: the kernel splits a write
        # into requests of at most 1 MiB and returns a short count when a later one is refused,
        # after the earlier ones were added. Such a step is never pushed (``_step``).
        self._refused: int | None = None
        self._dsync: set[int] = set()     # file handles opened O_SYNC or O_DSYNC: writes go through
        self._opener: dict[int, int | None] = {}  # file handle -> the process (thread group) that opened it
        self._t = time.time_ns()
        # Modification times: the gradient file's last write, the weights' last push (after it a
        # read returns the newer weights). Tools that watch mtime (make, rsync, a reloader) see them move.
        self._mtime = {"meta": self._t, "grad": self._t, "weights": self._t}
        n = flat.nbytes
        self.nodes = {"/model.json": Node("meta", 0, len(metadata)), "/grad": Node("grad", 0, n),
                      "/weights": Node("weights", 0, n)}
        for v in declaration.variables:
            self.nodes[f"/vars/{v.name}.grad"] = Node("grad", v.offset, v.nbytes)
            self.nodes[f"/vars/{v.name}.weights"] = Node("weights", v.offset, v.nbytes)
        self.dirs = {"/": ["model.json", "grad", "weights", "vars"],
                     "/vars": sorted(p[len("/vars/"):] for p in self.nodes if p.startswith("/vars/"))}

    # -- helpers -----------------------------------------------------------------------------
    def fail(self, reason: str, quiet: bool = False) -> None:
        if self.failed is None:
            self.failed = reason
            if not quiet:
                print(f"rdmaflow mount {self.label}: {reason}; every operation now fails with EIO",
                  file=sys.stderr, flush=True)

    def _node(self, path: str) -> Node:
        node = self.nodes.get(path)
        if node is None:
            raise FuseOSError(errno.ENOENT)
        return node

    def _check(self) -> None:
        if self.failed is not None:
            raise FuseOSError(errno.EIO)

    # -- namespace ---------------------------------------------------------------------------
    def init(self, path) -> None:
        self.mounted.set()

    def getattr(self, path, fh=None):
        t = self._t
        base = {"st_uid": 0, "st_gid": 0, "st_atime": t, "st_mtime": t, "st_ctime": t}
        if path in self.dirs:
            return dict(base, st_mode=stat.S_IFDIR | 0o755, st_nlink=2, st_size=0)
        node = self._node(path)
        mode = {"meta": 0o444, "grad": 0o644, "weights": 0o444}[node.kind]
        changed = self._mtime[node.kind]
        return dict(base, st_mode=stat.S_IFREG | mode, st_nlink=1, st_size=node.size, st_mtime=changed,
                    st_ctime=changed)

    def readdir(self, path, fh):
        if path not in self.dirs:
            raise FuseOSError(errno.ENOENT)
        return [".", "..", *self.dirs[path]]

    def open(self, path, flags):
        self._node(path)
        fh = next(self._fh)
        if flags & os.O_DSYNC:  # O_SYNC includes it
            self._dsync.add(fh)
        self._opener[fh] = _caller_process()
        return fh

    def create(self, path, mode, fi=None):
        raise FuseOSError(errno.EACCES)  # the layout is the model's: no new files

    def _fixed(self, *_args):
        raise FuseOSError(errno.EPERM)  # the names and modes are the model's: rm, mv, mkdir, chmod refused

    unlink = rmdir = mkdir = mknod = rename = link = symlink = chmod = chown = _fixed

    def truncate(self, path, length, fh=None):
        self._node(path)  # O_TRUNC changes nothing: a file is as large as its part of the model

    def release(self, path, fh):
        self._wrote.pop(fh, None)
        self._dsync.discard(fh)
        self._opener.pop(fh, None)

    # -- data --------------------------------------------------------------------------------
    def read_into(self, path, dest: int, size: int, offset: int, fh) -> int:
        node = self._node(path)
        if node.kind == "meta":
            chunk = self.metadata[offset : offset + size]
            ctypes.memmove(dest, chunk, len(chunk))
            return len(chunk)
        with self._interruptible(), self.gate.shared(self.step_timeout, "a read", interrupted):
            self._check()
            if offset >= node.size:
                return 0
            try:
                return self.flat.read_into(node.kind, node.offset + offset, min(size, node.size - offset), dest,
                                           interrupted)
            except RdmaflowError as e:
                self.fail(f"a read at byte {node.offset + offset} failed: {e}")
                raise FuseOSError(errno.EIO) from None

    def write_from(self, path, src: int, size: int, offset: int, fh) -> int:
        node = self._node(path)
        if node.kind != "grad":
            raise FuseOSError(errno.EBADF)
        try:
            if offset < 0 or offset + size > node.size:
                raise FuseOSError(errno.EINVAL)
            with self._interruptible(), self.gate.shared(self.step_timeout, "a write", interrupted):
                self._check()
                try:
                    self.flat.write(node.offset + offset, (ctypes.c_char * size).from_address(src), fh in self._dsync,
                                    interrupted)
                except RdmaflowError as e:
                    self.fail(f"a write at byte {node.offset + offset} failed: {e}")
                    raise FuseOSError(errno.EIO) from None
                self._wrote[fh] = self.steps
                self._mtime["grad"] = time.time_ns()
        except OSError as e:  # FuseOSError, the gate's ETIMEDOUT, flat's EINVAL, EINTR: this step is spoilt
            # (an interrupted request added nothing, but the kernel's earlier pieces of its write may have)
            if self._refused is None:
                self._refused = e.errno or errno.EIO
            raise
        return size

    # mfusepy's own interface, with bytes (BufferFUSE calls the two above instead).
    def read(self, path, size, offset, fh):
        buf = ctypes.create_string_buffer(size)
        return buf.raw[: self.read_into(path, ctypes.addressof(buf), size, offset, fh)]

    def write(self, path, data, offset, fh):
        buf = ctypes.create_string_buffer(bytes(data), len(data))
        return self.write_from(path, ctypes.addressof(buf), len(data), offset, fh)

    def fsync(self, path, datasync, fh):
        if self._node(path).kind == "grad":
            self._step(path)

    def flush(self, path, fh):
        # Closing a gradient file that wrote into this step pushes it (every close calls flush),
        # when the process that opened it closes it: not a forked child (a DataLoader worker)
        # closing its inherited copy, in the middle of the parent's step.
        if self._node(path).kind == "grad" and self._wrote.get(fh) == self.steps:
            opener, caller = self._opener.get(fh), _caller_process()
            if opener is None or caller is None or opener == caller:
                self._step(path)

    @staticmethod
    @contextmanager
    def _interruptible():
        """A request whose client gave up (a signal: Ctrl-C, kill) while it waited for weights
        or a step answers EINTR at once, with nothing done: the kernel holds the client until
        the mount answers, fatal signals included."""
        try:
            yield
        except InterruptedError:
            raise FuseOSError(errno.EINTR) from None

    def _step(self, path: str) -> None:
        with self._interruptible(), self.gate.exclusive(self.step_timeout, "a push", interrupted):
            self._check()
            if self._refused is not None:
                # Part of a refused write may have been added (the kernel's earlier requests of
                # it were): the step's sum is discarded, not pushed, and a new one starts.
                code, self._refused = self._refused, None
                # Nothing was written into the new step: closing a descriptor now pushes nothing.
                self._wrote = {fh: s for fh, s in self._wrote.items() if s != self.steps}
                try:
                    self.flat.discard()
                except RdmaflowError as e:
                    self.fail(f"discarding step {self.steps + 1} after a refused write failed: {e}")
                    raise FuseOSError(errno.EIO) from None
                print(f"rdmaflow mount {self.label}: push refused: a write into step {self.steps + 1} was refused "
                      f"({errno.errorcode.get(code, code)}); the step's gradient is discarded, write it again",
                      file=sys.stderr, flush=True)
                raise FuseOSError(code)
            partial = self.flat.incomplete()
            if partial:
                print(f"rdmaflow mount {self.label}: push refused: elements at byte offsets {partial[:5]} "
                      "are only partly written", file=sys.stderr, flush=True)
                raise FuseOSError(errno.EINVAL)
            try:
                self.flat.step(interrupted)
            except RdmaflowError as e:
                self.fail(f"step {self.steps + 1} failed: {e}")
                raise FuseOSError(errno.EIO) from None
            self.steps += 1
            self._mtime["weights"] = time.time_ns()


def _caller_process() -> int | None:
    """The process (thread group id) of the thread calling the current FUSE operation; None if
    unknown. FUSE gives the calling thread's id."""
    try:
        tid = fuse_get_context()[2]
        with open(f"/proc/{tid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Tgid:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None
