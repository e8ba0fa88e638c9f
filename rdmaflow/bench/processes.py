"""The processes a benchmark starts, and the state of the machine they run on: job secrets,
free ports, parent-death, a transport's environment, :class:`ChildProcess` (a peer speaking
JSON lines, with bounded reads), :class:`HostPhases` (the host's phases as a cache line's
handoff between the cpus shows them) and :class:`BackgroundMeter` (how busy the rest of the
machine was meanwhile).
"""
from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import secrets
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rdmaflow._ucx import ucx_env
from rdmaflow.device import cache_line_handoff_ns, tcp_congestion_of
from rdmaflow.errors import RdmaflowError

# ------------------------------------------------------------------------------------------
# Processes


class BenchError(RuntimeError):
    """A benchmark process, or a measurement, failed."""


def new_secret() -> str:
    """A fresh RDMAFLOW_JOB_SECRET."""
    return secrets.token_hex(16)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a job's rank 0 to bind seconds later (after importing
    torch). Drawn below the host's ephemeral range, from which the kernel gives every outgoing
    connection its port: a port it gave to bind(0) was taken by a connection of another process
    before rank 0 bound it (EADDRINUSE, seen in a full test run). Still racy against another
    process that binds ports of its own choosing there."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_lo = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_lo = 32768  # Linux's default
    if ephemeral_lo > 11000:
        for _ in range(100):
            port = secrets.randbelow(ephemeral_lo - 10000) + 10000
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


_libc: Any = None


