"""Two rollouts of the same episodes compared frame by frame: is A better than B, with an interval?

    python -m arvdm.evaluation.compare runs/new/samples/chunked runs/old/samples/chunked
    python -m arvdm.evaluation.compare OUT_POSE OUT_TIME --recent 6 --json pose_vs_time.json

    from arvdm.evaluation.compare import compare_rollouts
    result = compare_rollouts("out_a", "out_b")       # {"spans": [...], "revisits": {...}, ...}

A and B are folders written by ``sample.py`` (``rollout.npz`` with uint8 ``real`` and ``fake``, context included;
``eval.json`` or ``metrics.csv`` to tell how many frames were generated). Both must hold the same ground truth: the
same episodes, context and frames, as when two runs, two sampling settings or two memory choices are rolled out on
one data set. Reported, for each span of generated frames (first 1, first 4, 5-16, 17-64, 65-120 by default;
spans past the rollout are left out): A's and B's mean PSNR, copy-last's and context-mean's, A's and B's
sharpness (the spatial-gradient ratio generated / true, summed over the span's frames and episodes: ``eval.json``'s
definition; ~1 sharp, falling with blur), and **A − B** with a 95% bootstrap interval that resamples episodes with
their frames pooled (``paired_difference`` with the episode as the event): the way every "paired" figure of the
README is computed. On the revisit probes (generated frames
only memory can supply, ``revisit_score``) A − B is paired probe by probe, events resampled, in all and split by
whether a true context frame shows the view (at the probes' 25 dB threshold: memory can hold the truth) or only
frames the rollout drew do.
Per-frame PSNRs are capped at ``PSNR_CAP``.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from arvdm.errors import USER_ERRORS, ArvdmError
from arvdm.evaluation.baselines import baseline_frames, summed_gradient_ratio
from arvdm.evaluation.metrics import PSNR_CAP, psnr_per_frame, spatial_gradient_per_frame
from arvdm.evaluation.probes import DEFAULT_PSNR_THRESHOLD, MIN_EVENTS, format_interval, paired_difference
from arvdm.evaluation.revisit_score import revisit_score
from data.atomic import atomic_write_json

__all__ = ["DEFAULT_SPANS", "RolloutFileError", "compare_rollouts", "generated_frames", "load_rollout", "main",
           "read_rollout"]

#: Spans of generated frames (0-based, end exclusive) and their names: issue 21's first frames, 17-64 and 65-120.
DEFAULT_SPANS: tuple[tuple[str, int, int], ...] = (("first 1", 0, 1), ("first 4", 0, 4), ("5-16", 4, 16),
                                                   ("17-64", 16, 64), ("65-120", 64, 120))


class RolloutFileError(ArvdmError):
    """A rollout folder that is missing, unreadable, or not comparable with the other one."""


def read_rollout(folder: str | Path) -> tuple[Tensor, Tensor]:
    """(real, fake) float (B, T, C, H, W) in [-1, 1] from ``folder/rollout.npz`` (uint8 (B, T, H, W, 3) each)."""
    path = Path(folder) / "rollout.npz"
    try:
        with np.load(path) as z:
            if "real" not in z or "fake" not in z:
                raise RolloutFileError(f"{path}: needs arrays 'real' and 'fake' (has {sorted(z.files)})")
            real, fake = z["real"], z["fake"]
    except (OSError, ValueError, zipfile.BadZipFile) as e:
        if isinstance(e, RolloutFileError):
            raise
        raise RolloutFileError(f"{path}: unreadable ({e})") from None
    if real.shape != fake.shape or real.ndim != 5 or real.dtype != np.uint8:
        raise RolloutFileError(f"{path}: 'real' {real.shape} {real.dtype} and 'fake' {fake.shape} must be uint8 "
                               "(B, T, H, W, 3) of the same shape")
    as_float = [torch.from_numpy(a).permute(0, 1, 4, 2, 3).float() / 127.5 - 1.0 for a in (real, fake)]
    return as_float[0], as_float[1]  # (B, T, C, H, W) each


def generated_frames(folder: str | Path) -> int:
    """How many frames the rollout generated: eval.json's ``n_generated``, else the rows of metrics.csv."""
    folder = Path(folder)
    if (folder / "eval.json").is_file():
        try:
            return int(json.loads((folder / "eval.json").read_text())["n_generated"])
        except (ValueError, KeyError, TypeError) as e:
            raise RolloutFileError(f"{folder / 'eval.json'}: no readable n_generated ({e})") from None
    if (folder / "metrics.csv").is_file():
        with open(folder / "metrics.csv", newline="") as f:
            return sum(1 for _ in csv.DictReader(f))
    raise RolloutFileError(f"{folder}: neither eval.json nor metrics.csv (a folder written by sample.py has both "
                           "or the latter)")


