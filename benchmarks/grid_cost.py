"""Rollout cost per generated frame of every trained run of a grid, measured side by side -> OUT/cost.csv.

    python benchmarks/grid_cost.py --grid-out experiments/memory                # 1 thread, 16 context + 32 frames
    python benchmarks/grid_cost.py --grid-out experiments/memory --cells '*seed0*' --repeats 5 --reference NAME

For each cell of a grid folder whose training run has a checkpoint: load the run's weights, take the first
episode of the cell's evaluation data (its ``sample.data`` / ``split``, else the run's own data; ``--data``
overrides), and roll it out (``arvdm.sampling.roll_out_episodes``, batch 1) from ``--context`` ground-truth frames
for ``--frames`` frames with the cell's own sampling settings (schedule, steps, memory selection, context level,
history guidance: a guided rollout calls the network twice per row). Cells with the same run and the same
cost-relevant settings share one timing. The rollouts are timed round-robin (every variant once per round,
``--warmup`` untimed rounds, ``--repeats`` timed ones), so a busy stretch of a shared machine hits them all
alike; per variant the median, min and max of seconds / frames, and the median's ratio to the reference cell's.
``cost.csv`` (cell, train_run, label, ms_per_frame, ms_min, ms_max, ratio, timed_as, reference, repeats, frames,
context, threads, device) is what ``python -m arvdm.experiments report`` reads into its ``ms_per_frame`` column
and its revisit-gain-vs-cost plot. Run it when the grid has finished training, not beside it: it measures wall time.
"""

from __future__ import annotations

