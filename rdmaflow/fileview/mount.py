"""``rdmaflow mount MOUNTPOINT --model DECL.json``: a parameter-server worker that serves the
job's model as files, so that any language trains with plain ``pwrite``/``fsync``/``pread``
(iRDMA §IV-D, "Interoperability").

Start it like any worker: under ``rdmaflow launch`` or torchrun (shards run ``ps.init()`` here
and exit with the job), or with the ``RDMAFLOW_ROLE`` variables. ``{worker}`` in MOUNTPOINT
becomes the worker's index, so that several workers on one host mount at different places.

The filesystem runs libfuse's multi-threaded loop in a thread; the main thread waits for
SIGTERM, SIGINT or SIGHUP, or for an outside ``fusermount3 -u``. On a signal it tells the job
if requests are in flight (they fail with EIO, and the job is aborted with the reason), unmounts
(lazily, so that open files cannot keep a stale mount), and closes the worker."""
from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from rdmaflow import InvalidArgumentError, RdmaflowError
from rdmaflow.deadline import Deadline
from rdmaflow.fileview.fuse import abort_connection, connection_of, fuse_problem, is_mounted, unmount
from rdmaflow.fileview.model import load_declaration
from rdmaflow.ps import MODES, POLICIES
from rdmaflow.ps.context import resolve_role
from rdmaflow.ps.layout import DEFAULT_BLOCK_BYTES
from rdmaflow.ps.worker import checked_staleness

MOUNT_TIMEOUT = 30.0   # seconds for libfuse to mount, or to finish after an unmount
MAX_THREADS = 64       # libfuse's worker threads: requests in flight at once
LINGER = 2.0           # seconds for libfuse to end by itself after the unmount, before its connection is aborted
STEP_LINGER = 5.0      # seconds an unmount waits for the weights of the last push before it leaves the step undone
ABORT_CHECK = 1.0      # seconds between looks at the job's abort key while idle
UNMOUNTING = "the file view is unmounting"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("mountpoint", help="an empty directory; {worker} becomes the worker's index")
    p.add_argument("--model", required=True, help="the model declaration (JSON: variables, optimizer)")
    p.add_argument("--mode", choices=MODES, default="sync", help="consistency mode (default sync)")
    p.add_argument("--staleness", type=int, default=0, help="bounded mode: the most steps ahead of the slowest")
    p.add_argument("--policy", choices=POLICIES, default="block", help="placement (default block)")
    p.add_argument("--block-bytes", type=int, default=DEFAULT_BLOCK_BYTES, help="block size of the block policy")
    p.add_argument("--debug", action="store_true", help="libfuse's debug output")


def check_mountpoint(path: str) -> str:
    path = os.path.abspath(path)
    if is_mounted(path):
        raise InvalidArgumentError(f"mountpoint {path} is already a mount point (a stale mount? fusermount3 -u {path})")
    if not os.path.exists(path):
        raise InvalidArgumentError(f"mountpoint {path} does not exist: create an empty directory there")
    if not os.path.isdir(path):
        raise InvalidArgumentError(f"mountpoint {path} is not a directory")
    if os.listdir(path):
        raise InvalidArgumentError(f"mountpoint {path} is not empty")
    return path


def run(args) -> int:
    try:
        return serve(args)
    except RdmaflowError as e:
        print(f"rdmaflow mount: {e}", file=sys.stderr, flush=True)
        return 1


