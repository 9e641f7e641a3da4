"""The grid runner: train each distinct configuration once, evaluate every cell, skip what is finished.

    from arvdm.experiments.grid import load_grid
    from arvdm.experiments.runner import run_grid
    result = run_grid(load_grid("tiny"), "experiments/tiny")     # then arvdm.experiments.report writes the tables/plots

Resumable at two levels: a cell whose ``eval.json`` exists is skipped; a training run whose newest
checkpoint is at ``train.max_steps`` is not retrained, and an interrupted one resumes from its newest
checkpoint. A failing cell is recorded in ``cells/<cell>/error.txt`` and the others carry on. Outputs under
``OUT``: ``plan.json``, ``runs/<run>/`` (checkpoints, log.csv), ``cells/<cell>/`` (cell.json, eval.json,
metrics.csv, rollout.mp4 / .npz from arvdm.sampling), and the report (arvdm.experiments.report).
"""

from __future__ import annotations

import math
import os
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from arvdm.config import Config
from arvdm.experiments.cells import Cell, Grid, GridError, select_cells
from arvdm.experiments.report import write_report
from arvdm.model.checkpoint import checkpoint_step, latest_checkpoint, load_config
from arvdm.sample_settings import SampleSettings
from arvdm.sampling import sample_run
from arvdm.training.trainer import train
from data.atomic import atomic_write_json, atomic_write_text

__all__ = ["REPORT_REFRESH_S", "run_grid", "run_status"]

#: Seconds between refreshes of the tables and plots while a grid runs (they are always written at the end).
REPORT_REFRESH_S = 120.0


def run_status(run_dir: str | os.PathLike, cfg: Config) -> tuple[str, int]:
    """("fresh" | "resume" | "done", newest checkpoint step) of a training run folder.

    Raises GridError when the folder holds a run whose model, memory, diffusion or data differ from
    ``cfg``: its checkpoints cannot be this cell's, and silently reusing them would mislabel results.
    """
    ckpt = latest_checkpoint(run_dir)
    if ckpt is None:
        return "fresh", 0
    saved = load_config(ckpt).to_dict()
    want = cfg.to_dict()
    diff = [f"{s}.{k}: {saved[s].get(k)!r} there, {v!r} in the grid" for s in ("model", "memory", "diffusion")
            for k, v in want[s].items() if saved[s].get(k) != v]
    if saved["data"].get("path") != want["data"]["path"]:
        diff.append(f"data.path: {saved['data'].get('path')!r} there, {want['data']['path']!r} in the grid")
    if diff:
        raise GridError(f"{run_dir} holds a run with another configuration ({'; '.join(diff)}); delete it or "
                        f"use another --out")
    step = checkpoint_step(ckpt)
    return ("done" if step >= cfg.train.max_steps else "resume"), step


def _default_train(cfg: Config, run_dir: Path, resume: bool, device: str | None) -> None:
    """Train through the library (generating the stand-in data set first when it is absent)."""
    train(cfg, run_dir, resume=resume, generate_data=True, device=device)


def _settings(cell: Cell, device: str | None) -> SampleSettings:
    """The cell's sampling settings, evaluated and quiet (the grid has its own progress bar)."""
    kw = dict(cell.sample)
    if device:
        kw["device"] = device
    return SampleSettings(**kw, evaluate=True, progress=False)


@dataclass
class _Job:
    """One call of `run_grid`: what it runs, where, with which functions, and what happened so far."""

    grid: Grid
    out: Path
    cells: list[Cell]
    done: set[str]
    device: str | None
    fail_fast: bool
    train_fn: Callable[[Config, Path, bool, str | None], Any]
    sample_fn: Callable[[Path, Path, Any], Any]
    say: Callable[[str], None]
    result: dict[str, Any] = field(default_factory=dict)
    train_failed: dict[str, str] = field(default_factory=dict)
    last_report: float = -math.inf


def _plan(job: _Job, needed: Sequence[str], status: dict[str, tuple[str, int]]) -> list[str]:
    """One line per training run needed and per selected cell: what will happen to it."""
    plan = []
    for r in needed:
        state, step = status[r]
        max_steps = job.grid.runs[r].config.train.max_steps
        what = {"fresh": f"train {max_steps} steps", "resume": f"resume at step {step} of {max_steps}",
                "done": f"trained ({step} steps)"}[state]
        plan.append(f"run  {r}: {what}")
    return plan + [f"cell {c.name}: {'done, skipped' if c.name in job.done else 'evaluate'} (run {c.train_run})"
                   for c in job.cells]


def _train(job: _Job, run_name: str, state: str, step: int) -> None:
    """Train (or resume) one run unless it is finished; a failure is kept for its cells (or raised)."""
    run, run_dir = job.grid.runs[run_name], job.out / "runs" / run_name
    if state == "done" or run_name in job.train_failed:
        return
    job.say(f"training {run_name} ({'fresh' if state == 'fresh' else f'resuming at step {step}'}, "
            f"{run.config.train.max_steps} steps) -> {run_dir}")
    t0 = time.perf_counter()
    try:
        job.train_fn(run.config, run_dir, state == "resume", job.device)
        job.result["trained"].append(run_name)
        job.say(f"trained {run_name} in {time.perf_counter() - t0:.0f} s")
    except Exception as e:  # noqa: BLE001 - recorded per cell; KeyboardInterrupt propagates
        if job.fail_fast:
            raise
        job.train_failed[run_name] = f"training {run_name} failed: {e}\n{traceback.format_exc()}"


