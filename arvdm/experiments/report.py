"""The report: results tables and plots of an experiment grid, and the Pareto frontier they are read by.

    from arvdm.experiments.report import write_report, pareto_frontier, plot_pareto
    write_report("experiments/tiny")          # results.csv/.md, error_accumulation.png, retrieval_by_span.png,
                                              # pareto.png/.csv from OUT/cells/*/eval.json

The error-accumulation vs memory-bottleneck trade-off has one point per configuration (memory structure,
memory length, budget, schedule): x = max PSNR decay in dB (lower is better: the rollout degrades less),
y = mean retrieval rate (higher is better: the model remembers revisited places). The paper's claim is
that the two pull against each other (more memory retrieves farther back but decays more), so the useful
configurations are those on the frontier.

Plots use matplotlib's object API with the Agg canvas (no pyplot, no global backend switch), so they work
headless and do not disturb a caller's own figures. Every file is written atomically.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from arvdm.evaluation.evaluate import read_eval_json
from arvdm.evaluation.retrieval import mean_retrieval_rate
from arvdm.experiments.grid import MEMORY_KEYS, Grid, GridError
from arvdm.model.checkpoint import checkpoint_step, latest_checkpoint
from data.atomic import atomic_write, atomic_write_text

__all__ = [
    "collect_results",
    "paper_reference",
    "pareto_frontier",
    "plot_error_accumulation",
    "plot_pareto",
    "plot_retrieval_by_span",
    "write_points_csv",
    "write_report",
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
            ``arvdm.evaluation.baselines``), drawn as grey reference lines: a curve below them is not a result.
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
        ax.plot(range(len(y)), y, color="black", linestyle=style, linewidth=1.6, zorder=5, label=f"baseline: {name}")
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


# --------------------------------------------------------------------------------------------------------
# A grid's results: tables and plots from the cell folders
# --------------------------------------------------------------------------------------------------------


def _cells_for_report(out: Path, grid: Grid | None) -> tuple[list[dict[str, Any]], list[str], bool]:
    """(cells as dicts, extra columns, paper_reference) from the grid, else plan.json, else cells/*/cell.json."""
    if grid is not None:
        return [c.to_dict() for c in grid.cells], list(grid.columns), grid.paper_reference
    plan = out / "plan.json"
    if plan.is_file():
        try:
            d = json.loads(plan.read_text())
            return list(d["cells"]), list(d.get("columns", [])), bool(d.get("paper_reference", False))
        except (ValueError, KeyError, TypeError) as e:
            raise GridError(f"{plan}: not a plan written by arvdm.experiments.runner ({e}); pass --grid") from None
    cells = []
    for path in sorted((out / "cells").glob("*/cell.json")):
        try:
            cells.append(json.loads(path.read_text()))
        except ValueError as e:
            raise GridError(f"{path}: unreadable ({e})") from None
    if not cells:
        raise GridError(f"{out}: no plan.json and no cells/*/cell.json: nothing to report (run `pareto` first)")
    extra = list(dict.fromkeys(k for c in cells for k in c.get("values", {})
                               if k not in MEMORY_KEYS and k != "schedule"))
    return cells, extra, False


def _baseline_columns(ev: Mapping[str, Any]) -> dict[str, Any]:
    """The model beside copy-last and context-mean over the first 4 generated frames, and sharpness."""
    first = ev.get("first_frames") or {}
    cols = {f"psnr4_{name}": (first.get(name) or {}).get("psnr", {}).get("4")
            for name in ("model", "copy_last", "context_mean")}
    cols["grad_ratio16"] = ev.get("gradient_ratio_first16")
    v = ev.get("verdict")
    cols["beats_copy_last"] = None if v is None else int(bool(v.get("beats_copy_last")))
    return cols


def _read_curve(cell_dir: Path, ev: Mapping[str, Any]) -> list[float]:
    """PSNR per generated frame index: metrics.csv's ``psnr`` column (eval.json's ``psnr_curve`` without it)."""
    path = cell_dir / "metrics.csv"
    values: list[float] = []
    if path.is_file():
        with open(path, newline="") as f:
            values = [float(r["psnr"]) if r.get("psnr") not in (None, "") else math.nan for r in csv.DictReader(f)]
    elif ev.get("psnr_curve"):
        values = [math.nan if v is None else float(v) for v in ev["psnr_curve"]]
    # Identical frames have infinite PSNR; plotted as gaps rather than stretching the axis to infinity.
    return [v if math.isfinite(v) else math.nan for v in values]


