"""The grid language: a YAML file whose axes expand into cells (a Config + sampling settings each).

    from arvdm.experiments.grid import load_grid
    grid = load_grid("tiny")                 # a shipped grid (arvdm/grids/tiny.yaml) or a path
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
anything trains. The runner is arvdm.experiments.runner, the tables and plots arvdm.experiments.report; see
docs/experiments.md.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import itertools
import json
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from arvdm.config import Config, ConfigError, apply_overrides, get_preset
from arvdm.errors import ArvdmError

__all__ = ["GRIDS_DIR", "Cell", "Grid", "GridError", "TrainRun", "available_grids", "expand_grid", "load_grid",
           "resolve_grid_path", "select_cells"]

#: Where the grids that ship with the package live (``--grid tiny`` means ``GRIDS_DIR / "tiny.yaml"``).
GRIDS_DIR = Path(__file__).with_name("grids")

#: The memory settings every cell name spells out, whether or not the grid varies them.
MEMORY_KEYS = ("memory.structure", "memory.length", "memory.budget", "memory.compressor")
#: Compressor given to a cell that has a budget but no compressor (the paper's compression).
DEFAULT_COMPRESSOR = "joint"

_TOP_KEYS = ("name", "description", "base", "sample", "axes", "exclude", "cells", "report")
_BASE_KEYS = ("preset", "set")
_REPORT_KEYS = ("paper_reference",)
# SampleSettings fields the runner sets itself: every cell is evaluated, quietly (the grid has its own bar).
_RUNNER_SAMPLE_FIELDS = ("evaluate", "progress")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.+]+")


class GridError(ArvdmError):
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
# Loading a grid; checking its keys and values
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
    from arvdm.config import SampleSettings

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
    from arvdm.schedules.matrix import PRESETS as SCHEDULE_PRESETS

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
    from arvdm.schedules.matrix import ScheduleError, get_schedule

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
    context = cfg.default_context() if context is None else context
    if not isinstance(context, int) or context < 0 or context % c:
        problems.append(f"sample.context={context!r} must be a non-negative multiple of model.frames_per_chunk={c}")
    frames = sample.get("frames")
    available = _episode_frames(cfg)
    if isinstance(frames, int) and isinstance(context, int) and available is not None \
            and context + frames > available:
        problems.append(f"sample.context={context} + sample.frames={frames} = {context + frames} frames, but the "
                        f"episodes of {cfg.data.path} hold {available} (data.generate_length / frame_skip)")
    return problems


# --------------------------------------------------------------------------------------------------------
# Expanding a grid: read the sections, build the cells, share the training runs
# --------------------------------------------------------------------------------------------------------


@dataclass
class _Spec:
    """A grid spec's sections after their keys were checked (what building the cells needs)."""

    preset: str
    base_set: list[str]
    base_cfg: Config
    sample_fields: dict[str, Any]
    sample_base: dict[str, Any]
    axes: dict[str, list[Any]]
    excludes: list[dict[str, Any]]
    explicit: list[dict[str, Any]]
    varying: list[str] = field(default_factory=list)  # keys that vary and are not in every name already


def _check_top(spec: Any, name: str, path: Path | None) -> tuple[str, str]:
    """(grid name, where) after checking the top-level keys and the name."""
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
    return name, where


def _read_base(spec: Mapping[str, Any]) -> tuple[str, list[str], Config]:
    """(preset, base overrides, base Config) from the ``base`` section."""
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
    return preset, base_set, apply_overrides(base_cfg, base_set)


def _read_sample(spec: Mapping[str, Any], sample_fields: Mapping[str, Any]) -> dict[str, Any]:
    """SampleSettings defaults overridden by the ``sample`` section (runner-owned fields excluded)."""
    sample_base = {k: v for k, v in sample_fields.items() if k not in _RUNNER_SAMPLE_FIELDS}
    for key, value in _as_mapping(spec.get("sample"), "sample").items():
        if key in _RUNNER_SAMPLE_FIELDS:
            raise GridError(f"sample.{key}: set by the experiment runner (every cell is evaluated); remove it")
        if key not in sample_fields:
            raise GridError(f"sample.{key}: unknown sampling setting; SampleSettings has {sorted(sample_base)}")
        sample_base[key] = _scalar(value, f"sample.{key}")
    return sample_base


