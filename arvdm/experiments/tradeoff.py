"""A finished cell's side of the memory trade-off: revisit gain at one common ``recent``, error accumulation, cost.

    recent = common_recent(cells)                                   # the grid's smallest memory length
    cols = revisit_columns(cell_dir, ev, recent, out)               # revisit_gain, _lo, _hi, probes, events, ...
    cols |= own_revisit_columns(ev) | error_columns(ev)
    cost = read_cost(out)                                           # cell -> ms per frame (benchmarks/grid_cost.py)

**Revisit gain** = model minus copy-last PSNR (dB) on the memory probes of the cell's rollout: generated
frames whose view an earlier frame shows and none of the ``recent`` frames before them does
(``arvdm.evaluation.revisit_score.revisit_score``), pooled over probes with an event-level 95% bootstrap
interval. ``sample.py`` scores each cell with recent = that run's own memory length, so cells with more
memory are scored on fewer, harder probes; here every cell is scored again at **one** ``recent`` (by default
the grid's smallest ``memory.length``), so all cells of a grid score the same probes of the same episodes.
The rollout comes from the cell's ``rollout.npz`` (uint8 ``real`` and ``fake``, context included); the poses
from the evaluation data set named in eval.json's ``settings`` (``data``, ``split``, the first ``episodes``
episodes in sorted order, cut to the rollout's frames). Probes are defined by pixels; the poses are passed as
``sample.py`` passes them (they label probes, they do not change the gain). A recomputation is cached in
``cells/<cell>/revisit_common.json`` (keyed by recent, poses and the npz's size and time).

**Error accumulation** comes from eval.json: ``max_psnr_decay``, and from its ``hold_up``: the model minus
context-mean PSNR over generated frames 17-64, the hold-up horizon (first span below context-mean) and the
spatial-gradient ratio over the spans starting in frames 65-120.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from arvdm.evaluation.compare import read_rollout  # re-exported: a cell's rollout.npz
from arvdm.evaluation.revisit_score import revisit_score
from arvdm.experiments.cells import GridError
from data.atomic import atomic_write_json
from data.dataset import list_episodes, resolve_split
from data.episodes import read_actions_pose

__all__ = ["COST_FILE", "common_recent", "error_columns", "eval_poses", "find_eval_data", "own_revisit_columns",
           "read_cost", "read_rollout", "revisit_columns", "span_mean"]

#: The cost table benchmarks/grid_cost.py writes into a grid folder (read by the report when present).
COST_FILE = "cost.csv"
#: The cache of a cell's common-recent revisit score.
CACHE_FILE = "revisit_common.json"
#: Generated frames (0-based, end exclusive) of the "holds up" column (frames 17-64) and the gradient column.
HOLD_FRAMES = (16, 64)
GRADIENT_FRAMES = (64, 120)


def common_recent(cells: Sequence[Mapping[str, Any]]) -> int:
    """The recent frames every cell is scored with: the smallest ``memory.length`` among the cells (>= 1)."""
    lengths = [int(c.get("values", {}).get("memory.length") or 0) for c in cells]
    return max(1, min(lengths, default=1))


def find_eval_data(ev: Mapping[str, Any], out: Path) -> Path | None:
    """The evaluation data folder of a cell, or None: eval.json's ``settings.data`` (else the run's ``data.path`` /
    ``abs_path``) as given, then relative to the grid folder ``out``, the run folder (``ev["run"]``) and each
    folder above them. ``ev`` may be any mapping with those keys (benchmarks/grid_cost.py builds one)."""
    settings, data_cfg = ev.get("settings") or {}, (ev.get("config") or {}).get("data") or {}
    given = [settings["data"]] if settings.get("data") else [data_cfg.get("path"), data_cfg.get("abs_path")]
    bases = [Path(out).resolve(), *Path(out).resolve().parents]
    if ev.get("run"):
        run = Path(ev["run"]).resolve()
        bases += [run, *run.parents]
    found = []
    for g in [Path(p).expanduser() for p in given if p]:
        found += [g] if g.is_absolute() else [g, *(b / g for b in bases)]
    return next((p for p in dict.fromkeys(found) if p.is_dir()), None)


def eval_poses(ev: Mapping[str, Any], out: Path, n_episodes: int, frames: int,
               data_root: str | os.PathLike | None = None) -> Tensor | None:
    """(B, T, 3) poses of the cell's evaluation episodes, or None when the data set or its poses are absent.

    The episodes are the first ``n_episodes`` of ``settings.split`` in sorted order (``load_validation_episodes``'
    order), every ``data.frame_skip``-th pose, cut to ``frames``; ``data_root`` overrides where the data is.
    """
    root = Path(data_root) if data_root is not None else find_eval_data(ev, out)
    if root is None or not root.is_dir():
        return None
    split = resolve_split(root, (ev.get("settings") or {}).get("split") or "validation")
    skip = int(((ev.get("config") or {}).get("data") or {}).get("frame_skip") or 1)
    paths = list_episodes(split)[:n_episodes]
    poses = []
    for p in paths:
        pose = read_actions_pose(p)[1]
        if pose is None:
            return None
        pose = pose[::skip][:frames]
        if len(pose) < frames:
            raise GridError(f"{p}: {len(pose)} poses, but the rollout has {frames} frames: is {split} the data "
                            "the cell was evaluated on? (pass the right --data)")
        poses.append(pose)
    if len(poses) < n_episodes:
        raise GridError(f"{split}: {len(poses)} episodes, but the rollout has {n_episodes}")
    return torch.from_numpy(np.stack(poses)).float()  # (B, T, 3)


def _score(cell_dir: Path, ev: Mapping[str, Any], recent: int, out: Path, data_root: Any) -> dict[str, Any]:
    """revisit_score of the cell's rollout at ``recent`` (with ``poses_found``), from the cache when fresh."""
    npz = cell_dir / "rollout.npz"
    real, fake = read_rollout(cell_dir)
    context = int(ev.get("context") or (ev.get("settings") or {}).get("context") or 0)
    if not 1 <= context < real.shape[1]:
        return {}  # no ground-truth context (or nothing generated): no copy-last to compare with
    poses = eval_poses(ev, out, real.shape[0], real.shape[1], data_root)
    st = npz.stat()
    key = {"recent": recent, "poses": poses is not None, "npz": [st.st_size, st.st_mtime_ns], "per_probe": True}
    cache = cell_dir / CACHE_FILE
    if cache.is_file():
        try:
            saved = json.loads(cache.read_text())
            if saved.get("key") == key:
                return saved["score"]
        except (ValueError, KeyError, TypeError):
            pass  # a damaged cache is recomputed
    score = revisit_score(fake[:, context:], real, context, recent=recent, poses=poses, per_probe=True)
    score["poses_found"] = poses is not None
    atomic_write_json(cache, {"key": key, "score": score})
    return score


