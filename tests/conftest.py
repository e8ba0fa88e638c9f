"""Fixtures that start real peer processes over a chosen UCX transport."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager, suppress

import pytest

from rdmaflow._ucx import transport_vars

HERE = os.path.dirname(os.path.abspath(__file__))

# The Ctrl-C tests interrupt benchmark processes with SIGINT. A non-interactive shell starts
# its background jobs (a CI run started with ``&``) with SIGINT ignored, children inherit that,
# and Python then installs no KeyboardInterrupt handler: restore what a terminal gives.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# "sm": shared memory with the same-host mapping (a memcpy is one CPU copy into the peer's
# mapped region); "sm-cma": shared memory through UCX alone (cma), the mapping turned off.
# $RDMAFLOW_PLACEMENT_COSTS for jobs whose placement decision a test asserts: this machine's
# quiet figures (an op under the mode ~5 µs, a copy of a few KiB ~2 GB/s), not a timing of
# microseconds that a busy moment of two shared cores can turn around.
QUIET_PLACEMENT_COSTS = "mode_us_per_op=5,copy_gb_per_s=2"
TRANSPORTS = ["tcp", "sm", "sm-cma"]  # names of rdmaflow._ucx.TRANSPORT_ENV


class PeerProcess:
    """tests/peer.py in its own process; ``call`` sends one command and waits for its answer."""

    def __init__(self, env: dict, argv_prefix: list[str] | None = None, timeout: float = 30.0):
        self.proc = subprocess.Popen(
            (argv_prefix or []) + [sys.executable, os.path.join(HERE, "peer.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.timeout = timeout
        hello = self._read(timeout)
        self.endpoint = hello["endpoint"]

    def _read(self, timeout: float) -> dict:
        box: list = []
        t = threading.Thread(target=lambda: box.append(self.proc.stdout.readline()), daemon=True)
        t.start()
        t.join(timeout)
        if not box or not box[0]:
            err = ""
            if self.proc.poll() is not None:
                err = self.proc.stderr.read()
            raise RuntimeError(f"peer did not answer within {timeout} s (exit {self.proc.poll()}): {err[-2000:]}")
        return json.loads(box[0])

    def call(self, op: str, timeout: float | None = None, **kw) -> dict:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        if op == "crash":
            self.proc.wait(timeout or self.timeout)
            return {}
        r = self._read(timeout or self.timeout)
        if not r.get("ok"):
            raise RuntimeError(f"peer failed {op}: {r.get('error')}\n{r.get('tb', '')}")
        return r

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
        self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            # A dead, stuck or garbled peer (broken pipe, no answer, bad line, no exit): killed below.
            with suppress(OSError, RuntimeError, ValueError, subprocess.TimeoutExpired):
                self.call("exit", timeout=10)
                self.proc.wait(10)
        self.kill()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with suppress(OSError):  # closing stdin flushes it into a pipe nobody reads any more
                f.close()


TRANSFER_WAIT = 60.0  # bound on any single answer from a transfer peer


class TransferPeer(PeerProcess):
    """tests/transfer_peer.py in its own process.

    ``post`` sends a command without waiting, so that this process can send or receive while
    the peer does the other half; ``answer`` collects the reply, ``failure`` an expected error.
    """

    def __init__(self, env: dict, timeout: float = TRANSFER_WAIT):
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(HERE, "transfer_peer.py")],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, start_new_session=True,
        )
        self.timeout = timeout
        self.endpoint = self._read(timeout)["endpoint"]

    def post(self, op: str, **kw) -> None:
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def answer(self, wait: float = TRANSFER_WAIT) -> dict:
        r = self._read(wait)
        if not r.get("ok"):
            raise AssertionError(f"peer failed: {r.get('error_type')}: {r.get('error')}\n{r.get('tb', '')}")
        return r

    def failure(self, wait: float = TRANSFER_WAIT) -> dict:
        """The answer to a command that was to fail: its error_type, error and state."""
        r = self._read(wait)
        assert not r.get("ok"), f"the peer's command succeeded: {r}"
        return r

    def call(self, op: str, timeout: float | None = None, wait: float = TRANSFER_WAIT, **kw) -> dict:
        # ``timeout`` keeps PeerProcess.close()'s meaning (how long to wait for the answer).
        self.post(op, **kw)
        if op == "crash":
            self.proc.wait(timeout or wait)
            return {}
        return self.answer(timeout or wait)

    def crash(self) -> None:
        self.post("crash")
        self.proc.wait(TRANSFER_WAIT)


def assert_all_verified(r: dict, n: int, what: str = "") -> None:
    """A transfer peer's recv answer: n tensors received, every one right to the byte."""
    assert r["first_mismatch"] is None, f"{what}: tensor {r['first_mismatch']['i']} is wrong: {r['first_mismatch']['what']}"
    assert r["received"] == n and r["verified"] == n, f"{what}: {r}"


def raises_within(exc, seconds: float, fn, *a, **kw):
    """Runs fn, expects ``exc``, and that it came within ``seconds`` (no hang)."""
    t0 = time.monotonic()
    with pytest.raises(exc) as ei:
        fn(*a, **kw)
    took = time.monotonic() - t0
    assert took < seconds, f"{exc.__name__} took {took:.1f} s"
    return ei.value