def _run_info(run_dir: Path) -> dict[str, Any]:
    """Parameters and steps of the newest checkpoint, and the last validation losses in log.csv."""
    info: dict[str, Any] = {"params": None, "train_steps": None, "val_loss": None, "val_loss_ema": None}
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        info["train_steps"] = checkpoint_step(ckpt)
        weights = ckpt / "model.safetensors"
        if weights.is_file():
            try:  # shapes from the header only: no tensor is loaded
                from safetensors import safe_open

                with safe_open(str(weights), framework="pt") as f:
                    info["params"] = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
            except Exception:  # noqa: BLE001 - a damaged file leaves the column blank, not the report dead
                info["params"] = None
    log = run_dir / "log.csv"
    if log.is_file():
        with open(log, newline="") as f:
            for row in csv.DictReader(f):
                for key in ("val_loss", "val_loss_ema"):
                    if row.get(key):
                        info[key] = float(row[key])
    return info


def collect_results(out: str | os.PathLike, grid: Grid | None = None) -> list[dict[str, Any]]:
    """One row per cell (finished, failed or pending) with its settings, metrics and training facts.

    Columns: name, structure, length, budget, compressor, schedule, the grid's other varying keys, status,
    max_psnr_decay, retrieval_mean, retrieval_<bin> per gap bin, psnr_<span> per span, psnr_mean,
    ssim_mean, n_probes, retrieval_threshold, params, train_steps, val_loss, val_loss_ema, on_frontier,
    train_run. Metrics are blank for cells without eval.json. Internal keys ``_curve``, ``_rates`` and
    ``_counts`` (for the plots) start with an underscore and are not written to the tables.
    """
    out = Path(out)
    cells, extra, _ = _cells_for_report(out, grid)
    runs: dict[str, dict[str, Any]] = {}
    rows = []
    for cell in cells:
        values = cell.get("values", {})
        cell_dir = out / "cells" / cell["name"]
        row: dict[str, Any] = {
            "name": cell["name"], "structure": values.get("memory.structure"),
            "length": values.get("memory.length"), "budget": values.get("memory.budget"),
            "compressor": values.get("memory.compressor"), "schedule": values.get("schedule"),
        }
        row.update({k: values.get(k) for k in extra})
        ev_path = cell_dir / "eval.json"
        if ev_path.is_file():
            ev = read_eval_json(ev_path)
            by_span = ev.get("retrieval_by_span") or []
            mean = ev.get("retrieval_mean")
            row.update(status="done", max_psnr_decay=ev.get("max_psnr_decay"),
                       retrieval_mean=mean if mean is not None else mean_retrieval_rate(by_span))
            row.update({f"retrieval_{b['bin']}": b.get("rate") for b in by_span})
            row.update({f"psnr_{s['label']}": s.get("mean") for s in ev.get("psnr_by_span") or []})
            row.update(psnr_mean=ev.get("psnr_mean"), ssim_mean=ev.get("ssim_mean"), n_probes=ev.get("n_probes"),
                       retrieval_threshold=ev.get("retrieval_threshold"))
            row.update(_baseline_columns(ev))
            row["_curve"] = _read_curve(cell_dir, ev)
            row["_baselines"] = {k: v.get("psnr_curve") for k, v in (ev.get("baselines") or {}).items()}
            row["_rates"] = {b["bin"]: b.get("rate") for b in by_span}
            row["_counts"] = {b["bin"]: b.get("n") for b in by_span}
        else:
            row["status"] = "failed" if (cell_dir / "error.txt").is_file() else "pending"
        run = cell.get("train_run")
        if run is not None:
            if run not in runs:
                runs[run] = _run_info(out / "runs" / run)
            row.update(runs[run])
        row["train_run"] = run
        rows.append(row)
    done = [r for r in rows if r["status"] == "done"]
    front = set(pareto_frontier([{"x": r["max_psnr_decay"], "y": r["retrieval_mean"]} for r in done]))
    for i, r in enumerate(done):
        r["on_frontier"] = int(i in front)
    return rows