def load_rollout(folder: str | Path) -> tuple[Tensor, Tensor, int]:
    """(real, fake, context) of a sample.py folder: ``read_rollout``'s videos and the number of context frames
    (all frames minus ``generated_frames``); RolloutFileError when they do not add up."""
    real, fake = read_rollout(folder)
    n = generated_frames(folder)
    if not 1 <= n < real.shape[1]:
        raise RolloutFileError(f"{folder}: {n} generated frames, but rollout.npz holds {real.shape[1]} frames in all")
    return real, fake, real.shape[1] - n


def _interval(d: dict[str, Any]) -> dict[str, float]:
    return {"mean": d["mean"], "lo": d["lo"], "hi": d["hi"]}


def compare_rollouts(a: str | Path, b: str | Path | None, spans: Sequence[tuple[str, int, int]] = DEFAULT_SPANS,
                     recent: int = 6, n_boot: int = 2000, seed: int = 0, revisits: bool = True) -> dict[str, Any]:
    """A − B by span and on the revisit probes (module docstring); RolloutFileError when they are not comparable.
    ``revisits=False`` leaves the probes out (``"revisits": None``). ``b=None``: A and its baselines alone (no
    ``"b"``, ``"gradient_ratio_b"`` or revisits; ``"a_minus_b"`` None), as the seeds CLI without ``--b`` reads them.

    Returns ``{"a", "b", "episodes", "context", "generated", "spans": [{"span", "start", "end", "a", "b",
    "copy_last", "context_mean", "a_minus_b": {mean, lo, hi}, "gradient_ratio_a", "gradient_ratio_b"}],
    "revisits": {"probes", "events", "recent", "a", "b", "a_minus_b", "by_source": {"context" | "generated":
    {"probes", "events", "too_few", "a", "b", "a_minus_b"}}} or {"probes", "events", "recent",
    "too_few": True}}``.
    """
    real_a, fake_a, ctx_a = load_rollout(a)
    real_b, fake_b, ctx_b = (real_a, None, ctx_a) if b is None else load_rollout(b)
    if real_a.shape != real_b.shape or ctx_a != ctx_b or not torch.equal(real_a, real_b):
        raise RolloutFileError(f"{a} and {b} do not roll out the same ground truth (shapes {tuple(real_a.shape)} / "
                               f"{tuple(real_b.shape)}, context {ctx_a} / {ctx_b}): compare rollouts of the same "
                               "episodes, context and frames")
    context, n = ctx_a, real_a.shape[1] - ctx_a
    truth = real_a[:, context:]

    def psnr(frames: Tensor) -> np.ndarray:  # (B, n) per-frame PSNR, capped
        return psnr_per_frame(frames, truth).clamp(max=PSNR_CAP).double().numpy()

    grad_real = spatial_gradient_per_frame(truth)  # (B, n) sharpness of the truth, the ratios' denominator
    fakes = {"a": fake_a} if fake_b is None else {"a": fake_a, "b": fake_b}
    grad = {k: spatial_gradient_per_frame(f[:, context:]) for k, f in fakes.items()}  # (B, n) each
    curves = {**{k: psnr(f[:, context:]) for k, f in fakes.items()},
              "copy_last": psnr(baseline_frames(real_a, context, n, "copy_last")),
              "context_mean": psnr(baseline_frames(real_a, context, n, "context_mean"))}
    rows = []
    for name, lo, hi in spans:
        if lo >= n:
            continue
        hi = min(hi, n)
        part = {k: v[:, lo:hi] for k, v in curves.items()}  # (B, frames) each
        episodes = np.repeat(np.arange(part["a"].shape[0]), hi - lo)
        diff = None if b is None else _interval(
            paired_difference(part["a"].reshape(-1), part["b"].reshape(-1), episodes, n_boot=n_boot, seed=seed))
        sharp = {f"gradient_ratio_{k}": summed_gradient_ratio(g, grad_real, lo, hi) for k, g in grad.items()}
        rows.append({"span": name, "start": lo, "end": hi, **{k: float(v.mean()) for k, v in part.items()},
                     "a_minus_b": diff, **sharp})
    return {"a": str(a), "b": None if b is None else str(b), "episodes": int(real_a.shape[0]), "context": context,
            "generated": n, "spans": rows,
            "revisits": _paired_revisits(real_a, fake_a, fake_b, context, recent, n_boot, seed)
            if revisits and b is not None else None}


