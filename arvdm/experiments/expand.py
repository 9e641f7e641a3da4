"""Building a grid's cells from a checked `GridSpec`: the product of the axes, exclusions, explicit cells,
readable names, one shared context, and training runs shared by cells that differ only in sampling.

    cells, problems = build_cells(spec)         # spec from arvdm.experiments.spec.read_spec
    share_context(cells, spec.sample_base)
    problems += [p for c in cells for p in check_cell(c.config, c.sample)]
    runs, run_problems = share_runs(cells)

Contract: nothing here raises for an invalid cell; every problem comes back as a line, so that
``arvdm.experiments.grid.expand_grid`` can list them all in one `GridError` before anything trains.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from arvdm.config import SCHEDULE_PRESETS, Config, ConfigError, apply_overrides, get_preset
from arvdm.experiments.cells import MEMORY_KEYS, Cell, TrainRun
from arvdm.experiments.spec import GridSpec, fmt_value, name_part
from arvdm.schedules.matrix import ScheduleError
from arvdm.schedules.presets import get_schedule

__all__ = ["DEFAULT_COMPRESSOR", "build_cells", "check_cell", "share_context", "share_runs"]

#: Compressor given to a cell that has a budget but no compressor (the paper's compression).
DEFAULT_COMPRESSOR = "joint"


def _effective(key: str, cfg: Config, sample: Mapping[str, Any]) -> Any:
    """A key's value in a cell: from the sampling settings or from the Config."""
    if key == "schedule":
        return sample["schedule"]
    if key.startswith("sample."):
        return sample[key[len("sample."):]]
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def _same(a: Any, b: Any) -> bool:
    """Equal, or equal as text (a YAML ``8`` matches a Config's ``8`` and ``"8"`` alike)."""
    return a == b or str(a) == str(b)


def _matches(rule: Mapping[str, Any], cfg: Config, sample: Mapping[str, Any]) -> bool:
    """An exclude rule matches when every key's value equals the cell's (a list means any of them)."""
    for key, want in rule.items():
        have = _effective(key, cfg, sample)
        options = want if isinstance(want, list) else [want]
        if not any(_same(have, w) for w in options):
            return False
    return True


def _schedule_label(schedule: Any) -> str:
    """A schedule in a cell name: a preset's name, or a schedule file's stem."""
    s = str(schedule)
    return s if s in SCHEDULE_PRESETS else name_part(Path(s).stem)


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """The label of each extra varying key in a cell name: its last part, unless two keys share it."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else name_part(k)) for k, s in zip(keys, last)}


def _cell_names(cfg: Config, sample: Mapping[str, Any], extra: Sequence[str],
                short: Mapping[str, str]) -> tuple[str, str]:
    """(training-run name, cell name): ``prepend-m24-joint8`` and ``prepend-m24-joint8-chunked``."""
    mem = cfg.memory
    comp = "none" if mem.compressor == "none" else f"{mem.compressor}{mem.budget}"
    train = [mem.structure, f"m{mem.length}", comp]
    cell_tail = [_schedule_label(sample["schedule"])]
    for key in extra:
        part = f"{short[key]}{name_part(_effective(key, cfg, sample))}"
        (cell_tail if key.startswith("sample.") else train).append(part)
    train_name = "-".join(train)
    return train_name, "-".join([train_name] + cell_tail)


def _resolve_compression(values: dict[str, Any], base_cfg: Config) -> None:
    """Couple budget and compressor so an axis of budgets reads naturally (see arvdm.experiments.grid).

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


def check_cell(cfg: Config, sample: Mapping[str, Any]) -> list[str]:
    """Problems that would only show after training: the schedule, the context, the episode length."""
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


def _candidates(s: GridSpec) -> list[tuple[dict[str, Any], bool]]:
    """The cells' own values, with "from the product": the product of the axes, then the explicit cells."""
    out: list[tuple[dict[str, Any], bool]] = []
    if s.axes:
        keys = list(s.axes)
        out += [(dict(zip(keys, combo)), True) for combo in itertools.product(*s.axes.values())]
    out += [(dict(c), False) for c in s.explicit]
    return out or [({}, False)]  # no axes, no cells: the base configuration is the one cell


def _split_values(s: GridSpec, values: Mapping[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """A cell's values as (Config overrides, SampleSettings fields)."""
    config_items = [f"{k}={fmt_value(v)}" for k, v in values.items()
                    if k != "schedule" and not k.startswith("sample.")]
    sample = dict(s.sample_base)
    for k, v in values.items():
        if k == "schedule":
            sample["schedule"] = v
        elif k.startswith("sample."):
            sample[k[len("sample."):]] = v
    return config_items, sample


def build_cells(s: GridSpec) -> tuple[list[Cell], list[str]]:
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


def share_context(cells: Sequence[Cell], sample_base: dict[str, Any]) -> None:
    """One context for every cell unless the grid sets it: the longest memory (rounded up to every chunk
    size), so all cells generate the same frames of the same episodes and their curves line up."""
    if sample_base.get("context") is not None or not cells:
        return
    chunk = math.lcm(*(c.config.model.frames_per_chunk for c in cells))
    context = max(c.config.default_context() for c in cells)
    context = -(-context // chunk) * chunk  # rounded up to a multiple of chunk
    sample_base["context"] = context
    for c in cells:
        if "sample.context" not in c.values:
            c.sample["context"] = context


def share_runs(cells: Sequence[Cell]) -> tuple[dict[str, TrainRun], list[str]]:
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
