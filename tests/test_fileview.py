"""The model as files (issue 17): real jobs of a shard and `rdmaflow mount` workers, over UCX
tcp, with clients that use only POSIX file I/O.

- Two workers train through their mounts with plain os.pwrite/os.pread/os.fsync (the training
  processes load no rdmaflow module, which they report) and end with the parameters of single-process SGD on the
  concatenated batches.
- A C program, compiled here, does one step through the mount.
- Every error: a missing path, a write past the end, a write to a read-only file, a push with
  half-written elements, a shard that dies (EIO), an unmount with a request in flight (it fails
  with EIO and the job is told), a bad mountpoint, a job that cannot be reached.
No test leaves a mount behind: every mountpoint is unmounted (lazily) at the end.

Skipped, with the reason, only where the machine has no FUSE (/dev/fuse, libfuse, mfusepy).
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib.util
import itertools
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import HERE
from test_ps import DETECT_TIMEOUT, JOB_TIMEOUT, Job, base_env, free_port

from rdmaflow.fileview import fuse_problem, is_mounted, unmount

pytestmark = pytest.mark.skipif(fuse_problem() is not None, reason=f"no FUSE here: {fuse_problem()}")

CLIENT = os.path.join(HERE, "fileview_jobs", "train_files.py")
_spec = importlib.util.spec_from_file_location("train_files", CLIENT)
client = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(client)

N_IN, N_OUT = 6, 3
START_TIMEOUT = 2 * JOB_TIMEOUT  # three processes importing torch on a loaded 2-core machine
LR, MOMENTUM = 0.05, 0.5


def declaration(path, init_w=0.0, init_b=0.0) -> str:
    doc = {"variables": [{"name": "weight", "shape": [N_OUT, N_IN], "dtype": "float32", "init": init_w},
                         {"name": "bias", "shape": [N_OUT], "dtype": "float32", "init": init_b}],
           "optimizer": {"name": "SGD", "lr": LR, "momentum": MOMENTUM}}
    path.write_text(json.dumps(doc))
    return str(path)


class MountJob(Job):
    """A job whose every process runs `rdmaflow mount DIR/mnt{worker}`; at exit every mount is
    undone, and a test fails if one was left behind."""

    def start_mounts(self, workers: int, shards: int, decl: str, *args: str, extra: dict | None = None):
        self.mounts = []
        port = free_port()
        local = workers + shards
        for w in range(workers):
            os.makedirs(self.dir / f"mnt{w}")
            self.mounts.append(str(self.dir / f"mnt{w}"))
        for rank in range(local):
            name = f"shard{rank}" if rank < shards else f"worker{rank - shards}"
            env = self.env(dict(RANK=str(rank), WORLD_SIZE=str(local), LOCAL_RANK=str(rank),
                                LOCAL_WORLD_SIZE=str(local), GROUP_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), RDMAFLOW_SHARDS_PER_NODE=str(shards), **(extra or {})))
            self.spawn(name, [sys.executable, "-m", "rdmaflow", "mount", str(self.dir / "mnt{worker}"),
                              "--model", decl, *args], env)
        for w in range(workers):
            self.wait_output(f"worker{w}", "serving", START_TIMEOUT)
        return self

    def stop_mount(self, w: int) -> int:
        """SIGTERMs worker w's mount; returns its exit status (bounded)."""
        p = self.proc(f"worker{w}")
        p.popen.send_signal(signal.SIGTERM)
        return self.wait(DETECT_TIMEOUT, [p])[p.name]

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        stale = [m for m in getattr(self, "mounts", []) if is_mounted(m)]
        for m in stale:
            unmount(m)
        assert not stale, f"mounts left behind: {stale}"


def reference(workers: int, steps: int) -> np.ndarray:
    """Single-process SGD with momentum (torch's rule) on the concatenated batches."""
    w = np.zeros((N_OUT, N_IN))
    b = np.zeros(N_OUT)
    buf = None
    for step in range(steps):
        xs, ys = zip(*(client.batch(0, k, step, N_IN, N_OUT) for k in range(workers)))
        gw, gb = client.gradient(w, b, np.concatenate(xs), np.concatenate(ys))
        g = np.concatenate([gw.ravel(), gb])
        buf = g if buf is None else MOMENTUM * buf + g
        flat = np.concatenate([w.ravel(), b]) - LR * buf
        w, b = flat[: N_OUT * N_IN].reshape(N_OUT, N_IN), flat[N_OUT * N_IN :]
    return np.concatenate([w.ravel(), b])


