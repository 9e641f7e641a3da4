"""Trivial predictors a video model must beat, and the comparison every evaluation reports.

A rollout's PSNR means little on its own: PSNR favours blur, and a model whose frames are noise can still
"decay little". So every evaluation puts the model beside two predictors that need no model at all:

- ``copy_last``: every generated frame is the last context frame (a world that stands still);
- ``context_mean``: every generated frame is the mean of the context frames (the blurry average view);

and beside a sharpness check, the **spatial-gradient ratio** (mean |∇| of generated frames over that of
the real ones, ``arvdm.evaluation.metrics.spatial_gradient_per_frame``): ≈ 1 for real-looking frames, ≫ 1 for noise,
≪ 1 for blur. A curve is only read once the model beats copy-last on the first frames and its ratio is
near 1; ``compare_with_baselines`` says in words when it does not.

    report = compare_with_baselines(gen, real, context=8)     # gen (B,N,C,H,W), real (B,context+N,...)
    print(report["verdict"]["message"])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from arvdm.evaluation.metrics import (
    PSNR_CAP,
    psnr_per_frame,
    spatial_gradient_per_frame,
    ssim_per_frame,
    summarise_by_span,
)
from arvdm.evaluation.probes import format_interval, paired_difference

__all__ = ["BASELINES", "FIRST_FRAMES", "SHARPNESS_FRAMES", "SHARP_RANGE", "VERDICT_FRAMES", "baseline_frames",
           "compare_with_baselines", "first_frames_difference", "first_frames_mean", "gradient_ratio_by_span",
           "summed_gradient_ratio", "verdict"]

BASELINES = ("copy_last", "context_mean")
FIRST_FRAMES = (1, 4, 16)  # the "first k generated frames" the headline table reports
VERDICT_FRAMES = 4  # the model must reach copy-last's PSNR over this many first frames
SHARPNESS_FRAMES = 16  # the sharpness check's gradient ratio is taken over this many first generated frames
SHARP_RANGE = (0.6, 1.5)  # gradient ratio over the first SHARPNESS_FRAMES frames: below = blur, above = noise
_FLAT_GRADIENT = 1e-12  # floor of the real frames' gradient sum: flat real frames must not divide by zero


def baseline_frames(real: Tensor, context: int, n: int, kind: str) -> Tensor:
    """What a trivial predictor generates for ``n`` frames after ``context`` ground-truth frames.

    Args:
        real: (B, T, C, H, W) ground truth with T >= context >= 1.
        kind: ``copy_last`` (repeat frame context-1) or ``context_mean`` (repeat the mean of frames 0..context-1).
    Returns:
        (B, n, C, H, W).
    """
    if context < 1 or context > real.shape[1]:
        raise ValueError(f"baseline_frames: context={context} must be in 1..{real.shape[1]} (frames of real)")
    if kind == "copy_last":
        frame = real[:, context - 1]  # (B, C, H, W)
    elif kind == "context_mean":
        frame = real[:, :context].mean(dim=1)  # (B, C, H, W)
    else:
        raise ValueError(f"unknown baseline {kind!r}; choose one of {BASELINES}")
    return frame[:, None].expand(-1, n, -1, -1, -1)  # (B, n, C, H, W)


def first_frames_mean(per_frame: Tensor, ks=FIRST_FRAMES) -> dict[str, float]:
    """Mean of a (B, N) per-frame metric over the first k frames, for each k <= N: {"1": .., "4": ..}."""
    n = per_frame.shape[-1]
    return {str(k): float(per_frame[..., :k].double().mean()) for k in ks if k <= n}


def first_frames_difference(model: Tensor, base: Tensor, ks=FIRST_FRAMES, n_boot: int = 1000,
                            seed: int = 0) -> dict[str, dict[str, Any]]:
    """Model minus a baseline over the first k frames, paired by episode, for each k <= N: {"1": .., "4": ..}.

    model, base: (B, N) per-frame PSNR of the same episodes, clipped at ``PSNR_CAP`` here (as ``first_frames``).
    Each value is ``arvdm.evaluation.probes.paired_difference``: the mean difference (= the two ``first_frames``
    means' difference) with a 95% interval from resampling whole episodes, and each side's mean.
    """
    m, b = (x.clamp(max=PSNR_CAP).double().cpu() for x in (model, base))  # (B, N) each
    episode = torch.arange(m.shape[0])[:, None].expand_as(m)  # (B, N): each frame's episode
    return {str(k): paired_difference(m[:, :k].numpy(), b[:, :k].numpy(), episode[:, :k].numpy(), n_boot, seed)
            for k in ks if k <= m.shape[-1]}


def gradient_ratio_by_span(gen: Tensor, real: Tensor, span: int = 16) -> list[dict[str, Any]]:
    """Spatial-gradient ratio generated / real per span of frames: sum of mean |∇| over the span's frames
    and episodes, generated over real. gen, real: (B, N, C, H, W) aligned frame for frame.

    Public API for the sharpness check on its own; ``compare_with_baselines`` reports the same numbers
    (its ``gradient_ratio_by_span``) beside the baselines."""
    return _ratio_by_span(spatial_gradient_per_frame(gen), spatial_gradient_per_frame(real), span)


def summed_gradient_ratio(g: Tensor, r: Tensor, a: int, b: int) -> float:
    """Sum of per-frame gradients g over frames a..b-1 and episodes, over that of r ((B, N) each,
    ``spatial_gradient_per_frame``): the sharpness ratio of every report (eval.json, grids, compare)."""
    return float(g[:, a:b].double().sum() / r[:, a:b].double().sum().clamp(min=_FLAT_GRADIENT))


def _ratio_by_span(g: Tensor, r: Tensor, span: int) -> list[dict[str, Any]]:
    return [{**s, "mean": summed_gradient_ratio(g, r, s["start"], s["end"])} for s in summarise_by_span(g, span)]


def compare_with_baselines(gen: Tensor, real: Tensor, context: int, span: int = 16) -> dict[str, Any]:
    """The model beside copy-last and context-mean, by span and over the first frames, plus sharpness.

    Args:
        gen: (B, N, C, H, W) generated frames (the first generated frame first), in [-1, 1].
        real: (B, context + N, C, H, W) ground truth, context included.
    Returns:
        A JSON-ready dict: ``first_frames`` (PSNR/SSIM of model and baselines over the first 1/4/16 frames;
        per-frame PSNR clipped at ``PSNR_CAP`` first, so that an episode where the agent stands still, whose
        copy-last frames are exact, counts as 60 dB instead of making the mean, and the verdict, infinite),
        ``first_frames_minus`` (per baseline: the model's PSNR minus the baseline's over the first 1/4/16 frames,
        paired by episode with an interval, ``first_frames_difference``),
        ``baselines`` (per baseline: psnr_by_span, ssim_by_span, psnr_curve, ssim_curve),
        ``gradient_ratio_by_span``, ``gradient_ratio_curve`` (per frame, over all episodes),
        ``gradient_ratio_first16`` and ``verdict`` (``beats_copy_last``, ``sharp``, ``message``).
    """
    n = gen.shape[1]
    if real.shape[1] != context + n:
        raise ValueError(f"compare_with_baselines: real has {real.shape[1]} frames, expected context {context} "
                         f"+ generated {n}")
    target = real[:, context:]  # (B, N, C, H, W)
    psnr, ssim = {"model": psnr_per_frame(gen, target)}, {"model": ssim_per_frame(gen, target)}
    baselines: dict[str, Any] = {}
    for kind in BASELINES:
        pred = baseline_frames(real, context, n, kind)
        psnr[kind], ssim[kind] = psnr_per_frame(pred, target), ssim_per_frame(pred, target)  # (B, N)
        baselines[kind] = {"psnr_by_span": summarise_by_span(psnr[kind], span),
                           "ssim_by_span": summarise_by_span(ssim[kind], span),
                           "psnr_curve": psnr[kind].double().mean(0).tolist(),
                           "ssim_curve": ssim[kind].double().mean(0).tolist()}
    g, r = spatial_gradient_per_frame(gen), spatial_gradient_per_frame(target)  # (B, N) each, computed once
    g16 = summed_gradient_ratio(g, r, 0, SHARPNESS_FRAMES)
    first = {name: {"psnr": first_frames_mean(psnr[name].clamp(max=PSNR_CAP)), "ssim": first_frames_mean(ssim[name])}
             for name in ("model", *BASELINES)}
    minus = {kind: first_frames_difference(psnr["model"], psnr[kind]) for kind in BASELINES}
    return {"first_frames": first, "first_frames_minus": minus, "baselines": baselines,
            "gradient_ratio_by_span": _ratio_by_span(g, r, span),
            "gradient_ratio_curve": [summed_gradient_ratio(g, r, i, i + 1) for i in range(n)],
            "gradient_ratio_first16": g16, "verdict": verdict(first, g16, minus["copy_last"])}


def verdict(first: dict[str, Any], gradient_ratio: float,
            minus_copy_last: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Whether the model beats copy-last over the first frames (in the mean: at or above) and is sharp, with a
    sentence saying so; ``minus_copy_last`` (``first_frames_difference`` against copy-last) adds the paired
    difference and its interval to the sentence and to the result (``difference``)."""
    key = str(VERDICT_FRAMES) if str(VERDICT_FRAMES) in first["model"]["psnr"] else "1"
    model, copy = first["model"]["psnr"][key], first["copy_last"]["psnr"][key]
    beats = model >= copy
    lo, hi = SHARP_RANGE
    sharp = lo <= gradient_ratio <= hi
    texture = "sharp" if sharp else ("NOISY" if gradient_ratio > hi else "BLURRY")
    diff = (minus_copy_last or {}).get(key)
    paired = (f"; {format_interval(diff)} dB paired over {diff['n_events']} episode{'s' * (diff['n_events'] != 1)}"
              if diff else "")
    head = (f"model {'beats' if beats else 'LOSES TO'} copy-last over the first {key} generated frames "
            f"({model:.2f} vs {copy:.2f} dB{paired})")
    tail = (f"; frames are {texture} (spatial-gradient ratio {gradient_ratio:.2f} over the first {SHARPNESS_FRAMES}, "
            f"want {lo}-{hi})")
    warn = "" if beats and sharp else (" — its error curves and retrieval rates measure a model that has not "
                                       "learned this video; do not read them as results")
    return {"beats_copy_last": beats, "sharp": sharp, "frames": int(key), "model_psnr": model,
            "copy_last_psnr": copy, "difference": diff, "message": head + tail + warn}
