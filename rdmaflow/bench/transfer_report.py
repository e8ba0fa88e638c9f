"""What ``rdmaflow bench transfer`` reports from its cells: the tables (GB/s and per-transfer
time, median [min-max] of the repeats), the ratio table against rdmaflow zero copy, the
acceptance bars (:data:`ACCEPTANCE`), the CSV rows, the JSON document and the plot. The driver
(:mod:`rdmaflow.bench.transfer`) measures; this module only formats what it measured.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rdmaflow.bench.harness import cell_status, format_size, median_ratio, summarize, text_table, verdict
from rdmaflow.bench.plots import pyplot, save_figure, size_axis, style
from rdmaflow.bench.processes import fastest_handoff, handoff_values, slow_handoff, slow_phase_note
from rdmaflow.bench.transfer_systems import transport_env

Key = tuple[str, str, int]  # (system, transport, size)
CUDA_TRANSPORT = "cuda"  # the one "transport" of --device cuda runs
MIN_REPEATS = 3  # repeats a cell makes before its --cell-budget may stop it

#: The targets: (transports, numerator, denominator, least ratio), at ACCEPT_SIZES on the host
#: and at every size from CUDA_ACCEPT_FROM up on CUDA.
ACCEPT_SIZES = (16 << 20, 64 << 20)
CUDA_ACCEPT_FROM = 256 << 20
ACCEPTANCE: tuple[tuple[tuple[str, ...], str, str, float], ...] = (
    (("tcp",), "rdmaflow-zerocopy", "grpc-protobuf", 10.0),
    (("tcp",), "rdmaflow-zerocopy", "tensorpipe", 1.5),
    (("tcp",), "rdmaflow-zerocopy", "gloo", 1.2),
    (("tcp",), "rdmaflow-zerocopy", "ucx-perftest-put", 0.9),
    (("sm",), "rdmaflow-zerocopy", "tensorpipe", 1.3),
    (("sm",), "rdmaflow-zerocopy", "gloo", 1.5),
    (("sm",), "rdmaflow-zerocopy", "memcpy", 0.7),
    (("tcp", "sm"), "rdmaflow-zerocopy", "rdmaflow-copy", 1.2),
    ((CUDA_TRANSPORT,), "rdmaflow-zerocopy", "d2d-copy", 0.7),
    ((CUDA_TRANSPORT,), "rdmaflow-zerocopy", "gloo", 2.0),
    ((CUDA_TRANSPORT,), "rdmaflow-zerocopy", "tensorpipe", 1.0),
)
#: The system every other is compared with in the ratio table.
REFERENCE = "rdmaflow-zerocopy"

#: What the systems other than rdmaflow use per transport (printed with the tables).
PATHS = {
    "tcp": {"grpc-protobuf": "TCP 127.0.0.1", "tensorpipe": "uv transport, basic channel", "gloo": "TCP lo"},
    "sm": {"grpc-protobuf": "unix domain socket", "tensorpipe": "shm transport, cma channel",
           "gloo": "TCP lo (gloo has no shm transport)"},
    CUDA_TRANSPORT: {"rdmaflow-staging": "host arena tensors over a host static pair",
                     "tensorpipe": "shm/uv transports, cuda_ipc channel (device map 0 -> 0)",
                     "gloo": "TCP lo, host staging", "d2d-copy": "one process, CUDA events"},
}
#: What a receiver's consume step is, for the tables.
CONSUME_TEXT = {"max": "after reduce_max", "sync": "after a CUDA stream synchronize",
                "none": "with no consume step (diagnostic)"}

CSV_COLUMNS = [
    "system", "transport", "size_bytes", "size", "gb_per_s", "p50_us",
    "gb_per_s_min", "gb_per_s_max", "gb_per_s_iqr", "p50_us_min", "p50_us_max",
    "repeats", "failures", "iters", "warmup", "window", "status", "values_gb_per_s",
    "values_handoff_ns",
]


def cell_summary(cell: dict[str, Any] | None) -> dict[str, Any] | None:
    if not cell or not cell["gb_per_s"]:
        return None
    g = summarize(cell["gb_per_s"])
    p = summarize(cell["p50_us"]) if cell["p50_us"] else None
    return {"gb_per_s": g, "p50_us": p}


def ratio(results: Mapping[Key, dict[str, Any]], transport: str, num: str, den: str,
          size: int) -> float | None:
    """Median GB/s of ``num`` over median GB/s of ``den`` at ``size``."""
    a, b = results.get((num, transport, size)), results.get((den, transport, size))
    return median_ratio(a["gb_per_s"] if a else [], b["gb_per_s"] if b else [])


def _g(v: float, digits: int) -> str:
    """``v`` to ``digits`` significant digits, but whole from 10**digits up (a GPU's 1234 GB/s,
    not 1.2e+03)."""
    return f"{v:.{digits}g}" if abs(v) < 10 ** digits else f"{v:.0f}"


def format_tables(results: Mapping[Key, dict[str, Any]], transport: str, systems: Sequence[str],
                  sizes: Sequence[int], repeats: int, consume: str = "max") -> str:
    env = transport_env(transport)
    others = "; ".join(f"{name}: {path}" for name, path in PATHS.get(transport, {}).items() if name in systems)
    lines = [
        (f"## transport {transport}: rdmaflow{' and ucx_perftest' if 'ucx-perftest-put' in systems else ''} "
         f"with UCX_TLS={env['UCX_TLS']} "
         f"UCX_NET_DEVICES={env.get('UCX_NET_DEVICES', '')}" + (f"; {others}" if others else "")),
        (f"GB/s (1 GB = 1e9 B) at the receiver, {CONSUME_TEXT[consume]}; median [min-max] of {repeats} "
         f"interleaved repeats"),
    ]
    width = 17
    short = slow = False
    fastest = fastest_handoff(results.values())
    head = f"{'size':>6} " + " ".join(f"{s:>{width}}" for s in systems)
    lines += [head, "-" * len(head)]
    notes: dict[str, str] = {}
    for size in sizes:
        row = [f"{format_size(size):>6}"]
        for s in systems:
            cell = results.get((s, transport, size))
            sm = cell_summary(cell)
            if sm is None:
                txt = "failed" if cell and cell["errors"] else "-"
                if cell and cell["errors"]:
                    notes.setdefault(s, cell["errors"][0])
            else:
                g = sm["gb_per_s"]
                txt = f"{_g(g['median'], 3)} [{_g(g['min'], 2)}-{_g(g['max'], 2)}]"
                if cell["errors"]:
                    txt += "*"
                    notes.setdefault(s, cell["errors"][0])
                elif len(cell["gb_per_s"]) < repeats:
                    txt += "^"
                    short = True
                if slow_handoff(cell, fastest):
                    txt += "~"
                    slow = True
            row.append(f"{txt:>{width}}")
        lines.append(" ".join(row))
    lines += ["", ("p50 per-transfer time, us (median over repeats of the median receiver "
                   "inter-arrival time)"), head, "-" * len(head)]
    for size in sizes:
        row = [f"{format_size(size):>6}"]
        for s in systems:
            sm = cell_summary(results.get((s, transport, size)))
            txt = "-" if sm is None or sm["p50_us"] is None else _g(sm["p50_us"]["median"], 4)
            row.append(f"{txt:>{width}}")
        lines.append(" ".join(row))
    if short:
        lines.append(f"^ fewer repeats: the cell used up --cell-budget after {MIN_REPEATS}")
    if slow:
        lines.append(slow_phase_note(fastest))
    for s, msg in notes.items():
        lines.append(f"* {s}: failed: {msg}")
    ratio_lines = format_ratios(results, transport, systems, sizes)
    if ratio_lines:
        lines += ["", ratio_lines]
    return "\n".join(lines)


def ratios(results: Mapping[Key, dict[str, Any]], transport: str, systems: Sequence[str],
           sizes: Sequence[int], reference: str = REFERENCE) -> dict[int, dict[str, float | None]]:
    """size -> {system: median GB/s of ``reference`` over that system's} for every other system."""
    return {size: {s: ratio(results, transport, reference, s, size) for s in systems if s != reference}
            for size in sizes}


def format_ratios(results: Mapping[Key, dict[str, Any]], transport: str, systems: Sequence[str],
                  sizes: Sequence[int], reference: str = REFERENCE) -> str:
    """The table of :func:`ratios` ("" when ``reference`` is not in the run)."""
    others = [s for s in systems if s != reference]
    if reference not in systems or not others:
        return ""
    table = ratios(results, transport, systems, sizes, reference)
    rows = [[format_size(size), *("-" if table[size][s] is None else f"{table[size][s]:.2f}" for s in others)]
            for size in sizes]
    head = ["size", *(f"/{s}" for s in others)]
    return "\n".join([f"{reference} over each (median GB/s over median GB/s; above 1: {reference} faster)",
                      *text_table(head, rows)])


def accept_sizes(transport: str, sizes: Sequence[int]) -> list[int]:
    """The sizes a transport's bars apply at: ACCEPT_SIZES on the host, every size of the run
    from CUDA_ACCEPT_FROM up on CUDA."""
    if transport == CUDA_TRANSPORT:
        return sorted(s for s in set(sizes) if s >= CUDA_ACCEPT_FROM)
    return list(ACCEPT_SIZES)


def acceptance(results: Mapping[Key, dict[str, Any]], transports: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    for ts, num, den, bar in ACCEPTANCE:
        for t in ts:
            if t not in transports:
                continue
            for size in accept_sizes(t, [k[2] for k in results if k[1] == t]):
                if (num, t, size) not in results and (den, t, size) not in results:
                    continue
                x = ratio(results, t, num, den, size)
                rows.append({"transport": t, "size": size, "num": num, "den": den, "bar": bar,
                             "ratio": x, "verdict": verdict(x, bar)})
    return rows


def format_acceptance(rows: Sequence[dict[str, Any]]) -> str:
    if not rows:
        return ""
    lines = ["targets (median GB/s over median GB/s):"]
    for r in rows:
        x = "-" if r["ratio"] is None else f"{r['ratio']:.2f}"
        lines.append(f"  {r['transport']:>4} {format_size(r['size']):>4}  {r['num']} / {r['den']:<17}"
                     f" {x:>6}x  target: >= {r['bar']:g}x  {r['verdict']}")
    return "\n".join(lines)


def csv_rows(results: Mapping[Key, dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for (system, transport, size), cell in results.items():
        sm = cell_summary(cell)
        g = sm["gb_per_s"] if sm else None
        p = sm["p50_us"] if sm else None
        rows.append({
            "system": system, "transport": transport, "size_bytes": size,
            "size": format_size(size),
            "gb_per_s": f"{g['median']:.4f}" if g else "",
            "p50_us": f"{p['median']:.2f}" if p else "",
            "gb_per_s_min": f"{g['min']:.4f}" if g else "",
            "gb_per_s_max": f"{g['max']:.4f}" if g else "",
            "gb_per_s_iqr": f"{g['iqr']:.4f}" if g else "",
            "p50_us_min": f"{p['min']:.2f}" if p else "",
            "p50_us_max": f"{p['max']:.2f}" if p else "",
            "repeats": len(cell["gb_per_s"]), "failures": len(cell["errors"]),
            "iters": cell["iters"], "warmup": cell["warmup"], "window": cell["window"],
            "status": cell_status(cell, "gb_per_s"),
            "values_gb_per_s": " ".join(f"{v:.4f}" for v in cell["gb_per_s"]),
            "values_handoff_ns": handoff_values(cell),
        })
    return rows


def json_doc(results: Mapping[Key, dict[str, Any]], transports: Sequence[str], systems: Sequence[str],
             sizes: Sequence[int], *, header: str, settings: Mapping[str, Any], machine: Mapping[str, Any],
             elapsed_s: float, interrupted: bool = False) -> dict[str, Any]:
    """What ``--json`` holds: the settings and the machine, every cell (:func:`csv_rows`), the
    acceptance ratios and every ratio of :data:`REFERENCE` to the others, per transport."""
    return {
        "benchmark": "transfer", "header": header, "command": list(sys.argv), **settings,
        "machine": dict(machine), "transports": list(transports), "systems": list(systems),
        "sizes": [format_size(s) for s in sizes],
        "ucx_tls": {t: transport_env(t).get("UCX_TLS", "") for t in transports},
        "rows": csv_rows(results),
        "acceptance": [dict(r, size=format_size(r["size"])) for r in acceptance(results, transports)],
        "ratios": {t: {format_size(size): row for size, row in ratios(results, t, systems, sizes).items()}
                   for t in transports if REFERENCE in systems},
        "elapsed_s": round(elapsed_s, 1), "interrupted": interrupted,
    }


def plot(path: str, results: Mapping[Key, dict[str, Any]], transports: Sequence[str],
         systems: Sequence[str], sizes: Sequence[int], title: str = "") -> None:
    """Figure 8 style: log-log, throughput (top) and per-transfer time (bottom), a column per
    transport, one line per system with its min-max band."""
    n = len(transports)
    fig, axes = pyplot().subplots(2, n, figsize=(6.5 * n, 9), squeeze=False, sharex=True)
    for j, t in enumerate(transports):
        for s in systems:
            color, mark, ls = style(s)
            for i, metric in enumerate(("gb_per_s", "p50_us")):
                xs, med, lo, hi = [], [], [], []
                for size in sizes:
                    sm = cell_summary(results.get((s, t, size)))
                    if sm is None or sm[metric] is None:
                        continue
                    xs.append(size)
                    med.append(sm[metric]["median"])
                    lo.append(sm[metric]["min"])
                    hi.append(sm[metric]["max"])
                if not xs:
                    continue
                ax = axes[i][j]
                ax.plot(xs, med, marker=mark or None, linestyle=ls, color=color, label=s, ms=4)
                ax.fill_between(xs, lo, hi, color=color, alpha=0.15, linewidth=0)
        for i, ylabel in enumerate(("throughput, GB/s (1e9 B/s)", "time per transfer (p50), us")):
            ax = axes[i][j]
            size_axis(ax, sizes)
            ax.set_yscale("log")
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylabel(ylabel)
            if i == 0:
                ax.set_title("CUDA tensors, one GPU, two processes" if t == CUDA_TRANSPORT else
                             f"transport: {t}" + (" (gloo: TCP)" if t == "sm" else ""))
            else:
                ax.set_xlabel("tensor size (float32)")
        axes[0][j].legend(fontsize=8, loc="best")
    save_figure(fig, path, title, wrap=60 * n, fontsize=9, dpi=110)