def die_with_parent() -> None:
    """For ``preexec_fn``: the kernel SIGKILLs the child when this process dies, even if it is
    SIGKILLed (PR_SET_PDEATHSIG survives exec, also ``ip netns exec``)."""
    global _libc
    with contextlib.suppress(Exception):
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
        _libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def process_env(transport: str | None = None, *, base: Mapping[str, str] | None = None,
                net_device: str | None = None, secret: str | None = None,
                threads: int | None = None) -> dict[str, str]:
    """The environment of a benchmark process: :func:`rdmaflow._ucx.ucx_env` of ``transport``
    (a plain copy of ``base``, default ``os.environ``, without one), ``RDMAFLOW_JOB_SECRET``
    and ``OMP_NUM_THREADS`` when given, and unbuffered Python output."""
    env = ucx_env(transport, base, net_device=net_device) if transport else dict(os.environ if base is None else base)
    if secret is not None:
        env["RDMAFLOW_JOB_SECRET"] = secret
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.contextmanager
def environ(env: Mapping[str, str]):
    """Temporarily makes ``os.environ`` equal ``env`` (UCX reads it when a context is made)."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


class ChildProcess:
    """A process a benchmark started. It runs in its own session, so that killing its group
    reaches whatever it started; the kernel kills it if this process dies
    (:func:`die_with_parent`); its stdout lines are queued and the tail of its stderr kept;
    every wait is bounded.

    ``stdin``: a pipe for :meth:`send` (JSON lines), else /dev/null. ``log``: a path; stdout
    and stderr go to that file instead of pipes (read it with :meth:`output`). ``popen``: what
    starts it (default ``subprocess.Popen``; e.g. ``rdmaflow.testing.netns.Host.popen`` runs it
    in a network namespace); it must take Popen's keyword arguments.
    """

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], label: str, *, stdin: bool = True,
                 log: str | None = None, popen: Callable[..., subprocess.Popen] | None = None) -> None:
        self.label = label
        self.log = log
        self.lines: queue.Queue = queue.Queue()
        self._err: list[str] = []
        popen = popen or subprocess.Popen
        kw: dict[str, Any] = {"env": dict(env), "stdin": subprocess.PIPE if stdin else subprocess.DEVNULL,
                              "text": True, "errors": "replace", "start_new_session": True,
                              "preexec_fn": die_with_parent}
        if log is not None:
            with open(log, "w") as f:
                self.proc = popen(list(argv), stdout=f, stderr=subprocess.STDOUT, **kw)
            self.lines.put(None)
            return
        self.proc = popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)
        threading.Thread(target=self._pump_out, daemon=True).start()
        self._err_pump = threading.Thread(target=self._pump_err, daemon=True)
        self._err_pump.start()

    def _pump_out(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def _pump_err(self) -> None:
        for line in self.proc.stderr:
            self._err.append(line)
            del self._err[:-200]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float) -> int | None:
        """Its exit status, or None if it still runs after ``timeout`` seconds."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            return self.proc.wait(max(0.001, timeout))
        return None

    def output(self) -> str:
        """What it wrote to ``log`` so far ("" without one)."""
        if self.log is None:
            return ""
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def stderr_tail(self, n: int = 1500) -> str:
        """The last ``n`` characters of its stderr (of its log with ``log``)."""
        if self.log is None and not self._err and self.proc.poll() is not None:
            self._err_pump.join(0.5)  # an exited process: let the pump catch up
        text = ("".join(self._err) if self.log is None else self.output()).strip()
        return text if len(text) <= n else "..." + text[-n:]

    def send(self, obj: Mapping[str, Any]) -> None:
        """One JSON line on its stdin."""
        try:
            self.proc.stdin.write(json.dumps(obj) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError, AttributeError) as e:
            raise BenchError(f"{self.label} is gone ({e}); stderr: {self.stderr_tail()}") from None

    def readline(self, timeout: float) -> str:
        """Its next stdout line; BenchError if none comes within ``timeout`` or it exited."""
        try:
            line = self.lines.get(timeout=max(0.001, timeout))
        except queue.Empty:
            raise BenchError(f"{self.label} did not answer within {timeout:.0f} s") from None
        if line is None:
            self.lines.put(None)
            time.sleep(0.2)  # let the stderr pump catch up
            raise BenchError(f"{self.label} exited (code {self.proc.poll()}); stderr: {self.stderr_tail()}")
        return line

    def read(self, timeout: float) -> dict:
        """Its next stdout line as a JSON object whose "ok" is true; BenchError otherwise."""
        line = self.readline(timeout)
        try:
            msg = json.loads(line)
        except ValueError:
            raise BenchError(f"{self.label} wrote {line.strip()[:200]!r}") from None
        if not isinstance(msg, dict) or not msg.get("ok"):
            raise BenchError(f"{self.label}: {msg.get('error') if isinstance(msg, dict) else msg}")
        return msg

    def drain(self, timeout: float) -> list[str]:
        """Every stdout line left, up to its end (bounded: a grandchild may hold the pipe)."""
        out: list[str] = []
        end = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.001, end - time.monotonic()))
            except queue.Empty:
                return out
            if line is None:
                self.lines.put(None)
                return out
            out.append(line)

    def signal(self, sig: int) -> None:
        """Sends ``sig`` to its process group, if it still runs."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILLs its process group (whatever it started goes too) and reaps it (bounded)."""
        p = self.proc
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(5)
        for f in (p.stdin, p.stdout, p.stderr):
            with contextlib.suppress(Exception):
                if f is not None:
                    f.close()

    def close(self, grace: float = 3.0, exit_message: Mapping[str, Any] | None = None) -> None:
        """Asks it to exit (``exit_message``, default ``{"cmd": "exit"}``, when it has a stdin
        pipe; a stopped process is continued first), waits ``grace`` seconds, then kills."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)
            if self.proc.stdin is not None:
                with contextlib.suppress(BenchError):
                    self.send(exit_message or {"cmd": "exit"})
            self.wait(grace)
        self.kill()


def one_line(text: str, n: int = 600) -> str:
    """The last line of a process's stderr first (a failing process ends with its summary
    there), then the lines before it, on one line, at most about ``n`` characters."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return ""
    last = lines[-1] if len(lines[-1]) <= n else lines[-1][:n] + "..."
    before = " | ".join(lines[-6:-1])
    if not before:
        return last
    room = max(80, n - len(last))
    if len(before) > room:
        before = "..." + before[-room:]
    return f"{last} [stderr before it: {before}]"


