"""Short readable labels for a grid's cells, and their seeds pooled into one row per configuration.

    labels = cell_labels(cells)          # cell name -> CellLabel("pose k4 prepend +noise100 ctx20 s1", ...)
    pooled = pool_seeds(rows, ["revisit_gain", "max_psnr_decay"])   # one row per configuration

Cell names spell out every varying key and grow long; a label says the same in a few words, built from the
cell's ``values`` (the keys a results table shows), never from its name. Only keys whose value differs
between the cells appear. Known keys read as:

- ``memory.select`` (+ ``sample.memory_select``): ``pose``, ``time``, or ``pose->time`` for a pose-trained
  run rolled out with another selection;
- how much memory: ``k<pose_frames>`` for pose selection, ``m<length>`` for time selection;
- ``memory.structure``: ``prepend``, ``concat``, ``xattn``; compression: ``raw`` or ``joint8``;
- the error-accumulation levers, only when on: ``+noise<max>`` (train.context_noise_max),
  ``ctx<level>`` (sample.context_level), ``+drop<p>`` (train.memory_dropout), ``hg<W>``
  (sample.history_guidance), ``anchor<σ>`` / ``floor<level>`` (sample.anchor_sigma / anchor_floor); the sampling
  settings whose None means "the run's own" (RUN_DEFAULT_LEVERS) read as nothing only when None, so an explicit
  0 (``ctx0``, ``anchor0``: switched off for a run that has it on) differs from the run's default;
- switches the main job has on, only when off: ``-lastframe`` (model.last_frame_input false), ``-advect``
  (model.action_advection 0), ``-gate`` (model.copy_gate off; its loss keys go with it and read as nothing),
  ``-anchor`` (diffusion.anchor_sigma 0, the run's sampling anchor; its floor reads as nothing);
- ``train.seed`` last, as ``s<seed>``; the label without it is the cell's **configuration**, the unit over
  which ``pool_seeds`` averages;
- any other varying key as ``<last part of the key><value>``, like the cell names.
Two cells that would read alike get ``#2``, ``#3`` appended, so labels are unique within a grid.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SEED_KEYS", "CellLabel", "cell_labels", "label_parts", "pool_seeds", "varying_keys"]

#: Keys whose cells are repeats of one configuration (pooled by `pool_seeds`).
SEED_KEYS = ("train.seed",)
#: Short names of the memory structures.
STRUCTURE_SHORT = {"prepend": "prepend", "channel_concat": "concat", "cross_attention": "xattn"}
#: Keys the memory part of a label reads together (selection, amount, structure, compression).
MEMORY_PART_KEYS = ("memory.select", "sample.memory_select", "memory.pose_frames", "memory.length",
                    "memory.structure", "memory.budget", "memory.compressor")
#: Switch-like keys: shown only when on (value not 0 / None / False), as prefix + value.
LEVERS = {"train.context_noise_max": "+noise", "sample.context_level": "ctx", "train.memory_dropout": "+drop",
          "sample.history_guidance": "hg", "sample.anchor_sigma": "anchor", "sample.anchor_floor": "floor"}
#: Sampling levers whose None is the run's own setting (which may be on): any value set, 0 included, is shown.
RUN_DEFAULT_LEVERS = ("sample.context_level", "sample.anchor_sigma", "sample.anchor_floor")
#: Switches `tiny` has on: shown only when a cell turns them off, as this text.
OFF_SWITCHES = {"model.last_frame_input": "-lastframe", "model.action_advection": "-advect", "model.copy_gate": "-gate",
                "train.copy_gate_loss": "", "train.copy_gate_detach": "", "diffusion.anchor_sigma": "-anchor",
                "diffusion.anchor_floor": ""}


@dataclass(frozen=True)
class CellLabel:
    """A cell's label, its configuration (the label without the seed) and its seed text ('' if none)."""

    label: str
    config: str
    seed: str


def _fmt(value: Any) -> str:
    """A value in a label: 1.0 -> '1', 0.1 -> '0.1', strings as they are."""
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:g}"
    return str(value)


def _is_on(value: Any) -> bool:
    return value not in (None, False, 0, 0.0, "", "none", "off")


