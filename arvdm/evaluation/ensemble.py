"""K rollouts of the same episodes with other noise: is a rollout's error ignorance or the price of one sample?

    python sample.py --run runs/tiny --data D --split training --context 8 --frames 128 --episodes 32 --seed 1 --out s1
    ...                                                                                  (--seed 2, 3 ... --out s2, s3)
    python -m arvdm.evaluation.ensemble s0 s1 s2 s3 [--data D --split training] [--json ensemble.json]

PSNR rewards the mean of what may come: where the future is uncertain, the conditional mean E[x | context,
actions] has the least squared error, and one sample of that distribution pays twice its variance (the sample's
own spread plus the truth's). A blurry predictor such as the context mean can therefore beat a sharp sample that
knows more. This module separates the two. For each span of generated frames (first 1, first 4, 5-16, 17-64,
65-120) it reports, beside copy-last and the context mean:

    one sample     the mean PSNR of the K rollouts, each scored on its own (what sample.py reports)
    mean of K      the per-pixel mean of the K rollouts scored against the truth (an ensemble, not a rollout)
    model mean     the model's own conditional mean, K -> infinity: per pixel, (mean of K - truth)^2 minus the
                   samples' unbiased variance / K (the bias-variance split E[(m_K - x)^2] = bias^2 + var/K),
                   averaged over each frame, that frame's figure floored at 0, as PSNR
    agreement      the mean PSNR of every pair of rollouts against each other (how alike the samples are)

with the sharpness of one sample and of the mean of K (the spatial-gradient ratio generated / true summed over
the span, ``eval.json``'s definition: an ensemble pays for its PSNR in blur), and, paired over the same frames
with an episode-level 95% interval (``paired_difference``): mean of K - context mean, one sample - context mean
and mean of K - one sample. Reading: if the model's mean beats the context mean
where one sample does not, the model knows more than the context mean and loses only the sample's spread; if the
mean does not beat it either, no choice of sample can, and the model does not know the frames better than the
average of the context (docs/evaluation.md). With ``--data`` (the episodes the rollouts were drawn from, their
poses) frames 17-64 are also split by whether a context frame shows their view (``context_views``' definition).

How much sharpness would buy the PSNR back: for each blend weight lambda (``--shrink``, default 1, 0.85, 0.7, 0.5,
0) every sample is pulled towards the mean of the *other* K - 1 samples, m + lambda (x - m) (lambda = 1: the sample,
0: the others' mean; leave-one-out, so the sample is not scored against itself), and each span reports the blend's
PSNR, its difference from the context mean and its sharpness: the PSNR-sharpness frontier the samples allow. A
target of "PSNR above a baseline, gradient ratio within bounds" is within this model's reach only where some blend
meets both (the blend is a diagnostic, not a sampler).

The folders are ``sample.py`` outputs of the same episodes, context and frames (the same ground truth is
checked), differing in ``--seed`` (or in anything else whose spread is to be measured).
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from arvdm.errors import USER_ERRORS
from arvdm.evaluation.baselines import baseline_frames, summed_gradient_ratio
from arvdm.evaluation.compare import DEFAULT_SPANS, RolloutFileError, load_rollout, read_rollout
from arvdm.evaluation.holdup import VIEWS_SPAN, context_view_mask
from arvdm.evaluation.metrics import PSNR_CAP, psnr_per_frame, spatial_gradient_per_frame
from arvdm.evaluation.probes import format_interval, paired_difference
from data.atomic import atomic_write_json
from data.dataset import list_episodes, resolve_split
from data.episodes import load_episode

__all__ = ["PAIRS", "SHRINKS", "ensemble_report", "episode_poses", "format_ensemble", "main", "model_mean_psnr",
           "shrink_frontier"]

#: Blend weights of the PSNR-sharpness frontier: lambda in m + lambda (x - m), m the other samples' mean.
SHRINKS = (1.0, 0.85, 0.7, 0.5, 0.0)

#: The paired differences reported for each span: (name, a, b) of the per-frame PSNR curves, a - b.
PAIRS = (("mean of K - context mean", "mean_of_k", "context_mean"),
         ("one sample - context mean", "one_sample", "context_mean"),
         ("mean of K - one sample", "mean_of_k", "one_sample"))


def _mse_to_psnr(mse: Tensor, data_range: float = 2.0) -> Tensor:
    """PSNR in dB from a per-frame MSE of frames in [-1, 1], capped at PSNR_CAP (an MSE of 0 included)."""
    return (10 * torch.log10(data_range ** 2 / mse.clamp(min=1e-12))).clamp(max=PSNR_CAP)


def _capped_psnr(fake: Tensor, real: Tensor) -> Tensor:
    """(B, N) PSNR per frame of two (B, N, C, H, W) videos, capped at PSNR_CAP (a frame equal to its truth: the cap)."""
    return psnr_per_frame(fake, real).clamp(max=PSNR_CAP)


def _spans_within(spans: Sequence[tuple[str, int, int]], n: int) -> Iterator[tuple[str, int, int]]:
    """The spans that start within n generated frames, each clipped to them."""
    for name, lo, hi in spans:
        if lo < n:
            yield name, lo, min(hi, n)


def model_mean_psnr(gen: Tensor, truth: Tensor) -> Tensor:
    """(B, N) PSNR of the model's own conditional mean, estimated from K samples gen (K, B, N, C, H, W) of the truth
    (B, N, C, H, W): per pixel (m_K - x)^2 - s^2 / K with s^2 the unbiased variance over the K samples (so
    E = bias^2: the mean's error as K grows without bound), averaged over C, H, W, then floored at 0; capped."""
    k = gen.shape[0]
    if k < 2:
        raise ValueError(f"model_mean_psnr: needs K >= 2 samples to estimate their variance, got {k}")
    m = gen.mean(0)  # (B, N, C, H, W)
    bias2 = (m - truth).square() - gen.var(0, unbiased=True) / k  # (B, N, C, H, W)
    return _mse_to_psnr(bias2.mean(dim=(2, 3, 4)).clamp(min=0))  # (B, N)


def _agreement(gen: Tensor) -> Tensor:
    """(B, N) mean PSNR of every pair of the K samples (K, B, N, C, H, W) against each other, each pair capped."""
    pairs = [_capped_psnr(gen[i], gen[j]) for i, j in itertools.combinations(range(len(gen)), 2)]
    return torch.stack(pairs).mean(0)


MODEL_CURVES = ("one_sample", "mean_of_k", "model_mean", "agreement")  # what a model's K samples are scored by
_CURVE_LABELS = {"one_sample": "one sample", "mean_of_k": "mean of K", "model_mean": "model mean",
                 "agreement": "agreement"}


def model_curves(gen: Tensor, truth: Tensor) -> dict[str, Tensor]:
    """``MODEL_CURVES`` as (B, N) PSNR curves, capped, of K samples gen (K, B, N, C, H, W) of the truth (B, N, C, H,
    W): one sample (each scored alone, averaged over the K), the per-pixel mean of the K, the model's own mean
    (`model_mean_psnr`) and the samples' agreement."""
    return {"one_sample": torch.stack([_capped_psnr(g, truth) for g in gen]).mean(0),
            "mean_of_k": _capped_psnr(gen.mean(0), truth),
            "model_mean": model_mean_psnr(gen, truth), "agreement": _agreement(gen)}


def episode_poses(data: str | Path, split: str | None, real: Tensor) -> Tensor:
    """The poses (B, T, 3) of the first B episodes of ``data[/split]``, checked to be the episodes of ``real`` (B, T,
    C, H, W in [-1, 1], as ``read_rollout`` gives it): their first T frames must equal the rollout's ground truth."""
    folder = resolve_split(data, split) if split else Path(data)
    paths = list_episodes(folder)
    b, t = real.shape[:2]
    if len(paths) < b:
        raise RolloutFileError(f"--data {folder}: {len(paths)} episodes, the rollouts hold {b}")
    poses = []
    for i, path in enumerate(paths[:b]):
        ep = load_episode(path)
        if ep.pose is None:
            raise RolloutFileError(f"{path}: has no poses (a 'pose' array): frames cannot be split by view")
        video = np.asarray(ep.video[:t])  # (T, H, W, 3) uint8
        ours = ((real[i] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()
        if video.shape != ours.shape or not np.array_equal(video, ours):
            raise RolloutFileError(f"{path}: its first {t} frames are not episode {i}'s ground truth in the rollouts "
                                   "(give the --data and --split the rollouts were drawn from)")
        poses.append(torch.as_tensor(np.asarray(ep.pose[:t]), dtype=torch.float32))
    return torch.stack(poses)  # (B, T, 3)


def _load_all(folders: Sequence[str | Path]) -> tuple[Tensor, Tensor, int]:
    """(real (B, T, C, H, W), fakes (K, B, T, C, H, W), context) of K >= 2 folders of the same ground truth."""
    if len(folders) < 2:
        raise RolloutFileError(f"give at least 2 rollout folders of the same episodes, got {len(folders)}")
    real, fakes, context = None, [], None
    for folder in folders:
        r, f, c = load_rollout(folder)
        if real is None:
            real, context = r, c
        elif r.shape != real.shape or c != context or not torch.equal(r, real):
            raise RolloutFileError(f"{folder} does not roll out the ground truth of {folders[0]} (shape "
                                   f"{tuple(r.shape)} / {tuple(real.shape)}, context {c} / {context}): "
                                   "give rollouts of the same episodes, context and frames")
        fakes.append(f)
    return real, torch.stack(fakes), context


def shrink_frontier(gen: Tensor, truth: Tensor, context_mean: Tensor, spans: Sequence[tuple[str, int, int]],
                    shrinks: Sequence[float] = SHRINKS) -> list[dict[str, Any]]:
    """The PSNR-sharpness frontier of the module docstring: ``gen`` (K, B, N, C, H, W) samples, ``truth`` (B, N, C, H,
    W), ``context_mean`` (B, N) the baseline's PSNR. Returns per lambda ``{"lambda", "spans": {span: {"psnr",
    "minus_context_mean", "gradient_ratio"}}}``, each the mean over the K leave-one-out blends."""
    k, n = gen.shape[0], gen.shape[2]
    grad_real = spatial_gradient_per_frame(truth)  # (B, N)
    others = (gen.sum(0, keepdim=True) - gen) / (k - 1)  # (K, B, N, ...) each sample's others' mean
    out = []
    for lam in shrinks:
        blends = others + float(lam) * (gen - others)  # (K, B, N, C, H, W)
        psnr = torch.stack([_capped_psnr(x, truth) for x in blends]).double()  # (K, B, N)
        grads = [spatial_gradient_per_frame(x) for x in blends]  # K x (B, N)
        rows = {}
        for name, lo, hi in _spans_within(spans, n):
            rows[name] = {"psnr": float(psnr[:, :, lo:hi].mean()),
                          "minus_context_mean": float(psnr[:, :, lo:hi].mean() - context_mean[:, lo:hi].mean()),
                          "gradient_ratio": float(np.mean([summed_gradient_ratio(g, grad_real, lo, hi)
                                                           for g in grads]))}
        out.append({"lambda": float(lam), "spans": rows})
    return out


def ensemble_report(folders: Sequence[str | Path], spans: Sequence[tuple[str, int, int]] = DEFAULT_SPANS,
                    poses: Tensor | None = None, n_boot: int = 2000, seed: int = 0,
                    shrinks: Sequence[float] = SHRINKS) -> dict[str, Any]:
    """The module docstring's table for K >= 2 sample.py folders of the same episodes; RolloutFileError when they
    are not comparable. ``poses`` (B, >= T, 3) adds the seen / unseen split of frames 17-64.

    Returns ``{"folders", "k", "episodes", "context", "generated", "spans": [{"span", "start", "end", "one_sample",
    "mean_of_k", "model_mean", "agreement", "copy_last", "context_mean", "paired": {name: {mean, lo, hi}},
    "gradient_ratio_one_sample", "gradient_ratio_mean_of_k"}], "context_views": None or {"label", "share_seen",
    "seen", "unseen"}, "shrink": shrink_frontier(...)}`` (PSNR in dB; ``paired`` per ``PAIRS``; ``seen`` /
    ``unseen`` hold the span means and ``paired`` of their frames, or None when empty).
    """
    real, fakes, context = _load_all(folders)
    k, b, n = fakes.shape[0], real.shape[0], real.shape[1] - context
    truth, gen = real[:, context:], fakes[:, :, context:]  # (B, N, ...), (K, B, N, ...)

    mean_k = gen.mean(0)  # (B, N, C, H, W) the per-pixel mean of the K samples
    curves = {**model_curves(gen, truth), **{name: _capped_psnr(baseline_frames(real, context, n, name), truth)
                                             for name in ("copy_last", "context_mean")}}
    curves = {name: c.double().numpy() for name, c in curves.items()}  # (B, N) each
    grad_real = spatial_gradient_per_frame(truth)  # (B, N) the ratios' denominator
    grad_one = [spatial_gradient_per_frame(g) for g in gen]  # K x (B, N)
    grad_mean = spatial_gradient_per_frame(mean_k)  # (B, N)
    episode = np.broadcast_to(np.arange(b)[:, None], (b, n))  # (B, N): each frame's episode

    def part(mask: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {name: float(c[mask].mean()) for name, c in curves.items()}
        out["paired"] = {name: {key: d[key] for key in ("mean", "lo", "hi")} for name, d in
                         ((name, paired_difference(curves[a][mask], curves[c][mask], episode[mask], n_boot, seed))
                          for name, a, c in PAIRS)}
        return out

    rows = []
    for name, lo, hi in _spans_within(spans, n):
        mask = np.zeros((b, n), dtype=bool)
        mask[:, lo:hi] = True
        sharp = {"gradient_ratio_one_sample": float(np.mean([summed_gradient_ratio(g, grad_real, lo, hi)
                                                             for g in grad_one])),
                 "gradient_ratio_mean_of_k": summed_gradient_ratio(grad_mean, grad_real, lo, hi)}
        rows.append({"span": name, "start": lo, "end": hi, **part(mask), **sharp})
    views = None
    lo, hi = VIEWS_SPAN[0], min(VIEWS_SPAN[1], n)
    if poses is not None and lo < hi:
        seen = np.zeros((b, n), dtype=bool)  # a context frame shows the view (context_views' definition)
        try:
            seen[:, lo:hi] = context_view_mask(poses, b, context, lo, hi)
        except ValueError as e:
            raise RolloutFileError(str(e)) from None
        span = np.zeros((b, n), dtype=bool)
        span[:, lo:hi] = True
        views = {"label": f"{lo + 1}-{hi}", "share_seen": float(seen[:, lo:hi].mean()),
                 "seen": part(seen) if seen.any() else None,
                 "unseen": part(span & ~seen) if (span & ~seen).any() else None}
    frontier = shrink_frontier(gen, truth, torch.from_numpy(curves["context_mean"]), spans, shrinks)
    return {"folders": [str(f) for f in folders], "k": k, "episodes": b, "context": context, "generated": n,
            "spans": rows, "context_views": views, "shrink": frontier}


def ensemble_difference(folders_a: Sequence[str | Path], folders_b: Sequence[str | Path],
                        spans: Sequence[tuple[str, int, int]] = DEFAULT_SPANS, n_boot: int = 2000,
                        seed: int = 0) -> dict[str, Any]:
    """Two models' ensembles of the same episodes (K_A and K_B >= 2 sample.py folders), paired by episode: for each
    span and each of ``MODEL_CURVES``, A - B with a 95% interval (episodes resampled). Is A's own mean closer to the
    truth than B's, or are A's samples only more alike? RolloutFileError when the two sets roll out other episodes.

    Returns ``{"a", "b", "k_a", "k_b", "episodes", "spans": [{"span", "start", "end", name: {mean, lo, hi, mean_a,
    mean_b} for name in MODEL_CURVES}]}``.
    """
    real, gen_a, context = _load_all(folders_a)
    real_b, gen_b, context_b = _load_all(folders_b)
    if real_b.shape != real.shape or context_b != context or not torch.equal(real_b, real):
        raise RolloutFileError(f"--against {folders_b[0]} does not roll out the ground truth of {folders_a[0]} "
                               f"(shape {tuple(real_b.shape)} / {tuple(real.shape)}, context {context_b} / "
                               f"{context}): give both models' rollouts of the same episodes, context and frames")
    truth = real[:, context:]  # (B, N, C, H, W)
    a, b = (model_curves(g[:, :, context:], truth) for g in (gen_a, gen_b))  # each name -> (B, N)
    episodes, n = truth.shape[:2]
    episode = np.broadcast_to(np.arange(episodes)[:, None], (episodes, n))  # (B, N): each frame's episode
    rows = []
    for name, lo, hi in _spans_within(spans, n):
        diffs = {key: paired_difference(a[key][:, lo:hi].double().numpy(), b[key][:, lo:hi].double().numpy(),
                                        episode[:, lo:hi], n_boot, seed) for key in MODEL_CURVES}
        rows.append({"span": name, "start": lo, "end": hi,
                     **{key: {f: d[f] for f in ("mean", "lo", "hi", "mean_a", "mean_b")} for key, d in diffs.items()}})
    return {"a": [str(f) for f in folders_a], "b": [str(f) for f in folders_b], "k_a": gen_a.shape[0],
            "k_b": gen_b.shape[0], "episodes": episodes, "spans": rows}


def format_difference(result: dict[str, Any]) -> str:
    """``ensemble_difference`` as the CLI prints it under ``--against``."""
    lines = [f"A ({result['k_a']} rollouts) - B ({result['k_b']} rollouts) of the same {result['episodes']} episodes, "
             "paired by episode; PSNR dB, A - B with a 95% interval (episodes resampled)",
             f"{'frames':>12}  " + "  ".join(f"{_CURVE_LABELS[name]:<22}" for name in MODEL_CURVES)]
    lines += [f"{r['span']:>12}  " + "  ".join(f"{format_interval(r[name]):<22}" for name in MODEL_CURVES)
              for r in result["spans"]]
    return "\n".join(lines)


def format_ensemble(result: dict[str, Any]) -> str:
    """The report as a few lines of text (what the CLI prints)."""
    lines = [f"{result['k']} rollouts of {result['episodes']} episodes, {result['context']} context + "
             f"{result['generated']} generated frames; PSNR dB, differences with a 95% interval (episodes resampled)",
             f"{'frames':>12}  {'one sample':>10}  {'mean of K':>9}  {'model mean':>10}  {'agreement':>9}  "
             f"{'copy-last':>9}  {'ctx mean':>8}  {'mean of K - ctx mean':<22}  {'one sample - ctx mean':<22}  "
             "sharpness one / mean"]

    def row(label: str, r: dict[str, Any]) -> str:
        p = r["paired"]
        return (f"{label:>12}  {r['one_sample']:10.2f}  {r['mean_of_k']:9.2f}  {r['model_mean']:10.2f}  "
                f"{r['agreement']:9.2f}  {r['copy_last']:9.2f}  {r['context_mean']:8.2f}  "
                f"{format_interval(p[PAIRS[0][0]]):<22}  {format_interval(p[PAIRS[1][0]]):<22}" +
                (f"  {r['gradient_ratio_one_sample']:.2f} / {r['gradient_ratio_mean_of_k']:.2f}"
                 if "gradient_ratio_one_sample" in r else ""))

    lines += [row(r["span"], r) for r in result["spans"]]
    views = result["context_views"]
    if views is not None:
        lines.append(f"frames {views['label']} by context views ({views['share_seen']:.0%} seen):")
        lines += [row(f"{key} {views['label']}", views[key]) for key in ("seen", "unseen") if views[key] is not None]
    if result.get("shrink"):
        lines.append("each sample pulled towards the other samples' mean, m + lambda (x - m): PSNR (minus the context "
                     "mean) / sharpness")
        names = list(result["shrink"][0]["spans"])
        lines.append(f"{'lambda':>12}  " + "  ".join(f"{n:>24}" for n in names))
        for f in result["shrink"]:
            cells = [f"{r['psnr']:.2f} ({r['minus_context_mean']:+.2f}) / {r['gradient_ratio']:.2f}"
                     for r in f["spans"].values()]
            lines.append(f"{f['lambda']:12.2f}  " + "  ".join(f"{c:>24}" for c in cells))
    return "\n".join(lines)


def _parse_shrinks(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0.0 <= v <= 1.0 for v in values):
        raise RolloutFileError(f"--shrink {text!r}: give comma-separated blend weights in [0, 1], e.g. 1,0.7,0.5")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arvdm.evaluation.ensemble", description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+",
                   help="K >= 2 folders written by sample.py for the same episodes (other --seed)")
    p.add_argument("--data", default=None, help="the episodes the rollouts were drawn from: splits frames 17-64 by "
                                                "whether a context frame shows their view")
    p.add_argument("--split", default="validation", help="the split of --data the rollouts used (default validation)")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples (default 2000)")
    p.add_argument("--shrink", default=",".join(f"{x:g}" for x in SHRINKS),
                   help="blend weights lambda of the PSNR-sharpness frontier, comma-separated, each in [0, 1]")
    p.add_argument("--against", nargs="+", default=None, metavar="B",
                   help="K >= 2 folders of another model's rollouts of the same episodes: also print A - B per span "
                        "(one sample, mean of K, model mean, agreement), paired by episode")
    p.add_argument("--json", default=None, help="also write the report to this JSON file")
    args = p.parse_args(argv)
    try:
        if args.boot < 100:
            raise RolloutFileError(f"--boot {args.boot}: must be >= 100 for a 95% interval")
        shrinks = _parse_shrinks(args.shrink)
        poses = None
        if args.data is not None:
            real, _ = read_rollout(args.folders[0])
            poses = episode_poses(args.data, args.split, real)
        result = ensemble_report(args.folders, poses=poses, n_boot=args.boot, shrinks=shrinks)
        if args.against:
            result["against"] = ensemble_difference(args.folders, args.against, n_boot=args.boot)
        if args.json:
            atomic_write_json(args.json, result)
    except USER_ERRORS as e:
        print(f"ensemble: error: {e}", file=sys.stderr)
        return 2
    print(format_ensemble(result))
    if args.against:
        print(format_difference(result["against"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