def test_two_workers_train_through_files_like_single_process_sgd(tmp_path):
    steps = 6
    decl = declaration(tmp_path / "model.json")
    # Blocks of 16 bytes: the flat model is cut into many blocks that cut the variables.
    with MountJob(tmp_path, {}) as j:
        j.start_mounts(2, 1, decl, "--policy", "block", "--block-bytes", "16")
        clients = [subprocess.Popen([sys.executable, CLIENT, "--mount", j.mounts[w], "--worker", str(w),
                                     "--steps", str(steps), "--out", str(tmp_path / f"w{w}.npy")],
                                    stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for w in range(2)]
        for c in clients:
            out, _ = c.communicate(timeout=JOB_TIMEOUT)
            assert c.returncode == 0, out + j.logs()
            assert json.loads(out.strip().splitlines()[-1])["rdmaflow_modules"] == [], out  # plain file I/O only
        ref = reference(2, steps)
        for w in range(2):
            got = np.load(tmp_path / f"w{w}.npy")
            np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-6, err_msg=f"worker {w}")
        assert not np.allclose(ref, 0)
        for w in range(2):
            assert j.stop_mount(w) == 0, j.logs()
            assert not is_mounted(j.mounts[w])
        assert j.wait(DETECT_TIMEOUT)["shard0"] == 0, j.logs()


def mse(flat: np.ndarray, workers: int, step: int) -> float:
    w, b = flat[: N_OUT * N_IN].reshape(N_OUT, N_IN), flat[N_OUT * N_IN :]
    xs, ys = zip(*(client.batch(0, k, step, N_IN, N_OUT) for k in range(workers)))
    return float(np.mean((np.concatenate(xs) @ w.T + b - np.concatenate(ys)) ** 2))


