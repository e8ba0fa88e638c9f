"""What every ``rdmaflow bench`` harness shares: sizes, summaries, processes, output files,
ratio tables, plots and the machine's background load.

A benchmark module (``rdmaflow.bench.X``, listed in ``rdmaflow.cli.BENCHMARKS``) has
``add_arguments(parser)`` and ``run(args) -> int``; with this module a new one needs little
of its own beyond the measurement::

    from rdmaflow.bench import harness as h

    env = h.process_env("tcp", secret=h.new_secret())             # a transport's environment
    peer = h.ChildProcess([sys.executable, "-m", "my.peer"], env, "peer")  # JSON lines
    info = peer.read(60)                                           # its hello, bounded
    m = h.Measurements("GB/s")
    for rep in range(repeats):
        for size in sizes:
            m.add("rdmaflow", size, measure(size))                 # ... and each baseline
    peer.close()
    h.write_csv(path, h.MEASUREMENT_COLUMNS, m.rows())
    print(h.ratio_table(m, "rdmaflow", point_label=h.format_size))
    h.line_plot(png, m, xlabel="size", ylabel="GB/s", sizes=True)

Standard library only at import (matplotlib is imported by the plotting functions), so the
tools built on it run without the C++ extension.
"""
from __future__ import annotations

import contextlib
import csv
import ctypes
import json
import math
import os
import queue
import re
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rdmaflow._ucx import ucx_env

# ------------------------------------------------------------------------------------------
# Sizes

# Binary multiples: "1M" means 1 MiB, the way sizes are quoted for RDMA buffers.
_SIZE_UNITS = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Parse "123", "64K", "1M", "1G" (also "1MiB", "1mb") into bytes, powers of 1024."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"size must be non-negative, got {text}")
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"invalid size {text!r}: expected an integer with an optional "
                         "K/M/G/T suffix (powers of 1024), e.g. 64K, 1M, 123")
    return int(m.group(1)) << (10 * _SIZE_UNITS[m.group(2).upper()])


def parse_sizes(text: str) -> list[int]:
    """A comma list of sizes ("64K,1M") -> bytes; empty items are skipped."""
    return [parse_size(s) for s in text.split(",") if s.strip()]


def format_size(n: int) -> str:
    """Inverse of parse_size for exact multiples (1048576 -> "1M"), else plain bytes."""
    for suffix, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= (1 << shift) and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


# ------------------------------------------------------------------------------------------
# Summaries and ratios