def serve(args) -> int:
    problem = fuse_problem()
    if problem:
        raise InvalidArgumentError(problem)
    decl = load_declaration(args.model)
    role = resolve_role()
    mountpoint = args.mountpoint.replace("{worker}", str(role.index))
    if role.kind == "worker":
        mountpoint = check_mountpoint(mountpoint)  # before joining the job: a bad mountpoint fails at once
    # So is what every process would refuse later, the shards once they had waited for a worker
    # that had already failed: the optimizer, the placement (block size), the staleness.
    model, optimizer = decl.build()
    metadata = decl.metadata(role.num_shards, args.policy, args.block_bytes, args.mode)
    checked_staleness(args.mode, args.staleness)
    from rdmaflow import ps

    ctx = ps.init()  # a shard serves inside and exits with the job
    label = f"worker {ctx.role.index} at {mountpoint}"
    opt = ps.DistributedOptimizer(model, optimizer, mode=args.mode, staleness=args.staleness, policy=args.policy,
                                  block_bytes=args.block_bytes, overlap=False, zero_copy=True, progress=False)
    from rdmaflow.fileview.binding import BufferFUSE
    from rdmaflow.fileview.files import ModelFiles
    from rdmaflow.fileview.flat import FlatModel

    files = ModelFiles(FlatModel(opt, list(model.parameters()), ctx.step_timeout), decl, metadata,
                       step_timeout=ctx.step_timeout, label=label)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        # Installed before libfuse starts, which then leaves these signals to us.
        signal.signal(sig, lambda *_: stop.set())
    errors: list[BaseException] = []

    def loop() -> None:
        try:
            BufferFUSE(files, mountpoint, foreground=True, nothreads=False, debug=args.debug, direct_io=True,
                 max_threads=MAX_THREADS, max_idle_threads=MAX_THREADS, fsname="rdmaflow", subtype="rdmaflow")
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    thread = threading.Thread(target=loop, name="rdmaflow-fuse", daemon=True)
    thread.start()
    ok = False
    try:
        _wait(lambda: files.mounted.is_set() or not thread.is_alive(), MOUNT_TIMEOUT)
        if not files.mounted.is_set():
            reason = (f"libfuse did not mount {mountpoint} within {MOUNT_TIMEOUT:.0f} s"
                      + (f": {errors[0]}" if errors else ""))
            ctx.store.abort(f"{label}: {reason}")  # the shards and other workers stop with the reason
            raise RdmaflowError(reason)
        conn = connection_of(mountpoint)
        print(f"rdmaflow mount: {label}: serving {len(decl.variables)} variables, {decl.total_bytes} bytes, "
              f"mode {args.mode}", flush=True)
        _serve_until_stopped(thread, stop, files, ctx.store)
        if thread.is_alive():
            _stop(thread, files, ctx.store, mountpoint, conn, label)
        ok = files.failed in (None, UNMOUNTING)
    finally:
        if is_mounted(mountpoint):
            unmount(mountpoint)
        if ok:
            opt.close()
        else:
            ctx.device.close()
    print(f"rdmaflow mount: {label}: unmounted after {files.steps} steps", flush=True)
    return 0 if ok else 1


def _serve_until_stopped(thread: threading.Thread, stop: threading.Event, files, store) -> None:
    """Until a signal, an outside unmount, or the job's abort (then every operation fails with EIO)."""
    next_check = 0.0
    while thread.is_alive() and not stop.wait(0.2):
        if time.monotonic() >= next_check:
            next_check = time.monotonic() + ABORT_CHECK
            reason = store.aborted()  # also when the store is gone: the job is over
            if reason:
                files.fail(f"the job was aborted: {reason}")
                return


def _stop(thread: threading.Thread, files, store, mountpoint: str, conn: int | None, label: str) -> None:
    reason = None
    if files.failed is None and files.gate.busy:
        reason = f"{label} was unmounted with requests in flight"
    elif files.failed is None and not files.flat.landed(STEP_LINGER):
        reason = f"{label} was unmounted with step {files.steps} pushed and its weights not in"
    if reason:
        store.abort(reason)    # the job is told; a waiting request fails and answers EIO
        files.fail(reason)
    else:
        files.fail(UNMOUNTING, quiet=True)
    unmount(mountpoint)
    thread.join(LINGER)
    if thread.is_alive():
        # Files still open keep a lazily unmounted filesystem alive: end the connection.
        abort_connection(conn)
        thread.join(MOUNT_TIMEOUT)
    if thread.is_alive():
        print(f"rdmaflow mount: {label}: libfuse did not stop within {MOUNT_TIMEOUT:.0f} s", file=sys.stderr)


def _wait(cond, timeout: float) -> bool:
    deadline = Deadline(timeout)
    while not cond():
        if deadline.passed():
            return False
        time.sleep(deadline.slice(0.05))
    return True
