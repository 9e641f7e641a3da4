"""Reading a grid spec (the parsed YAML): every section's keys and values checked, into a `GridSpec`.

    spec = read_spec(yaml.safe_load(text))      # after check_top(spec, name, path)

Contract: a malformed section raises `GridError` naming the key and what is wrong; what comes out is only
checked keys in canonical form (``sample.schedule`` -> ``schedule``). Building the cells from a GridSpec is
``arvdm.experiments.expand``; the language itself is described in ``arvdm.experiments.grid``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arvdm.config import Config, ConfigError, apply_overrides, get_preset
from arvdm.experiments.cells import MEMORY_KEYS, GridError
from arvdm.sample_settings import SampleSettings

__all__ = ["RUNNER_SAMPLE_FIELDS", "GridSpec", "check_top", "fmt_value", "name_part", "read_report", "read_spec"]

_TOP_KEYS = ("name", "description", "base", "sample", "axes", "exclude", "cells", "report")
_BASE_KEYS = ("preset", "set")
_REPORT_KEYS = ("paper_reference",)
#: The preset a grid's base starts from when it names none.
DEFAULT_PRESET = "tiny"
#: SampleSettings fields the runner sets itself: every cell is evaluated, quietly (the grid has its own bar).
RUNNER_SAMPLE_FIELDS = ("evaluate", "progress")
_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.+]+")


@dataclass
class GridSpec:
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


def fmt_value(value: Any) -> str:
    """A YAML value as the right-hand side of a ``key=value`` override (apply_overrides parses JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


def name_part(value: Any) -> str:
    """A value as a file-system safe part of a name (runs of other characters become one '_')."""
    s = _NAME_UNSAFE.sub("_", str(value)).strip("_")
    return s or "x"


def _sample_fields() -> dict[str, Any]:
    """SampleSettings' fields and their defaults."""
    return {f.name: f.default for f in dataclasses.fields(SampleSettings)}


def _normalise_key(key: Any, where: str, sample_fields: Mapping[str, Any], preset: str) -> str:
    """Check an axis / cell / exclude key and return its canonical form (``sample.schedule`` -> ``schedule``)."""
    if not isinstance(key, str):
        raise GridError(f"{where}: key {key!r} must be a string like memory.length, schedule or sample.steps")
    if key in ("schedule", "sample.schedule"):
        return "schedule"
    if key.startswith("sample."):
        name = key[len("sample."):]
        if name in RUNNER_SAMPLE_FIELDS:
            raise GridError(f"{where}: {key} is set by the experiment runner and cannot be varied")
        if name not in sample_fields:
            raise GridError(f"{where}: unknown sampling key {key!r}; SampleSettings has {sorted(sample_fields)}")
        return key
    try:  # a config key: setting it to its preset value runs the Config's own check (names the section's keys)
        section, _, attr = key.partition(".")
        current = getattr(getattr(get_preset(preset), section, None), attr, 0) if attr else 0
        apply_overrides(get_preset(preset), [f"{key}={fmt_value(current)}"])
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
        items = [f"{k}={fmt_value(_scalar(v, f'base.set.{k}'))}" for k, v in raw.items()]
    elif isinstance(raw, list) and all(isinstance(s, str) and "=" in s for s in raw):
        items = list(raw)
    else:
        raise GridError("base.set: expected a mapping (train.max_steps: 500) or a list of 'key=value' strings")
    try:
        apply_overrides(get_preset(preset), items)
    except ConfigError as e:
        raise GridError(f"base.set: {e}") from None
    return items


def check_top(spec: Any, name: str, path: Path | None) -> tuple[str, str]:
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
    if name_part(name) != name:
        raise GridError(f"{where}: name {name!r} may only hold letters, digits, '_', '.', '+'")
    return name, where


def _read_base(spec: Mapping[str, Any]) -> tuple[str, list[str], Config]:
    """(preset, base overrides, base Config) from the ``base`` section."""
    base = _as_mapping(spec.get("base"), "base")
    bad = [k for k in base if k not in _BASE_KEYS]
    if bad:
        raise GridError(f"base: unknown key(s) {bad}; allowed: {list(_BASE_KEYS)}")
    preset = base.get("preset", DEFAULT_PRESET)
    try:
        base_cfg = get_preset(preset)
    except ConfigError as e:
        raise GridError(f"base.preset: {e}") from None
    base_set = _base_overrides(base, preset)
    return preset, base_set, apply_overrides(base_cfg, base_set)


def _read_sample(spec: Mapping[str, Any], sample_fields: Mapping[str, Any]) -> dict[str, Any]:
    """SampleSettings defaults overridden by the ``sample`` section (runner-owned fields excluded)."""
    sample_base = {k: v for k, v in sample_fields.items() if k not in RUNNER_SAMPLE_FIELDS}
    for key, value in _as_mapping(spec.get("sample"), "sample").items():
        if key in RUNNER_SAMPLE_FIELDS:
            raise GridError(f"sample.{key}: set by the experiment runner (every cell is evaluated); remove it")
        if key not in sample_fields:
            raise GridError(f"sample.{key}: unknown sampling setting; SampleSettings has {sorted(sample_base)}")
        sample_base[key] = _scalar(value, f"sample.{key}")
    return sample_base


def _read_axes(spec: Mapping[str, Any], sample_fields: Mapping[str, Any], preset: str) -> dict[str, list[Any]]:
    """The ``axes`` section: canonical key -> non-empty list of scalar values."""
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


def read_report(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The ``report`` section (``paper_reference``)."""
    report = _as_mapping(spec.get("report"), "report")
    bad = [k for k in report if k not in _REPORT_KEYS]
    if bad:
        raise GridError(f"report: unknown key(s) {bad}; allowed: {list(_REPORT_KEYS)}")
    return report


def read_spec(spec: Mapping[str, Any]) -> GridSpec:
    """The base, sample, axes, exclude and cells sections, checked; ``varying`` lists the keys that vary
    beyond the memory keys and the schedule (they get a table column and a part in the cell names)."""
    preset, base_set, base_cfg = _read_base(spec)
    sample_fields = _sample_fields()
    s = GridSpec(preset, base_set, base_cfg, sample_fields, _read_sample(spec, sample_fields),
                 _read_axes(spec, sample_fields, preset), _read_rules(spec, "exclude", sample_fields, preset),
                 _read_rules(spec, "cells", sample_fields, preset))
    s.varying = [k for k in dict.fromkeys(list(s.axes) + [k for c in s.explicit for k in c])
                 if k not in MEMORY_KEYS and k != "schedule"]
    return s
