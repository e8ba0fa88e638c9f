"""``rdmaflow bench pipeline``: pipeline-parallel training steps per second, rdmaflow's graph
layer next to ``torch.distributed.pipelining``.

The same model, split, microbatches (8) and schedule (GPipe), side by side in one run:

    rdmaflow          rdmaflow.graph: static/bounded/dynamic edges, allocation-site placement
    rdmaflow-copy     the same with allocation-site placement off (every send copies once)
    pipelining-gloo   torch.distributed.pipelining over gloo (TCP: gloo has no shared-memory
                      transport, so on one host it runs over loopback, what its users get)

Models (:mod:`rdmaflow.bench.pipeline_models`): ``comm`` (communication-bound), ``compute``
(compute-bound), ``varlen`` (a transformer whose sequence length changes every step; the
pipelining run pads it to the bound, rdmaflow runs it unpadded).

A cell is (model, stages, hosts, transport); rdmaflow runs over the cell's UCX transport, the
pipelining baseline over gloo's TCP. For each repeat, for each cell, every system runs one
short job (``--warmup`` steps, then ``--steps`` timed ones) in an order that rotates by one
each repeat; a job's value is its timed steps divided by their total seconds on stage 0 (a
GPipe step ends on stage 0 when the last backward reached it). The table gives steps/s,
median [min-max] over repeats, and the ratios of the medians; the targets are checked on
the two-stage cells on one host. Output in ``--out``: ``pipeline.csv`` (a row per system and
cell with every repeat's value), ``pipeline.json`` (the same, the failures, the bars, the
command), ``pipeline.png`` (steps/s per cell).

``--hosts netns``: stage ``i`` runs in network namespace "host" ``i``
(:class:`rdmaflow.testing.netns.Hosts`), over tcp on the namespaces' veths (needs root).
Exit status: 0 done, 1 a job failed (the rest was measured), 2 bad arguments or no network
namespaces, 130 interrupted (what was measured is written).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from typing import NamedTuple

from rdmaflow.bench import flags, plots
from rdmaflow.bench import harness as h
from rdmaflow.bench.processes import (
    BackgroundMeter,
    BenchError,
    ChildProcess,
    format_background,
    free_port,
    new_secret,
    process_env,
    wait_all,
)

SYSTEMS = ("rdmaflow", "rdmaflow-copy", "pipelining-gloo")
MODELS = ("comm", "compute", "varlen")
TRANSPORTS = ("sm", "tcp")
WORKER = "rdmaflow.bench._pipeline_worker"
RESULT_TAG = "RDMAFLOW_PIPELINE_RESULT"
CSV_COLUMNS = ("model", "stages", "hosts", "transport", "system", "unit", "median", "min", "max", "iqr",
               "repeats", "values")

#: The targets, on the two-stage cells on one host: (model, transport or None for both,
#: numerator, denominator, least steps/s ratio).
BARS = (
    ("comm", "sm", "rdmaflow", "pipelining-gloo", 1.3),
    ("comm", "tcp", "rdmaflow", "pipelining-gloo", 1.1),
    ("compute", None, "rdmaflow", "pipelining-gloo", 1.0),
    ("varlen", None, "rdmaflow", "pipelining-gloo", 1.2),
    ("comm", None, "rdmaflow", "rdmaflow-copy", 1.1),
)


class Cell(NamedTuple):
    model: str
    stages: int
    hosts: str       # "local" or "netns"
    transport: str   # rdmaflow's UCX transport

    def label(self) -> str:
        return f"{self.model} {self.stages} stages {self.transport}" + (" netns" if self.hosts == "netns" else "")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    flags.add_models(ap, MODELS, ", ".join(MODELS))
    ap.add_argument("--stages", default="2,4", help="numbers of stages, comma-separated (default 2,4)")
    flags.add_transport(ap, TRANSPORTS, note="rdmaflow's; --hosts netns: tcp only", allowed=TRANSPORTS)
    flags.add_hosts(ap, "stage i in network namespace i")
    flags.add_systems(ap, SYSTEMS, SYSTEMS)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per job (default 10)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them (default 3)")
    flags.add_repeats(ap, 3, "one job each (default 3)")
    flags.add_threads(ap, None, "default: this machine's cores / stages, at least 1, --hosts netns "
                                "included: the namespaces share the machine's cores")
    flags.add_seed(ap, "the models' weights, data and sequence lengths")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one job may take (default 600)")
    flags.add_out(ap, "bench-results/pipeline", "pipeline.csv, pipeline.json and pipeline.png "
                                                "(default bench-results/pipeline)")
    flags.add_quick(ap, "1 repeat of 2 steps after 1")


def cells_of(args) -> list[Cell]:
    models = flags.choose(args.models, MODELS, "--models")
    try:
        stages = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--stages must be comma-separated integers; got {args.stages!r}") from None
    if not stages or any(s < 2 or s > 8 for s in stages):
        raise ValueError(f"--stages must be between 2 and 8; got {args.stages!r}")
    transports = flags.transports(args.transport)
    if args.hosts == "netns":
        if transports != ["tcp"] and "tcp" not in transports:
            raise ValueError("--hosts netns runs rdmaflow over tcp between the namespaces; give --transport tcp")
        transports = ["tcp"]
    return [Cell(m, s, args.hosts, t) for s in stages for t in transports for m in models]


# -- one job ---------------------------------------------------------------------------------------
def run_job(system: str, cell: Cell, cfg: dict, *, timeout: float, hosts=None, threads: int | None = None,
            log=lambda s: None) -> dict:
    """Runs one job of ``cell.stages`` processes to its end; returns stage 0's result or raises
    BenchError. Every process it started is killed before it returns or raises."""
    secret, port = new_secret(), free_port()
    master = hosts[0].addr if hosts is not None else "127.0.0.1"
    argv = [sys.executable, "-m", WORKER]
    job = {**cfg, "system": system, "model": cell.model, "stages": cell.stages}
    procs: list[ChildProcess] = []
    try:
        for rank in range(cell.stages):
            host = hosts[rank] if hosts is not None else None
            ifname = host.ifname if host else None
            env = process_env(cell.transport if system != "pipelining-gloo" else None,
                              net_device=ifname, secret=secret, threads=threads)
            env.update({"RANK": str(rank), "WORLD_SIZE": str(cell.stages), "LOCAL_RANK": str(0 if host else rank),
                        "LOCAL_WORLD_SIZE": str(1 if host else cell.stages), "MASTER_ADDR": master,
                        "MASTER_PORT": str(port), "GLOO_SOCKET_IFNAME": ifname or "lo",
                        "RDMAFLOW_PIPELINE_CFG": json.dumps(job)})
            label = f"{system} stage {rank}" + (f" (host {rank})" if host else "")
            procs.append(ChildProcess(host.argv(argv) if host else argv, env, label, stdin=False))
            log(f"  started {label}, pid {procs[-1].pid}")
        wait_all(procs, timeout)
        lines = [ln[len(RESULT_TAG):].strip() for ln in procs[0].drain(5.0) if ln.startswith(RESULT_TAG)]
        if len(lines) != 1:
            raise BenchError(f"{system} stage 0 printed {len(lines)} {RESULT_TAG} lines, expected 1")
        res = json.loads(lines[0])
        times = res.get("times")
        if not isinstance(times, list) or len(times) != cfg["steps"] or not all(t > 0 for t in times):
            raise BenchError(f"{system} stage 0 reported {times!r}, expected {cfg['steps']} positive step times")
        return res
    finally:
        for p in procs:
            p.kill()


# -- tables, bars, files ---------------------------------------------------------------------------
def check_bars(m: h.Measurements, cells: Sequence[Cell]) -> list[dict]:
    rows = []
    for model, transport, num, den, bar in BARS:
        for c in cells:
            if (c.model, c.stages, c.hosts) == (model, 2, "local") and transport in (None, c.transport):
                for r in h.check_bars(m, [(num, den, bar)], [c]):
                    rows.append({**r, "point": c.label()})
    return rows


def table(m: h.Measurements, cells: Sequence[Cell]) -> str:
    systems = [s for s in m.systems]
    head = ["cell", *systems, *(f"rdmaflow/{s}" for s in systems if s != "rdmaflow")]
    rows = []
    for c in cells:
        if not any(m.values(s, c) for s in systems):
            continue
        vals = [h.spread(m.values(s, c)) if m.values(s, c) else "-" for s in systems]
        ratios = [m.ratio("rdmaflow", s, c) for s in systems if s != "rdmaflow"]
        rows.append([c.label(), *vals, *("-" if r is None else f"{r:.2f}" for r in ratios)])
    return "\n".join(["steps/s: median [min-max] over repeats; ratios of the medians", *h.text_table(head, rows)])


def format_bars(rows: list[dict]) -> str:
    if not rows:
        return "targets: none of their cells (2 stages on one host) was measured"
    out = ["targets, steps/s over steps/s (2 stages, one host):"]
    for r in rows:
        x = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        out.append(f"  {r['point']}: {r['num']}/{r['den']} {x}x  target: >= {r['bar']}x  {r['verdict']}")
    return "\n".join(out)


def plot(path: str, m: h.Measurements, cells: Sequence[Cell]) -> None:
    plt = plots.pyplot()
    shown = [c for c in cells if any(m.values(s, c) for s in m.systems)]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(shown)), 4))
    width = 0.8 / max(1, len(m.systems))
    for i, s in enumerate(m.systems):
        xs, ys, lo, hi = [], [], [], []
        for j, c in enumerate(shown):
            v = m.values(s, c)
            if v:
                st = h.summarize(v)
                xs.append(j + (i - (len(m.systems) - 1) / 2) * width)
                ys.append(st["median"])
                lo.append(st["median"] - st["min"])
                hi.append(st["max"] - st["median"])
        color, _, _ = plots.style(s)
        ax.bar(xs, ys, width, yerr=[lo, hi], label=s, color=color, capsize=2)
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([c.label().replace(" stages ", "st\n") for c in shown], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("steps/s (median, min-max)")
    ax.legend(fontsize=7)
    plots.save_figure(fig, path, "rdmaflow bench pipeline: GPipe training steps/s, 8 microbatches")


def save(out: str, m: h.Measurements, cells: Sequence[Cell], failures: list, bars: list, argv: Sequence[str]) -> None:
    rows = []
    for r in m.rows("cell"):
        c = r.pop("cell")
        rows.append({**r, "model": c.model, "stages": c.stages, "hosts": c.hosts, "transport": c.transport})
    h.write_csv(os.path.join(out, "pipeline.csv"), CSV_COLUMNS, rows)
    h.write_json(os.path.join(out, "pipeline.json"),
                 {"command": " ".join(argv), "rows": rows, "failures": failures, "bars": bars})
    with contextlib.suppress(ImportError):
        plot(os.path.join(out, "pipeline.png"), m, cells)


# -- the run ---------------------------------------------------------------------------------------
def run(args) -> int:
    try:
        cells = cells_of(args)
        systems = flags.choose(args.systems, SYSTEMS, "--systems")
        if args.steps < 1 or args.warmup < 0 or args.repeats < 1:
            raise ValueError("--steps and --repeats must be at least 1, --warmup at least 0")
    except ValueError as e:
        print(f"rdmaflow bench pipeline: {e}", file=sys.stderr)
        return 2
    if args.quick:
        args.steps, args.warmup, args.repeats = 2, 1, 1
    cfg = {"steps": args.steps, "warmup": args.warmup, "seed": args.seed, "timeout": args.timeout}
    hosts_cm = contextlib.nullcontext()
    if args.hosts == "netns":
        from rdmaflow.testing.netns import Hosts, netns_unavailable_reason

        why = netns_unavailable_reason()
        if why:
            print(f"rdmaflow bench pipeline: --hosts netns needs network namespaces: {why}", file=sys.stderr)
            return 2
        hosts_cm = Hosts(max(c.stages for c in cells))
    m = h.Measurements("steps/s")
    failures: list[dict] = []
    argv = ["rdmaflow", "bench", "pipeline", *sys.argv[3:]] if sys.argv[1:3] == ["bench", "pipeline"] else sys.argv
    meter = BackgroundMeter()
    interrupted = False

    def on_term(signum, frame):
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)  # SIGTERM stops it as Ctrl-C does
    try:
        with hosts_cm as hosts:
            for rep in range(args.repeats):
                order = systems[rep % len(systems):] + systems[:rep % len(systems)]
                for c in cells:
                    # Namespace "hosts" share this machine's cores: every stage counts.
                    threads = args.threads or max(1, (os.cpu_count() or 1) // c.stages)
                    for s in order:
                        t0 = time.monotonic()
                        try:
                            res = run_job(s, c, cfg, timeout=args.timeout, hosts=hosts, threads=threads)
                        except (BenchError, OSError, ValueError) as e:
                            msg = " ".join(str(e).split())[:600]
                            failures.append({"system": s, "cell": c.label(), "repeat": rep + 1, "error": msg})
                            print(f"[{rep + 1}/{args.repeats}] {c.label()} {s}: failed: {msg}", flush=True)
                            continue
                        rate = len(res["times"]) / sum(res["times"])
                        m.add(s, c, rate)
                        print(f"[{rep + 1}/{args.repeats}] {c.label()} {s}: {rate:.3g} steps/s "
                              f"({time.monotonic() - t0:.1f} s){_sends_note(res.get('sends'))}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print("\ninterrupted; every benchmark process was stopped", file=sys.stderr)
    finally:
        signal.signal(signal.SIGTERM, old_term)
    bars = check_bars(m, cells)
    print()
    print(table(m, cells))
    print(format_bars(bars))
    print(format_background(meter.report()))
    save(args.out, m, cells, failures, bars, argv)
    print(f"wrote {os.path.join(args.out, 'pipeline.csv')}, pipeline.json, pipeline.png")
    if args.quick:
        print("(--quick: a smoke run, not a measurement)")
    return 130 if interrupted else (1 if failures else 0)


def _sends_note(sends: dict | None) -> str:
    """What stage 0's allocation-site placement did (rdmaflow systems): its zero-copy sends, and
    why the others copied."""
    if not sends:
        return ""
    zero, total = sum(st["zero_copy"] for st in sends.values()), sum(st["sends"] for st in sends.values())
    why = sorted({st["copy_reason"] for st in sends.values() if st["copy_reason"]})
    return f"; stage 0: {zero}/{total} sends zero-copy" + (f" ({'; '.join(why)})" if why else "")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="rdmaflow bench pipeline", description=__doc__.split("\n")[0])
    add_arguments(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