def wait_all(procs: Sequence[ChildProcess], timeout: float, error: type[Exception] = BenchError) -> None:
    """Waits until every process of a job exited 0. Raises ``error`` naming the first that
    exited otherwise (and the others that failed with it) with the end of its stderr, or,
    after ``timeout`` seconds, the ones still running. Kills nothing: the caller does."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes):
            time.sleep(0.5)  # let the others show whether they failed too; stderr catch up
            codes = [p.poll() for p in procs]
            bad = [(p, c) for p, c in zip(procs, codes) if c not in (None, 0)]
            p, c = bad[0]
            msg = f"{p.label} exited with code {c}: {one_line(p.stderr_tail(4000)) or '(no stderr)'}"
            if len(bad) > 1:
                msg += "; also failed: " + ", ".join(f"{q.label} ({k})" for q, k in bad[1:])
            raise error(msg)
        if all(c == 0 for c in codes):
            return
        if time.monotonic() > deadline:
            running = [p.label for p, c in zip(procs, codes) if c is None]
            tails = [f"{p.label}: {one_line(p.stderr_tail(2000), 300)}"
                     for p, c in zip(procs, codes) if c is None and p.stderr_tail()]
            raise error(f"timed out after {timeout:.0f} s; still running: "
                        f"{', '.join(running)}" + (f"; stderr: {'; '.join(tails)}" if tails else ""))
        time.sleep(0.05)


# ------------------------------------------------------------------------------------------
# The machine's background load


def _cpu_split(root: int) -> tuple[float, float]:
    """(CPU seconds of ``root``, its live descendants and the children they reaped; CPU
    seconds of kernel threads)."""
    tck = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, float]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        cpu = sum(int(x) for x in fields[11:15]) / tck  # utime stime cutime cstime
        stats[int(d)] = (int(fields[1]), cpu)
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    mine, todo = 0.0, [root]
    while todo:
        pid = todo.pop()
        if pid in stats:
            mine += stats[pid][1]
        todo.extend(kids.get(pid, []))
    kthreads = sum(cpu for pid, (ppid, cpu) in stats.items() if pid == 2 or ppid == 2)
    return mine, kthreads


def _proc_stat() -> list[float]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return [x / os.sysconf("SC_CLK_TCK") for x in v]  # user nice system idle iowait irq softirq steal


def _tcp_counters() -> dict[str, int]:
    """The kernel's TCP counters, machine-wide: segments sent (``OutSegs``) and retransmitted
    (``RetransSegs``) from /proc/net/snmp, and ``reorder``, how often senders saw segments
    arrive out of order (the ``TcpExt`` counters named ``*Reorder`` in /proc/net/netstat).
    Empty where /proc does not have them."""
    out: dict[str, int] = {}
    for path, table in (("/proc/net/snmp", "Tcp:"), ("/proc/net/netstat", "TcpExt:")):
        try:
            with open(path) as f:
                rows = [line.split() for line in f if line.startswith(table)]
        except OSError:
            continue
        for names, values in zip(rows[::2], rows[1::2]):
            for name, value in zip(names[1:], values[1:]):
                if name in ("OutSegs", "RetransSegs"):
                    out[name] = int(value)
                elif name.endswith("Reorder"):
                    out["reorder"] = out.get("reorder", 0) + int(value)
    return out


def tcp_congestion_control() -> str:
    """The kernel's default TCP congestion control (``net.ipv4.tcp_congestion_control``), which
    every system's sockets get; "" where unreadable. Over loopback it shapes every tcp figure:
    bbr paces what it sends (docs/benchmarks.md, "Loopback tcp on this machine")."""
    try:
        with open("/proc/sys/net/ipv4/tcp_congestion_control") as f:
            return f.read().strip()
    except OSError:
        return ""


def rdmaflow_tcp_congestion() -> str:
    """The congestion control rdmaflow's devices give UCX's tcp data sockets here
    (:func:`rdmaflow.device.tcp_congestion_of`); "" where it cannot be told."""
    try:
        return tcp_congestion_of()
    except RdmaflowError:
        return ""


# A handoff this many times the fastest seen in a run, or more: the host is in a slow phase.
SLOW_HANDOFF = 2.0
# --settle: the default wait for a slow phase to pass, its bound, and the idle pause between probes
# (seconds).
DEFAULT_SETTLE = 5.0
MAX_SETTLE = 600.0
SETTLE_STEP = 0.2


def is_slow_handoff(h: float | None, fastest: float | None) -> bool:
    """Whether a handoff of ``h`` ns shows a slow phase of the host: :data:`SLOW_HANDOFF` times
    ``fastest`` or more (False where either is unknown)."""
    return h is not None and fastest is not None and h >= SLOW_HANDOFF * fastest


def handoff_ns(seconds: float = 0.02) -> float | None:
    """Nanoseconds a cache line takes to move between the first two cpus this process may run
    on (:func:`rdmaflow.device.cache_line_handoff_ns`, two threads spinning for ``seconds``);
    None with fewer than two cpus or where the threads cannot be pinned. Under a hypervisor
    this moves with where the host runs the vCPUs: a few times higher while they sit on
    different dies, and so is the time of every copy that hands lines from one process to the
    other (docs/benchmarks.md)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    try:
        return cache_line_handoff_ns(cpus[0], cpus[1], seconds)
    except RdmaflowError:
        return None


