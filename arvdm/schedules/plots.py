"""Pictures of scheduling matrices, and the ``python -m arvdm.schedules`` CLI.

    python -m arvdm.schedules --plot docs/schedules.png [--window 4 --steps 8]   # the three presets
    python -m arvdm.schedules --show fifo --window 4 --steps 8                   # a matrix and its init stage
    plot_schedule(schedule, "mine.png")                                          # any schedule

The matrices are arvdm.schedules.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from arvdm.errors import USER_ERRORS
from arvdm.schedules.matrix import ARSchedule
from arvdm.schedules.presets import PRESETS, get_schedule
from data.atomic import atomic_write

__all__ = ["main", "plot_presets", "plot_schedule"]


# ---------------------------------------------------------------------------------------------------
# plots
# ---------------------------------------------------------------------------------------------------
def plot_schedule(schedule: ARSchedule, path: str | os.PathLike | None = None, *, n_frames: int | None = None,
                  axes: Any = None):
    """Draw a schedule: the AR-step matrix S (left) and a rollout timeline (right); colour = noise level.

    Left: rows m = 0..M (down) × window frames j, numbers in the cells. Right: every model call of a
    rollout of ``n_frames`` frames (default 3 windows) down the page × absolute frame index; grey = not yet
    in the window, white = finished and committed to memory. Returns the figure; saves it when ``path``.
    """
    import matplotlib

    if path is not None and axes is None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    K = schedule.num_levels
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="#d9d9d9")  # bad (nan) = not yet in the window
    if axes is None:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), gridspec_kw={"width_ratios": [1, 2.2]},
                                 layout="constrained")
    else:
        fig = axes[0].figure
    ax0, ax1 = axes
    S = schedule.matrix
    im = ax0.imshow(S, cmap=cmap, vmin=0, vmax=K, aspect="auto", interpolation="nearest")
    if S.size <= 160:
        for (m, j), v in np.ndenumerate(S):
            ax0.text(j, m, str(v), ha="center", va="center", fontsize=7,
                     color="white" if v < 0.6 * K else "black")
    ax0.set_title(f"{schedule.name}: AR step S (M={schedule.num_steps}, Δ={schedule.delta})", fontsize=10)
    ax0.set_xlabel("window frame j")
    ax0.set_ylabel("row m (denoising call)")
    ax0.set_xticks(range(schedule.window))
    ax0.set_yticks(range(0, S.shape[0], max(1, S.shape[0] // 8)))

    n_frames = n_frames or 3 * schedule.window
    tl = schedule.timeline(n_frames)  # (calls+1, frames)
    shown = np.ma.masked_invalid(np.where(tl < 0, np.nan, tl))
    done = np.where(tl < 0, 1.0, np.nan)  # committed frames: drawn white on top
    ax1.imshow(shown, cmap=cmap, vmin=0, vmax=K, aspect="auto", interpolation="nearest")
    ax1.imshow(np.ma.masked_invalid(done), cmap=matplotlib.colors.ListedColormap(["white"]), aspect="auto",
               interpolation="nearest")
    M, Mi = schedule.num_steps, schedule.init_steps
    if Mi:
        ax1.axhline(Mi - 0.5, color="red", lw=1.2)
        ax1.text(tl.shape[1] - 0.6, Mi / 2 - 0.5, "init stage", color="red", ha="right", va="center", fontsize=8)
    for a in range(1, schedule.num_ar_steps(n_frames)):
        ax1.axhline(Mi + a * M - 0.5, color="white", lw=0.8, ls="--")
    ax1.set_title(f"{schedule.name}: rollout of {n_frames} frames, {schedule.num_calls(n_frames)} model calls",
                  fontsize=10)
    ax1.set_xlabel("generated frame index")
    ax1.set_ylabel("model call")
    fig.colorbar(im, ax=list(axes), label=f"noise level (0 clean … {K} noise)", fraction=0.03, pad=0.01)
    if path is not None:
        _save_figure(fig, path)
    return fig


def plot_presets(path: str | os.PathLike | None = None, *, window: int = 4, num_levels: int = 1000,
                 steps: int = 8, n_frames: int = 12):
    """One panel row per preset (chunked, fifo, pyramid) at equal steps per frame; saved when ``path``."""
    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    scheds = [get_schedule(n, window, num_levels, steps) for n in PRESETS]
    fig, axes = plt.subplots(3, 2, figsize=(12, 12.5), gridspec_kw={"width_ratios": [1, 2.2]},
                             layout="constrained")
    for sched, row in zip(scheds, axes):
        plot_schedule(sched, None, n_frames=n_frames, axes=row)
    fig.suptitle(f"Meta-ARVDM presets: w={window}, K={num_levels}, {steps} denoising steps per frame\n"
                 "left: one AR step's matrix S; right: a rollout, one row per model call "
                 "(grey = not yet in the window, white = finished and committed)", fontsize=11)
    if path is not None:
        _save_figure(fig, path)
    return fig


def _save_figure(fig: Any, path: str | os.PathLike) -> None:
    import matplotlib.pyplot as plt

    path = Path(path)
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=100, format=path.suffix.lstrip(".") or "png"))
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arvdm.schedules", description=__doc__.split("\n\n")[0])
    p.add_argument("--plot", metavar="PNG", help="draw the three presets into this file")
    p.add_argument("--show", metavar="NAME_OR_FILE", help="print a preset's or a file's matrix")
    p.add_argument("--window", type=int, default=4)
    p.add_argument("--levels", type=int, default=1000)
    p.add_argument("--steps", type=int, default=8, help="denoising steps per frame")
    args = p.parse_args(argv)
    if not (args.plot or args.show):
        p.error("give --plot PNG and/or --show NAME_OR_FILE")
    try:
        if args.show:
            s = get_schedule(args.show, None if Path(args.show).is_file() else args.window, args.levels, args.steps)
            print(s)
            print(f"init stage ({s.init_steps} calls):\n{s.init_matrix()}")
        if args.plot:
            plot_presets(args.plot, window=args.window, num_levels=args.levels, steps=args.steps)
            print(f"wrote {args.plot}")
    except USER_ERRORS as e:
        print(f"python -m arvdm.schedules: error: {e}", file=sys.stderr)
        return 2
    return 0
