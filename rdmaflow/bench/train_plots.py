"""The plots of ``rdmaflow bench train``: throughput bars, and Figures 9, 11 and 12 of Xue et al.
when the run has their axes (:func:`make_plots`)."""
from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rdmaflow.bench.plots import pyplot, save_figure, style
from rdmaflow.bench.train_cells import Config, Key, cell_key, lookup

PNG_BARS = "throughput.png"
PNG_FIG9 = "fig9_batch.png"
PNG_FIG11 = "fig11_workers.png"
PNG_FIG12 = "fig12_zero_copy.png"


def _label_configs(ax, configs: Sequence[Config], model: str, ylabel: str) -> None:
    """One tick per configuration (batch, workers, shards), titles, grid and legend."""
    ax.set_xticks(range(len(configs)))
    ax.set_xticklabels([f"batch {b}\n{w} W, {s} S" for _, b, w, s in configs], fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(model, fontsize=10)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7)


def _uniq(xs: Iterable[Any]) -> list[Any]:
    return list(dict.fromkeys(xs))


def plot_bars(path: str, cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config],
              systems: Sequence[str], title: str = "") -> None:
    """Every configuration, a bar per system: mini-batches/s per worker with p25-p75
    whiskers, a row per model; a failed cell is marked "x" at the bottom."""
    plt = pyplot()
    models = _uniq(c[0] for c in configs)
    most = max(sum(1 for c in configs if c[0] == m) for m in models)
    width = min(24.0, max(6.0, 1.5 + most * (0.3 * len(systems) + 0.5)))
    fig, axes = plt.subplots(len(models), 1, figsize=(width, 3.6 * len(models)), squeeze=False)
    w = 0.8 / max(1, len(systems))
    for r, model in enumerate(models):
        ax = axes[r][0]
        mine = [c for c in configs if c[0] == model]
        for j, s in enumerate(systems):
            xs, ys, lo, hi, bad = [], [], [], [], []
            for i, cfg in enumerate(mine):
                x = i + (j - (len(systems) - 1) / 2) * w
                cell = cells.get(cell_key(s, *cfg))
                m = cell["metrics"] if cell else None
                if m is None:
                    if cell is not None:
                        bad.append(x)
                    continue
                xs.append(x)
                ys.append(m["batches_per_s"])
                lo.append(max(0.0, m["batches_per_s"] - m["batches_per_s_p25"]))
                hi.append(max(0.0, m["batches_per_s_p75"] - m["batches_per_s"]))
            color = style(s)[0]
            if xs:
                ax.bar(xs, ys, width=w, color=color, label=s, yerr=[lo, hi], capsize=2,
                       error_kw={"linewidth": 0.8})
            if bad:
                ax.plot(bad, [0] * len(bad), "x", color=color or "black", ms=7, clip_on=False,
                        label=None if xs else f"{s} (failed)")
        _label_configs(ax, mine, model, "mini-batches/s per worker")
        ax.set_ylim(bottom=0)
    save_figure(fig, path, title)


def plot_fig9(path: str, cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config],
              systems: Sequence[str], title: str = "") -> None:
    """Figure 9 style: per model (columns) and workers/shards (rows), mini-batches/s per
    worker against the mini-batch size, one line per system with its p25-p75 band."""
    plt = pyplot()
    models = _uniq(c[0] for c in configs)
    ws = _uniq((c[2], c[3]) for c in configs)
    fig, axes = plt.subplots(len(ws), len(models), figsize=(5.2 * len(models), 4.0 * len(ws)),
                             squeeze=False)
    for r, (wk, sh) in enumerate(ws):
        for c, model in enumerate(models):
            ax = axes[r][c]
            batches = sorted(_uniq(b for m, b, w2, s2 in configs if m == model and (w2, s2) == (wk, sh)))
            for s in systems:
                color, mark, ls = style(s)
                pts = [(b, lookup(cells, s, (model, b, wk, sh))) for b in batches]
                pts = [(b, m) for b, m in pts if m is not None]
                if not pts:
                    continue
                xs = [b for b, _ in pts]
                ax.plot(xs, [m["batches_per_s"] for _, m in pts], marker=mark, linestyle=ls,
                        color=color, label=s + (" (1 process)" if s == "local" else ""), ms=4)
                ax.fill_between(xs, [m["batches_per_s_p25"] for _, m in pts],
                                [m["batches_per_s_p75"] for _, m in pts], color=color,
                                alpha=0.15, linewidth=0)
            ax.set_xscale("log", base=2)
            ax.set_xticks(batches)
            ax.set_xticklabels([str(b) for b in batches])
            ax.set_xlabel("mini-batch size per worker")
            ax.set_ylabel("mini-batches/s per worker")
            ax.set_title(f"{model}: {wk} workers, {sh} shards", fontsize=10)
            ax.grid(True, which="both", alpha=0.3)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    save_figure(fig, path, title)