def _paired_revisits(real: Tensor, fake_a: Tensor, fake_b: Tensor, context: int, recent: int, n_boot: int,
                     seed: int) -> dict[str, Any]:
    """A − B on the revisit probes of the shared ground truth, paired probe by probe."""
    sa = revisit_score(fake_a[:, context:], real, context, recent=recent, per_probe=True, n_boot=n_boot, seed=seed)
    if sa["events"] < MIN_EVENTS:
        return {"probes": sa["probes"], "events": sa["events"], "recent": recent, "too_few": True}
    sb = revisit_score(fake_b[:, context:], real, context, recent=recent, per_probe=True, n_boot=n_boot, seed=seed)
    pa, pb = sa["per_probe"], sb["per_probe"]  # the same probes: they depend on the ground truth only
    a, b, events = np.asarray(pa["model"]), np.asarray(pb["model"]), np.asarray(pa["event"])
    diff = paired_difference(a, b, events, n_boot=n_boot, seed=seed)
    # where a true context frame shows the view (memory can hold the truth), and where only frames the rollout drew do
    in_context = np.array([_context_shows(real[b_, :context], real[b_, t]) for b_, t in zip(pa["b"], pa["t"])],
                          dtype=bool)
    by_source = {}
    for name, mask in (("context", in_context), ("generated", ~in_context)):
        n_events = len(set(events[mask].tolist()))
        part: dict[str, Any] = {"probes": int(mask.sum()), "events": n_events, "too_few": n_events < MIN_EVENTS}
        if not part["too_few"]:
            d = paired_difference(a[mask], b[mask], events[mask], n_boot=n_boot, seed=seed)
            part.update(a=d["mean_a"], b=d["mean_b"], a_minus_b=_interval(d))
        by_source[name] = part
    return {"probes": sa["probes"], "events": sa["events"], "recent": recent, "a": diff["mean_a"],
            "b": diff["mean_b"], "a_minus_b": _interval(diff), "by_source": by_source}


def _context_shows(context: Tensor, frame: Tensor) -> bool:
    """Whether some frame of context (C, ch, H, W) matches frame (ch, H, W) at the memory probes' PSNR threshold."""
    psnr = psnr_per_frame(context[None].float(), frame[None, None].expand_as(context[None]).float())  # (1, C)
    return bool((psnr >= DEFAULT_PSNR_THRESHOLD).any())


def format_comparison(result: dict[str, Any]) -> str:
    """The comparison as a few lines of text (what the CLI prints)."""
    lines = [f"A = {result['a']}", f"B = {result['b']}",
             f"{result['episodes']} episodes, {result['context']} context + {result['generated']} generated frames; "
             "PSNR dB, A - B with a 95% interval (episodes resampled)",
             f"{'frames':>8}  {'A':>6}  {'B':>6}  {'copy-last':>9}  {'ctx mean':>8}  {'A - B':<22}  sharpness A / B"]
    for r in result["spans"]:
        lines.append(f"{r['span']:>8}  {r['a']:6.2f}  {r['b']:6.2f}  {r['copy_last']:9.2f}  {r['context_mean']:8.2f}  "
                     f"{format_interval(r['a_minus_b']):<22}  "
                     f"{r['gradient_ratio_a']:.2f} / {r['gradient_ratio_b']:.2f}")
    rv = result["revisits"]
    if rv is None:
        pass
    elif rv.get("too_few"):
        lines.append(f"revisits: {rv['probes']} probes in {rv['events']} events (fewer than {MIN_EVENTS}): not read")
    else:
        lines.append(f"revisits ({rv['probes']} probes, {rv['events']} events, recent {rv['recent']}): "
                     f"A {rv['a']:.2f}, B {rv['b']:.2f}, A - B {format_interval(rv['a_minus_b'])} (events resampled)")
        for name, label in (("context", "a context frame shows the view"), ("generated", "only drawn frames do")):
            part = rv["by_source"][name]
            head = f"  {label} ({part['probes']} probes, {part['events']} events)"
            lines.append(f"{head}: fewer than {MIN_EVENTS} events, not read" if part["too_few"] else
                         f"{head}: A {part['a']:.2f}, B {part['b']:.2f}, A - B {format_interval(part['a_minus_b'])}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arvdm.evaluation.compare", description=__doc__.split("\n")[0])
    p.add_argument("a", help="a folder written by sample.py (rollout.npz + eval.json or metrics.csv)")
    p.add_argument("b", help="another folder of the same episodes")
    p.add_argument("--recent", type=int, default=6, help="recent frames of the revisit probes (default 6)")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--json", default=None, help="also write the comparison to this JSON file")
    args = p.parse_args(argv)
    try:
        if args.recent < 1:
            raise RolloutFileError(f"--recent {args.recent}: must be >= 1")
        if args.boot < 100:
            raise RolloutFileError(f"--boot {args.boot}: must be >= 100 for a 95% interval")
        result = compare_rollouts(args.a, args.b, recent=args.recent, n_boot=args.boot)
        if args.json:
            atomic_write_json(args.json, result)
    except USER_ERRORS as e:
        print(f"compare: error: {e}", file=sys.stderr)
        return 2
    print(format_comparison(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