import argparse
import csv
import fnmatch
import io
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python benchmarks/grid_cost.py` from the repo root

from arvdm.config import parse_device  # noqa: E402
from arvdm.errors import USER_ERRORS  # noqa: E402
from arvdm.experiments.cells import GridError  # noqa: E402
from arvdm.experiments.labels import cell_labels  # noqa: E402
from arvdm.experiments.results import cells_for_report  # noqa: E402
from arvdm.experiments.tradeoff import COST_FILE, find_eval_data  # noqa: E402
from arvdm.model.checkpoint import latest_checkpoint  # noqa: E402
from arvdm.pipeline.runs import load_for_inference, load_validation_episodes  # noqa: E402
from arvdm.sample_settings import SampleSettings  # noqa: E402
from arvdm.sampling import roll_out_episodes  # noqa: E402
from arvdm.schedules.presets import get_schedule  # noqa: E402
from benchmarks.common import interleaved, median, print_table, set_threads  # noqa: E402
from data.atomic import atomic_write_text  # noqa: E402

#: Sampling settings that change what a rollout computes (cells equal on these and the run share a timing).
COST_KEYS = ("schedule", "steps", "eta", "use_cache", "context_level", "history_guidance", "memory_select")
COLUMNS = ("cell", "train_run", "label", "ms_per_frame", "ms_min", "ms_max", "ratio", "timed_as", "reference",
           "repeats", "frames", "context", "threads", "device")


def select(cells: list[dict[str, Any]], out: Path, patterns: Sequence[str] | None) -> tuple[list[dict], list[str]]:
    """(cells to time, lines about those left out): matching ``patterns`` (cell or run names) and trained."""
    chosen = [c for c in cells if not patterns or any(fnmatch.fnmatchcase(c["name"], p)
                                                      or fnmatch.fnmatchcase(str(c.get("train_run")), p)
                                                      for p in patterns)]
    if patterns and not chosen:
        raise GridError(f"--cells {list(patterns)} matches no cell of {out}")
    timed, skipped = [], []
    for c in chosen:
        run = c.get("train_run")
        if run is None or latest_checkpoint(out / "runs" / run) is None:
            skipped.append(f"{c['name']}: run {run} has no checkpoint yet")
        else:
            timed.append(c)
    if not timed:
        raise GridError(f"{out}: no selected cell has a trained run (runs/<run>/checkpoints/)")
    return timed, skipped


def variant_key(cell: dict[str, Any]) -> str:
    """The run plus the cost-relevant sampling settings of a cell, as one string."""
    sample = cell.get("sample") or {}
    return json.dumps([cell["train_run"], {k: sample.get(k) for k in COST_KEYS}], sort_keys=True, default=str)


def make_rollout(cell: dict[str, Any], out: Path, args: argparse.Namespace, models: dict[str, Any]
                 ) -> Callable[[], Any]:
    """A no-argument function that rolls the cell's first evaluation episode out with its settings."""
    run = cell["train_run"]
    run_dir = out / "runs" / run
    if run not in models:
        models[run] = load_for_inference(run_dir, device=args.device)
    model, cfg = models[run]
    sample = cell.get("sample") or {}
    root = Path(args.data) if args.data else find_eval_data({"settings": sample, "config": cfg.to_dict(),
                                                             "run": str(run_dir)}, out)
    if root is None:
        raise GridError(f"cell {cell['name']}: its evaluation data ({sample.get('data') or cfg.data.path}) was not "
                        "found; pass --data DIR")
    real, actions, poses = load_validation_episodes(root, cfg, 1, args.context, args.frames,
                                                    split=sample.get("split") or "validation")
    # as sample_run: "None = the run's" settings (eta, k_ctx, the anchor) filled from the run's config
    settings = SampleSettings(schedule=sample.get("schedule", "chunked"), steps=sample.get("steps", 20), batch_size=1,
                              episodes=1, eta=sample.get("eta"), use_cache=sample.get("use_cache", True),
                              context_level=sample.get("context_level"), progress=False,
                              history_guidance=sample.get("history_guidance") or 0.0,
                              memory_select=sample.get("memory_select"), anchor_sigma=sample.get("anchor_sigma"),
                              anchor_floor=sample.get("anchor_floor")).with_run_defaults(cfg)
    schedule = get_schedule(settings.schedule, cfg.train.window, cfg.diffusion.num_levels, settings.steps,
                            context_level=settings.context_level)
    model.check_schedule(schedule.delta, schedule.window)
    dev = parse_device(args.device)

    @torch.no_grad()
    def roll() -> Any:
        return roll_out_episodes(model, cfg, schedule, real, actions, args.context, settings, dev, poses)[0]

    return roll


def measure(cells: list[dict[str, Any]], out: Path, args: argparse.Namespace, labels: dict[str, Any]
            ) -> list[dict[str, Any]]:
    """One row per cell: the interleaved timings of its variant, per generated frame, and the ratio
    (``labels``: ``cell_labels`` of the whole grid, so a label reads as in the report)."""
    models: dict[str, Any] = {}
    first_of: dict[str, str] = {}  # variant -> the first cell that has it (the one timed)
    fns = {}
    for c in cells:
        key = variant_key(c)
        if key not in first_of:
            first_of[key] = c["name"]
            fns[c["name"]] = make_rollout(c, out, args, models)
    times = interleaved(fns, repeats=args.repeats, warmup=args.warmup)  # timed cell -> [seconds, ...]
    ms = {name: [1e3 * s / args.frames for s in secs] for name, secs in times.items()}
    ref_cell = args.reference or cells[0]["name"]
    ref_of = {c["name"]: first_of[variant_key(c)] for c in cells}
    if ref_cell not in ref_of:
        raise GridError(f"--reference {ref_cell}: not among the timed cells {sorted(ref_of)}")
    ref = median(ms[ref_of[ref_cell]])
    rows = []
    for c in cells:
        t = ms[ref_of[c["name"]]]
        rows.append({"cell": c["name"], "train_run": c["train_run"], "label": labels[c["name"]].label,
                     "ms_per_frame": median(t), "ms_min": min(t), "ms_max": max(t), "ratio": median(t) / ref,
                     "timed_as": ref_of[c["name"]], "reference": int(c["name"] == ref_cell), "repeats": args.repeats,
                     "frames": args.frames, "context": args.context, "threads": torch.get_num_threads(),
                     "device": args.device})
    return rows


def write_cost_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(rows)
    return atomic_write_text(path, buf.getvalue())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--grid-out", required=True, help="the grid's output folder (plan.json or cells/, runs/)")
    p.add_argument("--cells", nargs="+", metavar="PATTERN", help="only these cells / runs (shell patterns)")
    p.add_argument("--context", type=int, default=16, help="ground-truth frames before the timed rollout")
    p.add_argument("--frames", type=int, default=32, help="generated frames per timed rollout")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: comparable on a shared CPU)")
    p.add_argument("--reference", help="cell whose median is ratio 1 (default: the first timed cell)")
    p.add_argument("--data", help="folder of the evaluation episodes (default: each cell's sample.data)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--csv", help=f"where to write the table (default GRID_OUT/{COST_FILE})")
    args = p.parse_args(argv)
    for flag, value, lo in (("--context", args.context, 1), ("--frames", args.frames, 1),
                            ("--repeats", args.repeats, 1), ("--warmup", args.warmup, 0),
                            ("--threads", args.threads, 1)):
        if value < lo:
            p.error(f"{flag} must be >= {lo}, got {value}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.grid_out)
    try:
        if not out.is_dir():
            raise GridError(f"--grid-out {out}: folder does not exist")
        set_threads(args.threads)
        cells, _, _ = cells_for_report(out, None)
        timed, skipped = select(cells, out, args.cells)
        for line in skipped:
            print(f"skipped {line}", file=sys.stderr)
        rows = measure(timed, out, args, cell_labels(cells))
    except USER_ERRORS as e:
        print(f"grid_cost: error: {e}", file=sys.stderr)
        return 2
    path = write_cost_csv(rows, Path(args.csv) if args.csv else out / COST_FILE)
    print_table(["label", "ms/frame (median)", "min-max", "ratio", "timed as"],
                [[r["label"], f"{r['ms_per_frame']:.2f}", f"{r['ms_min']:.2f}-{r['ms_max']:.2f}", f"{r['ratio']:.3f}x",
                  "" if r["timed_as"] == r["cell"] else r["timed_as"][:40]] for r in rows],
                title=f"rollout cost per generated frame: {args.context} context + {args.frames} generated, batch 1, "
                      f"{rows[0]['threads']} thread(s), {args.device}, median of {args.repeats} interleaved rounds")
    print(f"-> {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
