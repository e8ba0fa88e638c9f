"""``rdmaflow bench file``: a training step through the file view, fio-style (iRDMA Figure 5).

One step = write the whole gradient in ``block``-sized requests, ``fsync`` (push), read the
whole weights in ``block``-sized requests (each waits for its part of the new weights).
Synchronous I/O (queue depth 1) issues the requests one after another; asynchronous I/O (queue
depth 32) keeps 32 in flight with Linux AIO, as iRDMA's libaio clients do (libfuse's
multi-threaded loop serves them concurrently). Both open the files ``O_DSYNC``, so a write
completes once its bytes are in the shards' memory, as a block request to iRDMA's server does.
The plain client (queue depth 1, no ``O_DSYNC``) is what a loop of ``pwrite`` gets: a write
returns once posted, and ``fsync`` waits for the rest. Next to them, in the same run, the same
model stepped through ``DistributedOptimizer``'s push and pull. Each side is a real job: one
shard and one worker (`rdmaflow mount`, or the Python worker), over UCX ``--transport``.

Throughput is gradient plus weight bytes per second of a step. The JSON has each file step's
split into writing, pushing (fsync) and reading: what bounds the file path.
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import statistics
import sys
import tempfile
import time

from rdmaflow.bench import flags, plots, processes
from rdmaflow.bench import harness as h
from rdmaflow.bench.aio import PREAD, PWRITE, Aio, aio_problem

BARS = [("file-qd32", "file-qd1", 1.5), ("file-qd32", "python-api", 0.3)]
BAR_POINT = 1 << 20
START_TIMEOUT = 180.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    flags.add_sizes(p, "4K,64K,1M,4M", "request (block) sizes (default 4K,64K,1M,4M)")
    p.add_argument("--model-bytes", default="16M", help="size of the model, float32 (default 16M)")
    p.add_argument("--steps", type=int, default=5, help="steps per measurement (default 5)")
    flags.add_repeats(p, 3, "each --steps steps (default 3)")
    p.add_argument("--depths", default="1,32", help="queue depths (default 1,32)")
    flags.add_transport(p, ("tcp",), note="one per run")
    p.add_argument("--no-plain", action="store_true",
                   help="leave out the plain client (queue depth 1, no O_DSYNC: writes return once posted)")
    flags.add_out(p, "bench-results/file", "file.csv, file.json and file.png (default bench-results/file)")


def _declaration(path: str, nbytes: int) -> None:
    n = max(1, nbytes // 4)
    with open(path, "w") as f:
        json.dump({"variables": [{"name": "flat", "shape": [n], "dtype": "float32", "init": 0.0}],
                   "optimizer": {"name": "SGD", "lr": 0.001}}, f)


def _start_job(argv: list[str], label: str, transport: str, logdir: str) -> list[processes.ChildProcess]:
    """A shard (rank 0) and a worker (rank 1), each running ``argv``."""
    port, secret, procs = processes.free_port(), processes.new_secret(), []
    for rank, role in enumerate(("shard", "worker")):
        env = processes.process_env(transport, secret=secret, threads=1)
        env.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RDMAFLOW_SHARDS_PER_NODE="1")
        procs.append(processes.ChildProcess([sys.executable, *argv], env, f"{label}-{role}", stdin=False,
                                    log=os.path.join(logdir, f"{label}-{role}.log")))
    return procs


def _wait_mounted(path: str, procs: list[processes.ChildProcess]) -> None:
    deadline = time.monotonic() + START_TIMEOUT
    while not os.path.exists(os.path.join(path, "model.json")):
        for p in procs:
            if p.poll() is not None:
                raise processes.BenchError(f"{p.label} exited ({p.poll()}):\n{p.output()[-2000:]}")
        if time.monotonic() > deadline:
            raise processes.BenchError(f"the file view did not mount within {START_TIMEOUT:.0f} s")
        time.sleep(0.1)


class Clients:
    """The file clients of a run, each a pair of descriptors (gradient, weights) and buffers the
    size of the model, as a training loop has: ``sync`` issues one request at a time
    (``pwrite``/``preadv``), ``aio`` keeps ``depth`` in flight with Linux AIO (``O_DIRECT``; a
    thread pool would not: the kernel serializes a file's direct writes, rdmaflow/bench/aio.py).
    ``through`` opens with ``O_DSYNC``: each write returns once its bytes are in the shards'
    memory (iRDMA's block requests); without it a write returns once posted and the push waits."""

    def __init__(self, mnt: str, nbytes: int, through: bool, direct: bool):
        flags = (os.O_DSYNC if through else 0) | (os.O_DIRECT if direct else 0)
        self.grad = os.open(os.path.join(mnt, "grad"), os.O_WRONLY | flags)
        self.weights = os.open(os.path.join(mnt, "weights"), os.O_RDONLY | flags)
        self.buf = mmap.mmap(-1, 2 * nbytes)  # gradient, then weights; page-aligned for O_DIRECT
        self.view = memoryview(self.buf)
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        self.nbytes = nbytes

    def step(self, block: int, aio: Aio | None) -> tuple[float, float, float]:
        """One step through the mount; returns the seconds spent writing, pushing and reading."""
        n = self.nbytes
        reqs = [(at, min(block, n - at)) for at in range(0, n, block)]
        t0 = time.perf_counter()
        if aio:
            aio.run(self.grad, PWRITE, [(self.addr + at, k, at) for at, k in reqs])
        else:
            for at, k in reqs:
                if os.pwrite(self.grad, self.view[at : at + k], at) != k:
                    raise processes.BenchError("short write")
        t1 = time.perf_counter()
        os.fsync(self.grad)
        t2 = time.perf_counter()
        if aio:
            aio.run(self.weights, PREAD, [(self.addr + n + at, k, at) for at, k in reqs])
        else:
            for at, k in reqs:
                if os.preadv(self.weights, [self.view[n + at : n + at + k]], at) != k:
                    raise processes.BenchError("short read")
        return t1 - t0, t2 - t1, time.perf_counter() - t2

    def close(self) -> None:
        os.close(self.grad)
        os.close(self.weights)
        self.view.release()
        self.buf.close()


def measure_files(mnt: str, nbytes: int, sizes: list[int], depths: list[int], steps: int, repeats: int,
                  m: h.Measurements, profile: list[dict], plain: bool) -> None:
    # (system, queue depth, through, O_DIRECT)
    cells = [(f"file-qd{qd}", qd, True, qd > 1) for qd in depths]
    if plain:
        cells.append(("file-plain-qd1", 1, False, False))
    clients = {c[0]: Clients(mnt, nbytes, c[2], c[3]) for c in cells}
    try:
        for _ in range(repeats):
            for size in sizes:
                for system, qd, _through, _direct in cells:
                    with contextlib.ExitStack() as stack:
                        aio = stack.enter_context(Aio(qd)) if qd > 1 else None
                        clients[system].step(size, aio)  # warm-up
                        parts = [clients[system].step(size, aio) for _ in range(steps)]
                    total = sum(sum(p) for p in parts)
                    m.add(system, size, 2 * nbytes * steps / total / 1e9)
                    profile.append({"system": system, "qd": qd, "block": size,
                                    "write_s": statistics.median(p[0] for p in parts),
                                    "push_s": statistics.median(p[1] for p in parts),
                                    "read_s": statistics.median(p[2] for p in parts)})
    finally:
        for c in clients.values():
            c.close()


def run(args) -> int:
    try:  # refused here, before a job starts (they failed after it, as tracebacks)
        sizes = h.parse_sizes(args.sizes)
        depths = [int(d) for d in args.depths.split(",") if d.strip()]
        nbytes = h.parse_size(args.model_bytes) // 4 * 4
        transport = flags.transports(args.transport, one=True)[0]
    except ValueError as e:
        print(f"error: --sizes, --depths, --model-bytes, --transport: {e}", file=sys.stderr)
        return 2
    if not sizes or min(sizes) < 1 or not depths or min(depths) < 1 or nbytes < 4 or args.steps < 1 \
            or args.repeats < 1:
        print("error: --sizes, --depths, --steps and --repeats must be >= 1, --model-bytes >= 4", file=sys.stderr)
        return 2
    from rdmaflow.fileview import fuse_problem, unmount

    problem = fuse_problem() or (aio_problem() if any(d > 1 for d in depths) else None)
    if problem:
        print(f"rdmaflow bench file: {problem}", file=sys.stderr)
        return 1
    os.makedirs(args.out, exist_ok=True)
    m = h.Measurements("GB/s")
    profile: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rdmaflow-bench-file-") as tmp:
        decl = os.path.join(tmp, "model.json")
        _declaration(decl, nbytes)
        mnt = os.path.join(tmp, "mnt")
        os.mkdir(mnt)
        procs = _start_job(["-m", "rdmaflow", "mount", mnt, "--model", decl], "mount", transport, args.out)
        try:
            _wait_mounted(mnt, procs)
            measure_files(mnt, nbytes, sizes, depths, args.steps, args.repeats, m, profile, not args.no_plain)
            procs[1].signal(15)  # SIGTERM: the mount unmounts and leaves the job
            procs[1].wait(60)
        finally:
            for p in procs:
                p.close(grace=10)
            unmount(mnt)
        api_steps = (args.steps + 1) * args.repeats
        procs = _start_job(["-m", "rdmaflow.bench._file_api_worker", "--model", decl, "--steps", str(api_steps)],
                           "api", transport, args.out)
        try:
            if procs[1].wait(START_TIMEOUT + 60 * api_steps) != 0:
                raise processes.BenchError(f"the Python API worker failed:\n{procs[1].output()[-2000:]}")
            times = [json.loads(line)["step_s"] for line in procs[1].output().splitlines()
                     if line.startswith('{"step_s"')]
        finally:
            for p in procs:
                p.close(grace=10)
    per_repeat = [times[i * (args.steps + 1) + 1 : (i + 1) * (args.steps + 1)] for i in range(args.repeats)]
    for rep in per_repeat:
        for size in sizes:  # the API path has no request size: the same values on every row
            m.add("python-api", size, 2 * nbytes * len(rep) / sum(rep) / 1e9)
    bars = h.check_bars(m, BARS, [BAR_POINT])
    h.write_csv(os.path.join(args.out, "file.csv"), h.MEASUREMENT_COLUMNS, m.rows())
    h.write_json(os.path.join(args.out, "file.json"), {"model_bytes": nbytes, "steps": args.steps,
                                                       "transport": transport, "profile": profile,
                                                       "bars": bars})
    print(h.ratio_table(m, "file-qd32", point_label=h.format_size,
                        title=f"gradient + weights GB/s per step, {h.format_size(nbytes)} model, median [min-max]"))
    for b in bars:
        print(f"{b['num']} / {b['den']} at {h.format_size(b['point'])}: {b['ratio'] and round(b['ratio'], 2)}x  "
              f"target: >= {b['bar']}x  {b['verdict']}")
    plots.line_plot(os.path.join(args.out, "file.png"), m, xlabel="request size", ylabel="GB/s", sizes=True,
                title="Training step through the file view: synchronous (qd 1) and asynchronous (qd 32) I/O "
                      "next to the Python API (iRDMA Figure 5)")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rdmaflow bench file", description=__doc__.splitlines()[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