@pytest.fixture
def tpeer(transport, job_secret):
    """Starts transfer peers sharing this test's UCX transport and job secret; cleans them up."""
    peers: list[TransferPeer] = []

    def spawn(**env_extra) -> TransferPeer:
        env = dict(os.environ)
        env["RDMAFLOW_JOB_SECRET"] = job_secret
        env.update({k: str(v) for k, v in env_extra.items()})
        p = TransferPeer(env)
        peers.append(p)
        return p

    yield spawn
    for p in peers:
        p.close()


@pytest.fixture
def dev(transport, job_secret):
    """This process's device (after ``transport`` restricted UCX), with a 64 MiB arena."""
    with local_device() as d:
        d.create_arena(64 << 20)
        yield d


def send_static(s, seed: int, n: int, start: int = 0, in_arena=False, dev=None) -> None:
    """Sends static tensors ``start`` .. ``start + n`` of sequence ``seed`` (transfer_peer.py);
    ``in_arena``: born in ``dev``'s arena (True, or "alternate": every other one)."""
    from transfer_peer import static_tensor

    for i in range(start, start + n):
        x = static_tensor(seed, i, s.shape, s.dtype)
        if in_arena is True or (in_arena == "alternate" and i % 2 == 0):
            y = dev.empty(s.shape, s.dtype)
            y.copy_(x)
            x = y
        s.send(x, timeout=30)


def recv_check(r, n: int, expect, start: int = 0) -> None:
    """Receives n tensors in this process and checks each against ``expect(i)``; each one
    (unless empty) lives in the receiver's registered arena."""
    from transfer_peer import mismatch

    for i in range(start, start + n):
        got = r.recv(timeout=30)
        bad = mismatch(got, expect(i))
        assert bad is None, f"tensor {i} on '{r.name}': {bad}"
        assert got.numel() == 0 or r.arena.contains(got), f"tensor {i} on '{r.name}' is not in the arena"


@pytest.fixture(autouse=True)
def _stores_served_by_a_test_end_with_it():
    """A process holds the job stores it serves until it exits (rdmaflow/job.py); this one runs
    every test, so a test's stores are let go when it ends, as its job's process would exit.
    Else their sockets outlived it (a later test counts this process's TCP sockets)."""
    from rdmaflow import job

    before = list(job._SERVING)
    yield
    job._SERVING[:] = before


@pytest.fixture(params=TRANSPORTS)
def transport(request, monkeypatch):
    """Restricts this process and its peers to one UCX transport."""
    env = {"RDMAFLOW_SAME_HOST": "auto", **transport_vars(request.param)}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return request.param


@pytest.fixture
def job_secret(monkeypatch):
    s = secrets.token_hex(16)
    monkeypatch.setenv("RDMAFLOW_JOB_SECRET", s)
    return s


@pytest.fixture
def spawn_peer(transport, job_secret):
    """Starts peer processes sharing this test's transport and job secret."""
    peers: list[PeerProcess] = []

    def spawn(secret: str | None = None, **env_extra) -> PeerProcess:
        env = dict(os.environ)
        env["RDMAFLOW_JOB_SECRET"] = secret or job_secret
        env.update({k: str(v) for k, v in env_extra.items()})
        p = PeerProcess(env)
        peers.append(p)
        return p

    yield spawn
    for p in peers:
        p.close()


@contextmanager
def local_device(**kw):
    import rdmaflow

    d = rdmaflow.Device("127.0.0.1:0", **kw)
    try:
        yield d
    finally:
        d.close()


def _proc_state(stat_path: str) -> str | None:
    """The state letter in a /proc ``stat`` file (R, S, T, Z, ...), None once it is gone. The
    command name before it may hold spaces and parentheses: the state follows the last ')'."""
    try:
        with open(stat_path) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie (dead, not yet reaped)."""
    return _proc_state(f"/proc/{pid}/stat") not in (None, "Z")


def stop_process(pid: int, timeout: float = 10.0) -> None:
    """SIGSTOP, then waits until every thread of ``pid`` has stopped. ``kill`` returns once the
    signal is queued; the group stop begins when one of the process's threads takes it, and on
    a busy machine that thread may wait for a core while the others run on: a peer answered a
    lookup sent right after the signal."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while True:
        states = [st for tid in os.listdir(f"/proc/{pid}/task")
                  if (st := _proc_state(f"/proc/{pid}/task/{tid}/stat")) is not None]
        if states and all(st in "Tt" for st in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout} s: threads {states}"
        time.sleep(0.001)


def processes_with_env(marker: str) -> list[int]:
    """The pids of processes whose environment holds RDMAFLOW_TEST_MARK=<marker> (what a test
    started, however deep), to check that nothing is left behind."""
    found = []
    needle = f"RDMAFLOW_TEST_MARK={marker}".encode()
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read().split(b"\0"):
                    found.append(int(d))
        except OSError:
            pass
    return found

