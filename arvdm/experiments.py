"""Experiment grids: train and evaluate many configurations, then tabulate and plot the trade-off.

    python -m arvdm.experiments pareto --grid tiny                 # the CPU grid (about an hour on 2 cores)
    python -m arvdm.experiments pareto --grid paper --out experiments/paper
    python -m arvdm.experiments pareto --grid my_grid.yaml --only 'prepend-*' --dry-run
    python -m arvdm.experiments report --out experiments/tiny      # tables and plots from finished cells

A grid (YAML; ``tiny`` and ``paper`` ship in ``arvdm/grids/``) names a base configuration, the sampling
settings, and *axes* whose product gives the *cells*::

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
differ only in sampling settings share one training run. Outputs under ``OUT`` (default
``experiments/<grid name>``)::

    OUT/plan.json                  the expanded grid: every cell's overrides, sample settings, training run
    OUT/runs/<run>/                one training run (checkpoints/, log.csv) per distinct training config
    OUT/cells/<cell>/              cell.json, eval.json, metrics.csv, rollout.mp4 / .npz (arvdm.sampling)
    OUT/results.csv, results.md    one row per cell
    OUT/error_accumulation.png     PSNR against generated frame index, one line per cell
    OUT/retrieval_by_span.png      retrieval rate per gap bin, one bar per cell
    OUT/pareto.png, pareto.csv     x = max PSNR decay, y = mean retrieval rate, frontier drawn

Resumable at two levels: a cell whose ``eval.json`` exists is skipped; a training run whose newest
checkpoint is at ``train.max_steps`` is not retrained, and an interrupted one resumes from its newest
checkpoint. Re-running the same command after a crash or Ctrl-C therefore only does what is missing.
"""

from __future__ import annotations

import os

# Idle OpenMP threads spin-wait by default, which on a CPU shared with other jobs makes small matmuls much
# slower (see train.py). Only effective when this module is imported before torch, as under `python -m`.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import csv  # noqa: E402
import dataclasses  # noqa: E402
import fnmatch  # noqa: E402
import itertools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable, Mapping, Sequence  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import yaml  # noqa: E402
from tqdm import tqdm  # noqa: E402

from arvdm.checkpoint import CheckpointError, checkpoint_step, latest_checkpoint, load_config  # noqa: E402
from arvdm.config import Config, ConfigError, apply_overrides, get_preset  # noqa: E402
from arvdm.metrics import atomic_write_text  # noqa: E402

__all__ = [
    "GRIDS_DIR",
    "Cell",
    "Grid",
    "GridError",
    "TrainRun",
    "collect_results",
    "expand_grid",
    "load_grid",
    "main",
    "resolve_grid_path",
    "run_grid",
    "run_status",
    "write_report",
]

#: Where the grids that ship with the package live (``--grid tiny`` means ``GRIDS_DIR / "tiny.yaml"``).
GRIDS_DIR = Path(__file__).with_name("grids")

#: The memory settings every cell name spells out, whether or not the grid varies them.
MEMORY_KEYS = ("memory.structure", "memory.length", "memory.budget", "memory.compressor")
#: Compressor given to a cell that has a budget but no compressor (the paper's compression).
DEFAULT_COMPRESSOR = "joint"

#: Seconds between refreshes of the tables and plots while a grid runs (they are always written at the end).
REPORT_REFRESH_S = 120.0

_TOP_KEYS = ("name", "description", "base", "sample", "axes", "exclude", "cells", "report")
_BASE_KEYS = ("preset", "set")
_REPORT_KEYS = ("paper_reference",)
# SampleSettings fields the runner sets itself: every cell is evaluated, quietly (the grid has its own bar).
_RUNNER_SAMPLE_FIELDS = ("evaluate", "progress")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.+]+")


class GridError(ValueError):
    """A grid file is malformed, or some of its cells are invalid (the message lists every problem)."""


# --------------------------------------------------------------------------------------------------------
# The expanded grid
# --------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------
# Loading and expanding a grid
# --------------------------------------------------------------------------------------------------------


def available_grids() -> list[str]:
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


def _fmt_value(value: Any) -> str:
    """A YAML value as the right-hand side of a ``key=value`` override (apply_overrides parses JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


def _sample_fields() -> dict[str, Any]:
    """SampleSettings' fields and defaults (imported lazily: arvdm.sampling pulls in diffusers)."""
    from arvdm.sampling import SampleSettings

    return {f.name: f.default for f in dataclasses.fields(SampleSettings)}