def percentile(sorted_vals: Sequence[float], q: float) -> float:
    """The q-quantile (0..1) of sorted values, interpolating between closest ranks (numpy's
    default)."""
    if len(sorted_vals) == 1:
        return sorted_vals[0]
    pos = q * (len(sorted_vals) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def summarize(values: Iterable[float]) -> dict[str, float]:
    """Return {"median", "min", "max", "iqr"} of a non-empty sequence of numbers.

    iqr is Q3 - Q1 with linear interpolation; it is 0.0 for a single value.
    """
    vals = sorted(float(v) for v in values)
    if not vals:
        raise ValueError("summarize() needs at least one value")
    return {
        "median": statistics.median(vals),
        "min": vals[0],
        "max": vals[-1],
        "iqr": percentile(vals, 0.75) - percentile(vals, 0.25),
    }


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    """median(num) / median(den); None when either is empty or the denominator is not > 0."""
    if not num or not den:
        return None
    d = statistics.median(den)
    return statistics.median(num) / d if d > 0 else None


def paired_ratio(num: Sequence[float], den: Sequence[float]) -> float | None:
    """The median of num[i] / den[i]: values measured in the same repeat, seconds apart, are
    compared with each other, which load that comes and goes disturbs less than the ratio of
    the medians."""
    pairs = [a / b for a, b in zip(num, den) if b > 0]
    return statistics.median(pairs) if pairs else None


def spread(values: Sequence[float], fmt: str = ".3g", scale: float = 1.0) -> str:
    """"median [min-max]" of ``values`` times ``scale``, each formatted with ``fmt``."""
    s = summarize(values)
    return (f"{format(s['median'] * scale, fmt)} [{format(s['min'] * scale, fmt)}-"
            f"{format(s['max'] * scale, fmt)}]")


def verdict(ratio: float | None, bar: float) -> str:
    """"PASS" when ``ratio >= bar``, "MISS" below it, "n/a" without a ratio."""
    return "n/a" if ratio is None else ("PASS" if ratio >= bar else "MISS")


class Measurements:
    """Repeated measurements of one metric: ``(system, point) -> [values]`` in the order
    added. ``point`` is what a row of the table is (a size, a configuration tuple, ...)."""

    def __init__(self, unit: str = "") -> None:
        self.unit = unit
        self.cells: dict[tuple[str, Any], list[float]] = {}

    def add(self, system: str, point: Any, value: float) -> None:
        self.cells.setdefault((system, point), []).append(float(value))

    def values(self, system: str, point: Any) -> list[float]:
        return self.cells.get((system, point), [])

    @property
    def systems(self) -> list[str]:
        return list(dict.fromkeys(s for s, _ in self.cells))

    @property
    def points(self) -> list[Any]:
        return list(dict.fromkeys(p for _, p in self.cells))

    def ratio(self, num: str, den: str, point: Any) -> float | None:
        return median_ratio(self.values(num, point), self.values(den, point))

    def rows(self, point_name: str = "point") -> list[dict[str, Any]]:
        """One dict per cell for :func:`write_csv` with :data:`MEASUREMENT_COLUMNS`."""
        out = []
        for (system, point), vals in self.cells.items():
            s = summarize(vals)
            out.append({"system": system, point_name: point, "unit": self.unit, **s,
                        "repeats": len(vals), "values": " ".join(f"{v:.6g}" for v in vals)})
        return out


#: CSV columns of :meth:`Measurements.rows` (with ``point_name="point"``).
MEASUREMENT_COLUMNS = ("system", "point", "unit", "median", "min", "max", "iqr", "repeats", "values")


def text_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Right-aligned columns as wide as their widest cell, a rule under the header."""
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    line = " ".join(f"{h:>{w}}" for h, w in zip(head, widths))
    return [line, "-" * len(line)] + [" ".join(f"{c:>{w}}" for c, w in zip(r, widths)) for r in rows]


def ratio_table(m: Measurements, reference: str, *, point_label: Callable[[Any], str] = str,
                fmt: str = ".3g", title: str = "") -> str:
    """A row per point: every system's "median [min-max]", then ``reference``'s median over
    each other system's (``reference/x``)."""
    others = [s for s in m.systems if s != reference]
    head = ["point", *m.systems, *(f"{reference}/{s}" for s in others)]
    rows = []
    for p in m.points:
        cells = [spread(m.values(s, p), fmt) if m.values(s, p) else "-" for s in m.systems]
        ratios = [m.ratio(reference, s, p) for s in others]
        rows.append([point_label(p), *cells, *("-" if r is None else f"{r:.2f}" for r in ratios)])
    lines = [title or f"{m.unit}: median [min-max] over repeats; ratios of the medians", *text_table(head, rows)]
    return "\n".join(lines)


def check_bars(m: Measurements, bars: Iterable[tuple[str, str, float]], points: Iterable[Any]) -> list[dict]:
    """Acceptance bars ``(num, den, bar)`` at ``points``: a row each with the ratio of the
    medians and its :func:`verdict`; pairs that were not both measured are left out."""
    rows = []
    for num, den, bar in bars:
        for p in points:
            if m.values(num, p) or m.values(den, p):
                x = m.ratio(num, den, p)
                rows.append({"point": p, "num": num, "den": den, "bar": bar, "ratio": x,
                             "verdict": verdict(x, bar)})
    return rows


# ------------------------------------------------------------------------------------------
# Processes


class BenchError(RuntimeError):
    """A benchmark process, or a measurement, failed."""


def new_secret() -> str:
    """A fresh RDMAFLOW_JOB_SECRET."""
    return secrets.token_hex(16)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now. Racy by nature (released before the user binds it):
    a user that fails to bind retries with a new one."""
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


# ------------------------------------------------------------------------------------------
# Interleaved measurements of several systems

#: What a failed measurement raises (a system's process died, timed out, answered nonsense).
MEASUREMENT_ERRORS = (BenchError, RuntimeError, OSError, ValueError)


def run_interleaved(systems: Mapping[str, Any], points: Sequence[Any], repeats: int,
                    measure: Callable[[str, Any, int], str | None], fail: Callable[[str, Any, str], None],
                    log: Callable[[str], None] = lambda s: None, label: str = "",
                    point_label: Callable[[Any], str] = str) -> None:
    """Measures every system at every point, ``repeats`` times, interleaved: for each repeat,
    for each point, every system once, their order rotated by one each repeat, so that load
    that comes and goes hits them alike.

    ``systems``: name -> an object with ``spawn()``, ``start()``, ``pause()``, ``resume()``,
    ``close()``. All are spawned first (start-ups overlap), then each is started and paused
    until its turn; one that fails to start gets ``fail(name, points[0], "start: ...")`` and is
    tried again at its first measurement. ``measure(name, point, tag)`` measures and records
    (``tag`` counts measurements); it returns a line for ``log`` (None: nothing to say, e.g.
    a cell it skipped). A measurement that raises one of :data:`MEASUREMENT_ERRORS` gets
    ``fail(name, point, message)``, its system is closed (restarted at its next measurement),
    and a system that failed 3 times in a row is skipped (``fail`` says so) for the rest.
    Every system is closed at the end, however it ends."""
    names = list(systems)
    failures_in_row = dict.fromkeys(names, 0)
    try:
        for obj in systems.values():
            with contextlib.suppress(BenchError, OSError):
                obj.spawn()
        for name, obj in systems.items():
            try:
                obj.start()
            except (BenchError, OSError) as e:
                fail(name, points[0], f"start: {e}")
                obj.close()  # tried again at its first measurement
            obj.pause()
        tag = 0
        for rep in range(repeats):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for point in points:
                for name in order:
                    if failures_in_row[name] >= 3:
                        fail(name, point, "skipped after 3 failures in a row")
                        continue
                    tag += 1
                    t0 = time.monotonic()
                    systems[name].resume()
                    try:
                        line = measure(name, point, tag)
                    except MEASUREMENT_ERRORS as e:
                        msg = " ".join(str(e).split())[:300]
                        fail(name, point, msg)
                        failures_in_row[name] += 1
                        log(f"[{label} {rep + 1}/{repeats}] {name} {point_label(point)}: failed: {msg}")
                        systems[name].close()  # restarted at its next measurement
                        continue
                    finally:
                        systems[name].pause()
                    failures_in_row[name] = 0
                    if line is not None:
                        log(f"[{label} {rep + 1}/{repeats}] {name} {point_label(point)}: {line} ({time.monotonic() - t0:.1f} s)")
    finally:
        for obj in systems.values():
            with contextlib.suppress(Exception):
                obj.close()


def for_each_transport(transports: Sequence[str], run_one: Callable[[str], None], table: Callable[[str], str],
                       save: Callable[[], None]) -> bool:
    """Runs ``run_one(transport)`` for each, then prints ``table(transport)`` and how busy the
    rest of the machine was meanwhile (:class:`BackgroundMeter`), and calls ``save()`` (the
    results so far survive a later failure). SIGTERM is a Ctrl-C meanwhile. Returns whether it
    was interrupted (every benchmark process is stopped by then)."""
    def on_term(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        for t in transports:
            meter = BackgroundMeter()
            run_one(t)
            print()
            print(table(t), flush=True)
            print(format_background(meter.report()), flush=True)
            save()
    except KeyboardInterrupt:
        print("\ninterrupted; every benchmark process was stopped", file=sys.stderr)
        return True
    finally:
        signal.signal(signal.SIGTERM, old)
    return False


# ------------------------------------------------------------------------------------------
# Output files


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    return repr(v) if isinstance(v, float) else v


def write_csv(path: str, columns: Sequence[str], rows: Iterable[Mapping[str, Any]]) -> None:
    """Writes ``rows`` (dicts) under ``columns``, replacing ``path`` at once (a reader never
    sees half a file). None is written as "", a float as its repr (every digit); missing
    keys are empty, extra keys ignored."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(columns), extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in columns})
    os.replace(tmp, path)


def write_json(path: str, doc: Any) -> None:
    """Writes ``doc`` as indented JSON (non-JSON values as str), replacing ``path`` at once."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    os.replace(tmp, path)


# ------------------------------------------------------------------------------------------
# Plots

#: system -> (color, marker, line style), the same in every benchmark's plots.
STYLES: dict[str, tuple[str, str, str]] = {
    "rdmaflow": ("tab:red", "o", "-"),
    "rdmaflow-zerocopy": ("tab:red", "o", "-"),
    "rdmaflow-tcp": ("tab:red", "o", "-"),
    "rdmaflow-copy": ("tab:orange", "s", "-"),
    "rdmaflow-sm": ("tab:orange", "s", "-"),
    "rdmaflow-dynamic": ("tab:brown", "^", "-"),
    "grpc": ("tab:blue", "v", "-"),
    "grpc-protobuf": ("tab:blue", "v", "-"),
    "tensorpipe": ("tab:green", "D", "-"),
    "gloo": ("tab:purple", "P", "-"),
    "nixl": ("tab:cyan", "*", "-"),
    "ddp": ("tab:purple", "P", "-"),
    "ucx-perftest-put": ("black", "x", "--"),
    "ucx_perftest": ("black", "x", "--"),
    "local": ("grey", "x", "--"),
    "memcpy": ("grey", "", ":"),
}


def style(system: str) -> tuple[str | None, str, str]:
    """(color, marker, line style) of ``system``; matplotlib's next color for an unknown one."""
    return STYLES.get(system, (None, "o", "-"))


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str, title: str = "", *, wrap: int | None = None, fontsize: int = 8,
                dpi: int = 100) -> None:
    """Titles ``fig`` (wrapped at ``wrap`` characters, default about 13 per inch of width),
    lays it out, writes ``path`` (making its directory) and closes it."""
    if title:
        import textwrap

        width = wrap or max(40, int(fig.get_figwidth() * 13))
        fig.suptitle("\n".join(textwrap.wrap(title, width)), fontsize=fontsize)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)