def _table_columns(rows: Sequence[Mapping[str, Any]], extra: Sequence[str]) -> list[str]:
    lead = ["name", "structure", "length", "budget", "compressor", "schedule", *extra, "status",
            "max_psnr_decay", "retrieval_mean"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    retrieval = [k for k in keys if k.startswith("retrieval_") and k not in ("retrieval_mean", "retrieval_threshold")]
    psnr = [k for k in keys if k.startswith("psnr_") and k != "psnr_mean"]
    tail = ["psnr4_model", "psnr4_copy_last", "psnr4_context_mean", "grad_ratio16", "beats_copy_last",
            "psnr_mean", "ssim_mean", "n_probes", "retrieval_threshold", "params", "train_steps", "val_loss",
            "val_loss_ema", "on_frontier", "train_run"]
    return lead + retrieval + psnr + tail


def _plots(out: Path, done: Sequence[Mapping[str, Any]], with_paper: bool) -> dict[str, Path]:
    """The three plots and pareto.csv from the finished rows (`collect_results`); `with_paper` overlays
    the paper's numbers."""
    ref = paper_reference() if with_paper else None
    paths: dict[str, Path] = {}
    curves = {r["name"]: r["_curve"] for r in done if r["_curve"]}
    # the trivial predictors depend only on the episodes: draw the first cell's as reference lines
    base = next((r["_baselines"] for r in done if r.get("_baselines")), None)
    if curves:
        paths["error_accumulation"] = plot_error_accumulation(
            curves, out / "error_accumulation.png", reference=ref["psnr_by_span"] if ref else None,
            baselines=base)
    paths["retrieval_by_span"] = plot_retrieval_by_span(
        {r["name"]: r["_rates"] for r in done}, out / "retrieval_by_span.png",
        reference=ref["retrieval_by_span"] if ref else None, counts={r["name"]: r["_counts"] for r in done})
    points = [{"name": r["name"], "x": r["max_psnr_decay"], "y": r["retrieval_mean"]} for r in done]
    plot_pareto(points, out / "pareto.png", csv_path=out / "pareto.csv",
                reference=ref["pareto_points"] if ref else None)
    paths["pareto"], paths["pareto_csv"] = out / "pareto.png", out / "pareto.csv"
    return paths


#: What the columns of results.md mean (its header).
COLUMNS_NOTE = (
    "max_psnr_decay: first span's mean PSNR minus the worst span's (dB, lower is better); "
    "retrieval_mean: mean retrieval rate over gap bins with probes (higher is better); "
    "retrieval_<a-b>: rate for revisits a-b frames back; psnr_<a-b>: mean PSNR over generated "
    "frames a-b; psnr4_<model|copy_last|context_mean>: mean PSNR over the first 4 generated frames "
    "of the model and of the two trivial predictors; grad_ratio16: spatial-gradient ratio "
    "generated/real over the first 16 (about 1 = sharp, >1.5 noise, <0.6 blur); beats_copy_last: "
    "1 when psnr4_model >= psnr4_copy_last (a cell with 0 has not learned the video: do not read "
    "its curve or retrieval as a result); on_frontier: 1 when no other cell is better on both axes.")


def _results_md(title: str, rows: Sequence[Mapping[str, Any]], table: str, paths: Mapping[str, Path]) -> str:
    """results.md: the table under a short header that says what the columns mean, then the plots."""
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "pending")}
    lines = [f"# Experiment results: {title}", "",
             f"{counts['done']} of {len(rows)} cells evaluated"
             + (f", {counts['failed']} failed" if counts["failed"] else "")
             + (f", {counts['pending']} pending" if counts["pending"] else "") + ".",
             COLUMNS_NOTE, "", table]
    for key, name in (("error_accumulation", "Error accumulation"), ("retrieval_by_span", "Retrieval by span"),
                      ("pareto", "Pareto frontier")):
        if key in paths:
            lines += [f"![{name}]({paths[key].name})", ""]
    return "\n".join(lines)


def write_report(out: str | os.PathLike, grid: Grid | None = None, *, paper_reference: bool | None = None,
                 quiet: bool = False) -> dict[str, Path]:
    """Write results.csv / results.md and, when any cell is finished, the three plots and pareto.csv.

    Args:
        out: the grid's output folder.
        grid: the grid (cell order, varying keys, paper_reference); default ``OUT/plan.json``, else the
            ``cells/*/cell.json`` found.
        paper_reference: overlay the paper's numbers (default: the grid's ``report.paper_reference``).
    Returns:
        name -> path of every file written.
    """
    out = Path(out)
    _, extra, grid_ref = _cells_for_report(out, grid)
    use_ref = grid_ref if paper_reference is None else paper_reference
    rows = collect_results(out, grid)
    paths: dict[str, Path] = {}
    paths["csv"], paths["md"] = write_results_table(rows, out / "results.csv", out / "results.md",
                                                    _table_columns(rows, extra))
    done = [r for r in rows if r["status"] == "done"]
    if done:
        paths.update(_plots(out, done, use_ref))
    title = grid.name if grid is not None else out.name
    atomic_write_text(paths["md"], _results_md(title, rows, paths["md"].read_text(encoding="utf-8"), paths))
    if not quiet:
        tqdm.write(f"report: {len(done)}/{len(rows)} cells -> {paths['csv']}, {paths['md']}"
                   + (f", {out / 'pareto.png'}" if done else " (no finished cell yet: no plots)"))
    return paths
