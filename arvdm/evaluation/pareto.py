"""The error-accumulation vs memory-bottleneck trade-off: its Pareto frontier, plot and points CSV.

    from arvdm.evaluation.pareto import pareto_frontier, plot_pareto
    points = [{"name": "prepend m=8", "x": 1.2, "y": 0.4}, ...]
    front = plot_pareto(points, "out/pareto.png")        # also out/pareto.csv; returns pareto_frontier(points)

One point per configuration (memory structure, memory length, budget, schedule): x = max PSNR decay in dB
(lower is better: the rollout degrades less), y = mean retrieval rate (higher is better: the model
remembers revisited places). The paper's claim is that the two pull against each other (more memory
retrieves farther back but decays more), so the useful configurations are those on the frontier.
A point is an (x, y) pair or a mapping with "x" and "y" (and "name"); a missing or non-finite coordinate
keeps it off the frontier and off the plot.

``plot_tradeoff`` draws any such pair of axes with an interval on y and a marker per group (the memory grid's
revisit gain against error accumulation, and against cost per frame; arvdm.experiments.report).
"""

from __future__ import annotations

import csv
import io
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arvdm.evaluation.plots import new_figure, save_png
from arvdm.evaluation.tables import format_value
from data.atomic import atomic_write_text

__all__ = ["pareto_frontier", "plot_pareto", "plot_tradeoff", "write_points_csv"]

#: Size in inches of the Pareto plot (taller than the others: names are written beside the points).
PARETO_FIGURE_SIZE = (7.0, 5.0)


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


def write_points_csv(points: Sequence[Mapping[str, Any]], path: str | os.PathLike) -> Path:
    """CSV of Pareto points: name, x (max PSNR decay), y (mean retrieval rate), on_frontier (0/1)."""
    front = set(pareto_frontier(points))
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["name", "max_psnr_decay", "mean_retrieval_rate", "on_frontier"])
    for i, p in enumerate(points):
        w.writerow([p.get("name", str(i)), format_value(p.get("x")), format_value(p.get("y")), int(i in front)])
    return atomic_write_text(path, buf.getvalue())


def plot_pareto(
    points: Sequence[Mapping[str, Any]],
    path: str | os.PathLike,
    csv_path: str | os.PathLike | None = None,
    reference: Sequence[Mapping[str, Any]] | None = None,
    title: str = "Error accumulation vs memory bottleneck",
) -> list[int]:
    """Scatter of configurations with the Pareto frontier drawn as a staircase; also a CSV of the points.

    Args:
        points: ``[{"name", "x": max PSNR decay, "y": mean retrieval rate}, ...]`` (a "label", when given, is
            written beside the point instead of the name; the CSV keeps the name); points with a missing
            coordinate are listed in the CSV but not drawn.
        csv_path: where to write the points CSV (default: ``path`` with suffix ``.csv``).
        reference: optional paper points (``paper_reference()["pareto_points"]``), drawn as hollow markers;
            they do not take part in the frontier (different data and model scale).
    Returns:
        The frontier indices (``pareto_frontier(points)``).
    """
    front = pareto_frontier(points)
    fig = new_figure(PARETO_FIGURE_SIZE)
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
        text = points[i].get("label", points[i].get("name", i))
        ax.annotate(str(text), xy[i], textcoords="offset points", xytext=(4, 4), fontsize=7)
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
    save_png(fig, path)
    write_points_csv(points, Path(path).with_suffix(".csv") if csv_path is None else csv_path)
    return front


#: Markers of the point groups of a trade-off plot (e.g. one per training seed), in order.
GROUP_MARKERS = ("o", "s", "^", "D", "v", "P")


def plot_tradeoff(points: Sequence[Mapping[str, Any]], path: str | os.PathLike, *, xlabel: str, ylabel: str,
                  title: str, zero_line: str | None = None) -> list[int]:
    """Scatter of configurations with y intervals, a marker per group and the Pareto frontier as a staircase.

    Args:
        points: ``[{"name", "x" (lower is better), "y" (higher is better), "lo", "hi" (y's interval, optional),
            "group" (e.g. "s0"; one marker per group, optional)}]``; a point without finite x and y is not drawn.
        zero_line: when given, a dashed line at y = 0 with this legend text (e.g. "= copy-last").
    Returns:
        The frontier indices (``pareto_frontier(points)``; intervals do not take part).
    """
    ordered = pareto_frontier(points)
    front = set(ordered)
    fig = new_figure(PARETO_FIGURE_SIZE)
    ax = fig.add_subplot()
    xy = [_xy(p) for p in points]
    drawn = [i for i, (x, y) in enumerate(xy) if math.isfinite(x) and math.isfinite(y)]
    groups = list(dict.fromkeys(str(points[i].get("group") or "") for i in drawn))
    for i in drawn:
        (x, y), p = xy[i], points[i]
        lo, hi = p.get("lo"), p.get("hi")
        # clipped at 0: a percentile interval need not contain the mean, and matplotlib refuses negative bars
        err = [[max(0.0, y - lo)], [max(0.0, hi - y)]] if lo is not None and hi is not None else None
        marker = GROUP_MARKERS[groups.index(str(p.get("group") or "")) % len(GROUP_MARKERS)]
        ax.errorbar([x], [y], yerr=err, fmt=marker, color="C3" if i in front else "0.45", ecolor="0.75",
                    elinewidth=1, capsize=2, markersize=5, zorder=3 if i in front else 2)
        ax.annotate(str(p.get("name", i)), (x, y), textcoords="offset points", xytext=(4, 3), fontsize=6)
    if ordered:
        ax.step([xy[i][0] for i in ordered], [xy[i][1] for i in ordered], where="post", color="C3", linewidth=1.2,
                zorder=1, label="Pareto frontier")
    for g in [g for g in groups if g]:  # legend entries for the named groups (seeds) only
        ax.scatter([], [], marker=GROUP_MARKERS[groups.index(g) % len(GROUP_MARKERS)], color="0.45",
                   label=g or "point")
    if zero_line is not None:
        ax.axhline(0.0, color="black", linestyle="--", linewidth=0.8, label=zero_line)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    save_png(fig, path)
    return ordered
