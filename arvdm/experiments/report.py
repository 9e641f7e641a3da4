"""The report of an experiment grid: results tables, the three plots and a results.md that shows them.

    from arvdm.experiments.report import write_report
    write_report("experiments/tiny")          # results.csv/.md, error_accumulation.png, retrieval_by_span.png,
                                              # pareto.png/.csv from OUT/cells/*/eval.json

The rows come from ``arvdm.experiments.results.collect_results``; the tables, plots and the Pareto frontier
are ``arvdm.evaluation.tables`` / ``plots`` / ``pareto``, and the paper's overlay numbers
``arvdm.experiments.paper``. Every file is written atomically; running it again rewrites them all from the
cell folders, so a report can be refreshed while a grid runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from arvdm.evaluation.pareto import plot_pareto
from arvdm.evaluation.plots import plot_error_accumulation, plot_retrieval_by_span
from arvdm.evaluation.tables import write_results_table
from arvdm.experiments.cells import Grid
from arvdm.experiments.paper import paper_reference
from arvdm.experiments.results import cells_for_report, collect_results
from data.atomic import atomic_write_text

__all__ = ["COLUMNS_NOTE", "write_report"]

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

#: The columns that come first (before the grid's per-bin and per-span columns) and last in the tables.
LEAD_COLUMNS = ("name", "structure", "length", "budget", "compressor", "schedule")
TAIL_COLUMNS = ("psnr4_model", "psnr4_copy_last", "psnr4_context_mean", "grad_ratio16", "beats_copy_last",
                "psnr_mean", "ssim_mean", "n_probes", "retrieval_threshold", "params", "train_steps", "val_loss",
                "val_loss_ema", "on_frontier", "train_run")
#: The plots results.md embeds: key in write_report's paths -> caption.
PLOT_CAPTIONS = (("error_accumulation", "Error accumulation"), ("retrieval_by_span", "Retrieval by span"),
                 ("pareto", "Pareto frontier"))


def _table_columns(rows: Sequence[Mapping[str, Any]], extra: Sequence[str]) -> list[str]:
    """Settings, status and the two Pareto axes; then rates per gap bin and PSNR per span; then the rest."""
    lead = [*LEAD_COLUMNS, *extra, "status", "max_psnr_decay", "retrieval_mean"]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    retrieval = [k for k in keys if k.startswith("retrieval_") and k not in ("retrieval_mean", "retrieval_threshold")]
    psnr = [k for k in keys if k.startswith("psnr_") and k != "psnr_mean"]
    return lead + retrieval + psnr + list(TAIL_COLUMNS)


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


def _results_md(title: str, rows: Sequence[Mapping[str, Any]], table: str, paths: Mapping[str, Path]) -> str:
    """results.md: the table under a short header that says what the columns mean, then the plots."""
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "pending")}
    lines = [f"# Experiment results: {title}", "",
             f"{counts['done']} of {len(rows)} cells evaluated"
             + (f", {counts['failed']} failed" if counts["failed"] else "")
             + (f", {counts['pending']} pending" if counts["pending"] else "") + ".",
             COLUMNS_NOTE, "", table]
    for key, name in PLOT_CAPTIONS:
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
    _, extra, grid_ref = cells_for_report(out, grid)
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
