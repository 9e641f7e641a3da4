"""Grid cells compared probe by probe: memory against the same weights with memory chosen another way.

    pairs = same_weight_pairs(rows)              # the first cell of each training run against its other cells
    pairs += named_pairs(rows, [("pose k4 prepend s2", "time m6 prepend s2")])   # any two cells, by label or name
    table = paired_rows(pairs, out)              # one row per pair: a - b on the same probes, first 4, 17-64
    pooled = pool_pairs(table)                   # one row per pair of configurations: mean over seeds

Every cell of a grid is scored on the same revisit probes of the same episodes (``arvdm.experiments.tradeoff``:
one common ``recent``), so two cells can be compared on each probe: ``a - b`` is the difference of the models'
PSNRs on the probes (dB), pooled over probes with an event-level 95% bootstrap interval
(``arvdm.evaluation.probes.paired_difference``); the copy-last baseline cancels. The pairs that need no naming are
the cells that share a training run, i.e. the same weights sampled another way (a pose-trained run rolled out
with memory chosen by time, by none, with history guidance, ...): the run's first cell in grid order is ``a``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from arvdm.evaluation.compare import compare_rollouts
from arvdm.evaluation.probes import paired_difference
from arvdm.evaluation.seeds import over_seeds, standard_error
from arvdm.experiments.cells import GridError
from arvdm.experiments.labels import pool_seeds

__all__ = ["PAIRED_COLUMNS", "PAIRED_NOTE", "POOLED_PAIR_COLUMNS", "named_pairs", "paired_rows", "pool_pairs",
           "same_weight_pairs"]

#: The columns of paired.csv / paired.md.
PAIRED_COLUMNS = ("a", "b", "difference", "lo", "hi", "probes", "events", "a_psnr", "b_psnr", "verdict",
                  "first4_diff", "first4_lo", "first4_hi", "f17_64_diff", "f17_64_lo", "f17_64_hi")
#: The spans of generated frames (0-based, end exclusive) paired beside the probes: column prefix -> (start, end).
SPAN_COLUMNS = {"first4": (0, 4), "f17_64": (16, 64)}
#: The columns of the pooled pairs (one row per pair of configurations).
POOLED_PAIR_COLUMNS = ("config", "seeds", "difference", "difference_lo", "difference_hi", "difference_by_seed",
                       "intervals_above_0",
                       "intervals_below_0", "first4_diff", "f17_64_diff", "f17_64_diff_by_seed")
#: What the paired table's columns mean (its header in results.md).
PAIRED_NOTE = (
    "a - b: the two cells' model PSNR on the same revisit probes (dB), pooled over probes, with its event-level 95% "
    "bootstrap interval [lo, hi]; a_psnr / b_psnr: each cell's mean over those probes; verdict: 'a > b' or "
    "'a < b' when the interval excludes 0, else 'no difference shown'; first4_ / f17_64_: a - b over the first 4 "
    "and over generated frames 17-64 (episodes resampled, frames pooled; blank without both rollouts). Cells that "
    "share a training run (same weights) are paired automatically, the run's first cell as a; more pairs with "
    "`report --pair A B`.")


def _usable(row: Mapping[str, Any]) -> bool:
    return row.get("status") == "done" and bool(row.get("_revisit_probes"))


def same_weight_pairs(rows: Sequence[Mapping[str, Any]]) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """(first cell, other cell) for every training run with several finished, scored cells, in grid order."""
    by_run: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if _usable(r) and r.get("train_run"):
            by_run.setdefault(r["train_run"], []).append(r)
    return [(members[0], other) for members in by_run.values() for other in members[1:]]


def named_pairs(rows: Sequence[Mapping[str, Any]], names: Sequence[tuple[str, str]]
                ) -> list[tuple[Mapping[str, Any], Mapping[str, Any]]]:
    """The cells named (by label or cell name) in each (a, b); GridError names a cell that is missing or unscored."""
    found = {key: r for r in rows for key in (r.get("label"), r.get("name")) if key}
    out = []
    for pair in names:
        cells = []
        for key in pair:
            if key not in found:
                raise GridError(f"--pair {key!r}: no such cell (labels: {', '.join(r['label'] for r in rows)})")
            if not _usable(found[key]):
                raise GridError(f"--pair {key!r}: the cell is not finished or has too few revisit events to pair")
            cells.append(found[key])
        out.append((cells[0], cells[1]))
    return out


def _span_columns(out: Path | None, a: Mapping[str, Any], b: Mapping[str, Any], n_boot: int,
                  seed: int) -> dict[str, Any]:
    """a - b over the SPAN_COLUMNS spans from the cells' rollout.npz (``compare_rollouts``); blank without them."""
    blank = {f"{k}_{part}": None for k in SPAN_COLUMNS for part in ("diff", "lo", "hi")}
    if out is None or not all((out / "cells" / r["name"] / "rollout.npz").is_file() for r in (a, b)):
        return blank
    spans = [(k, lo, hi) for k, (lo, hi) in SPAN_COLUMNS.items()]
    result = compare_rollouts(out / "cells" / a["name"], out / "cells" / b["name"], spans=spans, n_boot=n_boot,
                              seed=seed, revisits=False)
    cols = dict(blank)
    for r in result["spans"]:
        d = r["a_minus_b"]
        cols.update({f"{r['span']}_diff": d["mean"], f"{r['span']}_lo": d["lo"], f"{r['span']}_hi": d["hi"]})
    return cols


