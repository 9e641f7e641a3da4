"""Plots of an evaluation: error accumulation (a per-frame metric vs frame index) and retrieval by span.

    from arvdm.evaluation.plots import plot_error_accumulation, plot_retrieval_by_span
    plot_error_accumulation({"prepend m=8": psnr_curve}, "out/error_accumulation.png")
    plot_retrieval_by_span({"prepend m=8": {"0-16": 0.5, "16-48": 0.2}}, "out/retrieval_by_span.png")

Plots use matplotlib's object API with the Agg canvas (``new_figure``; no pyplot, no global backend
switch), so they work headless and do not disturb a caller's own figures. Every PNG is written atomically
(``save_png``). The Pareto plot is ``arvdm.evaluation.pareto.plot_pareto``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_write

__all__ = ["new_figure", "plot_error_accumulation", "plot_retrieval_by_span", "save_png"]

#: Figure size in inches (width, height) and resolution of every plot.
FIGURE_SIZE = (7.0, 4.5)
FIGURE_DPI = 120
#: Line styles of the baselines' reference curves, in order (a fifth baseline would not be drawn).
BASELINE_STYLES = ("-", "--", ":", "-.")
#: Offset of the small text marks ("n=12", "n/a", "0") above a bar, in retrieval-rate units.
BAR_LABEL_OFFSET = 0.01
#: More configurations than this put the retrieval legend in two columns.
LEGEND_ONE_COLUMN_MAX = 5


def new_figure(size: tuple[float, float] = FIGURE_SIZE):
    """A matplotlib Figure on an Agg canvas (headless, outside pyplot's global state)."""
    # lazy: matplotlib takes a second to import, and only the plots need it
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=FIGURE_DPI)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig, path: str | os.PathLike) -> Path:
    """Save a figure as PNG atomically (temp file in the same folder, then os.replace)."""
    path = Path(path)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    return path


def _as_list(values: Any) -> list[float]:
    """A per-frame curve (T,) or a batch of them (B, T) as one list of T floats (the batch mean)."""
    t = torch.as_tensor(values, dtype=torch.float64)
    if t.ndim == 2:  # (B, T) -> (T,)
        t = t.mean(0)
    if t.ndim != 1:
        raise ValueError(f"expected a per-frame curve (T,) or (B, T), got shape {tuple(t.shape)}")
    return t.tolist()


def plot_error_accumulation(
    curves: Mapping[str, Any],
    path: str | os.PathLike,
    span: int = 16,
    reference: Mapping[str, Mapping[str, float]] | None = None,
    ylabel: str = "PSNR (dB)",
    title: str = "Error accumulation: PSNR vs frame index",
    baselines: Mapping[str, Any] | None = None,
) -> Path:
    """Line plot of a per-frame metric against generated frame index, one line per configuration.

    Args:
        curves: name -> per-frame values (T,) or (B, T) (averaged over B).
        span: dotted vertical lines at span boundaries (the spans of the summaries).
        reference: optional name -> {span label "a-b": value}, e.g. ``paper_reference()["psnr_by_span"]``,
            drawn as dashed markers at the span centres.
        baselines: optional name -> per-frame values of a trivial predictor (copy-last, context-mean; see
            ``arvdm.evaluation.baselines``), drawn as grey reference lines: a curve below them is not a result.
    """
    if not curves:
        raise ValueError("plot_error_accumulation: no curves given")
    fig = new_figure()
    ax = fig.add_subplot()
    t_max = 0
    for name, values in curves.items():
        y = _as_list(values)
        t_max = max(t_max, len(y))
        ax.plot(range(len(y)), y, label=name, linewidth=1.5)
    for (name, values), style in zip((baselines or {}).items(), BASELINE_STYLES):
        y = _as_list(values)
        t_max = max(t_max, len(y))
        ax.plot(range(len(y)), y, color="black", linestyle=style, linewidth=1.6, zorder=5, label=f"baseline: {name}")
    for name, spans in (reference or {}).items():
        xs, ys = [], []
        for label, v in spans.items():
            lo, hi = (int(s) for s in label.split("-"))
            xs.append((lo + hi - 1) / 2)  # the span's centre frame
            ys.append(v)
            t_max = max(t_max, hi)
        ax.plot(xs, ys, linestyle="--", marker="s", label=f"{name} (paper, span means)")
    for x in range(span, t_max, span):
        ax.axvline(x - 0.5, color="0.85", linewidth=0.8, linestyle=":", zorder=0)
    ax.set_xlabel("generated frame index")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return save_png(fig, path)


def _label_bars(ax, xs, vals, bins, rates, counts) -> None:
    """Text over one configuration's bars: "n/a" (measured, no probes), "n=12" (probe count) or "0"."""
    for x, v, b in zip(xs, vals, bins):
        if v is None:
            if b in rates:  # a bin we measured but that had no probes; a bin the paper lacks stays blank
                ax.text(x, BAR_LABEL_OFFSET, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
        elif counts is not None and b in counts:
            ax.text(x, float(v) + BAR_LABEL_OFFSET, f"n={counts[b]}", ha="center", va="bottom", fontsize=6)
        elif float(v) == 0.0:  # a zero-height bar is invisible: mark it so 0 is not read as missing
            ax.text(x, BAR_LABEL_OFFSET, "0", ha="center", va="bottom", fontsize=6)


def plot_retrieval_by_span(
    rates: Mapping[str, Mapping[str, float | None]],
    path: str | os.PathLike,
    reference: Mapping[str, Mapping[str, float]] | None = None,
    counts: Mapping[str, Mapping[str, int]] | None = None,
    title: str = "Memory bottleneck: retrieval rate by how far back",
) -> Path:
    """Grouped bars: retrieval rate per gap bin (x groups), one bar per configuration.

    Args:
        rates: name -> {bin label: rate}; a None rate (no probes in that bin) is drawn as an "n/a" mark.
            ``eval.json``'s ``retrieval_by_span`` converts with ``{b["bin"]: b["rate"] for b in by_span}``.
        reference: optional paper rates (``paper_reference()["retrieval_by_span"]``), drawn hatched.
        counts: optional name -> {bin: number of probes}, written above the bars ("n=12").
    """
    series = [(name, r, False) for name, r in rates.items()]
    series += [(f"{name} (paper)", r, True) for name, r in (reference or {}).items()]
    if not series:
        raise ValueError("plot_retrieval_by_span: no rates given")
    bins: list[str] = []
    for _, r, _ in series:
        bins += [b for b in r if b not in bins]
    fig = new_figure((max(7.0, 1.6 * len(bins) + 0.25 * len(series)), 4.5))  # wider with more bins and bars
    ax = fig.add_subplot()
    width = 0.8 / len(series)  # the bars of one bin fill 0.8 of the unit between bin centres
    colors = [f"C{i % 10}" for i in range(len(series))]
    for k, (name, r, is_ref) in enumerate(series):
        xs = [j - 0.4 + width * (k + 0.5) for j in range(len(bins))]
        vals = [r.get(b) for b in bins]
        heights = [0.0 if v is None else float(v) for v in vals]
        ax.bar(xs, heights, width, label=name, color=colors[k], alpha=0.45 if is_ref else 0.9,
               hatch="//" if is_ref else None, edgecolor=colors[k])
        _label_bars(ax, xs, vals, bins, r, (counts or {}).get(name))
    ax.set_xticks(range(len(bins)), [f"{b} frames back" for b in bins])
    ax.set_ylabel("retrieval rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(series) > LEGEND_ONE_COLUMN_MAX else 1)
    return save_png(fig, path)