class HostPhases:
    """The host's phases around a benchmark's measurements, as :func:`handoff_ns` shows them.

    ``before()``: probes until the handoff is within :data:`SLOW_HANDOFF` of the fastest this
    object has seen, or ``settle`` seconds have passed, idle ``step`` seconds between probes
    (an idle vCPU is one the host may place elsewhere); returns the last figure. A wait that
    runs out is not repeated until a probe finds the host fast again, so that a phase longer
    than ``settle`` costs one wait, not one per measurement.
    ``after(before)``: probes again and returns the measurement's figure, the slower of the two
    (None where the probe cannot run). Blocking; one thread."""

    def __init__(self, settle: float, probe: Callable[[], float | None] | None = None,
                 step: float | None = None) -> None:
        self.settle = settle
        self.probe = probe or handoff_ns
        self.step = SETTLE_STEP if step is None else step
        self.fastest: float | None = None
        self.waited_out = False  # the last wait ran out and no probe since found the host fast

    def _probe(self) -> float | None:
        h = self.probe()
        if h is not None and (self.fastest is None or h < self.fastest):
            self.fastest = h
        return h

    def _slow(self, h: float | None) -> bool:
        return is_slow_handoff(h, self.fastest)

    def before(self) -> float | None:
        h = self._probe()
        if self.waited_out:
            self.waited_out = self._slow(h)
            return h
        end = time.monotonic() + self.settle
        while self._slow(h) and time.monotonic() < end:
            time.sleep(self.step)
            h = self._probe()
        self.waited_out = self._slow(h)
        return h

    def after(self, before: float | None) -> float | None:
        probes = [h for h in (before, self._probe()) if h is not None]
        return max(probes) if probes else None


def check_settle(seconds: float) -> float:
    """``--settle``'s value; ValueError unless it is between 0 and :data:`MAX_SETTLE`."""
    if not 0 <= seconds <= MAX_SETTLE:
        raise ValueError(f"--settle must be between 0 and {MAX_SETTLE:g} seconds, got {seconds:g}")
    return seconds


def handoff_values(cell: Mapping[str, Any]) -> str:
    """A cell's handoff per repeat for a CSV (``values_handoff_ns``): "-" where none was probed."""
    return " ".join("-" if h is None else f"{h:.0f}" for h in cell.get("handoff_ns", []))


def fastest_handoff(cells: Iterable[Mapping[str, Any]]) -> float | None:
    """The fastest handoff (ns) recorded in ``cells`` (their ``handoff_ns`` lists); None if none."""
    probed = [h for cell in cells for h in cell.get("handoff_ns", []) if h is not None]
    return min(probed) if probed else None


