"""What a grid expands into: cells (a Config + sampling settings each), shared training runs, the Grid.

    grid = load_grid("tiny")                         # arvdm.experiments.grid
    [c.name for c in select_cells(grid, ["prepend-*"])]

These are plain records: the grid language that builds them is ``arvdm.experiments.spec`` (reading the
YAML) and ``arvdm.experiments.expand`` (building and checking the cells); every user error of either is a
`GridError`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arvdm.config import Config
from arvdm.errors import ArvdmError

__all__ = ["MEMORY_KEYS", "Cell", "Grid", "GridError", "TrainRun", "select_cells"]

#: The memory settings every cell name spells out, whether or not the grid varies them.
MEMORY_KEYS = ("memory.structure", "memory.length", "memory.budget", "memory.compressor")


class GridError(ArvdmError):
    """A grid file is malformed, or some of its cells are invalid (the message lists every problem)."""


@dataclass
class Cell:
    """One point of the grid: a training configuration plus sampling settings.

    Attributes:
        name: unique, readable, file-system safe (the folder ``OUT/cells/<name>``).
        train_run: name of the training run it uses (``OUT/runs/<train_run>``), shared with every cell
            whose configuration is the same.
        overrides: ``key=value`` strings that turn the base preset into this cell's Config (the base's
            ``set`` first, then the cell's own values).
        sample: SampleSettings fields (without ``evaluate`` / ``progress``, which the runner sets).
        values: the settings a results table shows: the memory keys, ``schedule`` and any other key the
            grid varies, as effective values (preset defaults filled in).
        config: the validated Config.
    """

    name: str
    train_run: str
    overrides: list[str]
    sample: dict[str, Any]
    values: dict[str, Any]
    config: Config = field(repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "train_run": self.train_run, "overrides": list(self.overrides),
                "sample": dict(self.sample), "values": dict(self.values)}


@dataclass
class TrainRun:
    """One training run shared by the cells listed in ``cells`` (they differ only in sampling)."""

    name: str
    config: Config = field(repr=False)
    overrides: list[str]
    cells: list[str]


@dataclass
class Grid:
    """A grid file after expansion and validation: every cell and every distinct training run, in order."""

    name: str
    cells: list[Cell]
    runs: dict[str, TrainRun]
    sample: dict[str, Any]
    paper_reference: bool = False
    description: str = ""
    path: Path | None = None
    columns: list[str] = field(default_factory=list)  # the non-memory keys the grid varies (table columns)

    def cell(self, name: str) -> Cell:
        """The cell of that name (KeyError when the grid has none)."""
        for c in self.cells:
            if c.name == name:
                return c
        raise KeyError(name)

    def to_dict(self) -> dict[str, Any]:
        return {"grid": self.name, "description": self.description,
                "source": str(self.path) if self.path else None, "paper_reference": self.paper_reference,
                "columns": list(self.columns), "cells": [c.to_dict() for c in self.cells],
                "runs": {r.name: {"overrides": list(r.overrides), "cells": list(r.cells),
                                  "max_steps": r.config.train.max_steps} for r in self.runs.values()}}


def select_cells(grid: Grid, only: Sequence[str] | None) -> list[Cell]:
    """The cells named by ``only`` (cell or training-run names, shell patterns allowed); all when None."""
    if not only:
        return list(grid.cells)
    chosen, unmatched = [], []
    for pattern in only:
        hits = [c for c in grid.cells if fnmatch.fnmatchcase(c.name, pattern)
                or fnmatch.fnmatchcase(c.train_run, pattern)]
        if not hits:
            unmatched.append(pattern)
        chosen += [c for c in hits if c not in chosen]
    if unmatched:
        raise GridError(f"--only {unmatched} matches no cell or training run of grid {grid.name!r}; cells: "
                        f"{[c.name for c in grid.cells]}")
    return [c for c in grid.cells if c in chosen]  # grid order
