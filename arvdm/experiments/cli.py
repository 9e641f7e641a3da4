"""Experiment grids from the command line: train and evaluate many configurations, then tabulate and plot.

    python -m arvdm.experiments pareto --grid tiny                 # the CPU grid (benchmarks/RESULTS.md: time)
    python -m arvdm.experiments pareto --grid paper --out experiments/paper
    python -m arvdm.experiments pareto --grid my_grid.yaml --only 'prepend-*' --dry-run
    python -m arvdm.experiments report --out experiments/tiny      # tables and plots from finished cells
    python -m arvdm.experiments report --out experiments/memory --recent 3   # revisit gain scored at recent 3

The grid language is arvdm.experiments.grid, the runner arvdm.experiments.runner, the tables and plots
arvdm.experiments.report; the grid format and the output folder are described in docs/experiments.md.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from arvdm.errors import USER_ERRORS
from arvdm.experiments.grid import GridError, available_grids, load_grid
from arvdm.experiments.report import write_report
from arvdm.experiments.runner import run_grid
from arvdm.runtime import setup_environment

__all__ = ["main"]


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
    rep.add_argument("--recent", type=int, help="recent frames of the common revisit score (default: the grid's "
                                                "smallest memory.length)")
    rep.add_argument("--data", help="folder of the evaluation episodes (default: found from eval.json's settings)")
    rep.add_argument("--pair", nargs=2, action="append", default=[], metavar=("A", "B"),
                     help="also compare cells A and B (labels or names) probe by probe, A - B (paired.md); cells "
                          "that share a training run are paired anyway")
    for q in (run, rep):
        q.add_argument("--paper-reference", dest="paper_reference", action="store_true", default=None,
                       help="overlay the paper's numbers on the plots")
        q.add_argument("--no-paper-reference", dest="paper_reference", action="store_false")
    return p


def _run(args: argparse.Namespace) -> dict | None:
    grid = load_grid(args.grid) if args.grid else None
    if args.out is None and grid is None:
        raise GridError("report: give --out (the grid's output folder) or --grid")
    out = Path(args.out) if args.out else Path("experiments") / grid.name
    if grid is not None and args.paper_reference is not None:
        grid.paper_reference = args.paper_reference
    if args.command == "report":
        if args.recent is not None and args.recent < 1:
            raise GridError(f"--recent {args.recent}: must be an integer >= 1 (frames the model sees directly)")
        if args.data is not None and not Path(args.data).is_dir():
            raise GridError(f"--data {args.data}: folder does not exist")
        write_report(out, grid, paper_reference=args.paper_reference, recent=args.recent, data_root=args.data,
                     pairs=[tuple(p) for p in args.pair])
        return None
    return run_grid(grid, out, only=args.only, dry_run=args.dry_run, device=args.device,
                    fail_fast=args.fail_fast)


def main(argv: Sequence[str] | None = None) -> int:
    setup_environment()  # for a caller of main(); `python -m arvdm.experiments` set it before torch loaded
    args = _parser().parse_args(argv)
    try:
        result = _run(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; finished cells and checkpoints are kept: run the same command again to resume",
              file=sys.stderr)
        return 130
    if result and result["failed"]:
        print(f"{len(result['failed'])} cell(s) failed:", file=sys.stderr)
        for name, msg in result["failed"].items():
            print(f"  {name}: {msg}", file=sys.stderr)
        return 1
    return 0