def plot_fig11(path: str, cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config],
               systems: Sequence[str], netns: bool, title: str = "") -> None:
    """Figure 11 style: per model (columns) and batch (and shard count, rows), the job's
    samples/s against the number of workers, one line per system, the local process at 1
    and its ideal linear scaling (local x workers)."""
    plt = pyplot()
    models = _uniq(c[0] for c in configs)
    # netns: shards follow workers; else one row per (batch, shards).
    rows = _uniq((c[1], None if netns else c[3]) for c in configs)
    fig, axes = plt.subplots(len(rows), len(models), figsize=(5.2 * len(models), 4.0 * len(rows)),
                             squeeze=False)
    for r, (batch, sh) in enumerate(rows):
        for c, model in enumerate(models):
            ax = axes[r][c]
            mine = [cf for cf in configs if cf[0] == model and cf[1] == batch and (sh is None or cf[3] == sh)]
            workers = sorted(_uniq(cf[2] for cf in mine))
            by_w = {cf[2]: cf for cf in mine}
            for s in systems:
                if s == "local":
                    continue
                color, mark, ls = style(s)
                pts = [(w, lookup(cells, s, by_w[w])) for w in workers]
                pts = [(w, m) for w, m in pts if m is not None]
                if pts:
                    ax.plot([w for w, _ in pts], [m["samples_per_s"] for _, m in pts], marker=mark,
                            linestyle=ls, color=color, label=s, ms=4)
            loc = lookup(cells, "local", (model, batch, 1, 0))
            if loc is not None:
                xs = sorted({1, *workers})
                ax.plot(xs, [loc["samples_per_s"] * w for w in xs], linestyle=":", color="black",
                        label="ideal (local x workers)")
                ax.plot([1], [loc["samples_per_s"]], marker="*", ms=9, color="grey",
                        linestyle="none", label="local (1 process)")
            ax.set_xticks(sorted({1, *workers}) if loc is not None else workers)
            ax.set_xlabel("workers" + (" (= shards = hosts)" if netns else ""))
            ax.set_ylabel("samples/s (whole job)")
            ax.set_title(f"{model}: batch {batch}" + ("" if sh is None else f", {sh} shards"), fontsize=10)
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            ax.legend(fontsize=7)
    save_figure(fig, path, title)


def plot_fig12(path: str, cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config],
               title: str = "") -> None:
    """Figure 12 style: a row per model, the median mini-batch time of rdmaflow with zero
    copy and with the copy (rdmaflow-copy) per configuration, with the copy's overhead."""
    plt = pyplot()
    models = _uniq(c[0] for c in configs)
    most = max(sum(1 for c in configs if c[0] == m) for m in models)
    width = min(24.0, max(5.0, 1.5 + 1.1 * most))
    fig, axes = plt.subplots(len(models), 1, figsize=(width, 3.4 * len(models)), squeeze=False)
    for r, model in enumerate(models):
        ax = axes[r][0]
        mine = [cf for cf in configs if cf[0] == model]
        for j, s in enumerate(("rdmaflow", "rdmaflow-copy")):
            xs, ys = [], []
            for i, cf in enumerate(mine):
                m = lookup(cells, s, cf)
                if m is not None:
                    xs.append(i + (j - 0.5) * 0.38)
                    ys.append(m["median_iter_s"] * 1e3)
            if xs:
                ax.bar(xs, ys, width=0.38, color=style(s)[0],
                       label="zero copy (rdmaflow)" if s == "rdmaflow" else "copy (rdmaflow-copy)")
        for i, cf in enumerate(mine):
            a, b = lookup(cells, "rdmaflow", cf), lookup(cells, "rdmaflow-copy", cf)
            if a and b:
                top = max(a["median_iter_s"], b["median_iter_s"]) * 1e3
                pct = (b["median_iter_s"] / a["median_iter_s"] - 1) * 100
                ax.annotate(f"copy {pct:+.0f}%", (i, top), ha="center", va="bottom", fontsize=8)
        _label_configs(ax, mine, model, "mini-batch time, ms (median)")
        ax.margins(y=0.12)
    save_figure(fig, path, title)


def make_plots(out: str, cells: Mapping[Key, dict[str, Any]], configs: Sequence[Config],
               systems: Sequence[str], netns: bool, title: str) -> list[str]:
    """throughput.png always; fig9 when >= 2 batch sizes, fig11 when >= 2 worker counts,
    fig12 when rdmaflow-copy was measured. Returns the paths written."""
    if not any(c["metrics"] for c in cells.values()):
        return []
    made = []
    path = os.path.join(out, PNG_BARS)
    plot_bars(path, cells, configs, systems, title)
    made.append(path)
    if len(_uniq(c[1] for c in configs)) >= 2:
        path = os.path.join(out, PNG_FIG9)
        plot_fig9(path, cells, configs, systems, title)
        made.append(path)
    if len(_uniq(c[2] for c in configs)) >= 2:
        path = os.path.join(out, PNG_FIG11)
        plot_fig11(path, cells, configs, systems, netns, title)
        made.append(path)
    if "rdmaflow-copy" in systems and any(c["metrics"] for k, c in cells.items() if k[0] == "rdmaflow-copy"):
        path = os.path.join(out, PNG_FIG12)
        plot_fig12(path, cells, configs, title)
        made.append(path)
    return made