@pytest.mark.parametrize("mode", ["async", "bounded"])
def test_asynchronous_modes_train_through_files(tmp_path, mode):
    """The modes keep their meaning through the mount: each worker's push is applied on arrival,
    and the model learns (the loss on held-out batches falls to a quarter)."""
    steps = 25
    decl = declaration(tmp_path / "model.json")
    with MountJob(tmp_path, {}) as j:
        j.start_mounts(2, 1, decl, "--mode", mode, *(["--staleness", "1"] if mode == "bounded" else []))
        clients = [subprocess.Popen([sys.executable, CLIENT, "--mount", j.mounts[w], "--worker", str(w),
                                     "--steps", str(steps), "--out", str(tmp_path / f"w{w}.npy")],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for w in range(2)]
        for c in clients:
            out, _ = c.communicate(timeout=JOB_TIMEOUT)
            assert c.returncode == 0, out + j.logs()
        initial = mse(np.zeros(N_OUT * N_IN + N_OUT), 2, 999)
        for w in range(2):
            assert mse(np.load(tmp_path / f"w{w}.npy").astype(np.float64), 2, 999) < initial / 4
        for w in range(2):
            assert j.stop_mount(w) == 0, j.logs()
        assert j.wait(DETECT_TIMEOUT)["shard0"] == 0, j.logs()


C_CLIENT = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
/* One step through the mount: read the weights, write a gradient of ones, fsync, read again. */
int main(int argc, char **argv) {
  char path[4096];
  float before[%(n)d], after[%(n)d], grad[%(n)d];
  snprintf(path, sizeof path, "%%s/weights", argv[1]);
  int wfd = open(path, O_RDONLY);
  snprintf(path, sizeof path, "%%s/grad", argv[1]);
  int gfd = open(path, O_WRONLY);
  if (wfd < 0 || gfd < 0) { perror("open"); return 1; }
  if (pread(wfd, before, sizeof before, 0) != sizeof before) { perror("pread"); return 1; }
  for (int i = 0; i < %(n)d; i++) grad[i] = 1.0f;
  if (pwrite(gfd, grad, sizeof grad, 0) != sizeof grad) { perror("pwrite"); return 1; }
  if (fsync(gfd) != 0) { perror("fsync"); return 1; }
  if (pread(wfd, after, sizeof after, 0) != sizeof after) { perror("pread"); return 1; }
  for (int i = 0; i < %(n)d; i++) printf("%%g %%g\n", before[i], after[i]);
  close(gfd);
  close(wfd);
  return 0;
}
"""


def test_c_client_does_one_step(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    n = N_OUT * N_IN + N_OUT
    src = tmp_path / "step.c"
    src.write_text(C_CLIENT % {"n": n})
    subprocess.run([cc, "-O1", "-o", str(tmp_path / "step"), str(src)], check=True, timeout=120)
    decl = declaration(tmp_path / "model.json", init_w=1.5, init_b=-2.0)
    with MountJob(tmp_path, {}) as j:
        j.start_mounts(1, 1, decl)
        out = subprocess.run([str(tmp_path / "step"), j.mounts[0]], capture_output=True, text=True, timeout=60,
                             check=False)
        assert out.returncode == 0, out.stdout + out.stderr + j.logs()
        pairs = np.array([[float(x) for x in line.split()] for line in out.stdout.split("\n") if line])
        expect_before = np.array([1.5] * (N_OUT * N_IN) + [-2.0] * N_OUT)
        np.testing.assert_allclose(pairs[:, 0], expect_before)
        np.testing.assert_allclose(pairs[:, 1], expect_before - LR * 1.0, rtol=1e-6)
        assert j.stop_mount(0) == 0, j.logs()


def _aio_writes(fd: int, requests: list[tuple[int, bytes]]) -> None:
    from rdmaflow.bench.aio import PWRITE, Aio

    bufs = [ctypes.create_string_buffer(data, len(data)) for _, data in requests]
    with Aio(32) as aio:
        aio.run(fd, PWRITE, [(ctypes.addressof(b), len(data), at) for b, (at, data) in zip(bufs, requests)])


def _cut(rng, lo: int, hi: int, unit: int, count: int) -> list[tuple[int, int]]:
    """[lo, hi) cut at ``count`` random multiples of ``unit``, as (start, stop) pairs."""
    cuts = sorted({lo, hi, *(rng.integers(lo // unit + 1, hi // unit, count) * unit).tolist()})
    return list(itertools.pairwise(cuts))


@pytest.mark.parametrize("client", ["aio-dsync", "threads"])
def test_concurrent_writes_push_exactly_their_sum(tmp_path, client):
    """Many writes in flight at once: Linux AIO on O_DIRECT|O_DSYNC descriptors (each write
    returns once its bytes are in the shard's memory), or a thread pool of plain pwrites (each
    returns once posted). Blocks of 4 KiB (1024 elements), each step's writes in random order:

    - blocks 0-2 written once, cut at random elements: the step does not send them again, so
      the writes' own WRITEs must have put every element in place;
    - block 3 cut at random bytes (elements split between writes) and block 4 written, then
      partly written again: the step sends both again, after a fence;
    - block 5 written in step 1 only: step 2 sends its zeros (its slot still holds step 1's).

    The second step's writes come right behind the first step's fsync, so they wait for the
    blocks' new weights (delivered in chunks of 4 KiB). The weights end as SGD on the sums."""
    n, lr, init = 6000, 1.0, 0.5
    decl = tmp_path / "model.json"
    decl.write_text(json.dumps({"variables": [{"name": "flat", "shape": [n], "dtype": "float32", "init": init}],
                                "optimizer": {"name": "SGD", "lr": lr}}))
    rng = np.random.default_rng(7)
    with MountJob(tmp_path, {}) as j:
        j.start_mounts(1, 1, str(decl), "--block-bytes", "4096", extra={"RDMAFLOW_PS_CHUNK_BYTES": "4096"})
        m = j.mounts[0]
        flags = os.O_DIRECT | os.O_DSYNC if client == "aio-dsync" else 0
        grad = os.open(f"{m}/grad", os.O_WRONLY | flags)
        expected = np.full(n, init, np.float32)
        pool = ThreadPoolExecutor(16)
        for step in range(2):
            g = rng.standard_normal(n).astype(np.float32)
            again = np.zeros(n, np.float32)
            again[4200:4700] = rng.standard_normal(500).astype(np.float32)
            if step == 1:
                g[5120:] = 0.0
            raw = g.tobytes()
            spans = _cut(rng, 0, 4 * 3072, 4, 20) + _cut(rng, 4 * 3072, 4 * 4096, 1, 20) + _cut(rng, 4 * 4096, 4 * 5120, 4, 5)
            if step == 0:
                spans += _cut(rng, 4 * 5120, 4 * n, 4, 3)
            requests = [(a, raw[a:b]) for a, b in spans]
            requests += [(4 * a, again[a : a + 100].tobytes()) for a in range(4200, 4700, 100)]
            requests = [requests[i] for i in rng.permutation(len(requests))]
            if client == "aio-dsync":
                _aio_writes(grad, requests)
            else:
                assert list(pool.map(lambda r: os.pwrite(grad, r[1], r[0]), requests)) == [len(d) for _, d in requests]
            os.fsync(grad)
            expected -= lr * (g + again)
        pool.shutdown()
        weights = os.open(f"{m}/weights", os.O_RDONLY)
        np.testing.assert_allclose(np.frombuffer(os.pread(weights, 4 * n, 0), np.float32), expected, rtol=1e-5,
                                   atol=1e-5)
        os.close(grad)
        os.close(weights)
        assert j.stop_mount(0) == 0, j.logs()


def _oserror(fn) -> int:
    try:
        fn()
    except OSError as e:
        return e.errno
    return 0


def test_bad_input_gets_posix_errors_and_a_dead_shard_gives_eio(tmp_path):
    decl = declaration(tmp_path / "model.json")
    with MountJob(tmp_path, {}) as j:
        j.start_mounts(1, 1, decl)
        m = j.mounts[0]
        size = (N_OUT * N_IN + N_OUT) * 4
        grad = os.open(f"{m}/grad", os.O_WRONLY)
        assert _oserror(lambda: os.open(f"{m}/no-such-file", os.O_RDONLY)) == errno.ENOENT
        assert _oserror(lambda: os.open(f"{m}/vars/nothing.grad", os.O_WRONLY)) == errno.ENOENT
        assert _oserror(lambda: os.pwrite(grad, b"\0" * 8, size - 4)) == errno.EINVAL
        bias = os.open(f"{m}/vars/bias.grad", os.O_WRONLY)
        assert _oserror(lambda: os.pwrite(bias, b"\0" * 16, 0)) == errno.EINVAL  # past the variable's end
        meta = os.open(f"{m}/model.json", os.O_RDWR)
        assert _oserror(lambda: os.pwrite(meta, b"{}", 0)) == errno.EBADF
        weights = os.open(f"{m}/weights", os.O_RDWR)
        assert _oserror(lambda: os.pwrite(weights, b"\0" * 4, 0)) == errno.EBADF
        # The names and modes are the model's ("Function not implemented" before).
        for change in (lambda: os.unlink(f"{m}/weights"), lambda: os.rename(f"{m}/grad", f"{m}/g"),
                       lambda: os.mkdir(f"{m}/d"), lambda: os.rmdir(f"{m}/vars"), lambda: os.chmod(f"{m}/grad", 0o600),
                       lambda: os.symlink("grad", f"{m}/g"), lambda: os.link(f"{m}/grad", f"{m}/g")):
            assert _oserror(change) == errno.EPERM
        mtimes = {name: os.stat(f"{m}/{name}").st_mtime_ns for name in ("grad", "weights")}
        # Writing a range twice adds twice; reading /grad shows this step's sum so far.
        one = np.ones(2, np.float32).tobytes()
        assert os.pwrite(grad, one, 0) == 8 and os.pwrite(grad, one, 0) == 8
        with open(f"{m}/grad", "rb", buffering=0) as f:
            np.testing.assert_array_equal(np.frombuffer(f.read(8), np.float32), [2.0, 2.0])
        # Three bytes of an element, then a push: refused; the fourth byte completes it.
        assert os.pwrite(grad, b"\0\0\0", 4) == 3
        assert _oserror(lambda: os.fsync(grad)) == errno.EINVAL
        assert os.pwrite(grad, b"\0", 7) == 1
        # Whole elements over bytes of an element still incomplete: refused too (they were added)
        assert os.pwrite(grad, b"\0", 8) == 1
        assert _oserror(lambda: os.pwrite(grad, b"\0" * 8, 4)) == errno.EINVAL
        assert os.pwrite(grad, b"\0\0\0", 9) == 3
        os.fsync(grad)
        time.sleep(1.5)  # past the kernel's attribute cache (1 s)
        for name in ("grad", "weights"):  # written, then pushed: both changed (the times never moved)
            assert os.stat(f"{m}/{name}").st_mtime_ns > mtimes[name], name
        flat = np.frombuffer(os.pread(weights, size, 0), np.float32)
        np.testing.assert_allclose(flat[:2], -LR * 2.0)  # SGD from zero: -lr x the gradient (2.0)
        with open(f"{m}/vars/bias.weights", "rb") as f:
            np.testing.assert_array_equal(np.frombuffer(f.read(), np.float32), flat[N_OUT * N_IN :])
        # A forked child (a DataLoader worker) that exits closes its copy of the descriptor: that
        # pushes nothing (it pushed the parent's half-written step); the parent's fsync does.
        assert os.pwrite(grad, one, 0) == 8
        child = os.fork()
        if child == 0:
            os._exit(0)
        assert os.waitpid(child, 0)[1] == 0
        np.testing.assert_array_equal(np.frombuffer(os.pread(weights, size, 0), np.float32), flat)
        os.fsync(grad)
        # SGD with momentum: the second step moves by lr x (momentum x 2.0 + 1.0)
        np.testing.assert_allclose(np.frombuffer(os.pread(weights, 8, 0), np.float32), -LR * (3.0 + MOMENTUM * 2.0))
        # A push with nothing written is a gradient of zeros for every variable, as any element
        # never written is: momentum still moves them (they were left alone before).
        os.fsync(grad)
        np.testing.assert_allclose(np.frombuffer(os.pread(weights, 8, 0), np.float32),
                                   -LR * (3.0 + MOMENTUM * 2.0) - LR * MOMENTUM * (1.0 + MOMENTUM * 2.0), rtol=1e-6)
        # The shard dies: the next push fails with EIO, and so does everything after it.
        j.proc("shard0").kill()
        j.wait(DETECT_TIMEOUT, [j.proc("shard0")])
        # The write fails at once if the mount already saw the job end (its store was on the shard).
        assert _oserror(lambda: os.pwrite(grad, b"\0" * 4, 0)) in (0, errno.EIO)
        assert _oserror(lambda: os.fsync(grad)) == errno.EIO
        assert _oserror(lambda: os.pread(weights, 4, 0)) == errno.EIO
        assert _oserror(lambda: os.pwrite(grad, b"\0" * 4, 0)) == errno.EIO
        assert _oserror(lambda: os.close(grad)) in (0, errno.EIO)  # closing may push: that fails too
        for fd in (bias, meta, weights):
            os.close(fd)
        assert j.stop_mount(0) != 0
        assert "every operation now fails with EIO" in j.proc("worker0").output(), j.logs()  # and says why
        assert not is_mounted(m)


@pytest.mark.parametrize("in_flight", ["read", "step"])
def test_unmount_with_a_step_in_flight_fails_it_and_tells_the_job(tmp_path, in_flight):
    """Two workers in sync mode; worker 0 pushes (fsync returns once the push has landed) and
    worker 1 never does, so step 1's weights never come. SIGTERM to worker 0's mount, with two
    reads of the weights waiting for them ("read": they fail with EIO) or with nothing waiting
    ("step": the mount gives the weights a few seconds): the mount is gone, and the job is
    aborted with the reason: the shard stops, and worker 1's idle mount unmounts itself."""
    decl = declaration(tmp_path / "model.json")
    with MountJob(tmp_path, {}) as j:
        j.start_mounts(2, 1, decl)
        m = j.mounts[0]
        grad = os.open(f"{m}/grad", os.O_WRONLY)
        weights = os.open(f"{m}/weights", os.O_RDONLY)
        os.pwrite(grad, b"\0" * 4, 0)
        os.fsync(grad)
        result: dict = {}
        # Two reads: one polls the shard's reply flag, the other sleeps until it moves.
        readers = [threading.Thread(target=lambda k=k: result.update({k: _oserror(lambda: os.pread(weights, 4, 4 * k))}),
                                    daemon=True) for k in range(2)]
        if in_flight == "read":
            for t in readers:
                t.start()
            time.sleep(1.0)  # let the reads reach the mount (no assertion depends on how long it takes)
        rc = j.stop_mount(0)
        if in_flight == "read":
            for t in readers:
                t.join(DETECT_TIMEOUT)
                assert not t.is_alive(), "a read in flight never returned"
            assert set(result.values()) <= {errno.EIO, errno.ENOTCONN} and len(result) == 2, result
        assert rc != 0, j.logs()
        assert not is_mounted(m)
        for fd in (grad, weights):
            assert _oserror(lambda fd=fd: os.close(fd)) in (0, errno.ENOTCONN)  # the connection was ended
        said = {"read": "unmounted with requests in flight", "step": "unmounted with step 1 pushed"}[in_flight]
        assert said in j.proc("worker0").output(), j.logs()
        rcs = j.wait(DETECT_TIMEOUT)
        assert rcs["shard0"] != 0 and rcs["worker1"] != 0, rcs
        assert said in j.proc("shard0").output(), j.logs()
        assert "the job was aborted" in j.proc("worker1").output(), j.logs()
        assert not is_mounted(j.mounts[1])  # the idle mount saw the abort and unmounted itself


def test_bad_mountpoint_and_unreachable_job(tmp_path, monkeypatch, capsys):
    """What `rdmaflow mount` refuses, each with its reason: once end to end (the command's exit
    status and message), the rest through the same code in this process."""
    import argparse

    from rdmaflow.fileview import mount as mount_cli

    decl = declaration(tmp_path / "model.json")
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RDMAFLOW_JOB_SECRET": secrets.token_hex(16),
           "RDMAFLOW_PS_TIMEOUT": "3"}
    out = subprocess.run([sys.executable, "-m", "rdmaflow", "mount", str(tmp_path / "missing"), "--model", decl],
                         env=base_env(env), capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 1 and "rdmaflow mount: mountpoint" in out.stderr and "does not exist" in out.stderr, (
        out.stderr)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    parser = argparse.ArgumentParser()
    mount_cli.add_arguments(parser)

    def refused(path: str, *extra: str, model: str = decl) -> str:
        capsys.readouterr()
        assert mount_cli.run(parser.parse_args([path, "--model", model, *extra])) == 1
        return capsys.readouterr().err

    for path, why in ((str(tmp_path / "missing"), "does not exist"), (decl, "is not a directory")):
        assert why in refused(path)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    assert "is not empty" in refused(str(tmp_path / "full"))
    (tmp_path / "mnt").mkdir()
    assert "cannot reach the job's c10d store" in refused(str(tmp_path / "mnt"))
    assert not is_mounted(tmp_path / "mnt")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"variables": [{"name": "w", "shape": [2], "dtype": "int8"}]}))
    assert "dtype 'int8'" in refused(str(tmp_path / "mnt"), model=str(bad))
    # Settings that every process would refuse once joined are refused before, by the shard too
    # (it used to wait for the worker that had failed until its timeout, without the reason).
    for extra, why in ((["--mode", "bounded", "--staleness", "-3"], "staleness must be >= 0"),
                       (["--mode", "sync", "--staleness", "2"], "applies to mode 'bounded' only"),
                       (["--block-bytes", "0"], "block size 0 is not a positive multiple")):
        for rank in ("1", "0"):  # a worker, a shard
            monkeypatch.setenv("RANK", rank)
            monkeypatch.setenv("LOCAL_RANK", rank)
            assert why in refused(str(tmp_path / "mnt"), *extra)


