"""What every ``rdmaflow bench`` harness shares to measure and report: sizes, summaries, ratio
tables, interleaved repeats, output files. The processes it starts are in
:mod:`rdmaflow.bench.processes`, the plots in :mod:`rdmaflow.bench.plots`.

A benchmark module (``rdmaflow.bench.X``, listed in ``rdmaflow.cli.BENCHMARKS``) has
``add_arguments(parser)`` and ``run(args) -> int``; with this module a new one needs little
of its own beyond the measurement::

    from rdmaflow.bench import harness as h, plots, processes

    env = processes.process_env("tcp", secret=processes.new_secret())  # a transport's environment
    peer = processes.ChildProcess([sys.executable, "-m", "my.peer"], env, "peer")  # JSON lines
    info = peer.read(60)                                           # its hello, bounded
    m = h.Measurements("GB/s")
    for rep in range(repeats):
        for size in sizes:
            m.add("rdmaflow", size, measure(size))                 # ... and each baseline
    peer.close()
    h.write_csv(path, h.MEASUREMENT_COLUMNS, m.rows())
    print(h.ratio_table(m, "rdmaflow", point_label=h.format_size))
    plots.line_plot(png, m, xlabel="size", ylabel="GB/s", sizes=True)

Standard library only at import (matplotlib is imported by the plotting functions), so the
tools built on it run without the C++ extension.
"""
from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import re
import signal
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from rdmaflow.bench.processes import (
    DEFAULT_SETTLE,
    SLOW_HANDOFF,
    BackgroundMeter,
    BenchError,
    HostPhases,
    format_background,
)

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


def add_settle_argument(ap: Any, default: float | None = DEFAULT_SETTLE, default_text: str = "") -> None:
    """``--settle SECONDS`` (:class:`HostPhases`); ``default_text`` says the default where it is
    not ``default`` alone (None: the benchmark picks it)."""
    ap.add_argument("--settle", type=float, default=default,
                    help=f"before each measurement, wait up to this many seconds for a cache line's handoff "
                         f"between the cpus to come within {SLOW_HANDOFF:g}x of the fastest seen: the host "
                         f"out of a slow phase (default {default_text or f'{DEFAULT_SETTLE:g}'}; 0: no wait)")


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


def cell_status(cell: Mapping[str, Any] | None, values: str) -> str:
    """A benchmark cell's status for its CSV row: "not run", "ok", "failed: <first error>" when
    no repeat gave a value (its ``values`` list is empty), or "ok (<n> failed: <first error>)"."""
    if cell is None:
        return "not run"
    if not cell["errors"]:
        return "ok"
    if not cell[values]:
        return "failed: " + cell["errors"][0]
    return f"ok ({len(cell['errors'])} failed: {cell['errors'][0]})"


def verdict(ratio: float | None, bar: float) -> str:
    """A target's verdict: "met" when ``ratio >= bar``, "missed" below it, "n/a" without a ratio."""
    return "n/a" if ratio is None else ("met" if ratio >= bar else "missed")


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
# Interleaved measurements of several systems

#: What a failed measurement raises (a system's process died, timed out, answered nonsense).
MEASUREMENT_ERRORS = (BenchError, RuntimeError, OSError, ValueError)


def run_interleaved(systems: Mapping[str, Any], points: Sequence[Any], repeats: int,
                    measure: Callable[[str, Any, int], str | None], fail: Callable[[str, Any, str], None],
                    log: Callable[[str], None] = lambda s: None, label: str = "",
                    point_label: Callable[[Any], str] = str, phases: HostPhases | None = None,
                    record_phase: Callable[[str, Any, float | None], None] = lambda n, p, h: None) -> None:
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
    ``phases``: the host's phase is waited out before each measurement and probed after it
    (:class:`HostPhases`), every system paused meanwhile (one that spins would slow the probe);
    ``record_phase(name, point, handoff_ns)`` gets the figure of each measurement that
    ``measure`` recorded. Every system is closed at the end, however it ends."""
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
                    before = phases.before() if phases else None
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
                    if line is None:
                        continue
                    if phases:
                        handoff = phases.after(before)
                        record_phase(name, point, handoff)
                        line += "" if handoff is None else f", cache line handoff {handoff:.0f} ns"
                    log(f"[{label} {rep + 1}/{repeats}] {name} {point_label(point)}: {line} ({time.monotonic() - t0:.1f} s)")
    finally:
        for obj in systems.values():
            with contextlib.suppress(Exception):
                obj.close()


def cell_recorders(results: Mapping[tuple[str, str, Any], dict[str, Any]], transport: str
                   ) -> tuple[Callable[[str, Any, str], None], Callable[[str, Any, float | None], None]]:
    """:func:`run_interleaved`'s ``fail`` and ``record_phase`` for cells keyed (system,
    transport, point) that hold an ``errors`` and a ``handoff_ns`` list."""

    def fail(name: str, point: Any, msg: str) -> None:
        results[(name, transport, point)]["errors"].append(msg)

    def record_phase(name: str, point: Any, handoff: float | None) -> None:
        results[(name, transport, point)]["handoff_ns"].append(handoff)

    return fail, record_phase


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
