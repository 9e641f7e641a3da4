"""The error-accumulation vs memory-bottleneck trade-off: Pareto frontier, results tables and plots.

One point per configuration (memory structure, memory length, budget, schedule):
x = max PSNR decay in dB (lower is better: the rollout degrades less),
y = mean retrieval rate (higher is better: the model remembers revisited places).
The paper's claim is that the two pull against each other (more memory retrieves farther back but decays
more), so the useful configurations are those on the frontier.

Plots use matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so they work
headless and do not disturb a caller's own figures. Every file is written atomically.
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from arvdm.metrics import atomic_write_text
from data.episodes import atomic_write

__all__ = [
    "paper_reference",
    "pareto_frontier",
    "plot_error_accumulation",
    "plot_pareto",
    "plot_retrieval_by_span",
    "write_points_csv",
    "write_results_table",
]


# --------------------------------------------------------------------------------------------------------
# Frontier
# --------------------------------------------------------------------------------------------------------


def _xy(point: Any) -> tuple[float, float]:
    """A point as (x, y): accepts (x, y) pairs or mappings with "x"/"y" keys; None becomes NaN."""
    if isinstance(point, Mapping):
        x, y = point.get("x"), point.get("y")
    else:
        x, y = point
    return (float("nan") if x is None else float(x), float("nan") if y is None else float(y))


def pareto_frontier(points: Sequence[Any]) -> list[int]:
    """Indices of the non-dominated points, for x lower-is-better and y higher-is-better.

    Point i is dominated when some j has ``x_j <= x_i`` and ``y_j >= y_i`` with at least one strict.
    Exact duplicates do not dominate each other, so all copies of a frontier point are on the frontier.
    Points with a missing or non-finite coordinate (e.g. no retrieval probes) are never on it.

    Args:
        points: sequence of (x, y) or of mappings with "x" and "y".
    Returns:
        Frontier indices ordered by increasing x (then decreasing y, then index).
    """
    xy = [_xy(p) for p in points]
    ok = [i for i, (x, y) in enumerate(xy) if math.isfinite(x) and math.isfinite(y)]
    # Sweep in order of increasing x, best y first among equal x: a point is on the frontier iff its y is
    # >= the best y seen so far among points with smaller-or-equal x and strictly better than any point with
    # strictly smaller x. Groups of equal x are handled together so that ties in x do not dominate wrongly.
    order = sorted(ok, key=lambda i: (xy[i][0], -xy[i][1], i))
    frontier: list[int] = []
    best_y = -math.inf  # best y among points with strictly smaller x
    k = 0
    while k < len(order):
        x0 = xy[order[k]][0]
        group = [i for i in order[k:] if xy[i][0] == x0]
        top = xy[group[0]][1]  # max y at this x (group sorted by -y)
        if top > best_y:
            # Only the points with the group's max y survive (a lower y at the same x is dominated).
            frontier += [i for i in group if xy[i][1] == top]
            best_y = top
        k += len(group)
    return frontier


# --------------------------------------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------------------------------------


def _fmt(v: Any) -> str:
    """Table cell: 4 significant digits for floats, '' for None/NaN, str otherwise."""
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.4g}"
    return str(v)


def _columns(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None) -> list[str]:
    if columns is not None:
        return list(columns)
    cols: list[str] = []
    for r in rows:  # union of keys in first-seen order, so every row's fields appear
        cols += [k for k in r if k not in cols]
    return cols


def write_results_table(
    rows: Sequence[Mapping[str, Any]],
    csv_path: str | os.PathLike,
    md_path: str | os.PathLike,
    columns: Sequence[str] | None = None,
) -> tuple[Path, Path]:
    """Write one row per configuration as CSV (full precision) and as a Markdown table (4 significant digits).

    Args:
        rows: mappings of column -> value (missing values are left blank).
        columns: column order; default the union of the rows' keys in first-seen order.
    Returns:
        (csv_path, md_path).
    """
    cols = _columns(rows, columns)
    if not cols:
        raise ValueError("write_results_table: no columns (empty rows and no columns given)")
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow({c: ("" if r.get(c) is None else r.get(c)) for c in cols})
    csv_out = atomic_write_text(csv_path, buf.getvalue())

    def esc(s: str) -> str:  # a '|' inside a cell would split it
        return s.replace("|", "\\|")

    lines = ["| " + " | ".join(esc(c) for c in cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(esc(_fmt(r.get(c))) for c in cols) + " |" for r in rows]
    md_out = atomic_write_text(md_path, "\n".join(lines) + "\n")
    return csv_out, md_out


def write_points_csv(points: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """CSV of Pareto points: name, x (max PSNR decay), y (mean retrieval rate), on_frontier (0/1)."""
    front = set(pareto_frontier(points))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["name", "max_psnr_decay", "mean_retrieval_rate", "on_frontier"])
    for i, p in enumerate(points):
        w.writerow([p.get("name", str(i)), _fmt(p.get("x")), _fmt(p.get("y")), int(i in front)])
    return atomic_write_text(path, buf.getvalue())


# --------------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------------


def _new_figure(size: tuple[float, float] = (7.0, 4.5)):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, dpi=120)
    FigureCanvasAgg(fig)
    return fig


def _save_png(fig, path: str | os.PathLike) -> Path:
    """Save a figure as PNG atomically (temp file in the same folder, then os.replace)."""
    path = Path(path)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    return path


def _as_list(values: Any) -> list[float]:
    t = torch.as_tensor(values, dtype=torch.float64)
    if t.ndim == 2:  # (B, T) -> mean over the batch
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
            ``arvdm.baselines``), drawn as grey reference lines: a curve below them is not a result.
    """
    if not curves:
        raise ValueError("plot_error_accumulation: no curves given")
    fig = _new_figure()
    ax = fig.add_subplot()
    t_max = 0
    for name, values in curves.items():
        y = _as_list(values)
        t_max = max(t_max, len(y))
        ax.plot(range(len(y)), y, label=name, linewidth=1.5)
    for (name, values), style in zip((baselines or {}).items(), ("-", "--", ":", "-.")):
        y = _as_list(values)
        t_max = max(t_max, len(y))
        ax.plot(range(len(y)), y, color="0.45", linestyle=style, linewidth=1.2, label=f"baseline: {name}")
    for name, spans in (reference or {}).items():
        xs, ys = [], []
        for label, v in spans.items():
            lo, hi = (int(s) for s in label.split("-"))
            xs.append((lo + hi - 1) / 2)
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
    return _save_png(fig, path)


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
    fig = _new_figure((max(7.0, 1.6 * len(bins) + 0.25 * len(series)), 4.5))
    ax = fig.add_subplot()
    width = 0.8 / len(series)
    colors = [f"C{i % 10}" for i in range(len(series))]
    for k, (name, r, is_ref) in enumerate(series):
        xs = [j - 0.4 + width * (k + 0.5) for j in range(len(bins))]
        vals = [r.get(b) for b in bins]
        heights = [0.0 if v is None else float(v) for v in vals]
        ax.bar(xs, heights, width, label=name, color=colors[k], alpha=0.45 if is_ref else 0.9,
               hatch="//" if is_ref else None, edgecolor=colors[k])
        for x, v, b in zip(xs, vals, bins):
            if v is None:
                if b in r:  # a bin we measured but that had no probes; a bin the paper lacks stays blank
                    ax.text(x, 0.01, "n/a", ha="center", va="bottom", fontsize=6, rotation=90)
            elif counts and name in counts and b in counts[name]:
                ax.text(x, float(v) + 0.01, f"n={counts[name][b]}", ha="center", va="bottom", fontsize=6)
            elif float(v) == 0.0:  # a zero-height bar is invisible: mark it so 0 is not read as missing
                ax.text(x, 0.01, "0", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(bins)), [f"{b} frames back" for b in bins])
    ax.set_ylabel("retrieval rate")
    ax.set_ylim(0, 1.05)
    ax.set_title(title)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2 if len(series) > 5 else 1)
    return _save_png(fig, path)