def _normalise_key(key: Any, where: str, sample_fields: Mapping[str, Any], preset: str) -> str:
    """Check an axis / cell / exclude key and return its canonical form (``sample.schedule`` -> ``schedule``)."""
    if not isinstance(key, str):
        raise GridError(f"{where}: key {key!r} must be a string like memory.length, schedule or sample.steps")
    if key in ("schedule", "sample.schedule"):
        return "schedule"
    if key.startswith("sample."):
        name = key[len("sample."):]
        if name in _RUNNER_SAMPLE_FIELDS:
            raise GridError(f"{where}: {key} is set by the experiment runner and cannot be varied")
        if name not in sample_fields:
            raise GridError(f"{where}: unknown sampling key {key!r}; SampleSettings has {sorted(sample_fields)}")
        return key
    try:  # a config key: setting it to its preset value runs the Config's own check (names the section's keys)
        section, _, attr = key.partition(".")
        current = getattr(getattr(get_preset(preset), section, None), attr, 0) if attr else 0
        apply_overrides(get_preset(preset), [f"{key}={_fmt_value(current)}"])
    except ConfigError as e:
        raise GridError(f"{where}: {e}") from None
    return key


def _as_mapping(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise GridError(f"{where}: expected a mapping of key: value, got {type(value).__name__} {value!r}")
    return dict(value)


def _scalar(value: Any, where: str) -> Any:
    if isinstance(value, (Mapping, list, tuple)):
        raise GridError(f"{where}: expected a number, string or boolean, got {value!r}")
    return value


def _base_overrides(base: Mapping[str, Any], preset: str) -> list[str]:
    """``base.set`` as override strings; accepts a mapping or a list of ``key=value`` strings."""
    raw = base.get("set")
    if raw is None:
        return []
    if isinstance(raw, Mapping):
        items = [f"{k}={_fmt_value(_scalar(v, f'base.set.{k}'))}" for k, v in raw.items()]
    elif isinstance(raw, list) and all(isinstance(s, str) and "=" in s for s in raw):
        items = list(raw)
    else:
        raise GridError("base.set: expected a mapping (train.max_steps: 500) or a list of 'key=value' strings")
    try:
        apply_overrides(get_preset(preset), items)
    except ConfigError as e:
        raise GridError(f"base.set: {e}") from None
    return items


def _effective(key: str, cfg: Config, sample: Mapping[str, Any]) -> Any:
    """A key's value in a cell: from the sampling settings or from the Config."""
    if key == "schedule":
        return sample["schedule"]
    if key.startswith("sample."):
        return sample[key[len("sample."):]]
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def _same(a: Any, b: Any) -> bool:
    return a == b or str(a) == str(b)


def _matches(rule: Mapping[str, Any], cfg: Config, sample: Mapping[str, Any]) -> bool:
    """An exclude rule matches when every key's value equals the cell's (a list means any of them)."""
    for key, want in rule.items():
        have = _effective(key, cfg, sample)
        options = want if isinstance(want, list) else [want]
        if not any(_same(have, w) for w in options):
            return False
    return True


def _name_part(value: Any) -> str:
    s = _NAME_UNSAFE.sub("_", str(value)).strip("_")
    return s or "x"


def _schedule_label(schedule: Any) -> str:
    from arvdm.schedules import PRESETS as SCHEDULE_PRESETS

    s = str(schedule)
    return s if s in SCHEDULE_PRESETS else _name_part(Path(s).stem)


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """The label of each extra varying key in a cell name: its last part, unless two keys share it."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else _name_part(k)) for k, s in zip(keys, last)}


def _cell_names(cfg: Config, sample: Mapping[str, Any], extra: Sequence[str],
                short: Mapping[str, str]) -> tuple[str, str]:
    """(training-run name, cell name): ``prepend-m24-joint8`` and ``prepend-m24-joint8-chunked``."""
    mem = cfg.memory
    comp = "none" if mem.compressor == "none" else f"{mem.compressor}{mem.budget}"
    train = [mem.structure, f"m{mem.length}", comp]
    cell_tail = [_schedule_label(sample["schedule"])]
    for key in extra:
        part = f"{short[key]}{_name_part(_effective(key, cfg, sample))}"
        (cell_tail if key.startswith("sample.") else train).append(part)
    train_name = "-".join(train)
    return train_name, "-".join([train_name] + cell_tail)


def _resolve_compression(values: dict[str, Any], base_cfg: Config) -> None:
    """Couple budget and compressor so an axis of budgets reads naturally (see the module docs).

    Budget 0 means "no compression", so it forces compressor none (a compressor axis crossed with budget 0
    gives one uncompressed cell, not one per compressor); a budget B > 0 with no compressor gets the
    paper's joint compressor.
    """
    budget = values.get("memory.budget", base_cfg.memory.budget)
    compressor = values.get("memory.compressor", base_cfg.memory.compressor)
    if "memory.budget" not in values and "memory.compressor" not in values:
        return
    if _same(budget, 0) and compressor != "none":
        values["memory.compressor"] = "none"
    elif isinstance(budget, int) and budget > 0 and compressor == "none":
        values["memory.compressor"] = DEFAULT_COMPRESSOR


def _episode_frames(cfg: Config) -> int | None:
    """Frames per validation episode (after frame_skip) when known before training, else None.

    Known when the data set will be generated (no folder yet: ``data.generate_length``) or was generated
    (its ``dataset.json`` says the length). A folder of foreign episodes is not opened here.
    """
    root = Path(cfg.data.path)
    length: int | None = None
    manifest = root / "dataset.json"
    if not root.exists():
        length = cfg.data.generate_length
    elif manifest.is_file():
        try:
            length = int(json.loads(manifest.read_text())["length"])
        except (OSError, ValueError, KeyError, TypeError):
            return None
    if length is None:
        return None
    return (length - 1) // cfg.data.frame_skip + 1


def _check_cell(cfg: Config, sample: Mapping[str, Any]) -> list[str]:
    """Problems that would only show after training: the schedule, the context, the episode length."""
    from arvdm.schedules import ScheduleError, get_schedule

    problems = []
    c = cfg.model.frames_per_chunk
    try:
        sched = get_schedule(sample["schedule"], cfg.train.window, cfg.diffusion.num_levels, sample["steps"])
        if sched.delta % c:
            problems.append(f"schedule {sample['schedule']!r} finishes {sched.delta} frames per AR step, not a "
                            f"multiple of model.frames_per_chunk={c}")
    except (ScheduleError, ValueError, TypeError) as e:
        problems.append(f"schedule {sample['schedule']!r}: {e}")
    context = sample.get("context")
    context = max(cfg.memory.length, c) if context is None else context
    if not isinstance(context, int) or context < 0 or context % c:
        problems.append(f"sample.context={context!r} must be a non-negative multiple of model.frames_per_chunk={c}")
    frames = sample.get("frames")
    available = _episode_frames(cfg)
    if isinstance(frames, int) and isinstance(context, int) and available is not None \
            and context + frames > available:
        problems.append(f"sample.context={context} + sample.frames={frames} = {context + frames} frames, but the "
                        f"episodes of {cfg.data.path} hold {available} (data.generate_length / frame_skip)")
    return problems


def expand_grid(spec: Any, name: str = "grid", path: Path | None = None) -> Grid:
    """Expand a grid spec (the parsed YAML) into validated cells and shared training runs.

    Raises GridError naming the key and what is wrong for a malformed spec, and one GridError listing every
    invalid cell (its name or overrides, and the Config / schedule / context problem) before anything runs.
    """
    if isinstance(spec, Mapping) and isinstance(spec.get("name"), str):
        name = spec["name"]
    where = f"grid {path}" if path else f"grid {name!r}"
    if not isinstance(spec, Mapping):
        raise GridError(f"{where}: the top level must be a mapping with keys {list(_TOP_KEYS)}")
    unknown = [k for k in spec if k not in _TOP_KEYS]
    if unknown:
        raise GridError(f"{where}: unknown key(s) {unknown}; allowed: {list(_TOP_KEYS)}")
    name = str(spec.get("name") or name)
    if _name_part(name) != name:
        raise GridError(f"{where}: name {name!r} may only hold letters, digits, '_', '.', '+'")

    base = _as_mapping(spec.get("base"), "base")
    bad = [k for k in base if k not in _BASE_KEYS]
    if bad:
        raise GridError(f"base: unknown key(s) {bad}; allowed: {list(_BASE_KEYS)}")
    preset = base.get("preset", "tiny")
    try:
        base_cfg = get_preset(preset)
    except ConfigError as e:
        raise GridError(f"base.preset: {e}") from None
    base_set = _base_overrides(base, preset)
    base_cfg = apply_overrides(base_cfg, base_set)

    sample_fields = _sample_fields()
    sample_base = {k: v for k, v in sample_fields.items() if k not in _RUNNER_SAMPLE_FIELDS}
    for key, value in _as_mapping(spec.get("sample"), "sample").items():
        if key in _RUNNER_SAMPLE_FIELDS:
            raise GridError(f"sample.{key}: set by the experiment runner (every cell is evaluated); remove it")
        if key not in sample_fields:
            raise GridError(f"sample.{key}: unknown sampling setting; SampleSettings has {sorted(sample_base)}")
        sample_base[key] = _scalar(value, f"sample.{key}")

    axes_raw = _as_mapping(spec.get("axes"), "axes")
    axes: dict[str, list[Any]] = {}
    for key, values in axes_raw.items():
        k = _normalise_key(key, f"axes.{key}", sample_fields, preset)
        if not isinstance(values, list) or not values:
            raise GridError(f"axes.{key}: expected a non-empty list of values, got {values!r}")
        if k in axes:
            raise GridError(f"axes.{key}: the same key appears twice (as {k})")
        axes[k] = [_scalar(v, f"axes.{key}[{i}]") for i, v in enumerate(values)]

    def rules(section: str) -> list[dict[str, Any]]:
        raw = spec.get(section) or []
        if not isinstance(raw, list):
            raise GridError(f"{section}: expected a list of mappings, got {raw!r}")
        out = []
        for i, rule in enumerate(raw):
            rule = _as_mapping(rule, f"{section}[{i}]")
            if not rule:
                raise GridError(f"{section}[{i}]: empty mapping")
            out.append({_normalise_key(k, f"{section}[{i}].{k}", sample_fields, preset):
                        (v if section == "exclude" and isinstance(v, list) else _scalar(v, f"{section}[{i}].{k}"))
                        for k, v in rule.items()})
        return out

    excludes, explicit = rules("exclude"), rules("cells")
    report = _as_mapping(spec.get("report"), "report")
    bad = [k for k in report if k not in _REPORT_KEYS]
    if bad:
        raise GridError(f"report: unknown key(s) {bad}; allowed: {list(_REPORT_KEYS)}")

    # The cells' own values: the product of the axes (minus exclusions), then the explicit cells.
    candidates: list[tuple[dict[str, Any], bool]] = []
    if axes:
        keys = list(axes)
        candidates += [(dict(zip(keys, combo)), True) for combo in itertools.product(*axes.values())]
    candidates += [(dict(c), False) for c in explicit]
    if not candidates:
        candidates = [({}, False)]  # no axes, no cells: the base configuration is the one cell

    # Keys that vary across the grid and are not in every name already: they join the names and the table.
    varying = [k for k in dict.fromkeys(list(axes) + [k for c in explicit for k in c])
               if k not in MEMORY_KEYS and k != "schedule"]
    short = _short_keys(varying)

    cells: list[Cell] = []
    problems: list[str] = []
    excluded: set[int] = set()  # exclude rules that matched some cell
    seen: dict[str, tuple[str, str]] = {}  # cell name -> (config json, sample json)
    for values, from_product in candidates:
        _resolve_compression(values, base_cfg)
        config_items = [f"{k}={_fmt_value(v)}" for k, v in values.items() if k != "schedule"
                        and not k.startswith("sample.")]
        sample = dict(sample_base)
        for k, v in values.items():
            if k == "schedule":
                sample["schedule"] = v
            elif k.startswith("sample."):
                sample[k[len("sample."):]] = v
        label = ", ".join(f"{k}={v}" for k, v in values.items()) or "(base)"
        try:
            cfg = apply_overrides(get_preset(preset), base_set + config_items)
            # Exclusions first: a combination the grid excludes may well be invalid (budget > length).
            hits = [i for i, r in enumerate(excludes) if _matches(r, cfg, sample)] if from_product else []
            excluded.update(hits)
            if hits:
                continue
            cfg.validate()
        except ConfigError as e:
            problems.append(f"cell {label}: {e}")
            continue
        train_name, cell_name = _cell_names(cfg, sample, varying, short)
        ident = (cfg.to_json(), json.dumps(sample, sort_keys=True, default=str))
        if cell_name in seen:
            if seen[cell_name] == ident:
                continue  # the same cell twice (e.g. a compressor axis crossed with budget 0): keep one
            problems.append(f"cell {label}: its name {cell_name!r} is taken by a different cell; give the "
                            f"differing key a distinct value or an axis")
            continue
        seen[cell_name] = ident
        values_shown = {k: _effective(k, cfg, sample) for k in MEMORY_KEYS}
        values_shown["schedule"] = sample["schedule"]
        values_shown.update({k: _effective(k, cfg, sample) for k in varying})
        cells.append(Cell(cell_name, train_name, base_set + config_items, sample, values_shown, cfg))

    # A rule that excludes nothing is most likely a typo in a value (channel-concat for channel_concat).
    problems += [f"exclude[{i}] {rule} matches no cell of the axes' product; check its values"
                 for i, rule in enumerate(excludes) if i not in excluded]

    # One context for every cell unless the grid sets it: the longest memory (rounded up to every chunk
    # size), so all cells generate the same frames of the same episodes and their curves line up.
    if sample_base.get("context") is None and cells:
        chunk = math.lcm(*(c.config.model.frames_per_chunk for c in cells))
        context = max(max(c.config.memory.length, c.config.model.frames_per_chunk) for c in cells)
        context = -(-context // chunk) * chunk
        sample_base["context"] = context
        for c in cells:
            if "sample.context" not in c.values:
                c.sample["context"] = context

    for c in cells:
        problems += [f"cell {c.name}: {p}" for p in _check_cell(c.config, c.sample)]

    # Cells with the same Config share a training run; two configs must not end up with one run name.
    runs: dict[str, TrainRun] = {}
    for c in cells:
        run = runs.get(c.train_run)
        if run is None:
            runs[c.train_run] = TrainRun(c.train_run, c.config, [o for o in c.overrides], [c.name])
        elif run.config.to_json() != c.config.to_json():
            problems.append(f"cell {c.name}: its training run name {c.train_run!r} is shared with cells "
                            f"{run.cells} whose config differs; vary the differing key on an axis")
        else:
            run.cells.append(c.name)
    if problems:
        raise GridError(f"{where}: {len(problems)} invalid cell(s):\n  " + "\n  ".join(problems))
    return Grid(name=name, cells=cells, runs=runs, sample=sample_base,
                paper_reference=bool(report.get("paper_reference", False)),
                description=str(spec.get("description") or ""), path=path, columns=varying)


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


# --------------------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------------------


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
    from arvdm.training import train

    train(cfg, run_dir, resume=resume, generate_data=True, device=device)


def _default_sample(run_dir: Path, out_dir: Path, settings: Any) -> Any:
    from arvdm.sampling import sample_run

    return sample_run(run_dir, out_dir, settings)


def _settings(cell: Cell, device: str | None) -> Any:
    from arvdm.sampling import SampleSettings

    kw = dict(cell.sample)
    if device:
        kw["device"] = device
    return SampleSettings(**kw, evaluate=True, progress=False)


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
        grid: from :func:`load_grid` / :func:`expand_grid`.
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
    say = log or tqdm.write
    train_fn = train_fn or _default_train
    sample_fn = sample_fn or _default_sample
    cells = select_cells(grid, only)
    done = {c.name for c in cells if (out / "cells" / c.name / "eval.json").is_file()}

    # Before anything runs: the state of every training run a pending cell needs (a run folder holding
    # another configuration is an error now, not after an hour of other cells).
    needed = list(dict.fromkeys(c.train_run for c in cells if c.name not in done))
    status = {r: run_status(out / "runs" / r, grid.runs[r].config) for r in needed}
    plan = []
    for r in needed:
        state, step = status[r]
        max_steps = grid.runs[r].config.train.max_steps
        what = {"fresh": f"train {max_steps} steps", "resume": f"resume at step {step} of {max_steps}",
                "done": f"trained ({step} steps)"}[state]
        plan.append(f"run  {r}: {what}")
    plan += [f"cell {c.name}: {'done, skipped' if c.name in done else 'evaluate'} (run {c.train_run})"
             for c in cells]
    result: dict[str, Any] = {"evaluated": [], "skipped": sorted(done, key=[c.name for c in cells].index),
                              "failed": {}, "trained": [], "plan": plan}
    if dry_run:
        say(f"grid {grid.name}: {len(cells)} cell(s), {len(needed)} training run(s) needed; output {out}")
        for line in plan:
            say("  " + line)
        return result

    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "plan.json", json.dumps(grid.to_dict(), indent=2, default=str) + "\n")
    bar = tqdm(total=len(cells), initial=len(done), desc=f"grid {grid.name}", unit="cell", disable=not progress,
               dynamic_ncols=True)
    train_failed: dict[str, str] = {}
    last_report = -math.inf
    try:
        for run_name in needed:
            run, run_dir = grid.runs[run_name], out / "runs" / run_name
            pending = [c for c in cells if c.train_run == run_name and c.name not in done]
            state, step = status[run_name]
            if state != "done" and run_name not in train_failed:
                say(f"training {run_name} ({'fresh' if state == 'fresh' else f'resuming at step {step}'}, "
                    f"{run.config.train.max_steps} steps) -> {run_dir}")
                t0 = time.perf_counter()
                try:
                    train_fn(run.config, run_dir, state == "resume", device)
                    result["trained"].append(run_name)
                    say(f"trained {run_name} in {time.perf_counter() - t0:.0f} s")
                except Exception as e:  # noqa: BLE001 - recorded per cell; KeyboardInterrupt propagates
                    if fail_fast:
                        raise
                    train_failed[run_name] = f"training {run_name} failed: {e}\n{traceback.format_exc()}"
            for cell in pending:
                bar.set_postfix_str(cell.name)
                cell_dir = out / "cells" / cell.name
                cell_dir.mkdir(parents=True, exist_ok=True)
                atomic_write_text(cell_dir / "cell.json", json.dumps({"grid": grid.name, **cell.to_dict()},
                                                                     indent=2, default=str) + "\n")
                error = train_failed.get(run_name)
                if error is None:
                    t0 = time.perf_counter()
                    try:
                        sample_fn(run_dir, cell_dir, _settings(cell, device))
                        if not (cell_dir / "eval.json").is_file():
                            raise RuntimeError(f"sampling wrote no {cell_dir / 'eval.json'}")
                    except Exception as e:  # noqa: BLE001
                        if fail_fast:
                            raise
                        error = f"evaluating {cell.name} failed: {e}\n{traceback.format_exc()}"
                if error is None:
                    (cell_dir / "error.txt").unlink(missing_ok=True)
                    result["evaluated"].append(cell.name)
                    say(f"evaluated {cell.name} in {time.perf_counter() - t0:.0f} s")
                else:
                    atomic_write_text(cell_dir / "error.txt", error)
                    result["failed"][cell.name] = error.splitlines()[0]
                    say(f"FAILED {cell.name}: {error.splitlines()[0]} (details: {cell_dir / 'error.txt'})")
                bar.update(1)
                # Refresh the tables and plots as cells finish, so a long grid can be read while it runs
                # (at most every REPORT_REFRESH_S: the plots take seconds on a busy CPU).
                if time.monotonic() - last_report >= REPORT_REFRESH_S:
                    write_report(out, grid, quiet=True)
                    last_report = time.monotonic()
    finally:
        bar.close()
    write_report(out, grid)
    return result


# --------------------------------------------------------------------------------------------------------
# Results: tables and plots from the cell folders
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
            raise GridError(f"{plan}: not a plan written by arvdm.experiments ({e}); pass --grid") from None
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
    from arvdm.evaluate import read_eval_json
    from arvdm.pareto import pareto_frontier
    from arvdm.retrieval import mean_retrieval_rate

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
    from arvdm.pareto import paper_reference as paper_numbers
    from arvdm.pareto import plot_error_accumulation, plot_pareto, plot_retrieval_by_span, write_results_table

    out = Path(out)
    _, extra, grid_ref = _cells_for_report(out, grid)
    use_ref = grid_ref if paper_reference is None else paper_reference
    rows = collect_results(out, grid)
    columns = _table_columns(rows, extra)
    paths: dict[str, Path] = {}
    paths["csv"], paths["md"] = write_results_table(rows, out / "results.csv", out / "results.md", columns)

    done = [r for r in rows if r["status"] == "done"]
    ref = paper_numbers() if use_ref else None
    if done:
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

    # results.md: the table under a short header that says what the columns mean, and the plots.
    table = paths["md"].read_text(encoding="utf-8")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "failed", "pending")}
    name = grid.name if grid is not None else out.name
    lines = [f"# Experiment results: {name}", "",
             f"{counts['done']} of {len(rows)} cells evaluated"
             + (f", {counts['failed']} failed" if counts["failed"] else "")
             + (f", {counts['pending']} pending" if counts["pending"] else "") + ".",
             ("max_psnr_decay: first span's mean PSNR minus the worst span's (dB, lower is better); "
              "retrieval_mean: mean retrieval rate over gap bins with probes (higher is better); "
              "retrieval_<a-b>: rate for revisits a-b frames back; psnr_<a-b>: mean PSNR over generated "
              "frames a-b; psnr4_<model|copy_last|context_mean>: mean PSNR over the first 4 generated frames "
              "of the model and of the two trivial predictors; grad_ratio16: spatial-gradient ratio "
              "generated/real over the first 16 (about 1 = sharp, >1.5 noise, <0.6 blur); beats_copy_last: "
              "1 when psnr4_model >= psnr4_copy_last (a cell with 0 has not learned the video: do not read "
              "its curve or retrieval as a result); on_frontier: 1 when no other cell is better on both "
              "axes."), "", table]
    for key, title in (("error_accumulation", "Error accumulation"), ("retrieval_by_span", "Retrieval by span"),
                       ("pareto", "Pareto frontier")):
        if key in paths:
            lines += [f"![{title}]({paths[key].name})", ""]
    atomic_write_text(paths["md"], "\n".join(lines))
    if not quiet:
        tqdm.write(f"report: {counts['done']}/{len(rows)} cells -> {paths['csv']}, {paths['md']}"
                   + (f", {out / 'pareto.png'}" if done else " (no finished cell yet: no plots)"))
    return paths


# --------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m arvdm.experiments", description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.split("\n")[1:7]))
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("pareto", help="train and evaluate a grid (resumable), then write tables and plots")
    run.add_argument("--grid", required=True, help=f"grid YAML file, or a shipped grid: {available_grids()}")
    run.add_argument("--out", help="output folder (default experiments/<grid name>)")
    run.add_argument("--only", nargs="+", metavar="NAME", help="only these cells or training runs (shell "
                                                                "patterns allowed, e.g. 'prepend-*')")
    run.add_argument("--dry-run", action="store_true", help="print what would run and exit")
    run.add_argument("--device", help="cpu, cuda, cuda:1 (default: cuda when available)")
    run.add_argument("--fail-fast", action="store_true", help="stop at the first failing cell")
    rep = sub.add_parser("report", help="regenerate tables and plots from finished cells (runs nothing)")
    rep.add_argument("--grid", help="grid file or name (default: OUT/plan.json)")
    rep.add_argument("--out", help="output folder (default experiments/<grid name>)")
    for q in (run, rep):
        q.add_argument("--paper-reference", dest="paper_reference", action="store_true", default=None,
                       help="overlay the paper's numbers on the plots")
        q.add_argument("--no-paper-reference", dest="paper_reference", action="store_false")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        grid = load_grid(args.grid) if args.grid else None
        if args.out is None and grid is None:
            raise GridError("report: give --out (the grid's output folder) or --grid")
        out = Path(args.out) if args.out else Path("experiments") / grid.name
        if grid is not None and args.paper_reference is not None:
            grid.paper_reference = args.paper_reference
        if args.command == "report":
            write_report(out, grid, paper_reference=args.paper_reference)
            return 0
        result = run_grid(grid, out, only=args.only, dry_run=args.dry_run, device=args.device,
                          fail_fast=args.fail_fast)
    except (GridError, ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; finished cells and checkpoints are kept: run the same command again to resume",
              file=sys.stderr)
        return 130
    if result["failed"]:
        print(f"{len(result['failed'])} cell(s) failed:", file=sys.stderr)
        for name, msg in result["failed"].items():
            print(f"  {name}: {msg}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
