"""A grid's results as rows: one per cell, read from the cell and run folders under the grid's output.

    from arvdm.experiments.results import collect_results
    rows = collect_results("experiments/tiny")     # finished, failed and pending cells, in grid order

The cells come from the grid when given, else ``OUT/plan.json``, else the ``OUT/cells/*/cell.json`` found.
A finished cell's metrics come from its ``eval.json`` (and its per-frame PSNR from ``metrics.csv``), the
training facts from the run folder (checkpoint header, ``log.csv``), the cost per frame from ``OUT/cost.csv``
when ``benchmarks/grid_cost.py`` wrote one. The one thing computed from frames here is the revisit gain at a
recent common to all cells (``arvdm.experiments.tradeoff``, from ``rollout.npz``, cached per cell).
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safetensors import safe_open

from arvdm.evaluation.evaluate import read_eval_json
from arvdm.evaluation.pareto import pareto_frontier
from arvdm.evaluation.retrieval import mean_retrieval_rate
from arvdm.experiments.cells import MEMORY_KEYS, Grid, GridError
from arvdm.experiments.labels import cell_labels
from arvdm.experiments.tradeoff import common_recent, error_columns, own_revisit_columns, read_cost, revisit_columns
from arvdm.model.checkpoint import checkpoint_step, latest_checkpoint

__all__ = ["BASELINE_FRAMES", "cells_for_report", "collect_results"]

#: The first generated frames over which the table sets the model beside the trivial predictors
#: (the ``psnr4_*`` columns; eval.json's ``first_frames`` holds the means over 1, 4 and 16).
BASELINE_FRAMES = 4


def cells_for_report(out: Path, grid: Grid | None) -> tuple[list[dict[str, Any]], list[str], bool]:
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
    """The model beside copy-last and context-mean over the first `BASELINE_FRAMES` generated frames, and
    sharpness."""
    first = ev.get("first_frames") or {}
    cols = {f"psnr{BASELINE_FRAMES}_{name}": (first.get(name) or {}).get("psnr", {}).get(str(BASELINE_FRAMES))
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


def _count_parameters(weights: Path) -> int | None:
    """Parameters in a safetensors file, from its header's shapes only (no tensor is loaded)."""
    try:
        with safe_open(str(weights), framework="pt") as f:
            return sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    except Exception:  # noqa: BLE001 - a damaged file leaves the column blank, not the report dead
        return None


def _run_info(run_dir: Path) -> dict[str, Any]:
    """Parameters and steps of the newest checkpoint, and the last validation losses in log.csv."""
    info: dict[str, Any] = {"params": None, "train_steps": None, "val_loss": None, "val_loss_ema": None}
    ckpt = latest_checkpoint(run_dir)
    if ckpt is not None:
        info["train_steps"] = checkpoint_step(ckpt)
        weights = ckpt / "model.safetensors"
        if weights.is_file():
            info["params"] = _count_parameters(weights)
    log = run_dir / "log.csv"
    if log.is_file():
        with open(log, newline="") as f:
            for row in csv.DictReader(f):
                for key in ("val_loss", "val_loss_ema"):
                    if row.get(key):
                        info[key] = float(row[key])
    return info


def _metric_columns(cell_dir: Path, ev: Mapping[str, Any]) -> dict[str, Any]:
    """A finished cell's columns from its eval.json, and the ``_curve`` / ``_baselines`` / ``_rates`` /
    ``_counts`` the plots draw."""
    by_span = ev.get("retrieval_by_span") or []
    mean = ev.get("retrieval_mean")
    row: dict[str, Any] = {"status": "done", "max_psnr_decay": ev.get("max_psnr_decay"),
                           "retrieval_mean": mean if mean is not None else mean_retrieval_rate(by_span)}
    row.update({f"retrieval_{b['bin']}": b.get("rate") for b in by_span})
    row.update({f"psnr_{s['label']}": s.get("mean") for s in ev.get("psnr_by_span") or []})
    row.update(psnr_mean=ev.get("psnr_mean"), ssim_mean=ev.get("ssim_mean"), n_probes=ev.get("n_probes"),
               retrieval_threshold=ev.get("retrieval_threshold"))
    row.update(_baseline_columns(ev))
    row["_curve"] = _read_curve(cell_dir, ev)
    row["_baselines"] = {k: v.get("psnr_curve") for k, v in (ev.get("baselines") or {}).items()}
    row["_rates"] = {b["bin"]: b.get("rate") for b in by_span}
    row["_counts"] = {b["bin"]: b.get("n") for b in by_span}
    return row