def _read_axes(spec: Mapping[str, Any], sample_fields: Mapping[str, Any], preset: str) -> dict[str, list[Any]]:
    axes: dict[str, list[Any]] = {}
    for key, values in _as_mapping(spec.get("axes"), "axes").items():
        k = _normalise_key(key, f"axes.{key}", sample_fields, preset)
        if not isinstance(values, list) or not values:
            raise GridError(f"axes.{key}: expected a non-empty list of values, got {values!r}")
        if k in axes:
            raise GridError(f"axes.{key}: the same key appears twice (as {k})")
        axes[k] = [_scalar(v, f"axes.{key}[{i}]") for i, v in enumerate(values)]
    return axes


def _read_rules(spec: Mapping[str, Any], section: str, sample_fields: Mapping[str, Any],
                preset: str) -> list[dict[str, Any]]:
    """The ``exclude`` or ``cells`` section: a list of key -> value mappings (exclude values may be lists)."""
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


def _read_report(spec: Mapping[str, Any]) -> dict[str, Any]:
    report = _as_mapping(spec.get("report"), "report")
    bad = [k for k in report if k not in _REPORT_KEYS]
    if bad:
        raise GridError(f"report: unknown key(s) {bad}; allowed: {list(_REPORT_KEYS)}")
    return report


def _read_spec(spec: Mapping[str, Any]) -> _Spec:
    preset, base_set, base_cfg = _read_base(spec)
    sample_fields = _sample_fields()
    s = _Spec(preset, base_set, base_cfg, sample_fields, _read_sample(spec, sample_fields),
              _read_axes(spec, sample_fields, preset), _read_rules(spec, "exclude", sample_fields, preset),
              _read_rules(spec, "cells", sample_fields, preset))
    s.varying = [k for k in dict.fromkeys(list(s.axes) + [k for c in s.explicit for k in c])
                 if k not in MEMORY_KEYS and k != "schedule"]
    return s


def _candidates(s: _Spec) -> list[tuple[dict[str, Any], bool]]:
    """The cells' own values, with "from the product": the product of the axes, then the explicit cells."""
    out: list[tuple[dict[str, Any], bool]] = []
    if s.axes:
        keys = list(s.axes)
        out += [(dict(zip(keys, combo)), True) for combo in itertools.product(*s.axes.values())]
    out += [(dict(c), False) for c in s.explicit]
    return out or [({}, False)]  # no axes, no cells: the base configuration is the one cell