def plot_pareto(
    points: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    csv_path: str | os.PathLike | None = None,
    reference: Sequence[Mapping[str, Any]] | None = None,
    title: str = "Error accumulation vs memory bottleneck",
) -> list[int]:
    """Scatter of configurations with the Pareto frontier drawn as a staircase; also a CSV of the points.

    Args:
        points: ``[{"name", "x": max PSNR decay, "y": mean retrieval rate}, ...]``; points with a missing
            coordinate are listed in the CSV but not drawn.
        csv_path: where to write the points CSV (default: ``path`` with suffix ``.csv``).
        reference: optional paper points (``paper_reference()["pareto_points"]``), drawn as hollow markers;
            they do not take part in the frontier (different data and model scale).
    Returns:
        The frontier indices (``pareto_frontier(points)``).
    """
    front = pareto_frontier(points)
    fig = _new_figure((7.0, 5.0))
    ax = fig.add_subplot()
    xy = [_xy(p) for p in points]
    drawn = [i for i, (x, y) in enumerate(xy) if math.isfinite(x) and math.isfinite(y)]
    others = [i for i in drawn if i not in front]
    ax.scatter([xy[i][0] for i in others], [xy[i][1] for i in others], color="0.55", label="configuration")
    ax.scatter([xy[i][0] for i in front], [xy[i][1] for i in front], color="C3", zorder=3,
               label="on frontier")
    if front:
        # Staircase: from each frontier point, y holds until the next one (the region it dominates).
        fx = [xy[i][0] for i in front]
        fy = [xy[i][1] for i in front]
        ax.step(fx, fy, where="post", color="C3", linewidth=1.5, zorder=2, label="Pareto frontier")
    for i in drawn:
        ax.annotate(str(points[i].get("name", i)), xy[i], textcoords="offset points", xytext=(4, 4),
                    fontsize=7)
    for p in reference or []:
        x, y = _xy(p)
        ax.scatter([x], [y], facecolors="none", edgecolors="C0", marker="D", zorder=3)
        ax.annotate(f"{p.get('name', '')} (paper)", (x, y), textcoords="offset points", xytext=(4, -10),
                    fontsize=7, color="C0")
    ax.set_xlabel("max PSNR decay, dB (first span - worst span; lower is better)")
    ax.set_ylabel("mean retrieval rate (higher is better)")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    _save_png(fig, path)
    write_points_csv(points, Path(path).with_suffix(".csv") if csv_path is None else csv_path)
    return front


