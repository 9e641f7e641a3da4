"""Experiment grids: a YAML grid of configurations, trained and evaluated cell by cell, then tabulated.

    from arvdm.experiments import load_grid, run_grid, write_report
    grid = load_grid("tiny")
    run_grid(grid, "experiments/tiny")           # resumable; writes the report at the end
    write_report("experiments/tiny", grid)       # tables and plots again from the finished cells

The command line is ``python -m arvdm.experiments`` (``arvdm.experiments.cli.main``). This is the top
layer of arvdm: nothing outside this package imports it.
"""

from arvdm.experiments.cells import Cell, Grid, GridError, TrainRun, select_cells
from arvdm.experiments.grid import GRIDS_DIR, available_grids, expand_grid, load_grid
from arvdm.experiments.paper import paper_reference
from arvdm.experiments.report import write_report
from arvdm.experiments.results import collect_results
from arvdm.experiments.runner import run_grid, run_status

__all__ = [
    "GRIDS_DIR",
    "Cell",
    "Grid",
    "GridError",
    "TrainRun",
    "available_grids",
    "collect_results",
    "expand_grid",
    "load_grid",
    "paper_reference",
    "run_grid",
    "run_status",
    "select_cells",
    "write_report",
]