def _pair_row(a: Mapping[str, Any], b: Mapping[str, Any], n_boot: int, seed: int,
              out: Path | None = None) -> dict[str, Any]:
    pa, pb = a["_revisit_probes"], b["_revisit_probes"]
    if pa["b"] != pb["b"] or pa["t"] != pb["t"]:
        raise GridError(f"cells {a['label']!r} and {b['label']!r} were not scored on the same probes (other "
                        "episodes, frames or recent): they cannot be paired")
    d = paired_difference(pa["model"], pb["model"], np.asarray(pa["event"]), n_boot=n_boot, seed=seed)
    verdict = "a > b" if d["lo"] > 0 else "a < b" if d["hi"] < 0 else "no difference shown"
    same_seed = a.get("seed") == b.get("seed")
    return {"a": a["label"], "b": b["label"], "difference": d["mean"], "lo": d["lo"], "hi": d["hi"],
            "probes": len(pa["t"]), "events": len(set(pa["event"])), "a_psnr": d["mean_a"], "b_psnr": d["mean_b"],
            "verdict": verdict, "seed": a.get("seed") if same_seed else None,
            "config": f"{a.get('config')} - {b.get('config')}" if same_seed else None,
            **_span_columns(out, a, b, n_boot, seed)}


def paired_rows(pairs: Sequence[tuple[Mapping[str, Any], Mapping[str, Any]]], n_boot: int = 1000,
                seed: int = 0, out: str | os.PathLike | None = None) -> list[dict[str, Any]]:
    """One row per pair (``PAIRED_COLUMNS``, plus ``config`` and ``seed`` for pooling when both share a seed); with
    the grid folder ``out``, also a - b over the first 4 frames and frames 17-64 from the cells' rollouts."""
    return [_pair_row(a, b, n_boot, seed, None if out is None else Path(out)) for a, b in pairs]


def pool_pairs(table: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per pair of configurations (seeds pooled): the mean difference over seeds with its 95% Student-t
    interval over seeds (``arvdm.evaluation.seeds.over_seeds``, floored at the seeds' own standard errors; blank
    for one seed), each seed's, and in how many seeds the interval lies above / below 0."""
    pooled = pool_seeds(table, ("difference", "first4_diff", "f17_64_diff"))
    for row in pooled:
        members = [r for r in table if r.get("config") == row["config"]]
        over = over_seeds([r["difference"] for r in members], [standard_error(r) for r in members])
        row["difference_lo"], row["difference_hi"] = over["lo"], over["hi"]
        row["intervals_above_0"] = f"{sum(r['lo'] > 0 for r in members)} of {len(members)}"
        row["intervals_below_0"] = f"{sum(r['hi'] < 0 for r in members)} of {len(members)}"
    return pooled