# --------------------------------------------------------------------------------------------------------
# Paper numbers
# --------------------------------------------------------------------------------------------------------


def paper_reference() -> dict[str, Any]:
    """The paper's DMLab numbers (Meta-ARVDM v1, arXiv 2503.10704; 64x64) for overlaying on our plots.

    Returns a fresh dict:
        ``retrieval_by_span``: config name -> {"0-16", "16-48", "48-112": rate};
        ``psnr_by_span``: config name -> {"0-16", "48-64": PSNR dB} (the two spans the paper quotes);
        ``max_psnr_decay``: config name -> first minus last quoted span (dB);
        ``pareto_points``: [{"name", "x", "y"}] for the configs with both numbers (x = decay, y = mean of the
        three retrieval rates).
    """
    retrieval = {
        "prepend m=16": (0.52, 0.03, 0.00),
        "prepend m=48": (0.44, 0.32, 0.00),
        "prepend m=112": (0.48, 0.28, 0.23),
        "channel concat m=112": (0.12, 0.13, 0.08),
        "cross-attn m=112": (0.00, 0.00, 0.00),
        "prepend m=48 joint B=8": (0.28, 0.22, 0.00),
        "prepend m=48 joint B=48": (0.40, 0.34, 0.00),
    }
    bins = ("0-16", "16-48", "48-112")
    psnr = {
        "prepend m=48 joint B=8": {"0-16": 10.24, "48-64": 7.88},
        "prepend m=48 joint B=48": {"0-16": 10.52, "48-64": 6.76},
    }
    decay = {k: round(v["0-16"] - v["48-64"], 2) for k, v in psnr.items()}
    return {
        "source": "Meta-ARVDM v1 (arXiv 2503.10704), DMLab 64x64",
        "retrieval_by_span": {k: dict(zip(bins, v)) for k, v in retrieval.items()},
        "psnr_by_span": psnr,
        "max_psnr_decay": decay,
        "pareto_points": [
            {"name": k, "x": decay[k], "y": round(sum(retrieval[k]) / 3, 4)} for k in psnr
        ],
    }