def test_bench_file_runs_and_writes_its_outputs(tmp_path):
    """A short run of `rdmaflow bench file`'s code path (no timing is asserted): both jobs run,
    every cell of every client (synchronous, asynchronous through Linux AIO, plain) is
    measured, and the table, CSV, JSON profile and plot are written."""
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "rdmaflow", "bench", "file", "--sizes", "64K,1M", "--model-bytes", "1M",
                        "--steps", "1", "--repeats", "1", "--out", str(out)],
                       env=base_env(), capture_output=True, text=True, timeout=400, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "file-qd32 / file-qd1 at 1M" in r.stdout, r.stdout
    rows = (out / "file.csv").read_text().splitlines()
    systems = {line.split(",")[0] for line in rows[1:]}
    files = {"file-qd1", "file-qd32", "file-plain-qd1"}
    assert systems == files | {"python-api"}, rows
    assert len(rows) == 1 + 4 * 2
    doc = json.loads((out / "file.json").read_text())
    assert {(p["system"], p["block"]) for p in doc["profile"]} == {(f, b) for f in files for b in (65536, 1 << 20)}
    assert (out / "file.png").stat().st_size > 0


def test_declarations_that_cannot_be_built_are_refused_by_name():
    """Each used to escape parse_declaration or build as a raw TypeError, RuntimeError (an
    allocation of 4e15 bytes) or OverflowError, which `rdmaflow mount` printed as a traceback."""
    import rdmaflow
    from rdmaflow.fileview.model import parse_declaration

    w = {"name": "w", "shape": [2]}
    for doc, said in [({"variables": [w], "optimizer": {"name": 5}}, "optimizer 5 is not a torch.optim class"),
                      ({"variables": [w], "optimizer": {"name": "lr_scheduler"}}, "is not a torch.optim class"),
                      ({"variables": [w], "optimizer": {"name": "LBFGS"}}, "on its shards; LBFGS is not supported"),
                      ({"variables": [dict(w, dtype=["float32"])]}, r"dtype \['float32'\] is not one of"),
                      ({"variables": [dict(w, shape=[True, 2])]}, "shape must be a list of non-negative integers"),
                      ({"variables": [dict(w, shape=[10**5] * 3)]}, "more than this host's memory"),
                      ({"variables": [dict(w, dtype="float16", init=1e10)]}, "does not fit float16"),
                      ({"variables": [dict(w, init=10**400)]}, "does not fit float32"),
                      # A misspelled key fell back to its default (SGD at lr 0.01, zeros) unsaid.
                      ({"variables": [w], "optimiser": {"name": "Adam"}},
                       "unknown key 'optimiser' \\(did you mean 'optimizer'\\?\\)"),
                      ({"variables": [dict(w, intit=1.0)]}, "variable w has an unknown key 'intit' \\(did you mean 'init'"),
                      ({"variables": [dict(w, size=[2])]}, r"unknown key 'size'; the keys are \['name'")]:
        with pytest.raises(rdmaflow.InvalidArgumentError, match=said):
            parse_declaration(doc).build()