def size_axis(ax: Any, sizes: Sequence[int]) -> None:
    """A log2 x axis with a tick labelled "64K", "1M", ... at each size."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(sizes))
    ax.set_xticklabels([format_size(s) for s in sizes], rotation=45)


def line_plot(path: str, m: Measurements, *, xlabel: str, ylabel: str, sizes: bool = False,
              logy: bool = False, title: str = "") -> None:
    """One line per system through its medians, a band from min to max; numeric points on
    the x axis (``sizes``: byte sizes on a log2 axis)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system in m.systems:
        color, mark, ls = style(system)
        pts = [(p, summarize(m.values(system, p))) for p in m.points if m.values(system, p)]
        xs = [p for p, _ in pts]
        ax.plot(xs, [s["median"] for _, s in pts], marker=mark or None, linestyle=ls, color=color,
                label=system, ms=4)
        ax.fill_between(xs, [s["min"] for _, s in pts], [s["max"] for _, s in pts], color=color,
                        alpha=0.15, linewidth=0)
    if sizes:
        size_axis(ax, m.points)
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, path, title)


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


class BackgroundMeter:
    """How much CPU others used while the benchmark ran: the noise in its numbers.

    ``report()``: ``other_cpus``, user and system time of processes outside the benchmark's
    process tree (kernel threads excluded); ``kernel_cpus``, kernel threads, interrupts and
    softirqs (the benchmark's own loopback traffic lands there too); ``steal_cpus``, time the
    hypervisor gave to other guests. All in CPUs busy (CPU-seconds per second)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()
        self.stat0 = _proc_stat()
        self.mine0, self.kthreads0 = _cpu_split(os.getpid())

    def report(self) -> dict[str, float]:
        wall = max(1e-9, time.monotonic() - self.t0)
        st = [b - a for a, b in zip(self.stat0, _proc_stat())]
        mine, kthreads = _cpu_split(os.getpid())
        kthreads -= self.kthreads0
        others = max(0.0, st[0] + st[1] + st[2] - (mine - self.mine0) - kthreads)
        return {"wall_s": wall, "other_cpu_s": others, "other_cpus": others / wall,
                "kernel_cpus": (kthreads + st[5] + st[6]) / wall, "steal_cpus": st[7] / wall,
                "cpus": float(os.cpu_count() or 1)}


def format_background(bg: Mapping[str, float]) -> str:
    text = (f"background: other processes used {bg['other_cpu_s']:.0f} CPU-s in {bg['wall_s']:.0f} s "
            f"({bg['other_cpus']:.2f} of {bg['cpus']:.0f} cores); kernel threads + softirq "
            f"{bg['kernel_cpus']:.2f} cores, steal {bg['steal_cpus']:.2f}")
    return text + ("  <- noisy: other processes were busy" if bg["other_cpus"] > 0.1 else "  (quiet)")