def _gain_columns(score: Mapping[str, Any] | None, prefix: str) -> dict[str, Any]:
    """Gain (model - copy-last, dB) with its interval, probes and events of a revisit_score result."""
    score = score or {}
    diff = score.get("model_minus_copy_last") or {}
    return {f"{prefix}_gain": diff.get("mean"), f"{prefix}_gain_lo": diff.get("lo"),
            f"{prefix}_gain_hi": diff.get("hi"), f"{prefix}_probes": score.get("probes"),
            f"{prefix}_events": score.get("events"), f"{prefix}_recent": score.get("recent")}


def revisit_columns(cell_dir: Path, ev: Mapping[str, Any], recent: int, out: Path,
                    data_root: str | os.PathLike | None = None) -> dict[str, Any]:
    """``revisit_gain`` / ``_lo`` / ``_hi`` / ``_probes`` / ``_events`` / ``_recent``, the three PSNRs behind
    it (``revisit_model``, ``revisit_copy_last``, ``revisit_oracle``), ``revisit_closes`` and
    ``revisit_poses`` (1 when the evaluation poses were found); blank without ``rollout.npz``. Gain and
    interval are blank when the probes fall in fewer than ``MIN_EVENTS`` events. The internal ``_revisit_probes`` holds
    every probe's episode, frame, event and model PSNR (``revisit_score(per_probe=True)``), else None."""
    cell_dir = Path(cell_dir)
    if not (cell_dir / "rollout.npz").is_file():
        return _gain_columns(None, "revisit")
    score = _score(cell_dir, ev, recent, Path(out), data_root)
    cols = _gain_columns(score, "revisit")
    cols.update({f"revisit_{k}": (score.get(k) or {}).get("mean") for k in ("model", "copy_last", "oracle")})
    cols.update(revisit_closes=score.get("closes"), revisit_poses=int(bool(score.get("poses_found"))))
    cols["_revisit_probes"] = score.get("per_probe")  # for pairing cells probe by probe (arvdm.experiments.paired)
    return cols


def own_revisit_columns(ev: Mapping[str, Any]) -> dict[str, Any]:
    """The cell's own revisit score as sample.py wrote it (recent = its memory length): ``own_gain`` etc."""
    return _gain_columns(ev.get("revisits"), "own")


def span_mean(spans: Sequence[Mapping[str, Any]], lo: int, hi: int, key: str = "mean") -> float | None:
    """Frame-weighted mean of ``key`` over the spans that start in [lo, hi) (weights ``n_frames`` or ``n``)."""
    total = weight = 0.0
    for s in spans or []:
        v, n = s.get(key), s.get("n_frames", s.get("n", 1))
        if lo <= s.get("start", -1) < hi and v is not None and math.isfinite(v) and n:
            total, weight = total + v * n, weight + n
    return total / weight if weight else None


def error_columns(ev: Mapping[str, Any]) -> dict[str, Any]:
    """``psnr17_64_minus_ctx`` (model minus context-mean over generated frames 17-64, dB), ``hold_up_horizon``
    (the first span below context-mean, "never", or blank without ``hold_up``) and ``grad_ratio_65_120``."""
    hold = ev.get("hold_up")
    if not hold:
        return {"psnr17_64_minus_ctx": None, "hold_up_horizon": None, "grad_ratio_65_120": None}
    horizon = hold.get("hold_up_horizon")
    return {"psnr17_64_minus_ctx": span_mean((hold.get("psnr_minus") or {}).get("context_mean"), *HOLD_FRAMES),
            "hold_up_horizon": "never" if horizon is None else horizon.get("label"),
            "grad_ratio_65_120": span_mean(hold.get("gradient_ratio_by_span"), *GRADIENT_FRAMES)}


def read_cost(out: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Cell -> {"ms_per_frame", "ms_min", "ms_max", "cost_ratio"} from ``OUT/cost.csv``; {} without the file."""
    path = Path(out) / COST_FILE
    if not path.is_file():
        return {}
    cost = {}
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            try:
                cost[r["cell"]] = {k: float(r[c]) for k, c in (("ms_per_frame", "ms_per_frame"),
                                                               ("ms_min", "ms_min"), ("ms_max", "ms_max"),
                                                               ("cost_ratio", "ratio"))}
            except (KeyError, TypeError, ValueError) as e:
                raise GridError(f"{path}: not a table written by benchmarks/grid_cost.py ({e})") from None
    return cost