def test_ctrl_c_during_bench_file_stops_it_cleanly(tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) while the mount is measured: the bench
    exits 130 with one line, no traceback (it printed one, or two), and leaves no mount and no
    process behind."""
    out = tmp_path / "out"
    env = dict(base_env(), TMPDIR=str(tmp_path))
    p = subprocess.Popen([sys.executable, "-m", "rdmaflow", "bench", "file", "--sizes", "64K,1M", "--model-bytes",
                          "1M", "--steps", "20", "--repeats", "3", "--out", str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not any(is_mounted(str(m)) for m in tmp_path.glob("rdmaflow-bench-file-*/mnt")):
            assert p.poll() is None, p.communicate()
            assert time.monotonic() < deadline, "the bench never mounted its model"
            time.sleep(0.1)
        os.killpg(p.pid, signal.SIGINT)
        _, stderr = p.communicate(timeout=90)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    assert p.returncode == 130 and "rdmaflow: interrupted" in stderr and "Traceback" not in stderr, stderr
    assert not any(is_mounted(str(m)) for m in tmp_path.glob("rdmaflow-bench-file-*/mnt"))
    gone_by = time.monotonic() + 15
    while True:  # every process of the bench ends
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < gone_by, "processes of the bench outlived it"
        time.sleep(0.1)