def _evaluate(job: _Job, cell: Cell) -> None:
    """Sample and evaluate one cell into ``cells/<cell>/``; record success or the error."""
    cell_dir = job.out / "cells" / cell.name
    cell_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(cell_dir / "cell.json", {"grid": job.grid.name, **cell.to_dict()}, indent=2, default=str)
    error = job.train_failed.get(cell.train_run)
    t0 = time.perf_counter()
    if error is None:
        try:
            job.sample_fn(job.out / "runs" / cell.train_run, cell_dir, _settings(cell, job.device))
            if not (cell_dir / "eval.json").is_file():
                raise RuntimeError(f"sampling wrote no {cell_dir / 'eval.json'}")
        except Exception as e:  # noqa: BLE001
            if job.fail_fast:
                raise
            error = f"evaluating {cell.name} failed: {e}\n{traceback.format_exc()}"
    if error is None:
        (cell_dir / "error.txt").unlink(missing_ok=True)
        job.result["evaluated"].append(cell.name)
        job.say(f"evaluated {cell.name} in {time.perf_counter() - t0:.0f} s")
    else:
        atomic_write_text(cell_dir / "error.txt", error)
        job.result["failed"][cell.name] = error.splitlines()[0]
        job.say(f"FAILED {cell.name}: {error.splitlines()[0]} (details: {cell_dir / 'error.txt'})")


def _refresh_report(job: _Job) -> None:
    """Refresh the tables and plots as cells finish, so a long grid can be read while it runs (at most
    every REPORT_REFRESH_S: the plots take seconds on a busy CPU)."""
    if time.monotonic() - job.last_report >= REPORT_REFRESH_S:
        write_report(job.out, job.grid, quiet=True)
        job.last_report = time.monotonic()


def run_grid(
    grid: Grid,
    out: str | os.PathLike,
    *,
    only: Sequence[str] | None = None,
    dry_run: bool = False,
    device: str | None = None,
    fail_fast: bool = False,
    train_fn: Callable[[Config, Path, bool, str | None], Any] | None = None,
    sample_fn: Callable[[Path, Path, Any], Any] | None = None,
    progress: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Train and evaluate the grid's (selected) cells, skipping what is finished; then write the report.

    Args:
        grid: from `arvdm.experiments.grid.load_grid` / `expand_grid`.
        out: output folder (``runs/``, ``cells/``, tables and plots).
        only: cell or training-run names / shell patterns (default: every cell).
        dry_run: print the plan (what would train, resume, evaluate or be skipped) and do nothing.
        device: for training and sampling (default: CUDA when available).
        fail_fast: stop at the first failing cell (default: record the error in ``cells/<cell>/error.txt``,
            carry on with the other cells, and list the failures at the end).
        train_fn: ``train_fn(cfg, run_dir, resume, device)``; default trains with arvdm.training.
        sample_fn: ``sample_fn(run_dir, cell_dir, SampleSettings)`` that writes ``eval.json``; default
            ``arvdm.sampling.sample_run``.
    Returns:
        ``{"evaluated": [...], "skipped": [...], "failed": {cell: message}, "trained": [...], "plan": [...]}``.
    """
    out = Path(out)
    cells = select_cells(grid, only)
    done = {c.name for c in cells if (out / "cells" / c.name / "eval.json").is_file()}
    job = _Job(grid, out, cells, done, device, fail_fast, train_fn or _default_train,
               sample_fn or sample_run, log or tqdm.write)
    # Before anything runs: the state of every training run a pending cell needs (a run folder holding
    # another configuration is an error now, not after an hour of other cells).
    needed = list(dict.fromkeys(c.train_run for c in cells if c.name not in done))
    status = {r: run_status(out / "runs" / r, grid.runs[r].config) for r in needed}
    job.result = {"evaluated": [], "skipped": sorted(done, key=[c.name for c in cells].index),
                  "failed": {}, "trained": [], "plan": _plan(job, needed, status)}
    if dry_run:
        job.say(f"grid {grid.name}: {len(cells)} cell(s), {len(needed)} training run(s) needed; output {out}")
        for line in job.result["plan"]:
            job.say("  " + line)
        return job.result

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "plan.json", grid.to_dict(), indent=2, default=str)
    with tqdm(total=len(cells), initial=len(done), desc=f"grid {grid.name}", unit="cell", disable=not progress,
              dynamic_ncols=True) as bar:
        for run_name in needed:
            _train(job, run_name, *status[run_name])
            for cell in [c for c in cells if c.train_run == run_name and c.name not in done]:
                bar.set_postfix_str(cell.name)
                _evaluate(job, cell)
                bar.update(1)
                _refresh_report(job)
    write_report(out, grid)
    return job.result
