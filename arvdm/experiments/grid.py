"""The grid language: a YAML file whose axes expand into cells (a Config + sampling settings each).

    from arvdm.experiments.grid import load_grid
    grid = load_grid("tiny")                 # a shipped grid (arvdm/experiments/grids/tiny.yaml) or a path
    [c.name for c in grid.cells]             # prepend-m8-none-chunked, ...

A grid names a base configuration, the sampling settings, and *axes* whose product gives the *cells*::

    name: my_grid
    base:    {preset: tiny, set: {train.max_steps: 500, data.path: datasets/maze_revisit}}
    sample:  {steps: 20, context: 24, frames: 128, episodes: 4}     # SampleSettings fields
    axes:                                                           # product of the lists
      memory.structure: [prepend, channel_concat]
      memory.length: [8, 24]
      schedule: [chunked, fifo]
    exclude: [{memory.structure: channel_concat, schedule: fifo}]    # drop product cells matching all keys
    cells:   [{memory.length: 24, memory.budget: 8}]                 # extra cells, taken as written
    report:  {paper_reference: false}                                # overlay the paper's numbers

Axis and cell keys are any Config key (``section.name``), ``schedule``, or ``sample.<field>`` for another
SampleSettings field. Every cell gets a readable name, ``<structure>-m<length>-<compression>-<schedule>``
(e.g. ``prepend-m8-none-chunked``, ``prepend-m24-joint8-chunked``) plus any other varying key. Cells that
differ only in sampling settings share one training run (`TrainRun`). Every problem is found here, before
anything trains. This module is the entry (load, expand); reading the sections is arvdm.experiments.spec,
building the cells arvdm.experiments.expand, the records arvdm.experiments.cells. The runner is
arvdm.experiments.runner, the tables and plots arvdm.experiments.report; see docs/experiments.md.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

from arvdm.experiments.cells import MEMORY_KEYS, Cell, Grid, GridError, TrainRun, select_cells
from arvdm.experiments.expand import build_cells, check_cell, share_context, share_runs
from arvdm.experiments.spec import check_top, read_report, read_spec

__all__ = ["GRIDS_DIR", "MEMORY_KEYS", "Cell", "Grid", "GridError", "TrainRun", "available_grids", "expand_grid",
           "load_grid", "resolve_grid_path", "select_cells"]

#: Where the grids that ship with the package live (``--grid tiny`` means ``GRIDS_DIR / "tiny.yaml"``).
GRIDS_DIR = Path(__file__).with_name("grids")


def available_grids() -> list[str]:
    """Names of the grids that ship with the package (``tiny``, ``cpu``, ``paper``)."""
    return sorted(p.stem for p in GRIDS_DIR.glob("*.yaml"))


def resolve_grid_path(grid: str | os.PathLike) -> Path:
    """A grid file by path, or by the name of a grid that ships with the package (``tiny``, ``paper``)."""
    path = Path(grid)
    if path.is_file():
        return path
    shipped = GRIDS_DIR / f"{grid}.yaml"
    if path.suffix == "" and shipped.is_file():
        return shipped
    raise GridError(f"no grid {str(grid)!r}: not a file, and not one of the shipped grids "
                    f"{available_grids()} (in {GRIDS_DIR})")


def load_grid(grid: str | os.PathLike) -> Grid:
    """Read, expand and validate a grid file (path or shipped name); see :func:`expand_grid`."""
    path = resolve_grid_path(grid)
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as e:
        raise GridError(f"grid {path}: cannot read it as YAML: {e}") from None
    return expand_grid(spec, name=path.stem, path=path)


def expand_grid(spec: Any, name: str = "grid", path: Path | None = None) -> Grid:
    """Expand a grid spec (the parsed YAML) into validated cells and shared training runs.

    Raises GridError naming the key and what is wrong for a malformed spec, and one GridError listing every
    invalid cell (its name or overrides, and the Config / schedule / context problem) before anything runs.
    """
    name, where = check_top(spec, name, path)
    s = read_spec(spec)
    report = read_report(spec)
    cells, problems = build_cells(s)
    share_context(cells, s.sample_base)
    for c in cells:
        problems += [f"cell {c.name}: {p}" for p in check_cell(c.config, c.sample)]
    runs, run_problems = share_runs(cells)
    problems += run_problems
    if problems:
        raise GridError(f"{where}: {len(problems)} invalid cell(s):\n  " + "\n  ".join(problems))
    return Grid(name=name, cells=cells, runs=runs, sample=s.sample_base,
                paper_reference=bool(report.get("paper_reference", False)),
                description=str(spec.get("description") or ""), path=path, columns=s.varying)