def _frontier_flags(done: list[dict[str, Any]]) -> None:
    """``on_frontier`` (max decay vs mean retrieval, the old criterion), ``on_frontier_gain`` (max decay vs
    revisit gain) and ``on_frontier_cost`` (ms per frame vs revisit gain) of the finished rows."""
    axes = {"on_frontier": ("max_psnr_decay", "retrieval_mean"), "on_frontier_gain": ("max_psnr_decay", "revisit_gain"),
            "on_frontier_cost": ("ms_per_frame", "revisit_gain")}
    for flag, (x, y) in axes.items():
        front = set(pareto_frontier([{"x": r.get(x), "y": r.get(y)} for r in done]))
        for i, r in enumerate(done):
            r[flag] = int(i in front)


def _cell_row(out: Path, cell: Mapping[str, Any], extra: list[str], recent: int,
              data_root: str | os.PathLike | None) -> dict[str, Any]:
    """One cell's settings and, when it has an eval.json, its metrics and trade-off columns."""
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
        row.update(_metric_columns(cell_dir, ev))
        row.update(revisit_columns(cell_dir, ev, recent, out, data_root))
        row.update(own_revisit_columns(ev))
        row.update(error_columns(ev))
    else:
        row["status"] = "failed" if (cell_dir / "error.txt").is_file() else "pending"
    return row


def collect_results(out: str | os.PathLike, grid: Grid | None = None, *, recent: int | None = None,
                    data_root: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """One row per cell (finished, failed or pending) with its settings, metrics and training facts.

    Columns: label, config, seed (``arvdm.experiments.labels``), name, structure, length, budget, compressor,
    schedule, the grid's other varying keys, status, max_psnr_decay, retrieval_mean, retrieval_<bin> per gap
    bin, psnr_<span> per span, psnr_mean, ssim_mean, n_probes, retrieval_threshold; the trade-off columns
    (``arvdm.experiments.tradeoff``): revisit_gain / _lo / _hi / _probes / _events / _recent, revisit_model,
    revisit_copy_last, revisit_oracle, revisit_closes, revisit_poses, own_gain / _lo / _hi / _probes /
    _events / _recent, psnr17_64_minus_ctx, hold_up_horizon, grad_ratio_65_120, ms_per_frame, ms_min, ms_max,
    cost_ratio (blank without ``OUT/cost.csv``); params, train_steps, val_loss, val_loss_ema, on_frontier,
    on_frontier_gain, on_frontier_cost, train_run. Metrics are blank for cells without eval.json. Internal
    keys ``_curve``, ``_rates`` and ``_counts`` (for the plots) start with an underscore and are not written.

    Args:
        recent: the recent frames of the common revisit score (default: the grid's smallest memory.length).
        data_root: where the evaluation episodes are (default: found from eval.json's settings).
    """
    out = Path(out)
    cells, extra, _ = cells_for_report(out, grid)
    recent = common_recent(cells) if recent is None else recent
    labels, cost = cell_labels(cells), read_cost(out)
    runs: dict[str, dict[str, Any]] = {}
    rows = []
    for cell in cells:
        lab = labels[cell["name"]]
        row = {"label": lab.label, "config": lab.config, "seed": lab.seed,
               **_cell_row(out, cell, extra, recent, data_root)}
        if row["status"] == "done":
            row.update(cost.get(cell["name"], dict.fromkeys(("ms_per_frame", "ms_min", "ms_max", "cost_ratio"))))
        run = cell.get("train_run")
        if run is not None:
            if run not in runs:
                runs[run] = _run_info(out / "runs" / run)
            row.update(runs[run])
        row["train_run"] = run
        rows.append(row)
    _frontier_flags([r for r in rows if r["status"] == "done"])
    return rows