def varying_keys(values: Iterable[Mapping[str, Any]]) -> list[str]:
    """Keys whose value differs between the given cells' values (a key some cells lack counts as varying)."""
    rows = list(values)
    keys = list(dict.fromkeys(k for v in rows for k in v))
    return [k for k in keys if len({repr(v.get(k)) for v in rows}) > 1]


def _memory_parts(values: Mapping[str, Any], varying: set[str]) -> list[str]:
    """Selection, amount, structure and compression, each when some key behind it varies."""
    parts = []
    select = values.get("memory.select", "time")
    override = values.get("sample.memory_select")
    if varying & {"memory.select", "sample.memory_select"}:
        parts.append(f"{select}->{override}" if override not in (None, select) else str(select))
    if varying & {"memory.select", "memory.pose_frames", "memory.length"}:
        parts.append(f"k{values.get('memory.pose_frames')}" if select == "pose" else f"m{values.get('memory.length')}")
    if "memory.structure" in varying:
        s = values.get("memory.structure")
        parts.append(STRUCTURE_SHORT.get(s, str(s)))
    if varying & {"memory.budget", "memory.compressor"}:
        comp, budget = values.get("memory.compressor", "none"), values.get("memory.budget", 0)
        parts.append("raw" if comp in (None, "none") else f"{comp}{budget}")
    return parts


def label_parts(values: Mapping[str, Any], varying: Iterable[str]) -> tuple[list[str], list[str]]:
    """(configuration parts, seed parts) of one cell's label, given the keys that vary in its grid."""
    vary = set(varying)
    config = _memory_parts(values, vary)
    seeds = []
    for key in [k for k in values if k in vary and k not in MEMORY_PART_KEYS]:
        v = values[key]
        if key in SEED_KEYS:
            seeds.append(f"s{_fmt(v)}")
        elif key in LEVERS:
            if _is_on(v) or (key in RUN_DEFAULT_LEVERS and v is not None):
                config.append(f"{LEVERS[key]}{_fmt(v)}")
        elif key in OFF_SWITCHES:
            if not _is_on(v) and OFF_SWITCHES[key]:
                config.append(OFF_SWITCHES[key])
        elif key == "schedule":
            config.append(str(v))
        else:
            config.append(f"{key.rsplit('.', 1)[-1]}{_fmt(v)}")
    return config, seeds


def cell_labels(cells: Sequence[Mapping[str, Any]]) -> dict[str, CellLabel]:
    """Cell name -> CellLabel for cells given as dicts with ``name`` and ``values`` (``Cell.to_dict()``,
    plan.json's cells or a cell.json). Labels are unique: repeats get ``#2``, ``#3``, ..."""
    vary = varying_keys(c.get("values", {}) for c in cells)
    out: dict[str, CellLabel] = {}
    seen: dict[str, int] = {}
    for c in cells:
        config, seeds = label_parts(c.get("values", {}), vary)
        label = " ".join(config + seeds) or "base"
        seen[label] = seen.get(label, 0) + 1
        if seen[label] > 1:  # two cells read alike (a varying key whose values all read as "off")
            label, config = f"{label} #{seen[label]}", config + [f"#{seen[label]}"]
        out[c["name"]] = CellLabel(label, " ".join(config) or "base", " ".join(seeds))
    return out


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def pool_seeds(rows: Sequence[Mapping[str, Any]], columns: Sequence[str]) -> list[dict[str, Any]]:
    """One row per configuration (``row["config"]``), in first-seen order: ``config``, ``seeds`` (the seed
    texts that have a value), and for each column its mean over seeds and ``<column>_by_seed``, every seed's
    value in seed order ("0.52 / 0.31"; blank where a seed has none). Rows without ``config`` are skipped."""
    groups: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r.get("config") is not None:
            groups.setdefault(r["config"], []).append(r)
    out = []
    for config, members in groups.items():
        members = sorted(members, key=lambda r: str(r.get("seed") or ""))
        row: dict[str, Any] = {"config": config, "seeds": " ".join(str(r.get("seed") or "-") for r in members)}
        for col in columns:
            vals = [r.get(col) for r in members]
            nums = [float(v) for v in vals if isinstance(v, (int, float)) and math.isfinite(v)]
            row[col] = _mean(nums)
            row[f"{col}_by_seed"] = " / ".join("" if not isinstance(v, (int, float)) else f"{v:.3g}" for v in vals)
        out.append(row)
    return out