def _split_values(s: _Spec, values: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """A cell's values as (Config overrides, SampleSettings fields)."""
    config_items = [f"{k}={_fmt_value(v)}" for k, v in values.items()
                    if k != "schedule" and not k.startswith("sample.")]
    sample = dict(s.sample_base)
    for k, v in values.items():
        if k == "schedule":
            sample["schedule"] = v
        elif k.startswith("sample."):
            sample[k[len("sample."):]] = v
    return config_items, sample


def _build_cells(s: _Spec) -> tuple[list[Cell], list[str]]:
    """Every cell that is valid, not excluded and not a duplicate; and the problems found on the way."""
    short = _short_keys(s.varying)
    cells: list[Cell] = []
    problems: list[str] = []
    excluded: set[int] = set()  # exclude rules that matched some cell
    seen: dict[str, tuple[str, str]] = {}  # cell name -> (config json, sample json)
    for values, from_product in _candidates(s):
        _resolve_compression(values, s.base_cfg)
        config_items, sample = _split_values(s, values)
        label = ", ".join(f"{k}={v}" for k, v in values.items()) or "(base)"
        try:
            cfg = apply_overrides(get_preset(s.preset), s.base_set + config_items)
            # Exclusions first: a combination the grid excludes may well be invalid (budget > length).
            hits = [i for i, r in enumerate(s.excludes) if _matches(r, cfg, sample)] if from_product else []
            excluded.update(hits)
            if hits:
                continue
            cfg.validate()
        except ConfigError as e:
            problems.append(f"cell {label}: {e}")
            continue
        train_name, cell_name = _cell_names(cfg, sample, s.varying, short)
        ident = (cfg.to_json(), json.dumps(sample, sort_keys=True, default=str))
        if cell_name in seen:
            if seen[cell_name] != ident:
                problems.append(f"cell {label}: its name {cell_name!r} is taken by a different cell; give the "
                                f"differing key a distinct value or an axis")
            continue  # else the same cell twice (a compressor axis crossed with budget 0): keep one
        seen[cell_name] = ident
        shown = {k: _effective(k, cfg, sample) for k in MEMORY_KEYS}
        shown["schedule"] = sample["schedule"]
        shown.update({k: _effective(k, cfg, sample) for k in s.varying})
        cells.append(Cell(cell_name, train_name, s.base_set + config_items, sample, shown, cfg))
    # A rule that excludes nothing is most likely a typo in a value (channel-concat for channel_concat).
    problems += [f"exclude[{i}] {rule} matches no cell of the axes' product; check its values"
                 for i, rule in enumerate(s.excludes) if i not in excluded]
    return cells, problems


def _share_context(cells: Sequence[Cell], sample_base: dict[str, Any]) -> None:
    """One context for every cell unless the grid sets it: the longest memory (rounded up to every chunk
    size), so all cells generate the same frames of the same episodes and their curves line up."""
    if sample_base.get("context") is not None or not cells:
        return
    chunk = math.lcm(*(c.config.model.frames_per_chunk for c in cells))
    context = max(c.config.default_context() for c in cells)
    context = -(-context // chunk) * chunk
    sample_base["context"] = context
    for c in cells:
        if "sample.context" not in c.values:
            c.sample["context"] = context


def _share_runs(cells: Sequence[Cell]) -> tuple[dict[str, TrainRun], list[str]]:
    """Cells with the same Config share a training run; two configs must not end up with one run name."""
    runs: dict[str, TrainRun] = {}
    problems = []
    for c in cells:
        run = runs.get(c.train_run)
        if run is None:
            runs[c.train_run] = TrainRun(c.train_run, c.config, list(c.overrides), [c.name])
        elif run.config.to_json() != c.config.to_json():
            problems.append(f"cell {c.name}: its training run name {c.train_run!r} is shared with cells "
                            f"{run.cells} whose config differs; vary the differing key on an axis")
        else:
            run.cells.append(c.name)
    return runs, problems


def expand_grid(spec: Any, name: str = "grid", path: Path | None = None) -> Grid:
    """Expand a grid spec (the parsed YAML) into validated cells and shared training runs.

    Raises GridError naming the key and what is wrong for a malformed spec, and one GridError listing every
    invalid cell (its name or overrides, and the Config / schedule / context problem) before anything runs.
    """
    name, where = _check_top(spec, name, path)
    s = _read_spec(spec)
    report = _read_report(spec)
    cells, problems = _build_cells(s)
    _share_context(cells, s.sample_base)
    for c in cells:
        problems += [f"cell {c.name}: {p}" for p in _check_cell(c.config, c.sample)]
    runs, run_problems = _share_runs(cells)
    problems += run_problems
    if problems:
        raise GridError(f"{where}: {len(problems)} invalid cell(s):\n  " + "\n  ".join(problems))
    return Grid(name=name, cells=cells, runs=runs, sample=s.sample_base,
                paper_reference=bool(report.get("paper_reference", False)),
                description=str(spec.get("description") or ""), path=path, columns=s.varying)


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
