"""The report of an experiment grid: results tables, the plots and a results.md that shows them.

    from arvdm.experiments.report import write_report
    write_report("experiments/memory")   # results.csv/.md, results_pooled.csv/.md, paired.csv/.md, pareto_gain.png,
                                         # pareto_cost.png (with OUT/cost.csv), error_accumulation.png,
                                         # retrieval_by_span.png, pareto.png/.csv, from OUT/cells/*

The rows come from ``arvdm.experiments.results.collect_results``; the tables, plots and Pareto frontiers are
``arvdm.evaluation.tables`` / ``plots`` / ``pareto``, the labels and the seeds pooled per configuration
``arvdm.experiments.labels``, and the paper's overlay numbers ``arvdm.experiments.paper``. results.md leads with
the memory trade-off (revisit gain vs error accumulation vs cost per frame), then the table pooled over seeds, the
cells compared probe by probe (``arvdm.experiments.paired``), the plots, and last the table of every column.
Every file is written atomically; running it again rewrites them all from the cell folders, so a report can be
refreshed while a grid runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tqdm import tqdm

from arvdm.evaluation.pareto import plot_pareto, plot_tradeoff
from arvdm.evaluation.plots import plot_error_accumulation, plot_retrieval_by_span
from arvdm.evaluation.tables import markdown_table, write_results_table
from arvdm.experiments.cells import Grid
from arvdm.experiments.labels import pool_seeds
from arvdm.experiments.paired import (
    PAIRED_COLUMNS,
    PAIRED_NOTE,
    POOLED_PAIR_COLUMNS,
    named_pairs,
    paired_rows,
    pool_pairs,
    same_weight_pairs,
)
from arvdm.experiments.paper import paper_reference
from arvdm.experiments.results import cells_for_report, collect_results
from data.atomic import atomic_write_text

__all__ = ["COLUMNS_NOTE", "POOLED_COLUMNS", "TRADEOFF_COLUMNS", "TRADEOFF_NOTE", "write_report"]

#: What the columns of the full table mean.
COLUMNS_NOTE = (
    "max_psnr_decay: first span's mean PSNR minus the worst span's (dB, lower is better); "
    "retrieval_mean: mean retrieval rate over gap bins with probes (the old rank criterion: it rewards a model "
    "that merely stays on track; read revisit_gain instead); "
    "retrieval_<a-b>: rate for revisits a-b frames back; psnr_<a-b>: mean PSNR over generated "
    "frames a-b; psnr4_<model|copy_last|context_mean>: mean PSNR over the first 4 generated frames "
    "of the model and of the two trivial predictors; grad_ratio16: spatial-gradient ratio "
    "generated/real over the first 16 (about 1 = sharp, >1.5 noise, <0.6 blur); beats_copy_last: "
    "1 when psnr4_model >= psnr4_copy_last (a cell with 0 has not learned the video: do not read "
    "its curve or retrieval as a result); on_frontier: 1 when no other cell is better on both "
    "max_psnr_decay and retrieval_mean.")

#: What the trade-off table's columns mean (its header in results.md; {recent} is filled in).
TRADEOFF_NOTE = (
    "revisit_gain: model minus copy-last PSNR (dB) on the memory probes (generated frames whose view an earlier "
    "frame shows and none of the {recent} frames before it does), the same probes for every cell, pooled over "
    "probes; _lo/_hi: its event-level 95% bootstrap interval; revisit_probes/_events: probes and independent "
    "returns (blank gain: fewer than 10 events); own_gain: the same at the cell's own memory length "
    "(own_recent), as sample.py wrote it; psnr17_64_minus_ctx: model minus context-mean PSNR over generated "
    "frames 17-64 (> 0: still better than the blurry average view); hold_up_horizon: first 16-frame span "
    "below context-mean; grad_ratio_65_120: sharpness generated/real over frames 65-120 (~1 sharp, < 0.7 "
    "blur); ms_per_frame: rollout cost per generated frame (benchmarks/grid_cost.py, 1 thread; blank without "
    "cost.csv), cost_ratio: to its reference cell; on_frontier_gain / _cost: on the Pareto frontier of "
    "revisit_gain against max_psnr_decay / ms_per_frame.")

#: The columns that come first (before the grid's per-bin and per-span columns) and last in the full table.
LEAD_COLUMNS = ("name", "structure", "length", "budget", "compressor", "schedule")
TAIL_COLUMNS = ("psnr4_model", "psnr4_copy_last", "psnr4_context_mean", "grad_ratio16", "beats_copy_last",
                "psnr_mean", "ssim_mean", "n_probes", "retrieval_threshold", "params", "train_steps", "val_loss",
                "val_loss_ema", "on_frontier", "on_frontier_gain", "on_frontier_cost", "config", "seed",
                "train_run")
#: The memory trade-off, one row per cell (the first table of results.md; all are in results.csv too).
TRADEOFF_COLUMNS = ("label", "status", "revisit_gain", "revisit_gain_lo", "revisit_gain_hi", "revisit_probes",
                    "revisit_events", "own_gain", "own_gain_lo", "own_gain_hi", "own_recent", "max_psnr_decay",
                    "psnr17_64_minus_ctx", "hold_up_horizon", "grad_ratio_65_120", "ms_per_frame", "cost_ratio",
                    "psnr4_model", "psnr4_copy_last", "beats_copy_last", "on_frontier_gain", "on_frontier_cost")
#: Columns averaged over seeds in results_pooled (each with its per-seed values beside it).
POOLED_COLUMNS = ("revisit_gain", "own_gain", "max_psnr_decay", "psnr17_64_minus_ctx", "grad_ratio_65_120",
                  "ms_per_frame")
#: The columns of results_pooled: each pooled column beside its per-seed values.
POOLED_TABLE = ("config", "seeds", *(c for col in POOLED_COLUMNS for c in (col, f"{col}_by_seed")))
#: The plots results.md embeds: key in write_report's paths -> caption.
PLOT_CAPTIONS = (("pareto_gain", "Revisit gain vs error accumulation"), ("pareto_cost", "Revisit gain vs cost per "
                 "frame"), ("error_accumulation", "Error accumulation"), ("retrieval_by_span", "Retrieval by span "
                 "(old criterion)"), ("pareto", "Pareto frontier, max decay vs mean retrieval (old criterion)"))


def _table_columns(rows: Sequence[Mapping[str, Any]], extra: Sequence[str]) -> list[str]:
    """Label, settings, status and the Pareto axes; the trade-off; rates per gap bin and PSNR per span; the rest."""
    lead = ["label", *LEAD_COLUMNS, *extra, "status", "max_psnr_decay", "retrieval_mean"]
    keys = list(dict.fromkeys(k for r in rows for k in r if not k.startswith("_")))
    trade = [k for k in keys if k.startswith(("revisit_", "own_")) or k in (
        "psnr17_64_minus_ctx", "hold_up_horizon", "grad_ratio_65_120", "ms_per_frame", "ms_min", "ms_max",
        "cost_ratio")]
    retrieval = [k for k in keys if k.startswith("retrieval_") and k not in ("retrieval_mean", "retrieval_threshold")]
    psnr = [k for k in keys if k.startswith("psnr_") and k != "psnr_mean"]
    return lead + trade + retrieval + psnr + list(TAIL_COLUMNS)


def _tradeoff_plots(out: Path, done: Sequence[Mapping[str, Any]]) -> dict[str, Path]:
    """pareto_gain.png (revisit gain vs max PSNR decay) and, with any cost measured, pareto_cost.png."""
    def points(x: str) -> list[dict[str, Any]]:
        return [{"name": r["label"], "x": r.get(x), "y": r.get("revisit_gain"), "lo": r.get("revisit_gain_lo"),
                 "hi": r.get("revisit_gain_hi"), "group": r.get("seed")} for r in done]

    ylabel = "revisit gain vs copy-last, dB (95% interval)"
    paths = {}
    if any(r.get("revisit_gain") is not None for r in done):
        paths["pareto_gain"] = out / "pareto_gain.png"
        plot_tradeoff(points("max_psnr_decay"), paths["pareto_gain"], ylabel=ylabel, zero_line="= copy-last",
                      xlabel="max PSNR decay, dB (first span - worst span; lower is better)",
                      title="Memory trade-off: revisit gain vs error accumulation")
        if any(r.get("ms_per_frame") is not None for r in done):
            paths["pareto_cost"] = out / "pareto_cost.png"
            plot_tradeoff(points("ms_per_frame"), paths["pareto_cost"], ylabel=ylabel, zero_line="= copy-last",
                          xlabel="rollout cost per generated frame, ms (1 thread; lower is better)",
                          title="Memory trade-off: revisit gain vs cost per frame")
    return paths


def _plots(out: Path, done: Sequence[Mapping[str, Any]], with_paper: bool) -> dict[str, Path]:
    """The plots and pareto.csv from the finished rows (`collect_results`); `with_paper` overlays the paper's
    numbers."""
    ref = paper_reference() if with_paper else None
    paths = _tradeoff_plots(out, done)
    curves = {r["label"]: r["_curve"] for r in done if r["_curve"]}
    # the trivial predictors depend only on the episodes: draw the first cell's as reference lines
    base = next((r["_baselines"] for r in done if r.get("_baselines")), None)
    if curves:
        paths["error_accumulation"] = plot_error_accumulation(
            curves, out / "error_accumulation.png", reference=ref["psnr_by_span"] if ref else None,
            baselines=base)
    paths["retrieval_by_span"] = plot_retrieval_by_span(
        {r["label"]: r["_rates"] for r in done}, out / "retrieval_by_span.png",
        reference=ref["retrieval_by_span"] if ref else None, counts={r["label"]: r["_counts"] for r in done})
    points = [{"name": r["name"], "label": r["label"], "x": r["max_psnr_decay"], "y": r["retrieval_mean"]}
              for r in done]
    plot_pareto(points, out / "pareto.png", csv_path=out / "pareto.csv",
                reference=ref["pareto_points"] if ref else None)
    paths["pareto"], paths["pareto_csv"] = out / "pareto.png", out / "pareto.csv"
    return paths


def _results_md(title: str, rows: Sequence[Mapping[str, Any]], pooled: Sequence[Mapping[str, Any]], table: str,
                paths: Mapping[str, Path], paired: Sequence[Mapping[str, Any]] = ()) -> str:
    """results.md: the trade-off table, the seeds pooled, the paired comparisons, the plots, then the full table."""
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "pending")}
    recent = next((r["revisit_recent"] for r in rows if r.get("revisit_recent") is not None), None)
    lines = [f"# Experiment results: {title}", "",
             f"{counts['done']} of {len(rows)} cells evaluated"
             + (f", {counts['failed']} failed" if counts["failed"] else "")
             + (f", {counts['pending']} pending" if counts["pending"] else "") + ".", "",
             "## The memory trade-off", "",
             TRADEOFF_NOTE.format(recent=f"recent = {recent}" if recent is not None else "recent"), "",
             markdown_table(rows, TRADEOFF_COLUMNS), "## Seeds pooled (mean over seeds; per-seed values beside)",
             "", markdown_table(pooled, POOLED_TABLE)]
    if paired:
        lines += ["## Paired on the same probes (a - b)", "", PAIRED_NOTE, "", markdown_table(paired, PAIRED_COLUMNS),
                  "Seeds pooled:", "", markdown_table(pool_pairs(paired), POOLED_PAIR_COLUMNS)]
    for key, name in PLOT_CAPTIONS:
        if key in paths:
            lines += [f"![{name}]({paths[key].name})", ""]
    lines += ["## Every column", "", COLUMNS_NOTE, "", table]
    return "\n".join(lines)


def write_report(out: str | os.PathLike, grid: Grid | None = None, *, paper_reference: bool | None = None,
                 quiet: bool = False, recent: int | None = None, data_root: str | os.PathLike | None = None,
                 pairs: Sequence[tuple[str, str]] = ()) -> dict[str, Path]:
    """Write results.csv / .md, results_pooled.csv / .md, paired.csv / .md (cells compared probe by probe:
    ``arvdm.experiments.paired``) and, when any cell is finished, the plots.

    Args:
        out: the grid's output folder.
        grid: the grid (cell order, varying keys, paper_reference); default ``OUT/plan.json``, else the
            ``cells/*/cell.json`` found.
        paper_reference: overlay the paper's numbers (default: the grid's ``report.paper_reference``).
        recent, data_root: of the common revisit score (``collect_results``).
        pairs: (a, b) cell labels or names to compare on the same probes, besides the cells that share a run.
    Returns:
        name -> path of every file written.
    """
    out = Path(out)
    _, extra, grid_ref = cells_for_report(out, grid)
    use_ref = grid_ref if paper_reference is None else paper_reference
    rows = collect_results(out, grid, recent=recent, data_root=data_root)
    paths: dict[str, Path] = {}
    paths["csv"], paths["md"] = write_results_table(rows, out / "results.csv", out / "results.md",
                                                    _table_columns(rows, extra))
    done = [r for r in rows if r["status"] == "done"]
    pooled = pool_seeds(done, POOLED_COLUMNS)
    paths["pooled_csv"], paths["pooled_md"] = write_results_table(
        pooled, out / "results_pooled.csv", out / "results_pooled.md",
        POOLED_TABLE)
    paired = paired_rows(same_weight_pairs(done) + named_pairs(rows, pairs), out=out)
    paths["paired_csv"], paths["paired_md"] = write_results_table(paired, out / "paired.csv", out / "paired.md",
                                                                  PAIRED_COLUMNS)
    if done:
        paths.update(_plots(out, done, use_ref))
    title = grid.name if grid is not None else out.name
    atomic_write_text(paths["md"], _results_md(title, rows, pooled, paths["md"].read_text(encoding="utf-8"), paths,
                                               paired))
    if not quiet:
        tqdm.write(f"report: {len(done)}/{len(rows)} cells -> {paths['csv']}, {paths['md']}"
                   + (f", {out / 'pareto_gain.png'}" if "pareto_gain" in paths else "")
                   + ("" if done else " (no finished cell yet: no plots)"))
    return paths
