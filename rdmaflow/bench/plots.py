"""The plots of every ``rdmaflow bench`` harness: one style per system, so that a system looks
the same in every figure, and the line plot of a :class:`~rdmaflow.bench.harness.Measurements`.

matplotlib is imported by the functions that draw, not at import.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from rdmaflow.bench.harness import Measurements, format_size, summarize

# ------------------------------------------------------------------------------------------
# Plots

#: system -> (color, marker, line style), the same in every benchmark's plots.
STYLES: dict[str, tuple[str, str, str]] = {
    "rdmaflow": ("tab:red", "o", "-"),
    "rdmaflow-zerocopy": ("tab:red", "o", "-"),
    "rdmaflow-zerocopy-ucx": ("tab:red", "o", ":"),
    "rdmaflow-tcp": ("tab:red", "o", "-"),
    "rdmaflow-copy": ("tab:orange", "s", "-"),
    "rdmaflow-sm": ("tab:orange", "s", "-"),
    "rdmaflow-dynamic": ("tab:brown", "^", "-"),
    "rdmaflow-staging": ("tab:pink", "s", "-."),
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
    "d2d-copy": ("grey", "", ":"),
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
