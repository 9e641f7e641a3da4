"""How long a rollout holds up: the hold-up horizon, and the model minus a baseline per span with intervals.

    h = hold_up_horizon(model_psnr, ctx_mean_psnr, span=16)      # first span below context-mean, or None
    d = span_differences(model_psnr, ctx_mean_psnr, span=16)     # per span: mean difference, 95% interval
    report = hold_up(gen, real, context=8, poses=poses)          # all of it from videos, JSON-ready
    views = context_views(gen, real, context=8, poses=poses)     # frames 17-64: views the context holds vs the rest

Error accumulation shows as a PSNR curve that falls with the frame index; a curve alone cannot say when the
rollout stops being worth anything. The **hold-up horizon** is the first span of generated frames where the
model's mean PSNR falls below that of the context-mean baseline (every frame = the mean of the context frames,
``arvdm.evaluation.baselines.baseline_frames``): from there on the model draws worse than a blurry average
view. Blur itself shows in the spatial-gradient ratio by span (``arvdm.evaluation.baselines.
gradient_ratio_by_span``: ~1 sharp, falling with blur), which ``hold_up`` reports beside it.

Whether a model can beat context-mean far out depends on what is left to predict: a generated frame whose view
some context frame shows (same place and heading, the revisit tolerances of ``arvdm.evaluation.revisits``) can be
drawn from the context; one the context never showed must be invented, and a sharp sample of an unseen view is
expected to score below a blurry average of it (two independent samples of a calibrated model are twice the
posterior variance apart, the mean once). ``context_views`` splits a span by that, from the episodes' poses.

Per-frame curves are (N,) or (B, N) (episodes by generated frames; frame 0 = first generated frame); spans are
``arvdm.evaluation.metrics.summarise_by_span``'s [0, span), [span, 2 span), ... Intervals resample episodes
(``arvdm.evaluation.probes.pooled_rate`` with the episode as the event), deterministic given the seed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from arvdm.evaluation.baselines import BASELINES, baseline_frames, gradient_ratio_by_span
from arvdm.evaluation.metrics import PSNR_CAP, psnr_per_frame, summarise_by_span
from arvdm.evaluation.probes import paired_difference, pooled_rate
from arvdm.evaluation.revisits import DEFAULT_HEADING_TOL, DEFAULT_POS_TOL, check_poses, pose_match_matrix

__all__ = ["context_view_mask", "context_views", "hold_up", "hold_up_horizon", "span_differences"]

#: The generated frames `context_views` splits by default (0-based, end exclusive): frames 17-64, issue 21's span.
VIEWS_SPAN = (16, 64)


def _curves(model: Any, base: Any, name: str) -> tuple[Tensor, Tensor]:
    """Both curves as (B, N) float64 of the same shape, or a clear error."""
    m, b = (torch.as_tensor(x, dtype=torch.float64) for x in (model, base))
    m, b = (x[None] if x.ndim == 1 else x for x in (m, b))
    if m.ndim != 2 or m.shape != b.shape:
        raise ValueError(f"{name}: model {tuple(m.shape)} and baseline {tuple(b.shape)} must be the same (N,) or "
                         "(B, N) per-frame curves")
    if m.shape[1] == 0:
        raise ValueError(f"{name}: the curves have no frames")
    if torch.isnan(m).any() or torch.isnan(b).any():
        raise ValueError(f"{name}: the curves contain NaN")
    return m, b


def hold_up_horizon(model_psnr: Any, ctx_mean_psnr: Any, span: int = 16) -> dict[str, Any] | None:
    """The first span where the model's mean PSNR falls below the context-mean baseline's.

    Args:
        model_psnr, ctx_mean_psnr: per-frame PSNR, (N,) already averaged over episodes or (B, N) (averaged
            here over episodes and the span's frames).
        span: frames per span (> 0).
    Returns:
        ``{"span_index", "start", "end", "label", "model", "baseline"}`` (frames [start, end) of the generated
        frames; the two span means in dB), or None when the model never falls below the baseline.
    """
    m, b = _curves(model_psnr, ctx_mean_psnr, "hold_up_horizon")
    for i, (ms, bs) in enumerate(zip(summarise_by_span(m, span), summarise_by_span(b, span))):
        if ms["mean"] < bs["mean"]:
            return {"span_index": i, "start": ms["start"], "end": ms["end"], "label": ms["label"],
                    "model": ms["mean"], "baseline": bs["mean"]}
    return None


def span_differences(model: Any, base: Any, span: int = 16, n_boot: int = 1000, seed: int = 0,
                     level: float = 0.95) -> list[dict[str, Any]]:
    """Model minus baseline per span, with an episode-level bootstrap interval.

    Args:
        model, base: (B, N) per-frame values of the same episodes and frames (e.g. PSNR of the model and of
            context-mean); a difference is taken frame by frame, so the comparison is paired.
    Returns:
        ``[{"start", "end", "label", "mean", "lo", "hi", "n_episodes", "n_frames"}]``: the mean difference over
        the span's frames and episodes, and its interval when whole episodes are resampled.
    """
    m, b = _curves(model, base, "span_differences")
    if not torch.isfinite(m).all() or not torch.isfinite(b).all():
        raise ValueError("span_differences: the curves contain inf (an identical frame has PSNR inf; clip first)")
    diff = (m - b).numpy()  # (B, N)
    episode = np.broadcast_to(np.arange(diff.shape[0])[:, None], diff.shape)  # (B, N): each value's episode
    out = []
    for s in summarise_by_span(torch.from_numpy(diff), span):
        a, e = s["start"], s["end"]
        r = pooled_rate(diff[:, a:e], episode[:, a:e], n_boot, seed, level)
        out.append({"start": a, "end": e, "label": s["label"], "mean": r["mean"], "lo": r["lo"], "hi": r["hi"],
                    "n_episodes": r["n_events"], "n_frames": r["n_probes"]})
    return out


def context_views(gen: Tensor, real: Tensor, context: int, poses: Tensor, start: int = VIEWS_SPAN[0],
                  end: int = VIEWS_SPAN[1], pos_tol: float = DEFAULT_POS_TOL, heading_tol: float = DEFAULT_HEADING_TOL,
                  n_boot: int = 1000, seed: int = 0, psnr_cap: float = PSNR_CAP) -> dict[str, Any] | None:
    """Generated frames [start, end) split by whether a context frame shows their view; model minus context-mean
    on each part.

    Args:
        gen: (B, N, C, H, W) generated frames; real: (B, context + N, C, H, W) ground truth, context included.
        poses: (B, >= context + N, 3) the episodes' ground-truth poses (x, y, heading in radians).
        start, end: the generated frames to split (0-based, end exclusive; default frames 17-64 counted from 1,
            issue 21's span); `end` is clipped to N.
        pos_tol, heading_tol: a frame "shows the same view" as a context frame within these (the revisit tolerances).
    Returns:
        None when the rollout has no frame at `start`; else ``{"start", "end", "label", "share_seen", "all", "seen",
        "unseen"}``: ``share_seen`` the fraction of the span's frames whose view a context frame shows; ``all`` /
        ``seen`` / ``unseen`` each ``paired_difference`` of the model's PSNR minus context-mean's over the whole span
        / those frames, episodes resampled as events (None when the part is empty).
    """
    n = gen.shape[1]
    if real.ndim != 5 or real.shape[1] != context + n or real.shape[0] != gen.shape[0] or context < 1:
        raise ValueError(f"context_views: real {tuple(real.shape)} must be the {gen.shape[0]} episodes' context "
                         f"{context} (>= 1) + generated {n} frames (gen {tuple(gen.shape)})")
    target = real[:, context:]  # (B, N, C, H, W)
    model = psnr_per_frame(gen, target).clamp(max=psnr_cap)  # (B, N)
    base = psnr_per_frame(baseline_frames(real, context, n, "context_mean"), target).clamp(max=psnr_cap)  # (B, N)
    return _split_by_context_views(model, base, context, poses, start, end, pos_tol, heading_tol, n_boot, seed)


def context_view_mask(poses: Tensor, b: int, context: int, start: int, end: int, pos_tol: float = DEFAULT_POS_TOL,
                      heading_tol: float = DEFAULT_HEADING_TOL) -> np.ndarray:
    """(B, end - start) bool: whether some context frame shows the view of generated frame start..end-1 (0-based)
    of each of the b episodes, by the revisit definition of the same view (``pose_match_matrix``); poses (B, >=
    context + end, 3). Raises ValueError on poses of another shape."""
    p = check_poses(poses, "context_views")
    if p.ndim != 3 or p.shape[0] != b or p.shape[1] < context + end:
        raise ValueError(f"context_views: poses {tuple(p.shape)} must be (B, >= {context + end}, 3) for B = {b} "
                         "episodes")
    # rows: the span, columns: the context
    return torch.stack([pose_match_matrix(p[i, :context + end], pos_tol, heading_tol)[context + start:, :context]
                        .any(dim=1) for i in range(b)]).cpu().numpy()


def _split_by_context_views(model: Tensor, base: Tensor, context: int, poses: Tensor, start: int, end: int,
                            pos_tol: float, heading_tol: float, n_boot: int, seed: int) -> dict[str, Any] | None:
    """`context_views` from the per-frame PSNR (B, N) of the model and of context-mean (`hold_up` has them)."""
    b, n = model.shape
    end = min(end, n)
    if not 0 <= start < end:
        return None
    seen = context_view_mask(poses, b, context, start, end, pos_tol, heading_tol)  # (B, S)
    model, base = model[:, start:end].cpu().numpy(), base[:, start:end].cpu().numpy()  # (B, S) each
    episode = np.broadcast_to(np.arange(b)[:, None], seen.shape)  # (B, S): each frame's episode

    def part(mask: np.ndarray) -> dict[str, Any] | None:
        return paired_difference(model[mask], base[mask], episode[mask], n_boot, seed) if mask.any() else None

    return {"start": start, "end": end, "label": f"{start + 1}-{end}", "share_seen": float(seen.mean()),
            "all": part(np.ones_like(seen)), "seen": part(seen), "unseen": part(~seen)}

def hold_up(gen: Tensor, real: Tensor, context: int, span: int = 16, n_boot: int = 1000, seed: int = 0,
            psnr_cap: float = PSNR_CAP, poses: Tensor | None = None) -> dict[str, Any]:
    """A rollout's hold-up measures from its videos, JSON-ready.

    Args:
        gen: (B, N, C, H, W) generated frames; real: (B, context + N, C, H, W) ground truth, context included.
        psnr_cap: per-frame PSNR is clipped to this (dB) before the spans are averaged and differenced.
    Returns:
        ``hold_up_horizon`` (against context-mean; None = never below it), ``psnr_minus`` (per baseline in
        ``BASELINES``: ``span_differences`` of the model's PSNR minus the baseline's) and
        ``gradient_ratio_by_span``; with the episodes' `poses` (B, >= context + N, 3) also ``context_views``
        (frames 17-64 split by whether the context shows their view; `context_views`).
    """
    n = gen.shape[1]
    if real.ndim != 5 or real.shape[1] != context + n or real.shape[0] != gen.shape[0]:
        raise ValueError(f"hold_up: real {tuple(real.shape)} must be the {gen.shape[0]} episodes' context {context} "
                         f"+ generated {n} frames (gen {tuple(gen.shape)})")
    target = real[:, context:]  # (B, N, C, H, W)
    model = psnr_per_frame(gen, target).clamp(max=psnr_cap)  # (B, N)
    base = {kind: psnr_per_frame(baseline_frames(real, context, n, kind), target).clamp(max=psnr_cap)
            for kind in BASELINES}  # (B, N) each
    report = {"hold_up_horizon": hold_up_horizon(model, base["context_mean"], span),
              "psnr_minus": {kind: span_differences(model, base[kind], span, n_boot, seed) for kind in BASELINES},
              "gradient_ratio_by_span": gradient_ratio_by_span(gen, target, span)}
    if poses is not None:
        report["context_views"] = _split_by_context_views(model, base["context_mean"], context, poses, *VIEWS_SPAN,
                                                          DEFAULT_POS_TOL, DEFAULT_HEADING_TOL, n_boot, seed)
    return report
