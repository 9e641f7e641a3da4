"""A change measured on several training seeds: A − B on each seed's episodes, then over the seeds.

    python -m arvdm.evaluation.seeds --a ev/new_s0 ev/new_s1 ev/new_s2 --b ev/base_s0 ev/base_s1 ev/base_s2
    python -m arvdm.evaluation.seeds --a ev/base_s0 ev/base_s1 ev/base_s2 --plot seeds.png   # one configuration

    from arvdm.evaluation.seeds import compare_seeds
    result = compare_seeds(["new_s0", "new_s1"], ["base_s0", "base_s1"])   # {"seeds", "spans", "revisits"}

Why: on the main job the training seed alone moves frames 17-64 by up to 1.1 dB (benchmarks/RESULTS.md), more
than most changes measured on one seed. ``arvdm.evaluation.compare``'s interval resamples episodes: it says whether
*these weights* differ from *those*, not whether the change would hold on another training run. Here pair i is
two ``sample.py`` folders of the same episodes whose runs share training seed i (A with the change, B without):
each pair is compared as ``compare_rollouts`` does (its episode interval is listed per seed), and **over seeds** the
figure is the mean of the per-seed paired means with a Student-t 95% interval on those means (n − 1 degrees of
freedom; each seed's mean carries its own episodes' noise, so the spread of the means holds both; for A − B their
variance is floored at the seeds' own squared standard errors). With three seeds the t factor is 4.30: the interval
is wide because three training runs say little, not because of a bug.

Beside A − B, each side's distance to the trivial predictors (A − context mean, A − copy-last: issue 21's targets)
is pooled the same way, and the revisit probes' A − B when both sides have enough events. Without ``--b`` only the
A side is read (its baselines over seeds). Pairs may use different episode sets; a span missing from any pair is
left out.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from arvdm.errors import USER_ERRORS
from arvdm.evaluation.compare import DEFAULT_SPANS, RolloutFileError, compare_rollouts
from arvdm.evaluation.plots import new_figure, save_png
from arvdm.evaluation.probes import format_interval
from data.atomic import atomic_write_json

__all__ = ["T_975", "compare_seeds", "format_seeds", "main", "over_seeds", "plot_seeds", "standard_error"]

#: Student-t 0.975 quantiles by degrees of freedom (1-30); past 30 the normal's 1.96 is used.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)
#: The baselines each side is measured against: key in compare_rollouts' span rows -> name in the result.
BASELINES = {"context_mean": "context mean", "copy_last": "copy-last"}


def standard_error(interval: dict[str, Any]) -> float:
    """The standard error behind a 95% interval ``{lo, hi}`` (its width over 2 x 1.96)."""
    return (interval["hi"] - interval["lo"]) / 3.92


def over_seeds(values: Sequence[float], standard_errors: Sequence[float] | None = None) -> dict[str, Any]:
    """Mean of per-seed values with a two-sided 95% Student-t interval (``lo``/``hi`` None for one seed), and
    how many seeds lie above and below 0.

    ``standard_errors`` (each seed's own standard error, e.g. from its episode interval) floor the variance of the
    seed values at their mean square: a seed's value varies at least by its own noise, so two seeds that agree by
    chance do not give an interval narrower than either seed's."""
    v = np.asarray(values, dtype=np.float64)
    if v.ndim != 1 or v.size == 0 or not np.isfinite(v).all():
        raise ValueError(f"over_seeds: need one finite value per seed, got {values!r}")
    mean, n = float(v.mean()), v.size
    if n == 1:
        lo = hi = None
    else:
        var = float(v.var(ddof=1))
        if standard_errors is not None:
            var = max(var, float(np.mean(np.square(np.asarray(standard_errors, dtype=np.float64)))))
        half = (T_975[n - 2] if n - 1 <= len(T_975) else 1.96) * math.sqrt(var / n)
        lo, hi = mean - half, mean + half
    return {"mean": mean, "lo": lo, "hi": hi, "seeds": n, "by_seed": [float(x) for x in v],
            "above_0": int((v > 0).sum()), "below_0": int((v < 0).sum())}


def compare_seeds(a: Sequence[str | Path], b: Sequence[str | Path] | None = None,
                  spans: Sequence[tuple[str, int, int]] = DEFAULT_SPANS, recent: int = 6, n_boot: int = 2000,
                  revisits: bool = True) -> dict[str, Any]:
    """A − B per training seed and over seeds (module docstring); RolloutFileError for folders that cannot be
    compared, ValueError when ``a`` and ``b`` differ in length.

    Returns ``{"a", "b", "seeds", "spans": [{"span", "start", "end", "gradient_ratio_a": [per seed],
    "a_minus_b": {over_seeds..., "episode_intervals": [{mean, lo, hi} per seed], "seeds_above_0" and
    "seeds_below_0" (episode intervals excluding 0)} or None, "a_minus_context_mean", "a_minus_copy_last",
    "b_minus_...": over_seeds}], "revisits": over_seeds of the probes' A − B or None}``.
    """
    a = [str(x) for x in a]
    b = None if b is None else [str(x) for x in b]
    if not a:
        raise ValueError("compare_seeds: no rollouts given")
    if b is not None and len(b) != len(a):
        raise ValueError(f"compare_seeds: {len(a)} A folders but {len(b)} B folders (one pair per training seed)")
    pairs = [compare_rollouts(x, y, spans, recent=recent, n_boot=n_boot, revisits=revisits)  # y None: A alone
             for x, y in zip(a, b if b is not None else [None] * len(a))]
    names = [s["span"] for s in pairs[0]["spans"] if all(s["span"] in [r["span"] for r in p["spans"]] for p in pairs)]
    rows = []
    for name in names:
        per_seed = [next(r for r in p["spans"] if r["span"] == name) for p in pairs]
        row: dict[str, Any] = {"span": name, "start": per_seed[0]["start"], "end": per_seed[0]["end"],
                               "gradient_ratio_a": [r["gradient_ratio_a"] for r in per_seed], "a_minus_b": None}
        for side in ("a", "b") if b is not None else ("a",):
            for key in BASELINES:
                row[f"{side}_minus_{key}"] = over_seeds([r[side] - r[key] for r in per_seed])
        if b is not None:
            row["gradient_ratio_b"] = [r["gradient_ratio_b"] for r in per_seed]
            intervals = [r["a_minus_b"] for r in per_seed]
            row["a_minus_b"] = {**over_seeds([d["mean"] for d in intervals], [standard_error(d) for d in intervals]),
                                "episode_intervals": intervals,
                                "seeds_above_0": sum(d["lo"] > 0 for d in intervals),
                                "seeds_below_0": sum(d["hi"] < 0 for d in intervals)}
        rows.append(row)
    read = [p["revisits"] for p in pairs if p["revisits"] is not None and not p["revisits"].get("too_few")]
    return {"a": a, "b": b, "seeds": len(a), "spans": rows,
            "revisits": over_seeds([r["a_minus_b"]["mean"] for r in read]) | {"seeds_read": len(read)}
            if read else None}


def _over(d: dict[str, Any]) -> str:
    """``+0.54 [-0.90, +1.98]`` (or ``+0.54 (one seed)``) and the per-seed values."""
    head = f"{d['mean']:+.2f} (one seed)" if d["lo"] is None else format_interval(d)
    return f"{head}  seeds {' '.join(f'{x:+.2f}' for x in d['by_seed'])}"


def format_seeds(result: dict[str, Any]) -> str:
    """The comparison as text (what the CLI prints)."""
    n = result["seeds"]
    lines = [f"{n} training seeds; PSNR dB; over seeds: the mean of the per-seed figures with a 95% Student-t "
             f"interval on them ({n - 1} degrees of freedom)" if n > 1 else "1 training seed: no interval over seeds"]
    for i, x in enumerate(result["a"]):
        lines.append(f"  seed {i}: A = {x}" + (f", B = {result['b'][i]}" if result["b"] else ""))
    sides = ("a", "b") if result["b"] else ("a",)
    for row in result["spans"]:
        lines.append(f"frames {row['span']}:")
        for side in sides:
            for key, label in BASELINES.items():
                lines.append(f"  {side.upper()} - {label:<12} {_over(row[f'{side}_minus_{key}'])}")
        d = row["a_minus_b"]
        if d is not None:
            lines.append(f"  A - B {'':<13}{_over(d)}")
            lines.append(f"  {'':<20}per seed, episodes resampled: "
                         + "  ".join(format_interval(e) for e in d["episode_intervals"])
                         + f"  ({d['seeds_above_0']} above 0, {d['seeds_below_0']} below)")
        ratios = [f"{x:.2f}" for x in row["gradient_ratio_a"]]
        lines.append(f"  sharpness A {' / '.join(ratios)}"
                     + (f"; B {' / '.join(f'{x:.2f}' for x in row['gradient_ratio_b'])}" if result["b"] else ""))
    rv = result["revisits"]
    if rv is not None:
        lines.append(f"revisit probes, A - B over {rv['seeds_read']} seed(s) with enough events: {_over(rv)}")
    return "\n".join(lines)


def plot_seeds(result: dict[str, Any], path: str | Path) -> None:
    """Each span's per-seed figures as dots and their mean over seeds with its interval: A − B when B was given,
    else A − context mean."""
    key, label = ("a_minus_b", "A - B") if result["b"] else ("a_minus_context_mean", "A - context mean")
    fig = new_figure()
    ax = fig.add_subplot(1, 1, 1)
    for x, row in enumerate(result["spans"]):
        d = row[key]
        ax.scatter([x] * len(d["by_seed"]), d["by_seed"], color="tab:gray", s=14, zorder=2)
        err = None if d["lo"] is None else [[d["mean"] - d["lo"]], [d["hi"] - d["mean"]]]
        ax.errorbar([x + 0.15], [d["mean"]], yerr=err, fmt="o", color="tab:blue", capsize=4, zorder=3)
    ax.axhline(0.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(result["spans"])), [r["span"] for r in result["spans"]])
    ax.set_xlabel("generated frames")
    ax.set_ylabel(f"{label} (dB)")
    ax.set_title(f"{label} over {result['seeds']} training seeds (gray: each seed; blue: mean, 95% t interval)")
    save_png(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arvdm.evaluation.seeds", description=__doc__.split("\n")[0])
    p.add_argument("--a", nargs="+", required=True, help="sample.py folders with the change, one per training seed")
    p.add_argument("--b", nargs="+", default=None,
                   help="sample.py folders without it, in the same seed order (the same episodes as each A)")
    p.add_argument("--recent", type=int, default=6, help="recent frames of the revisit probes (default 6)")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples per seed (default 2000)")
    p.add_argument("--no-revisits", action="store_true", help="leave the revisit probes out (faster)")
    p.add_argument("--json", default=None, help="also write the result to this JSON file")
    p.add_argument("--plot", default=None, help="also draw the per-seed figures to this PNG")
    args = p.parse_args(argv)
    try:
        if args.b is not None and len(args.b) != len(args.a):
            raise RolloutFileError(f"--a has {len(args.a)} folders, --b {len(args.b)}: give one pair per seed")
        if args.recent < 1:
            raise RolloutFileError(f"--recent {args.recent}: must be >= 1")
        if args.boot < 100:
            raise RolloutFileError(f"--boot {args.boot}: must be >= 100 for a 95% interval")
        result = compare_seeds(args.a, args.b, recent=args.recent, n_boot=args.boot, revisits=not args.no_revisits)
        if args.json:
            atomic_write_json(args.json, result)
        if args.plot:
            plot_seeds(result, args.plot)
    except USER_ERRORS as e:
        print(f"seeds: error: {e}", file=sys.stderr)
        return 2
    print(format_seeds(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