def slow_handoff(cell: Mapping[str, Any], fastest: float | None) -> bool:
    """Whether a repeat of ``cell`` ran in a slow phase of the host: its handoff
    :data:`SLOW_HANDOFF` times ``fastest`` or more."""
    return any(is_slow_handoff(h, fastest) for h in cell.get("handoff_ns", []))


def slow_phase_note(fastest: float | None) -> str:
    """The footnote of a table whose cells :func:`slow_handoff` marked ``~``."""
    return (f"~ a repeat ran while a cache line took {SLOW_HANDOFF:g}x the run's fastest handoff "
            f"({fastest or 0:.0f} ns) or more between the cpus: a slow phase of the host")


class BackgroundMeter:
    """How much CPU others used while the benchmark ran: the noise in its numbers.

    ``report()``: ``other_cpus``, user and system time of processes outside the benchmark's
    process tree (kernel threads excluded); ``kernel_cpus``, kernel threads, interrupts and
    softirqs (the benchmark's own loopback traffic lands there too); ``steal_cpus``, time the
    hypervisor gave to other guests. All in CPUs busy (CPU-seconds per second). And what TCP
    did meanwhile, machine-wide (the benchmark's loopback traffic, mostly): ``tcp_cc``, the
    congestion control; ``tcp_out_segs``, ``tcp_retrans_segs`` and ``tcp_reorder``, the changes
    of the counters of :func:`_tcp_counters`."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.stat0 = _proc_stat()
        self.mine0, self.kthreads0 = _cpu_split(os.getpid())
        self.tcp0 = _tcp_counters()

    def report(self) -> dict[str, Any]:
        wall = max(1e-9, time.monotonic() - self.t0)
        st = [b - a for a, b in zip(self.stat0, _proc_stat())]
        mine, kthreads = _cpu_split(os.getpid())
        kthreads -= self.kthreads0
        others = max(0.0, st[0] + st[1] + st[2] - (mine - self.mine0) - kthreads)
        tcp = _tcp_counters()
        moved = {k: tcp[k] - self.tcp0[k] for k in tcp if k in self.tcp0}
        return {"wall_s": wall, "other_cpu_s": others, "other_cpus": others / wall,
                "kernel_cpus": (kthreads + st[5] + st[6]) / wall, "steal_cpus": st[7] / wall,
                "cpus": float(os.cpu_count() or 1), "tcp_cc": tcp_congestion_control(),
                "rdmaflow_tcp_cc": rdmaflow_tcp_congestion(),
                "tcp_out_segs": moved.get("OutSegs", 0), "tcp_retrans_segs": moved.get("RetransSegs", 0),
                "tcp_reorder": moved.get("reorder", 0)}


def format_background(bg: Mapping[str, Any]) -> str:
    """The background line; with a second line on TCP where the run sent a thousand segments or
    more (tcp runs: the benchmark's own loopback traffic)."""
    text = (f"background: other processes used {bg['other_cpu_s']:.0f} CPU-s in {bg['wall_s']:.0f} s "
            f"({bg['other_cpus']:.2f} of {bg['cpus']:.0f} cores); kernel threads + softirq "
            f"{bg['kernel_cpus']:.2f} cores, steal {bg['steal_cpus']:.2f}")
    text += "  <- noisy: other processes were busy" if bg["other_cpus"] > 0.1 else "  (quiet)"
    out = bg.get("tcp_out_segs", 0)
    if out >= 1000:
        cc = bg.get("tcp_cc") or "unknown"
        ours = bg.get("rdmaflow_tcp_cc")
        if ours and ours != bg.get("tcp_cc"):
            cc += f" (rdmaflow's data sockets: {ours})"
        text += (f"\ntcp, machine-wide: congestion control {cc}; "
                 f"{bg['tcp_retrans_segs']} of {out} segments retransmitted "
                 f"({bg['tcp_retrans_segs'] / out:.2%}), {bg['tcp_reorder']} reorderings seen")
    return text
